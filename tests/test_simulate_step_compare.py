"""``benchmarks/gpu_step_compare.py``: a block and a fine prefill step of one round, profiled.

The figures, stated here independently of the code: a step's wall time is its ``step`` range;
the host time before the first launch runs from the step's start to the earliest launch inside
it; GPU busy is the length of the union of the device work's intervals (overlapping kernels
count once), idle inside the step is the span from the first kernel's start to the last one's
end less busy, and the idle before and after are the gaps to the step's start and end; kernel
time by category sums each kernel's own duration by the first category whose words its name
holds; device time by range goes to the innermost host range that holds the work's launch.
The idle time inside the step, by range: every stretch between the first kernel's start and the
last one's end in which no work runs goes to the innermost range holding the launch of the work
that starts after it, the range named with its place among the step's ranges of the same name
(0 for the first). Block - fine divides each category's difference by the token difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("prefixcache._core")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_step_compare as sc
from gpu_step_compare import Span

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _step(scale: float = 1.0) -> list[Span]:
    """A made-up step of 100 us: kernels at 30-40 (flash), 35-45 (gemm, overlapping it),
    60 to 60 + 10 * scale (an elementwise kernel), launched at 25, 30 and 50, 80-85 (a gemv
    whose operator started at 55) and 86-87 (launched by nothing known)."""
    return [
        Span("step", "range", 0.0, 100.0),
        Span("schedule", "range", 1.0, 9.0),
        Span("forward", "range", 20.0, 90.0),
        Span("layer:kda", "range", 28.0, 35.0),
        Span("norm", "range", 29.0, 31.0),
        Span("cudaLaunchKernel", "launch", 25.0, 26.0, 1),
        Span("cudaLaunchKernel", "launch", 30.0, 31.0, 2),
        Span("cuLaunchKernelEx", "launch", 50.0, 51.0, 3),
        Span("void pytorch_flash::flash_fwd_kernel<...>", "work", 30.0, 40.0, 1),
        Span("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "work", 35.0, 45.0, 2),
        Span(
            "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor>",
            "work",
            60.0,
            60.0 + 10.0 * scale,
            3,
        ),
        # Launched by an operator at 55 whose launch call is not among the spans.
        Span("aten::mm", "op", 55.0, 58.0, 41),
        Span("void gemv_kernel", "work", 80.0, 85.0, 40, 41),
        Span("unknown kernel", "work", 86.0, 87.0, 42, 43),
        Span("before the step", "range", -50.0, -40.0),
        Span("cudaLaunchKernel", "launch", -45.0, -44.0, 9),  # outside: not counted
    ]


def test_one_step_is_analysed_by_the_stated_rule() -> None:
    out = sc.analyse(_step())
    assert out["wall_ms"] == pytest.approx(0.100)
    assert out["host_before_first_launch_ms"] == pytest.approx(0.025)
    assert out["launches"] == 3
    assert out["kernels"] == 5
    assert out["gpu_busy_ms"] == pytest.approx(0.031)  # [30, 45], [60, 70], [80, 85], [86, 87]
    assert out["gpu_span_ms"] == pytest.approx(0.057)
    assert out["gpu_idle_inside_ms"] == pytest.approx(0.026)
    assert out["gpu_idle_before_ms"] == pytest.approx(0.030)
    assert out["gpu_idle_after_ms"] == pytest.approx(0.013)
    by_category = out["kernel_ms_by_category"]
    assert by_category["attention"] == pytest.approx(0.010)
    assert by_category["matmul"] == pytest.approx(0.015)
    assert by_category["elementwise"] == pytest.approx(0.010)
    assert by_category["other"] == pytest.approx(0.001)
    assert sum(by_category.values()) == pytest.approx(0.036)  # own durations, not the union
    assert out["kernels_by_category"]["matmul"] == 2
    # Launched at 25 (forward), 30 (norm inside layer:kda: the innermost), 50 and by the
    # operator at 55 (forward); the last by nothing known.
    assert out["kernel_ms_by_range"] == pytest.approx(
        {"forward": 0.025, "norm": 0.010, "unattributed": 0.001}
    )
    assert out["phases_ms"]["schedule"] == pytest.approx(0.008)
    assert out["phases_ms"]["forward"] == pytest.approx(0.070)
    # Idle 45-60 before the kernel launched at 50, 70-80 before the one whose operator started
    # at 55 (both in forward), 85-86 before the one launched by nothing known.
    assert out["gpu_idle_by_range_ms"] == pytest.approx({"forward#0": 0.025, "unattributed": 0.001})


def test_idle_time_goes_to_the_layer_that_launched_the_work_after_it() -> None:
    spans = [
        Span("step", "range", 0.0, 100.0),
        Span("forward", "range", 0.0, 100.0),
        Span("layer:kda", "range", 10.0, 20.0),
        Span("layer:mlp", "range", 20.0, 25.0),
        Span("layer:kda", "range", 30.0, 40.0),
        Span("cudaLaunchKernel", "launch", 11.0, 12.0, 1),
        Span("cudaLaunchKernel", "launch", 21.0, 22.0, 2),
        Span("cudaLaunchKernel", "launch", 31.0, 32.0, 3),
        Span("cudaLaunchKernel", "launch", 32.0, 33.0, 4),
        Span("k1", "work", 12.0, 15.0, 1),
        Span("k2", "work", 26.0, 28.0, 2),  # after 11 idle, launched in the MLP
        Span("k3", "work", 33.0, 50.0, 3),  # after 5 idle, launched in the second KDA layer
        Span("k4", "work", 40.0, 45.0, 4),  # runs beside k3: no idle before it
    ]
    out = sc.analyse(spans)
    assert out["gpu_idle_inside_ms"] == pytest.approx(0.016)
    assert out["gpu_idle_by_range_ms"] == pytest.approx(
        {"layer:mlp#0": 0.011, "layer:kda#1": 0.005}
    )
    report = {
        "measure_round": 4,
        "block": {"profiled": out | {"tokens": 3, "rows": 1}, "timed_wall_ms_p50": None},
        "fine": {"profiled": out | {"tokens": 2, "rows": 1}, "timed_wall_ms_p50": None},
        "difference": sc.compare(out | {"tokens": 3}, out | {"tokens": 2}),
    }
    text = sc.render(report)
    assert "| layer:mlp#0 | 0.011 | 0.011 |" in text
    assert text.index("| layer:kda#1 |") > text.index("| layer:mlp#0 |")


def test_a_step_without_launches_or_work_and_spans_without_a_step() -> None:
    out = sc.analyse([Span("step", "range", 0.0, 10.0), Span("schedule", "range", 0.0, 2.0)])
    assert out["host_before_first_launch_ms"] is None
    assert out["kernels"] == 0
    assert "gpu_busy_ms" not in out
    with pytest.raises(ValueError, match="no 'step' range"):
        sc.analyse([Span("forward", "range", 0.0, 1.0)])


def test_profile_events_become_spans_and_ranges_mirrored_on_the_gpu_are_not_work() -> None:
    from types import SimpleNamespace

    from torch.autograd import DeviceType  # type: ignore[attr-defined]

    def event(name, device_type, start, end, id_=0, linked=0, parent=None):
        return SimpleNamespace(
            name=name,
            device_type=device_type,
            time_range=SimpleNamespace(start=start, end=end),
            id=id_,
            linked_correlation_id=linked,
            cpu_parent=parent,
        )

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        event("step", cpu, 0, 100),
        event("layer:kda", cpu, 10, 40),
        event("aten::mm", cpu, 11, 20, 7),
        event("cudaLaunchKernel", cpu, 12, 13, 8),
        # On the GPU: the kernel, and the ranges the profiler mirrors there (they span it).
        event("nvjet_sm90_gemm", gpu, 30, 60, 8, 7),
        event("layer:kda", gpu, 30, 60),
        event("step", gpu, 30, 60),
    ]
    spans = sc.spans_from_profile(events, "cuda")
    assert [s for s in spans if s.kind == "work"] == [
        Span("nvjet_sm90_gemm", "work", 30.0, 60.0, 8, 7)
    ]
    assert {(s.name, s.kind) for s in spans} == {
        ("step", "range"),
        ("layer:kda", "range"),
        ("aten::mm", "op"),
        ("cudaLaunchKernel", "launch"),
        ("nvjet_sm90_gemm", "work"),
    }
    result = sc.analyse(spans)
    assert result["gpu_busy_ms"] == pytest.approx(0.030)
    assert result["kernel_ms_by_range"] == {"layer:kda": pytest.approx(0.030)}


def test_block_minus_fine_per_token() -> None:
    block = sc.analyse(_step(scale=3.0)) | {"tokens": 300}
    fine = sc.analyse(_step()) | {"tokens": 200}
    diff = sc.compare(block, fine)
    assert diff["tokens"] == 100
    assert diff["kernel_ms_by_category"]["elementwise"] == pytest.approx(0.020)
    assert diff["kernel_us_per_token"]["elementwise"] == pytest.approx(0.2)
    assert diff["kernel_us_per_token"]["attention"] == pytest.approx(0.0)
    assert diff["gpu_busy_ms"] == pytest.approx(0.014)  # 60-90 now covers 80-85 and 86-87
    same = sc.compare(fine, fine)
    assert same["kernel_us_per_token"]["matmul"] is None  # no token difference


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>, false>",
            "attention",
        ),
        ("split_kernel", "attention"),
        ("_Z25_flash_kda_fwd_recurrenceIN4cute9TiledCopy", "kda"),
        ("conv_kernel", "conv"),
        ("nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_TNT", "matmul"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps>>", "reduce"),
        ("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>", "copy"),
        ("Memcpy DtoH (Device -> Pageable)", "copy"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>",
            "elementwise",
        ),
        ("rms_norm_kernel", "norm"),
        ("aten::linear", "matmul"),
        ("something_else", "other"),
    ],
)
def test_kernel_categories(name: str, expected: str) -> None:
    assert sc.category(name) == expected


def test_the_smoke_run_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compare.json"
    assert sc.main(["--smoke", "--steps", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for name in ("block", "fine"):
        step = report[name]["profiled"]
        assert step["first_token"] is True  # the request is prefilled in this one step
        assert step["tokens"] > 0
        assert 0 < step["host_before_first_launch_ms"] < step["wall_ms"]
        assert 0 < step["gpu_busy_ms"] <= step["gpu_span_ms"] < step["wall_ms"]
        assert step["phases_ms"]["forward"] < step["wall_ms"]
        assert step["phases_ms"]["schedule"] > 0 and step["phases_ms"]["plan"] > 0
        assert step["phases_ms"]["layer:kda"] > 0 and step["phases_ms"]["norm"] > 0
        assert sum(step["kernel_ms_by_category"].values()) == pytest.approx(
            sum(step["kernel_ms_by_range"].values())
        )
        assert "unattributed" not in step["kernel_ms_by_range"]
        assert sum(step["gpu_idle_by_range_ms"].values()) == pytest.approx(
            step["gpu_idle_inside_ms"]
        )
        assert len(report[name]["timed"]) == 2
    # Block computes more tokens of the round's request than fine (the smoke geometry's
    # block of 96 against a unit of 8).
    assert report["difference"]["tokens"] == (
        report["block"]["profiled"]["tokens"] - report["fine"]["profiled"]["tokens"]
    )
    assert report["difference"]["tokens"] > 0
    text = capsys.readouterr().out
    assert "| GPU busy |" in text and "| kernel category |" in text


def test_the_probe_leaves_the_model_and_engine_as_found() -> None:
    from prefixcache.engine import engine as engine_module
    from prefixcache.models import hybrid

    step, norm = engine_module._Loop.step, hybrid.rms_norm
    assert sc.main(["--smoke", "--steps", "1", "--rounds", "2"]) == 0
    assert engine_module._Loop.step is step
    assert hybrid.rms_norm is norm
