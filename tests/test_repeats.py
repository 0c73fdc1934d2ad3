"""Measured passes (``simulate(..., repeats=N)``, ``prefixcache simulate --repeats N``).

The rule, stated here independently of the code: after the warm pass every policy but the
``none`` reference runs N times, counterbalanced: odd passes in the order asked for, even passes
in the reverse order (block, fine, fine, block, block, fine), each on fresh caches; the
reference runs once, first, and every pass is checked against it. Every pass is kept; per
policy the document gives the median over the passes and the spread (largest over smallest,
less 1) of TTFT p50, prefill time, KDA time and host time, and its headline entry is its median
pass by TTFT p50 (the faster middle one of an even count). Passes of one policy compute the
same tokens and generate the same outputs. One pass (the default) leaves the document as it
was; counts outside 1 to 16 are refused before anything runs.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("prefixcache._core")

from prefixcache.engine import Engine, RunResult, build_model, simulate
from prefixcache.engine.cli import build_parser, main
from prefixcache.engine.simulate import MAX_REPEATS, measured_order
from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload, Workload

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_seed_report

SPEC = GrowingPrefixSpec(streams=2, first_prompt=150, growth=70, rounds=3, output_len=3)
GEOMETRY = Geometry(block_size=32, unit=8, token_budget=96, max_running=2)
FIGURES = ("ttft_p50_ms", "prefill_seconds", "kda_prefill_seconds", "host_seconds")
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    runs: list[str] = []
    original = Engine.run

    def recording(engine: Engine, workload: Workload, **kwargs: object) -> RunResult:
        runs.append(engine.policy.name)
        return original(engine, workload, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "run", recording)
    return runs


@pytest.fixture(scope="module")
def workload() -> PresetWorkload:
    return PresetWorkload("growing-prefix", "test", SPEC, GEOMETRY)


def test_two_passes_interleave_agree_and_give_medians(
    workload: PresetWorkload, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = build_model("cpu", "torch")
    runs = _recording(monkeypatch)
    report = simulate(workload, ["block", "fine"], model, repeats=2)
    assert runs == ["none", "block", "fine", "fine", "block"]
    document = report.to_json()
    assert document["repeats"] == 2
    assert document["pass_order"] == [
        [1, "none"],
        [1, "block"],
        [1, "fine"],
        [2, "fine"],
        [2, "block"],
    ]
    # Counterbalanced: each policy's mean position is the same (2.5).
    for name, positions in (("block", [1, 4]), ("fine", [2, 3])):
        entry = document["policies"][name]
        passes = entry["passes"]
        assert [p["pass"] for p in passes] == [1, 2]
        assert [p["position"] for p in passes] == positions
        first, second = passes
        for key in ("prompt_tokens", "hit_tokens", "computed_prefill_tokens", "steps"):
            assert first[key] == second[key], (name, key)
        assert [r["computed_prefill_tokens"] for r in first["rounds"]] == [
            r["computed_prefill_tokens"] for r in second["rounds"]
        ]
        assert all(p["outputs_match_no_cache"] is True for p in passes), name
        a, b = (run for run, _, _ in report.passes[name])
        assert a is not b
        for request_id, result in a.requests.items():
            assert result.output_ids == b.requests[request_id].output_ids
        for key in FIGURES:
            values = [p[key] for p in passes]
            assert entry["median"][key] == pytest.approx(statistics.median(values))
            assert entry["spread"][key] == pytest.approx(max(values) / min(values) - 1)
        # The headline is a pass: the faster of two by TTFT p50.
        ttfts = [p["ttft_p50_ms"] for p in passes]
        assert entry["ttft_p50_ms"] == min(ttfts)
        assert passes[entry["median_pass"] - 1]["ttft_p50_ms"] == entry["ttft_p50_ms"]
        assert entry["host_seconds"] == passes[entry["median_pass"] - 1]["host_seconds"]
    path = tmp_path / "repeated.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    lines = _report([str(path)], monkeypatch)
    assert "### order check: pass 1 against pass 2" in lines
    assert any(line.startswith("| block spread |") for line in lines)
    assert sum(line.startswith("| fine | TTFT p50 ms |") for line in lines) == 1


@pytest.mark.parametrize(
    ("names", "repeats", "expected"),
    [
        (["none", "block", "fine"], 1, ["none", "block", "fine"]),
        (["none", "fine", "block"], 2, ["none", "fine", "block", "block", "fine"]),
        (["block", "fine"], 3, ["block", "fine", "fine", "block", "block", "fine"]),
        (["block", "fine"], 4, ["block", "fine", "fine", "block"] * 2),
        (["fine"], 3, ["fine"] * 3),
        (["none"], 2, ["none", "none"]),  # the reference alone is the repeated policy
    ],
)
def test_the_measured_order_is_counterbalanced(
    names: list[str], repeats: int, expected: list[str]
) -> None:
    order = measured_order(names, repeats)
    assert order == expected
    repeated = [name for name in names if name != "none"] or names
    if repeats % 2 == 0 and len(repeated) > 1:
        # Over an even number of passes every repeated policy sits, on average, at the same
        # place in the process.
        positions = {
            name: statistics.mean(k for k, ran in enumerate(order) if ran == name)
            for name in repeated
        }
        assert len(set(positions.values())) == 1, positions


def test_each_run_starts_on_a_frozen_heap_and_the_heap_is_thawed_after(
    workload: PresetWorkload,
) -> None:
    assert gc.get_freeze_count() == 0
    report = simulate(workload, ["block", "fine"], build_model("cpu", "torch"), repeats=2)
    for name in ("block", "fine"):
        starts = []
        for entry in report.to_json()["policies"][name]["passes"]:
            state = entry["step_times"]["pass_state"]
            # What the earlier runs left (the model, their results) is out of the collector's
            # sight before the run starts, and stays so through it (a frozen object that the
            # run lets go of is freed by its reference count, so the count may only fall).
            start, end = state["start"]["python_frozen"], state["end"]["python_frozen"]
            assert 0 < end <= start, name
            starts.append(start)
        # The second pass also has the first pass's kept results frozen.
        assert starts[1] > starts[0], name
    assert gc.get_freeze_count() == 0


def test_three_passes_head_with_the_median_pass(
    workload: PresetWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model("cpu", "torch")
    runs = _recording(monkeypatch)
    report = simulate(workload, ["fine"], model, repeats=3, reference=False)
    assert runs == ["fine"] * 3
    entry = report.to_json()["policies"]["fine"]
    ttfts = [p["ttft_p50_ms"] for p in entry["passes"]]
    assert entry["ttft_p50_ms"] == statistics.median(ttfts)
    assert all(p["outputs_match_no_cache"] is None for p in entry["passes"])
    # A pass whose outputs differ fails the policy's check, whichever pass heads it.
    run, times, _ = report.passes["fine"][0]
    report.add_pass("fine", run, times, (False, "ids differ"))
    assert report.to_json()["policies"]["fine"]["outputs_match_no_cache"] is False
    assert report.matches["fine"] == (False, "pass 4: ids differ")


def test_one_pass_leaves_the_document_as_it_was(workload: PresetWorkload) -> None:
    document = simulate(workload, ["fine"], build_model("cpu", "torch")).to_json()
    assert "repeats" not in document and "pass_order" not in document
    for entry in document["policies"].values():
        assert not {"passes", "median", "spread", "median_pass"} & set(entry)


@pytest.mark.parametrize("bad", [0, -1, 17, 10**12, True, 2.0, "2", None])
def test_bad_pass_counts_are_refused_before_anything_runs(
    workload: PresetWorkload, monkeypatch: pytest.MonkeyPatch, bad: object
) -> None:
    model = build_model("cpu", "torch")
    runs = _recording(monkeypatch)
    with pytest.raises(ValueError, match="repeats must"):
        simulate(workload, ["fine"], model, repeats=bad)  # type: ignore[arg-type]
    assert runs == []


def test_the_command_line_passes_repeats_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"id": "a", "arrival_s": 0.0, "prompt_len": 120, "output_len": 2},
        {"id": "b", "arrival_s": 0.0, "prompt_len": 200, "prefix_of": "a", "output_len": 2},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    out = tmp_path / "run.json"
    arguments = ["simulate", "--workload", "trace", str(trace), "--policies", "fine"]
    assert main([*arguments, "--repeats", "2", "--json", str(out)]) == 0
    document = json.loads(out.read_text(encoding="utf-8"))
    assert document["repeats"] == 2
    assert [p["pass"] for p in document["policies"]["fine"]["passes"]] == [1, 2]
    assert "Passes (2, in the order they ran" in capsys.readouterr().out
    for bad in ("0", "17", "-3"):
        assert main([*arguments, "--repeats", bad]) == 2
        assert "repeats must be from 1 to 16" in capsys.readouterr().err
    # The help states the library's bound.
    parser = build_parser().parse_args(["simulate"]).command_parser
    (action,) = (a for a in parser._actions if a.dest == "repeats")
    assert f"1 to {MAX_REPEATS}" in str(action.help)


def _report(paths: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    printed: list[str] = []
    monkeypatch.setattr("builtins.print", lambda *a, **_: printed.append(" ".join(map(str, a))))
    assert gpu_seed_report.main(paths) == 0
    return "\n".join(printed).splitlines()


def test_the_seed_report_still_reads_the_committed_single_pass_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stem = "seed_h200_2026-12-02_out200_graphs"
    paths = [str(RESULTS / f"{stem}_block_first.json"), str(RESULTS / f"{stem}_fine_first.json")]
    lines = _report(paths, monkeypatch)
    assert "## order check" in lines
    assert "| block | prefill s | 6.299 | 5.892 | -6.5% |" in lines
    assert not any("passes" in line for line in lines)


def test_the_seed_report_gives_each_pass_fine_against_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The H200's depth-6 run (block, fine, fine, block): pass 1 is block first, pass 2 fine
    # first; docs/BENCHMARKS.md quotes both passes' totals from these lines.
    path = RESULTS / "seed_h200_2026-12-06_2027_depth6_passes_block_fine_fine_block.json"
    lines = _report([str(path)], monkeypatch)
    tables = {
        number: lines[lines.index(f"### pass {number}: fine against block") :] for number in (1, 2)
    }
    assert "| TTFT p50, ms | 80.3 | 63.6 | -20.8% | <= -20% |" in tables[1]
    assert "| TTFT p50, ms | 80.7 | 63.8 | -21.0% | <= -20% |" in tables[2]
    assert "| whole-model prefill time, s | 14.050 | 11.123 | -20.8% | - |" in tables[2]
    # Each pass's table is its own: pass 2's round 3, not the headline (pass 1) one.
    assert any(
        line.startswith("| 3 | 21,248 | 16,128 | -24.1% |") and "71.5 | 57.1" in line
        for line in tables[2]
    )
