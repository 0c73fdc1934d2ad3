#!/usr/bin/env python3
"""GPU parity and timing of the KDA kernel backends (fla, flashkda, flashkda-op) on an H200.

What it does, in one run:

1. Parity (``prefixcache.kernels.parity``) for ``fla`` (``h`` and ``chain`` checkpoint modes, both
   gates), ``flashkda-op`` and ``flashkda`` (through ``flash_kda`` or, where that package cannot
   load, through vLLM's op called without checkpoint arguments): one forward with checkpoints vs
   forwards split at the same offsets (bitwise for fp32 state paths; fla's ``h`` equal to the bf16
   rounding of the split state) and vs the float64 torch reference (relative L2 < 2e-2).
2. Refusal: each backend refuses an offset off its grid (and the raw op is shown to skip one
   silently, which is why the plan check exists).
3. Timing (``triton.testing.do_bench``, median, after warm-up, random data) at 4 x 8192 and
   1 x 32768 tokens with 32 heads (Kimi-Linear) and 12 heads (Kimi-K3 at TP8), K = V = 128,
   bounded gate: the recurrence forward (``backend.forward``: state gather, kernel calls, state
   and checkpoint writes) without checkpoints, with 1 and with 2 checkpoints per sequence; the
   slot filling (copying checkpoint states and conv windows into their slots) alone; and, for
   context, the whole layer (``kda_prefill``: plan check + short conv + forward).

It prints a short table last and writes everything to ``<out>/gpu_kernels.json`` and
``<out>/gpu_kernels_table.md``.

Run on the device (the ``run`` tool; the wheels and the op library travel as carried, git-ignored
paths; the prefixcache wheel is the abi3 one built here, ``maturin build --release -o
.device/wheels``)::

    pip install -q --no-index --no-deps --target /tmp/site .device/wheels/*.whl
    PYTHONPATH=/tmp/site PREFIXCACHE_FLASHKDA_LIB=.device/flashkda/_flashkda_C.abi3.so \\
        python3 benchmarks/gpu_kernels.py --out "$OUT"

``prefixcache.kernels`` is imported from the installed package, else from ``python/`` of this
checkout; either way it needs the Rust extension ``_core`` (the kernels ask the core which
checkpoint offsets are exportable). ``--smoke`` runs the whole script on the CPU with the torch
backend and tiny shapes, to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def import_kernels() -> tuple[ModuleType, str]:
    """``prefixcache.kernels`` as installed (the wheel), else from ``python/`` of this checkout."""
    try:
        module = importlib.import_module("prefixcache.kernels")
    except ImportError:
        for name in [name for name in sys.modules if name.split(".")[0] == "prefixcache"]:
            del sys.modules[name]
        sys.path.insert(0, str(REPO / "python"))
        module = importlib.import_module("prefixcache.kernels")
    return module, f"prefixcache.kernels from {Path(str(module.__file__)).parent}"


kernels, IMPORTED_AS = import_kernels()
log = logging.getLogger("gpu_kernels")


def bench_ms(fn: Callable[[], object], smoke: bool) -> float:
    """Median milliseconds of ``fn`` after warm-up."""
    if smoke:
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return sorted(samples)[1]
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))


def build_backends(library: str | None, smoke: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The backends to measure, by label, and the reasons of those that cannot be built."""
    built: dict[str, Any] = {}
    missing: dict[str, str] = {}
    if smoke:
        built["torch-64"] = kernels.TorchBackend(64)
        built["torch-16-loop"] = kernels.TorchBackend(16, mode="loop")
        return built, missing

    def add(label: str, make: Callable[[], Any]) -> None:
        try:
            built[label] = make()
        except kernels.BackendUnavailableError as error:
            missing[label] = str(error)

    add("fla-h", lambda: kernels.FlaBackend("h"))
    add("fla-chain", lambda: kernels.FlaBackend("chain"))
    add("flashkda-op", lambda: kernels.FlashKDAOpBackend(library))
    try:
        built["flashkda"] = kernels.FlashKDABackend()
    except kernels.BackendUnavailableError as error:
        missing["flashkda (flash_kda package)"] = str(error)
        if "flashkda-op" in built:
            built["flashkda"] = kernels.FlashKDABackend(
                fwd=built["flashkda-op"].fwd_without_checkpoints()
            )
            built["flashkda"].via = "vLLM op without checkpoint arguments"
    return built, missing


