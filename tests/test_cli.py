"""``prefixcache simulate``: options, the --json document, the plot, errors, and the workloads.

The end-to-end runs replay a small trace (a few hundred tokens per request) so that the whole
command, three policies included, takes seconds.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("prefixcache._core")

import prefixcache
from prefixcache.engine.cli import build_parser, main
from prefixcache.engine.workloads import (
    AgenticSpec,
    Geometry,
    GrowingPrefixSpec,
    SharedPromptsSpec,
    TraceError,
    load_trace,
    workload_preset,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the CLI sets one thread on the CPU


def write_trace(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    return path


def small_trace(path: Path) -> Path:
    prompt = np.random.default_rng(7).integers(0, 1000, size=130).tolist()
    return write_trace(
        path,
        [
            {"id": "a", "arrival_s": 0.0, "prompt": prompt, "output_len": 4},
            {"id": "b", "arrival_s": 0.0, "prompt_len": 300, "prefix_of": "a", "output_len": 4},
            {"id": "c", "arrival_s": 0.0, "prompt_len": 120, "output_len": 3, "round": 2},
            {
                "id": "d",
                "arrival_s": 0.01,
                "prompt_len": 250,
                "prefix_of": "b",
                "output_len": 5,
                "round": 2,
            },
        ],
    )


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["simulate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--workload",
        "--preset",
        "--policies",
        "--device",
        "--backend",
        "--model",
        "--depth",
        "--kda-timing",
        "--conv",
        "--warm-up",
        "--no-reference",
        "--json",
        "--plot",
    ):
        assert option in text
    for choice in (
        "growing-prefix",
        "shared-prompts",
        "agentic",
        "trace FILE",
        "default",
        "seed",
        "none",
        "block",
        "fine",
        "cpu",
        "cuda",
        "auto",
        "torch",
        "fla",
        "flashkda",
        "flashkda-op",
        "kimi-k3-tp8",
        "events",
    ):
        assert choice in text
    assert "does not represent" in text
    assert "((N-1)//U)*U" in text and "((N-1)//B)*B" in text


def test_simulate_writes_the_json_document_and_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = small_trace(tmp_path / "trace.jsonl")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    status = main(
        ["simulate", "--workload", "trace", str(trace), "--json", str(out), "--plot", str(png)]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "Summary" in printed and "Per round" in printed
    document = json.loads(out.read_text(encoding="utf-8"))
    assert document["workload"] == "trace"
    assert document["preset"] == "default"
    assert document["device"] == "cpu"
    assert document["backend"] == "torch"
    assert list(document["policies"]) == ["none", "block", "fine"]
    expected_types = {
        "requests": int,
        "prompt_tokens": int,
        "hit_tokens": int,
        "computed_prefill_tokens": int,
        "prefill_seconds": float,
        "ttft_p50_ms": float,
        "outputs_match_no_cache": bool,
        "rounds": list,
    }
    for name, policy in document["policies"].items():
        for key, kind in expected_types.items():
            assert isinstance(policy[key], kind), (name, key)
        assert policy["requests"] == 4
        assert policy["prompt_tokens"] == 130 + 300 + 120 + 250
        assert policy["outputs_match_no_cache"] is True
        assert [r["round"] for r in policy["rounds"]] == [1, 2]
        for entry in policy["rounds"]:
            assert isinstance(entry["round"], int)
            assert isinstance(entry["hit_tokens"], int)
            assert isinstance(entry["computed_prefill_tokens"], int)
            assert isinstance(entry["ttft_p50_ms"], float)
        total = sum(r["computed_prefill_tokens"] for r in policy["rounds"])
        assert total == policy["computed_prefill_tokens"]
    assert document["policies"]["none"]["hit_tokens"] == 0
    # b shares a's 130 tokens (B=96, U=8): block resumes at 96, fine at 128; d shares 250 of b.
    assert document["policies"]["fine"]["hit_tokens"] > document["policies"]["block"]["hit_tokens"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_policies_can_be_chosen_and_none_is_always_the_reference(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out.json"
    assert (
        main(
            [
                "simulate",
                "--workload",
                "trace",
                str(trace),
                "--policies",
                "fine",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text(encoding="utf-8"))
    assert list(document["policies"]) == ["none", "fine"]


def test_no_reference_skips_the_none_run_and_leaves_outputs_unchecked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = small_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out.json"
    arguments = ["simulate", "--workload", "trace", str(trace), "--json", str(out)]
    assert main([*arguments, "--policies", "block,fine", "--no-reference"]) == 0
    document = json.loads(out.read_text(encoding="utf-8"))
    assert list(document["policies"]) == ["block", "fine"]
    for policy in document["policies"].values():
        assert policy["outputs_match_no_cache"] is None
        assert "not checked" in policy["outputs_match_detail"]
    assert "unchecked" in capsys.readouterr().out
    # Named explicitly, none still runs and checks the others.
    assert main([*arguments, "--no-reference"]) == 0
    document = json.loads(out.read_text(encoding="utf-8"))
    assert [p["outputs_match_no_cache"] for p in document["policies"].values()] == [True] * 3


def test_finished_policies_are_saved_before_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The module, not the function the package re-exports under the same name.
    simulate_module = importlib.import_module("prefixcache.engine.simulate")
    trace = small_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out.json"
    original = simulate_module.Engine.run

    def run_then_fail_on_block(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if engine.policy.name == "block":
            raise RuntimeError("the device was taken away")
        return original(engine, *args, **kwargs)

    monkeypatch.setattr(simulate_module.Engine, "run", run_then_fail_on_block)
    with pytest.raises(RuntimeError, match="taken away"):
        main(["simulate", "--workload", "trace", str(trace), "--json", str(out)])
    document = json.loads(out.read_text(encoding="utf-8"))
    assert document["complete"] is False
    assert list(document["policies"]) == ["none"]
    assert document["policies"]["none"]["requests"] == 4
    assert document["policies"]["none"]["outputs_match_no_cache"] is True


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--workload", "trace"], "needs a FILE"),
        (["--workload", "growing-prefix", "x.jsonl"], "takes no FILE"),
        (["--workload", "chat"], "unknown workload"),
        (["--policies", "none,all"], "--policies"),
        (["--preset", "huge"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_with_status_2(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *arguments])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a CPU-only host")
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--backend", "fla"], "needs a CUDA GPU"),
        (["--device", "cuda"], "no CUDA device"),
        (["--kda-timing", "gpu"], "timing mode 'gpu' needs a CUDA device"),
    ],
)
def test_unavailable_devices_and_backends_are_reported(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *arguments]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a CPU-only host")
def test_the_triton_conv_on_a_cpu_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the interpreter is for tests only
    assert main(["simulate", "--conv", "triton"]) == 2
    assert "conv_impl 'triton'" in capsys.readouterr().err


def test_conv_choices_are_the_kernel_layers() -> None:
    from prefixcache.kernels.backend import CONV_IMPLS

    simulate = build_parser().parse_args(["simulate"]).command_parser
    conv = next(a for a in simulate._actions if a.dest == "conv")
    assert tuple(conv.choices) == ("auto", *CONV_IMPLS)


def test_a_broken_trace_is_reported_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"id": 1, "arrival_s": 0, "prompt_len": 5, "output_len": 1}\n{"id": 2}\n')
    assert main(["simulate", "--workload", "trace", str(trace)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_python_dash_m_and_the_console_script_run() -> None:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [
            str(Path(prefixcache.__file__).resolve().parents[1]),
            environment.get("PYTHONPATH", ""),
        ]
    )
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache", "simulate", "--help"],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--workload" in result.stdout
    script = shutil.which("prefixcache")
    if script is not None:
        result = subprocess.run(
            [script, "simulate", "--help"],
            capture_output=True,
            text=True,
            env=environment,
            check=False,
        )
        assert result.returncode == 0, result.stderr


# --- the workloads the command offers ------------------------------------------------------


def test_trace_prompts_follow_prefix_of(tmp_path: Path) -> None:
    spec = load_trace(small_trace(tmp_path / "t.jsonl"))
    a, b, c, d = spec.requests
    assert b.prompt_len == 300 and np.array_equal(b.prompt[:130], a.prompt)
    assert d.prompt_len == 250 and np.array_equal(d.prompt, b.prompt[:250])
    assert (b.extends, d.extends) == (a.request_id, b.request_id)
    assert (c.round, d.arrival_s) == (2, 0.01)
    again = load_trace(tmp_path / "t.jsonl")
    assert all(
        np.array_equal(x.prompt, y.prompt)
        for x, y in zip(spec.requests, again.requests, strict=True)
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"arrival_s": 0, "prompt_len": 5, "output_len": 1}, "'id'"),
        ({"id": 1, "prompt_len": 5, "output_len": 1}, "arrival_s"),
        ({"id": 1, "arrival_s": -1, "prompt_len": 5, "output_len": 1}, "arrival_s"),
        ({"id": 1, "arrival_s": 0, "prompt_len": 5, "output_len": 0}, "output_len"),
        ({"id": 1, "arrival_s": 0, "prompt": [], "output_len": 1}, "prompt"),
        ({"id": 1, "arrival_s": 0, "prompt": [1, 5000], "output_len": 1}, "[0, 1000)"),
        ({"id": 1, "arrival_s": 0, "prompt_len": 5, "prefix_of": 9, "output_len": 1}, "prefix_of"),
        ({"id": 1, "arrival_s": 0, "prompt_len": 5, "output_len": 1, "round": 0}, "round"),
    ],
)
def test_bad_trace_lines_are_refused(tmp_path: Path, line: dict[str, Any], message: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", [line])
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_trace(path)


def test_duplicate_trace_ids_are_refused(tmp_path: Path) -> None:
    line = {"id": "x", "arrival_s": 0, "prompt_len": 5, "output_len": 1}
    with pytest.raises(TraceError, match="duplicate"):
        load_trace(write_trace(tmp_path / "t.jsonl", [line, line]))


def test_growing_prefix_rounds_extend_the_previous_prompt() -> None:
    spec = GrowingPrefixSpec(streams=2, first_prompt=50, growth=20, rounds=3, output_len=2)
    workload = spec.build(1000)
    first = workload.initial_requests()
    assert [r.prompt_len for r in first] == [50, 50]
    assert not np.array_equal(first[0].prompt, first[1].prompt)
    second = workload.on_finished(first[0], [1, 2])
    assert len(second) == 1 and second[0].round == 2 and second[0].prompt_len == 70
    assert np.array_equal(second[0].prompt[:50], first[0].prompt)
    assert second[0].extends == first[0].request_id and second[0].arrival_s is None
    third = workload.on_finished(second[0], [1, 2])
    assert workload.on_finished(third[0], [1, 2]) == []


def test_agentic_turns_carry_the_model_output() -> None:
    spec = AgenticSpec(conversations=1, turns=2, first_prompt=30, user_turn=7, output_len=3)
    workload = spec.build(1000)
    (first,) = workload.initial_requests()
    (second,) = workload.on_finished(first, [11, 12, 13])
    assert second.prompt_len == 30 + 3 + 7
    assert np.array_equal(second.prompt[:30], first.prompt)
    assert second.prompt[30:33].tolist() == [11, 12, 13]
    assert workload.on_finished(second, [1, 2, 3]) == []


def test_shared_prompts_share_their_system_prompt() -> None:
    spec = SharedPromptsSpec(
        requests=6, prompt_len=40, system_len=24, system_prompts=2, output_len=1, round_size=4
    )
    requests = spec.build(1000).initial_requests()
    assert np.array_equal(requests[0].prompt[:24], requests[2].prompt[:24])
    assert not np.array_equal(requests[0].prompt[:24], requests[1].prompt[:24])
    assert not np.array_equal(requests[0].prompt[24:], requests[2].prompt[24:])
    assert [r.round for r in requests] == [1, 1, 1, 1, 2, 2]


def analytic_recomputation(spec: GrowingPrefixSpec, step: int) -> int:
    """Prefill tokens computed over rounds 2.. when round r resumes at ((N_{r-1}-1)//step)*step."""
    return sum(
        spec.prompt_len(r) - (spec.prompt_len(r - 1) - 1) // step * step
        for r in range(2, spec.rounds + 1)
    )


def test_the_default_growing_prefix_preset_keeps_the_seed_ratio() -> None:
    seed, default = workload_preset("growing-prefix", "seed"), workload_preset("growing-prefix")
    ratios = []
    for preset in (seed, default):
        spec = preset.spec
        assert isinstance(spec, GrowingPrefixSpec)
        assert (spec.streams, spec.rounds) == (8, 23)
        fine = analytic_recomputation(spec, preset.geometry.unit)
        block = analytic_recomputation(spec, preset.geometry.block_size)
        ratios.append(1 - fine / block)
    assert ratios[0] == ratios[1]
    assert round(ratios[0], 3) == 0.242
    assert (seed.geometry.block_size, seed.geometry.unit) == (1536, 128)


def test_geometry_is_raised_to_the_kernel_alignment() -> None:
    geometry = Geometry(block_size=96, unit=8, token_budget=512, max_running=8)
    assert geometry.aligned(1) == geometry
    assert (geometry.aligned(16).unit, geometry.aligned(16).block_size) == (16, 96)
    assert (geometry.aligned(64).unit, geometry.aligned(64).block_size) == (64, 192)


def test_simulate_publishes_its_events_and_serves_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--events`` publishes every run's events (stores among them, sequence numbers +1 a
    batch). A PUB socket sends only to subscribers already connected, and this tiny run may end
    before one is (the slow joiner), so the test reads as a router does: what arrives live, then
    the replay socket from sequence 0 while ``--serve-for`` keeps the endpoints up; every live
    batch must equal the replayed batch of its sequence."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    import socket
    import threading
    import time

    from prefixcache.events import END_SEQ

    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{ports[0]}")
    got: list[list[bytes]] = []
    done = threading.Event()

    def collect() -> None:
        while not done.is_set() or sub.poll(200):
            if sub.poll(50):
                got.append(sub.recv_multipart())

    trace = small_trace(tmp_path / "trace.jsonl")
    arguments = ["simulate", "--workload", "trace", str(trace), "--policies", "fine"]
    events = [
        "--events",
        f"tcp://127.0.0.1:{ports[0]}",
        "--events-replay",
        f"tcp://127.0.0.1:{ports[2]}",
        "--metrics-port",
        str(ports[1]),
    ]
    status: list[int] = []
    runner = threading.Thread(
        target=lambda: status.append(main([*arguments, *events, "--serve-for", "5"]))
    )
    reader = threading.Thread(target=collect)
    reader.start()
    replies: list[list[bytes]] = []
    try:
        runner.start()
        printed = ""
        deadline = time.monotonic() + 300
        while "serving the final state" not in printed and runner.is_alive():
            assert time.monotonic() < deadline, "the run did not finish"
            time.sleep(0.05)
            printed += capsys.readouterr().out
        assert "serving the final state" in printed, printed
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 30_000)
        dealer.connect(f"tcp://127.0.0.1:{ports[2]}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                break
            replies.append(frames[1:])
        runner.join()
    finally:
        done.set()
        reader.join()
        runner.join()
        ctx.destroy(linger=0)
    assert status == [0]
    assert replies, "the replay returned no batch"
    seqs = [int.from_bytes(frames[1], "big") for frames in replies]
    assert seqs == list(range(len(seqs))), seqs
    for frames in got:
        assert frames == replies[int.from_bytes(frames[1], "big")]
    types = [e["type"] for frames in replies for e in msgpack.unpackb(frames[2])[1]]
    assert "BlockStored" in types
    assert set(types) <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
