"""The seed measurement's set-up on the CPU: the Kimi-K3 cost proxy, its defaults, the warm pass.

The proxy runs here at reduced width (``kimi-k3-tp8/32``) and depth (one group), through the
real cache manager and engine, and caching must change none of its outputs; the warm pass must
meet what the measured run meets (its longest context, full chunks, a resume, a decode) and
change no measured figure; the GPU defaults (Triton convolution, event timing) must stay off
the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("prefixcache._core")

from prefixcache.engine import Engine, RunResult, build_model, simulate
from prefixcache.engine.cli import main
from prefixcache.engine.simulate import warm_up_workload
from prefixcache.engine.workloads import (
    Geometry,
    GrowingPrefixSpec,
    PresetWorkload,
    Workload,
    workload_preset,
)
from prefixcache.kernels import ops
from prefixcache.models import ModelConfig

SPEC = GrowingPrefixSpec(streams=2, first_prompt=150, growth=70, rounds=3, output_len=3)
GEOMETRY = Geometry(block_size=32, unit=8, token_budget=96, max_running=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_reduced_proxy_serves_a_workload_exactly_under_every_policy() -> None:
    config = ModelConfig.kimi_k3_tp8(1, divisor=32)
    model = build_model("cpu", "torch", config=config)
    workload = PresetWorkload("growing-prefix", "test", SPEC, GEOMETRY)
    report = simulate(workload, ["block", "fine"], model).to_json()
    policies = report["policies"]
    for name in ("block", "fine"):
        assert policies[name]["outputs_match_no_cache"] is True, policies[name]
    assert (
        policies["fine"]["computed_prefill_tokens"] < policies["block"]["computed_prefill_tokens"]
    )
    assert report["model"]["name"] == "kimi-k3-tp8/32"
    assert report["model"]["macs_per_token"] == config.macs_per_token()
    assert report["warm_up"] == "none"  # the CPU default


def test_the_cpu_keeps_the_torch_conv_and_the_wall_clock() -> None:
    model = build_model("cpu", "torch")
    assert model.backend.conv_impl == "torch" and model.kda_timer.mode == "wall"
    assert model.config == ModelConfig.tiny()
    assert ops.default_conv(torch.device("cpu")) == "torch"


def test_cuda_defaults_to_the_triton_conv_where_triton_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefixcache.kernels import conv_triton

    monkeypatch.setattr(conv_triton, "triton_unavailable_reason", lambda device: None)
    assert ops.default_conv(torch.device("cuda")) == "triton"
    monkeypatch.setattr(conv_triton, "triton_unavailable_reason", lambda device: "no triton")
    assert ops.default_conv(torch.device("cuda")) == "torch"


@pytest.mark.parametrize(
    "workload",
    [
        workload_preset("growing-prefix", "seed"),
        workload_preset("growing-prefix", "default"),
        PresetWorkload("growing-prefix", "test", SPEC, GEOMETRY),
    ],
    ids=["seed", "default", "small"],
)
def test_the_warm_pass_meets_the_measured_runs_shapes(workload: PresetWorkload) -> None:
    geometry = workload.geometry.aligned(16)
    warm = warm_up_workload(workload, geometry)
    spec = warm.spec
    assert isinstance(spec, GrowingPrefixSpec)
    longest = workload.spec.longest_sequence()
    # Its longest sequence is within one block of the measured one's (allocations, gathers).
    assert longest - geometry.block_size <= spec.longest_sequence() <= longest
    # Full chunks, then a partial one; several rows in a step; a hit in round 2 that resumes
    # from a checkpoint off the block grid for the fine unit; a decode.
    assert spec.first_prompt > geometry.token_budget
    assert spec.first_prompt % geometry.token_budget != 0
    assert spec.streams >= 2 and spec.rounds >= 2 and spec.output_len >= 2
    assert spec.growth % geometry.unit != 0 and spec.growth > geometry.unit
    assert warm.geometry == geometry


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    runs: list[tuple[str, int]] = []
    original = Engine.run

    def recording(engine: Engine, workload: Workload, **kwargs: object) -> RunResult:
        runs.append((engine.policy.name, workload.num_requests))
        return original(engine, workload, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "run", recording)
    return runs


def test_a_full_warm_pass_runs_the_measured_workload_first_and_changes_no_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = build_model("cpu", "torch")
    workload = PresetWorkload("growing-prefix", "test", SPEC, GEOMETRY)
    cold = simulate(workload, ["block", "fine"], model, warm_up="none").to_json()
    runs = _recording(monkeypatch)
    warm = simulate(workload, ["block", "fine"], model, warm_up="full").to_json()
    requests = SPEC.num_requests
    assert runs == [("none", requests), ("block", requests), ("fine", requests)] * 2
    assert warm["warm_up"] == "full"
    for name in ("none", "block", "fine"):
        a, b = cold["policies"][name], warm["policies"][name]
        for key in ("hit_tokens", "computed_prefill_tokens", "steps", "outputs_match_no_cache"):
            assert a[key] == b[key], (name, key)
    runs.clear()
    simulate(workload, ["fine"], model, warm_up="shapes", reference=False)
    warm_requests = warm_up_workload(workload, GEOMETRY).spec.num_requests
    assert runs == [("fine", warm_requests), ("fine", requests)]
    with pytest.raises(ValueError, match="warm_up must be one of"):
        simulate(workload, ["fine"], model, warm_up="twice")  # type: ignore[arg-type]


def test_the_command_line_runs_the_proxy_and_reports_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = np.random.default_rng(3).integers(0, 100, size=120).tolist()
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"id": "a", "arrival_s": 0.0, "prompt": prompt, "output_len": 3},
        {"id": "b", "arrival_s": 0.0, "prompt_len": 230, "prefix_of": "a", "output_len": 3},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    out = tmp_path / "run.json"
    arguments = ["simulate", "--workload", "trace", str(trace), "--model", "kimi-k3-tp8/64"]
    assert main([*arguments, "--depth", "1", "--warm-up", "shapes", "--json", str(out)]) == 0
    document = json.loads(out.read_text(encoding="utf-8"))
    assert document["model"]["name"] == "kimi-k3-tp8/64"
    assert document["model"]["layers"] == ["kda", "kda", "kda", "attention"]
    assert document["warm_up"] == "shapes" and document["conv"] == "torch"
    assert all(p["outputs_match_no_cache"] for p in document["policies"].values())
    assert "model: kimi-k3-tp8/64" in capsys.readouterr().out
    assert main(["simulate", "--model", "huge"]) == 2
    assert "unknown model 'huge'" in capsys.readouterr().err
    assert main(["simulate", "--depth", "2"]) == 2
    assert "one group" in capsys.readouterr().err


def test_policies_run_in_the_order_asked_for_after_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = build_model("cpu", "torch")
    workload = PresetWorkload("growing-prefix", "test", SPEC, GEOMETRY)
    runs = _recording(monkeypatch)
    report = simulate(workload, ["fine", "block"], model, reference=False)
    assert [name for name, _ in runs] == ["fine", "block"]
    assert list(report.to_json()["policies"]) == ["fine", "block"]
    runs.clear()
    simulate(workload, ["fine", "block", "fine"], model)
    assert [name for name, _ in runs] == ["none", "fine", "block"]


def test_the_command_lines_choices_are_the_libraries() -> None:
    from prefixcache.engine.cli import build_parser
    from prefixcache.engine.simulate import WARM_UPS
    from prefixcache.models.timing import TIMING_MODES

    simulate_parser = build_parser().parse_args(["simulate"]).command_parser
    actions = {action.dest: action for action in simulate_parser._actions}
    assert tuple(actions["kda_timing"].choices) == ("auto", *TIMING_MODES)
    assert tuple(actions["warm_up"].choices) == ("auto", *WARM_UPS)