def environment(library: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "kernels_imported_as": IMPORTED_AS,
        "flashkda_library": library,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["cuda"] = torch.version.cuda
    for package in ("triton", "fla"):
        try:
            info[package] = importlib.import_module(package).__version__
        except Exception as error:
            info[package] = f"unavailable: {error}"
    return info


def run_parity(backends: dict[str, Any], device: str, smoke: bool) -> list[dict[str, Any]]:
    results = []
    for label, backend in backends.items():
        gates = ["bounded"] if label.startswith("flashkda") else ["bounded", "softplus"]
        for gate in gates:
            start = time.perf_counter()
            entry: dict[str, Any] = {"backend": label, "gate": gate}
            try:
                report = kernels.parity.check_parity(
                    backend,
                    gate=gate,
                    num_heads=2 if smoke else 12,
                    head_dim=16 if smoke else 128,
                    device=device,
                    dtype=torch.float32 if smoke else torch.bfloat16,
                )
                entry.update(report.as_dict())
                entry["passed"] = report.passed(
                    bf16_checkpoints=label == "fla-h", exact_resume=not label.startswith("flashkda")
                )
                entry["passed_exact_resume"] = report.passed(bf16_checkpoints=label == "fla-h")
            except Exception as error:
                entry["error"] = f"{type(error).__name__}: {error}"
                entry["traceback"] = traceback.format_exc()
                entry["passed"] = False
            entry["backend"] = label
            entry["seconds"] = round(time.perf_counter() - start, 1)
            log.info(
                "parity %s",
                json.dumps({key: value for key, value in entry.items() if key != "traceback"}),
            )
            results.append(entry)
    return results


def run_refusals(backends: dict[str, Any], smoke: bool) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for label, backend in backends.items():
        try:
            result[label] = kernels.parity.unaligned_plan_error(backend)
        except AssertionError as error:
            result[label] = f"ACCEPTED (bug): {error}"
    op = backends.get("flashkda-op")
    if op is not None and not smoke:
        # The raw op, given offsets 8 (off its 16-grid) and 16, writes only the second row.
        device = torch.device("cuda")
        heads, tokens = 2, 64
        q = torch.randn(1, 2 * tokens, heads, 128, device=device, dtype=torch.bfloat16)
        state = torch.zeros(2, heads, 128, 128, device=device)
        staging = torch.full_like(state, math.nan)
        op._run(
            q, q.clone(), q.clone(), q.clone(), q[..., 0].clone(), 128**-0.5, torch.empty_like(q),
            torch.zeros(heads, device=device), torch.zeros(heads, 128, device=device), -5.0,
            state, torch.empty_like(state),
            torch.tensor([0, tokens, 2 * tokens], device=device),
            staging, torch.tensor([8, 16], device=device),
        )  # fmt: skip
        torch.cuda.synchronize()
        result["raw op, offset 8 (off grid) left its staging row unwritten"] = bool(
            torch.isnan(staging[0]).all()
        )
        result["raw op, offset 16 wrote its staging row"] = bool(torch.isfinite(staging[1]).all())
        result["chained vs one run (max abs)"] = chain_experiment(op)
    return result


def host_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Host milliseconds per call of ``fn`` (enqueue time; the GPU is not waited for)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e3
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed


def chain_experiment(op: Any) -> dict[str, float]:
    """FlashKDA op: one run over 512 tokens vs two runs chained at token 256 (on its grid)."""
    device = torch.device("cuda")
    torch.manual_seed(2)
    heads, tokens, cut = 4, 512, 256
    q, k, v, g = (
        torch.randn(1, tokens, heads, 128, device=device, dtype=torch.bfloat16) for _ in range(4)
    )
    beta = torch.randn(1, tokens, heads, device=device, dtype=torch.bfloat16)
    a_log = torch.log(torch.empty(heads, device=device).uniform_(1, 16))
    dt_bias = 0.5 * torch.randn(heads, 128, device=device)
    result = {}
    for name, initial in (
        ("zero", torch.zeros(1, heads, 128, 128, device=device)),
        ("random", 0.5 * torch.randn(1, heads, 128, 128, device=device)),
    ):

        def call(a: int, b: int, state: torch.Tensor, offset: int = 0) -> tuple[Any, Any, Any]:
            parts = [x[:, a:b].contiguous() for x in (q, k, v, g, beta)]
            out, final = torch.empty_like(parts[2]), torch.empty_like(state)
            staging = torch.empty_like(state) if offset else None
            offsets = torch.tensor([offset], device=device) if offset else None
            op._run(
                *parts, 128**-0.5, out, a_log, dt_bias, -5.0, state.contiguous(), final,
                torch.tensor([0, b - a], device=device), staging, offsets,
            )  # fmt: skip
            return out, final, staging

        out_one, final_one, staging = call(0, tokens, initial, offset=cut)
        out_first, state_cut, _ = call(0, cut, initial)
        out_second, final_chained, _ = call(cut, tokens, state_cut)
        result[f"{name}_state: checkpoint vs prefix final"] = float(
            (staging - state_cut).abs().max()
        )
        result[f"{name}_state: first part outputs"] = float(
            (out_one[:, :cut] - out_first).abs().max()
        )
        result[f"{name}_state: resumed outputs"] = float(
            (out_one[:, cut:] - out_second).abs().max()
        )
        result[f"{name}_state: final states"] = float((final_one - final_chained).abs().max())
    return result


def offsets_for(length: int, count: int) -> list[int]:
    """``count`` interior offsets spread evenly over a sequence, on the 64-token grid."""
    return [max(64, (length * (i + 1) // (count + 1)) // 64 * 64) for i in range(count)]


def run_timing(
    backends: dict[str, Any],
    device: str,
    smoke: bool,
    deadline: float,
    only: list[tuple[int, int, int]] | None = None,
) -> list[dict[str, Any]]:
    """Time every backend at each (rows, length, heads) configuration (or those in ``only``)."""
    configs = [(2, 256, 2)]
    if not smoke:
        configs = [(4, 8192, 32), (1, 32768, 32), (4, 8192, 12), (1, 32768, 12)]
    if only:
        configs = only
    entries: list[dict[str, Any]] = []
    for rows, length, heads in configs:
        if time.monotonic() > deadline:
            log.warning("time budget spent; skipping %s x %s, H=%s", rows, length, heads)
            continue
        entries += time_config(backends, rows, length, heads, device, smoke)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return entries


def time_config(
    backends: dict[str, Any], rows: int, length: int, heads: int, device: str, smoke: bool
) -> list[dict[str, Any]]:
    """Time the forward with 0, 1 and 2 checkpoints per row, the slot filling and the layer."""
    head_dim = 16 if smoke else 128
    dtype = torch.float32 if smoke else torch.bfloat16
    torch.manual_seed(0)
    params = kernels.KDALayerParams.random(
        heads, head_dim, gate="bounded", dtype=dtype, device=device
    )
    tokens = rows * length

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    q, k, v, g = (randn(tokens, heads, head_dim) for _ in range(4))
    beta = randn(tokens, heads)
    x = randn(tokens, params.conv_channels)
    cache = kernels.StateCache.for_layer(params, 4 * rows + 4, device=device)
    cache.recurrent.normal_(0, 0.5)
    cache.conv.normal_()
    checkpoint_slots = [[2 * rows + 2 * r, 2 * rows + 2 * r + 1] for r in range(rows)]
    plans = {}
    for count in (0, 1, 2):
        offsets = offsets_for(length, count)
        plans[count] = {
            "query_start_loc": torch.arange(rows + 1, dtype=torch.int32) * length,
            "initial_slot": torch.arange(rows, dtype=torch.int32),
            "running_slot": torch.arange(rows, 2 * rows, dtype=torch.int32),
            "checkpoint_offsets": torch.tensor([offsets] * rows, dtype=torch.int32),
            "checkpoint_slots": torch.tensor([s[:count] for s in checkpoint_slots]),
        }
        for name in ("checkpoint_offsets", "checkpoint_slots"):
            plans[count][name] = plans[count][name].reshape(rows, count).to(torch.int32)

    # Slot filling alone: one checkpoint state and conv window per row into its slot.
    fill_slots = [s[0] for s in checkpoint_slots]
    staging = torch.randn(rows, heads, head_dim, head_dim, device=device)
    staging_bf16 = staging.to(torch.bfloat16)
    windows = torch.randn(rows, params.conv_channels, params.conv_width - 1, device=device)
    windows = windows.to(cache.conv.dtype)
    fill_index = torch.tensor(fill_slots, device=device)
    write_states = kernels.backend.write_states
    fill_state_ms = bench_ms(lambda: write_states(cache.recurrent, fill_slots, staging), smoke)
    fill_state_bf16_ms = bench_ms(
        lambda: write_states(cache.recurrent, fill_slots, staging_bf16), smoke
    )
    fill_conv_ms = bench_ms(lambda: cache.conv.index_copy_(0, fill_index, windows), smoke)
    # The copies alone (slot index already on the GPU): the floor of slot filling.
    fill_kernels_ms = bench_ms(
        lambda: (
            cache.recurrent.index_copy_(0, fill_index, staging),
            cache.conv.index_copy_(0, fill_index, windows),
        ),
        smoke,
    )
    conv_plan = kernels.check_state_plan(**plans[1], num_slots=cache.num_blocks)
    splits = (heads * head_dim,) * 3
    conv_ms = bench_ms(
        lambda: kernels.conv.causal_conv(x, params, cache.conv, conv_plan, splits=splits), smoke
    )
    start = time.perf_counter()
    for _ in range(200):
        kernels.check_state_plan(**plans[2], num_slots=cache.num_blocks, alignment=64)
    check_us = (time.perf_counter() - start) / 200 * 1e6

    entries = []
    for label, backend in backends.items():
        entry: dict[str, Any] = {
            "rows": rows, "length": length, "heads": heads, "backend": label,
            "offsets_1": offsets_for(length, 1), "offsets_2": offsets_for(length, 2),
            "conv_ms": conv_ms, "plan_check_us": check_us,
            "fill_state_ms": fill_state_bf16_ms if label == "fla-h" else fill_state_ms,
            "fill_conv_ms": fill_conv_ms, "fill_kernels_ms": fill_kernels_ms,
        }  # fmt: skip
        try:
            for count in (0, 1, 2):
                plan = backend.check_plan(
                    **plans[count], num_slots=cache.num_blocks, num_tokens=tokens
                )
                entry[f"forward_{count}_ms"] = bench_ms(
                    lambda backend=backend, plan=plan: backend.forward(
                        q, k, v, g, beta, params, cache.recurrent, plan
                    ),
                    smoke,
                )
                entry[f"host_{count}_ms"] = host_ms(
                    lambda backend=backend, plan=plan: backend.forward(
                        q, k, v, g, beta, params, cache.recurrent, plan
                    )
                )
            for count in (0, 1):
                entry[f"layer_{count}_ms"] = bench_ms(
                    lambda backend=backend, count=count: kernels.kda_prefill(
                        backend, x, g, beta, params, cache, **plans[count]
                    ),
                    smoke,
                )
        except Exception as error:
            entry["error"] = f"{type(error).__name__}: {error}"
            entry["traceback"] = traceback.format_exc()
        base = entry.get("forward_0_ms")
        if base:
            for count in (1, 2):
                if f"forward_{count}_ms" in entry:
                    entry[f"export_{count}_pct"] = 100 * (entry[f"forward_{count}_ms"] / base - 1)
            entry["fill_ms"] = entry["fill_state_ms"] + entry["fill_conv_ms"]
            entry["fill_pct"] = 100 * entry["fill_ms"] / base
        log.info(
            "timing %s",
            json.dumps({key: value for key, value in entry.items() if key != "traceback"}),
        )
        entries.append(entry)
    return entries


def _vs_split(report: dict[str, Any], key: str, name: str) -> str:
    if report[key]:
        return "bitwise"
    return f"max {report['max_abs'][name]:.2e}"


def _parity_line(p: dict[str, Any]) -> str:
    if "error" in p:
        return f"| {p['backend']} | {p['gate']} | error: {p['error'][:80]} | | | | no |"
    checkpoints = _vs_split(p, "checkpoints_bitwise", "checkpoints_vs_split")
    if not p["checkpoints_bitwise"] and p["checkpoints_bitwise_bf16"]:
        checkpoints = "= bf16(split)"
    rel = p["rel_l2"]
    return (
        f"| {p['backend']} | {p['gate']} | {_vs_split(p, 'outputs_bitwise', 'outputs_vs_split')} "
        f"| {_vs_split(p, 'running_bitwise', 'running_vs_split')} | {checkpoints} "
        f"| {rel['outputs']:.1e} / {rel['running_states']:.1e} / {rel['checkpoint_states']:.1e} "
        f"| {'yes' if p['passed'] else 'NO'} |"
    )


def _timing_line(t: dict[str, Any]) -> str:
    shape = f"{t['rows']} x {t['length']}"
    if "forward_0_ms" not in t:
        return f"| {shape} | {t['heads']} | {t['backend']} | error: {t.get('error', '')[:80]} |"
    cells = []
    for count in (0, 1, 2):
        ms = t.get(f"forward_{count}_ms")
        if ms is None:
            cells.append("-")
        elif count == 0:
            cells.append(f"{ms:.3f}")
        else:
            cells.append(f"{ms:.3f} ({t[f'export_{count}_pct']:+.1f}%)")
    layer = " / ".join(f"{t[f'layer_{c}_ms']:.3f}" if f"layer_{c}_ms" in t else "-" for c in (0, 1))
    fill = f"{1e3 * t['fill_ms']:.1f} us ({t['fill_pct']:.2f}%)"
    if "fill_kernels_ms" in t:
        fill += f", copies {1e3 * t['fill_kernels_ms']:.1f} us"
    return f"| {shape} | {t['heads']} | {t['backend']} | {' | '.join(cells)} | {fill} | {layer} |"


def table(
    parity: list[dict[str, Any]], timing: list[dict[str, Any]], refusals: dict[str, Any]
) -> str:
    """The short Markdown summary printed last."""
    lines = [
        "Parity: one forward with checkpoints vs split forwards; rel L2 vs float64 reference",
        "",
        "| backend | gate | outputs | running | checkpoints | rel L2 out / state / ckpt | pass |",
        "|---|---|---|---|---|---|---|",
        *(_parity_line(p) for p in parity),
        "",
        "Unaligned offsets: " + "; ".join(f"{k}: {v}" for k, v in refusals.items()),
        "",
        "Timing, median ms (forward = state gather + kernel calls + state and checkpoint writes)",
        "",
        "| tokens | H | backend | 0 ckpt | 1 ckpt/seq | 2 ckpt/seq | slot fill | layer 0/1 ckpt |",
        "|---|---|---|---|---|---|---|---|",
        *(_timing_line(t) for t in timing),
    ]
    return "\n".join(lines)


def packing_experiment(op: Any) -> dict[str, Any]:
    """Does a FlashKDA op result depend on where a sequence sits in the packed batch?"""
    return {
        "unaligned": _packing_case(op, [280, 83, 32, 396]),
        "aligned": _packing_case(op, [288, 96, 32, 400]),
    }


def _packing_case(op: Any, lengths: list[int]) -> dict[str, Any]:
    device = torch.device("cuda")
    heads = 4
    torch.manual_seed(1)
    tokens = sum(lengths)
    q, k, v, g = (
        torch.randn(1, tokens, heads, 128, device=device, dtype=torch.bfloat16) for _ in range(4)
    )
    beta = torch.randn(1, tokens, heads, device=device, dtype=torch.bfloat16)
    a_log = torch.log(torch.empty(heads, device=device).uniform_(1, 16))
    dt_bias = 0.5 * torch.randn(heads, 128, device=device)
    initial = 0.5 * torch.randn(len(lengths), heads, 128, 128, device=device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)

    def call(lo: int, hi: int, offsets: list[int] | None = None) -> tuple[Any, Any]:
        rows = slice(lo, hi)
        first, last = int(cu[lo]), int(cu[hi])
        parts = [x[:, first:last].contiguous() for x in (q, k, v, g, beta)]
        out = torch.empty_like(parts[2])
        final = torch.empty_like(initial[rows])
        staging = torch.empty_like(final) if offsets is not None else None
        off = torch.tensor(offsets, device=device) if offsets is not None else None
        op._run(
            *parts, 128**-0.5, out, a_log, dt_bias, -5.0, initial[rows].contiguous(), final,
            cu[lo : hi + 1] - cu[lo], staging, off,
        )  # fmt: skip
        return out, final

    out_all, final_all = call(0, len(lengths))
    rows = []
    for r in range(len(lengths)):
        out_alone, final_alone = call(r, r + 1)
        a, b = int(cu[r]), int(cu[r + 1])
        rows.append(
            {
                "start": a,
                "output_max_abs": float((out_all[:, a:b] - out_alone).abs().max()),
                "final_max_abs": float((final_all[r] - final_alone[0]).abs().max()),
            }
        )
    zero_offsets = call(0, len(lengths), [0] * len(lengths))
    grid_offsets = call(0, len(lengths), [16] * len(lengths))
    return {
        "lengths": lengths,
        "packed_vs_alone": rows,
        "zero_checkpoint_offsets_outputs_max_abs": float((zero_offsets[0] - out_all).abs().max()),
        "checkpoint_offset_16_outputs_max_abs": float((grid_offsets[0] - out_all).abs().max()),
        "checkpoint_offset_16_final_max_abs": float((grid_offsets[1] - final_all).abs().max()),
    }


def profile(fn: Callable[[], object]) -> str:
    """A torch.profiler table of one call of ``fn`` (after warm-up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with run_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


def diagnose(backends: dict[str, Any]) -> dict[str, Any]:
    """Packing dependence of FlashKDA, aligned-length parity, and profiles of chained calls."""
    result: dict[str, Any] = {}
    op = backends.get("flashkda-op")
    if op is None:
        return {"error": "flashkda-op unavailable"}
    result["packing"] = packing_experiment(op)
    log.info("packing %s", json.dumps(result["packing"]))
    for label in ("flashkda-op", "flashkda"):
        report = kernels.parity.check_parity(backends[label], num_heads=12, aligned_lengths=True)
        result[f"parity_aligned_{label}"] = report.as_dict() | {"passed": report.passed()}
        log.info("aligned parity %s %s", label, json.dumps(result[f"parity_aligned_{label}"]))
    subset = {label: backends[label] for label in ("flashkda-op", "flashkda")}
    result["timing"] = time_config(subset, 4, 8192, 12, "cuda", smoke=False)
    torch.manual_seed(0)
    params = kernels.KDALayerParams.random(12, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v, g = (
        torch.randn(32768, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    beta = torch.randn(32768, 12, device="cuda", dtype=torch.bfloat16)
    cache = kernels.StateCache.for_layer(params, 20, device="cuda")
    for label, count in (("flashkda", 1), ("flashkda-op", 2)):
        offsets = offsets_for(8192, count)
        plan = backends[label].check_plan(
            query_start_loc=[8192 * r for r in range(5)],
            initial_slot=[0, 1, 2, 3],
            running_slot=[4, 5, 6, 7],
            checkpoint_offsets=[offsets] * 4,
            checkpoint_slots=[[8 + 2 * r + i for i in range(count)] for r in range(4)],
            num_slots=20,
        )
        name = f"profile_{label}_{count}ckpt_4x8192_H12"
        result[name] = profile(
            lambda b=backends[label], p=plan: b.forward(
                q, k, v, g, beta, params, cache.recurrent, p
            )
        )
        print(name + "\n" + result[name], flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--library", default=os.environ.get(kernels.LIBRARY_ENV))
    parser.add_argument("--budget", type=float, default=480.0, help="seconds before timing stops")
    parser.add_argument("--smoke", action="store_true", help="CPU, torch backend, tiny shapes")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--backends", default="", help="comma-separated labels (default: all)")
    parser.add_argument(
        "--configs", default="", help="comma-separated ROWSxLENGTHxHEADS to time (default: all)"
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="FlashKDA packing experiment, aligned parity and profiles instead of the suite",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    deadline = time.monotonic() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"

    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "environment": environment(args.library),
    }
    log.info("environment %s", json.dumps(results["environment"]))
    results["available"] = kernels.available_backends(library=args.library)
    if not args.smoke:
        results["auto"] = kernels.get_backend("auto", library=args.library).name
    backends, missing = build_backends(args.library, args.smoke)
    if args.backends:
        backends = {k: v for k, v in backends.items() if k in args.backends.split(",")}
    only = [
        (int(r), int(n), int(h)) for r, n, h in (c.split("x") for c in args.configs.split(",") if c)
    ]
    results["missing"] = missing
    log.info("backends %s; missing %s", list(backends), missing)

    def save() -> None:
        (out / "gpu_kernels.json").write_text(json.dumps(results, indent=2, default=str))

    if args.diagnose:
        results["diagnose"] = diagnose(backends)
        (out / "gpu_kernels_diagnose.json").write_text(json.dumps(results, indent=2, default=str))
        print(json.dumps(results["diagnose"].get("packing"), indent=1))
        for entry in results["diagnose"].get("timing", []):
            print(_timing_line(entry), {k: v for k, v in entry.items() if k.startswith("host")})
        return 0
    results["parity"] = [] if args.skip_parity else run_parity(backends, device, args.smoke)
    save()
    results["refusals"] = run_refusals(backends, args.smoke)
    save()
    results["timing"] = run_timing(backends, device, args.smoke, deadline, only or None)
    text = table(results["parity"], results["timing"], results["refusals"])
    results["table"] = text
    save()
    (out / "gpu_kernels_table.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if all(p.get("passed") for p in results["parity"]) else 1


if __name__ == "__main__":
    sys.exit(main())
