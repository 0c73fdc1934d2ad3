"""The warm pass's own order and what each measured pass records of the process
(``simulate(..., warm_order=...)``, ``prefixcache simulate --warm-order``, ``pass_state``).

The rule, stated here independently of the code: the warm pass runs each measured policy once,
unmeasured, before the measured runs. By default in the measured order; a warm order, when given,
must name exactly the measured policies (``none`` may be left out: a measured ``none`` reference
is then warmed first), each once, and needs a warm pass; anything else is refused before any run.
It changes only the order of the unmeasured runs: the measured runs, their order and their
outputs stay as they were. Every measured pass records the process state at its start and its
end (CPU seconds, page faults, context switches, Python's allocated blocks, the collector's
counts; the CUDA allocator's figures on CUDA only) and the change of each count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("prefixcache._core")

from prefixcache.engine import Engine, RunResult, build_model, simulate
from prefixcache.engine.cli import main
from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload, Workload

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_seed_report

SPEC = GrowingPrefixSpec(streams=2, first_prompt=150, growth=70, rounds=3, output_len=3)
GEOMETRY = Geometry(block_size=32, unit=8, token_budget=96, max_running=2)
COUNTS = (
    "cpu_seconds",
    "minor_faults",
    "major_faults",
    "voluntary_switches",
    "involuntary_switches",
    "python_blocks",
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(policy, requests) of every engine run, in order: the warm-up runs have the warm
    workload's 4 requests (shapes), the measured runs the preset's 6."""
    runs: list[tuple[str, int]] = []
    original = Engine.run

    def recording(engine: Engine, workload: Workload, **kwargs: object) -> RunResult:
        result = original(engine, workload, **kwargs)  # type: ignore[arg-type]
        runs.append((engine.policy.name, len(result.requests)))
        return result

    monkeypatch.setattr(Engine, "run", recording)
    return runs


@pytest.fixture(scope="module")
def workload() -> PresetWorkload:
    return PresetWorkload("growing-prefix", "test", SPEC, GEOMETRY)


def test_the_warm_order_changes_only_the_unmeasured_runs(
    workload: PresetWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model("cpu", "torch")
    baseline = simulate(workload, ["fine", "block"], model, warm_up="shapes")
    runs = _recording(monkeypatch)
    report = simulate(
        workload, ["fine", "block"], model, warm_up="shapes", warm_order=["block", "fine"]
    )
    warm = [name for name, requests in runs if requests == 4]
    measured = [name for name, requests in runs if requests == 6]
    assert warm == ["none", "block", "fine"]  # none left out: warmed first
    assert measured == ["none", "fine", "block"]
    assert [name for name, _ in runs] == warm + measured  # every warm run before any measured
    document = report.to_json()
    assert document["warm_order"] == ["none", "block", "fine"]
    assert baseline.to_json()["warm_order"] == ["none", "fine", "block"]
    for name in ("block", "fine"):
        assert report.matches[name][0] is True, report.matches[name]
        run, before = report.runs[name], baseline.runs[name]
        assert run.computed_prefill_tokens == before.computed_prefill_tokens
        for request_id, result in run.requests.items():
            assert result.output_ids == before.requests[request_id].output_ids


def test_a_warm_order_naming_none_runs_it_where_named(
    workload: PresetWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model("cpu", "torch")
    runs = _recording(monkeypatch)
    report = simulate(
        workload, ["block", "fine"], model, warm_up="shapes", warm_order=["fine", "none", "block"]
    )
    assert [name for name, requests in runs if requests == 4] == ["fine", "none", "block"]
    assert report.warm_order == ["fine", "none", "block"]


@pytest.mark.parametrize(
    ("policies", "reference", "warm_up", "order", "message"),
    [
        (["block", "fine"], True, "shapes", ["block"], "once each"),
        (["block"], False, "shapes", ["block", "fine"], "once each"),
        (["block", "fine"], True, "shapes", ["block", "fine", "block"], "twice"),
        (["block", "fine"], True, "shapes", ["block", "lru"], "unknown"),
        (["block", "fine"], False, "shapes", ["none", "block", "fine"], "once each"),
        (["block", "fine"], True, "none", ["block", "fine"], "needs a warm pass"),
        (["block", "fine"], True, False, ["fine", "block"], "needs a warm pass"),
    ],
)
def test_a_bad_warm_order_is_refused_before_any_run(
    workload: PresetWorkload,
    monkeypatch: pytest.MonkeyPatch,
    policies: list[str],
    reference: bool,
    warm_up: str | bool,
    order: list[str],
    message: str,
) -> None:
    model = build_model("cpu", "torch")
    runs = _recording(monkeypatch)
    with pytest.raises(ValueError, match=message):
        simulate(workload, policies, model, reference=reference, warm_up=warm_up, warm_order=order)
    assert runs == []


def test_every_pass_records_the_process_state(workload: PresetWorkload) -> None:
    model = build_model("cpu", "torch")
    report = simulate(workload, ["block", "fine"], model, repeats=2)
    document = report.to_json()
    assert document["warm_order"] == []  # the CPU default: no warm pass
    for name in ("block", "fine"):
        for entry in document["policies"][name]["passes"]:
            state = entry["step_times"]["pass_state"]
            start, end, change = state["start"], state["end"], state["change"]
            for key in COUNTS:
                assert change[key] == end[key] - start[key], (name, key)
            # A run of the engine spends CPU time, and its outputs are Python objects.
            assert change["cpu_seconds"] > 0
            assert start["python_blocks"] > 0
            assert len(start["gc_counts"]) == 3
            assert not any(key.startswith("cuda_") for key in start)  # CUDA only
    table = gpu_seed_report.pass_states(document)
    assert len(table) == 2 + 1 + 4  # the header, its rule, the reference, 2 passes of 2
    assert all(row.endswith("- | - | - | - |") for row in table[2:])


def test_the_cli_takes_a_warm_order_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    trace = tmp_path / "trace.jsonl"
    prompt = list(range(1, 131))
    lines = [
        {"id": "a", "arrival_s": 0.0, "prompt": prompt, "output_len": 3},
        {"id": "b", "arrival_s": 0.0, "prompt_len": 200, "prefix_of": "a", "output_len": 3},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    common = ["simulate", "--workload", "trace", str(trace), "--policies", "fine,block"]
    args = [*common, "--warm-up", "shapes", "--warm-order", "block,fine", "--json", str(out)]
    assert main(args) == 0
    document = json.loads(out.read_text())
    assert document["warm_order"] == ["none", "block", "fine"]
    assert list(document["policies"]) == ["none", "fine", "block"]
    capsys.readouterr()
    assert main([*common, "--warm-order", "block,fine"]) == 2  # no warm pass on the CPU
    assert "needs a warm pass" in capsys.readouterr().err
    assert main([*common, "--warm-up", "full", "--warm-order", "block"]) == 2
    assert "once each" in capsys.readouterr().err


def test_help_documents_the_warm_order(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    assert "--warm-order POLICIES" in capsys.readouterr().out
