#!/usr/bin/env python3
"""GPU time per token and per step of each layer kind of the Kimi-K3 cost proxy.

For each layer kind of ``ModelConfig.kimi_k3_tp8`` (a KDA mixer through the model's kernel
backend and short convolution, a grouped-query attention mixer over a paged cache holding a
cached prefix, the dense SwiGLU block), one packed row of T new tokens (T = 2,048, 4,096 and
8,192, ``--tokens``; KDA also with one and two checkpoints, and as the seed's prefill step
packs it, 7 decode rows and a row with one checkpoint; attention also after cached prefixes of
0, 64K and 128K tokens, ``--prefixes``, and one decode token of 8 rows at 128K, through the
gathering torch path and the Triton paged decode kernel, alone and in one layer group's decode
step) is timed with CUDA events (median of repeated calls after
warm-up, random data). Each kind's time is fitted as ``fixed + per_token * T`` (least squares
over the T's): ``per_token`` is what a token costs, ``fixed`` what a step costs whatever its
tokens; after 128K cached tokens the fixed part is split into the context gather, the key/value
head repeat and the flash kernel (and a grouped-query flash call without the repeat, and one
with the prefix split across the GPU, which the model's attention now does). The host
time of one call (its launches, no synchronisation) is printed beside: when it is well below
the GPU time, a step's wall time follows its GPU work. Each case is also timed behind a
GPU-side backlog (``busy_ms``: the GPU's execution alone, without its waits for the host's
launches, as inside a prefill step whose launches run ahead of the GPU), and fitted the same way
(``busy_fixed_ms``, ``busy_per_token_us``); ``--kernels`` lists the kernels of the KDA, seed-step,
MLP and attention cases at the two largest token counts, with their GPU time a call (what a fixed
part is made of). Prints a table; ``--json FILE`` writes every figure.

    PYTHONPATH=<site with the wheel> PREFIXCACHE_FLASHKDA_LIB=<_flashkda_C.abi3.so> \\
        python3 benchmarks/gpu_layers.py --backend flashkda-op --json "$OUT/layers.json"
    python3 benchmarks/gpu_layers.py --smoke     # CPU, a narrow proxy, the code path only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

TOKENS = (2048, 4096, 8192)
PREFIXES = (0, 65536, 131072)


#: Decode rows beside the prefill row in the seed's steps (8 streams, one prefilling).
DECODE_ROWS = 7
#: The KDA cases with checkpoints (:func:`kda_plans`).
KDA_PLANS = ("kda-ckpt1", "kda-ckpt2", "kda-step")


def _counts(text: str, least: int = 1) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < least:
        raise argparse.ArgumentTypeError(f"counts >= {least}, comma-separated: {text!r}")
    return counts


def _prefixes(text: str) -> tuple[int, ...]:
    return _counts(text, least=0)


def kda_plans(backend: Any, tokens: int, num_slots: int) -> dict[str, Any]:
    """A KDA layer's plans for a row of ``tokens``: one checkpoint in the row (``kda-ckpt1``),
    two (``kda-ckpt2``: the op chains a second call), and the seed's prefill step as the engine
    packs it (``kda-step``): :data:`DECODE_ROWS` decode rows, then the row with its one interior
    checkpoint, the tail (every prefill row of 4,096 tokens or fewer in the seed's rounds has
    one, or none, under both policies: a row's decode-tail snapshots are copies after the step).
    Offsets are on the kernel's grid; every slot is distinct (``num_slots`` >= 5 + 2 x the
    decode rows)."""
    grid = max(1, int(backend.checkpoint_alignment))

    def on_grid(offset: int) -> int:
        return max(grid, offset // grid * grid)

    one, two = on_grid(tokens // 2), (on_grid(tokens // 3), on_grid(2 * tokens // 3))
    plans = {
        "kda-ckpt1": backend.check_plan(
            query_start_loc=[0, tokens],
            initial_slot=[1],
            running_slot=[2],
            checkpoint_offsets=[[one]],
            checkpoint_slots=[[3]],
            num_slots=num_slots,
            num_tokens=tokens,
        ),
        "kda-ckpt2": backend.check_plan(
            query_start_loc=[0, tokens],
            initial_slot=[1],
            running_slot=[2],
            checkpoint_offsets=[list(two)],
            checkpoint_slots=[[3, 4]],
            num_slots=num_slots,
            num_tokens=tokens,
        ),
    }
    rows = DECODE_ROWS
    decode_initial = list(range(5, 5 + rows))
    decode_running = list(range(5 + rows, 5 + 2 * rows))
    plans["kda-step"] = backend.check_plan(
        query_start_loc=[*range(rows + 1), rows + tokens],
        initial_slot=[*decode_initial, 1],
        running_slot=[*decode_running, 2],
        checkpoint_offsets=[*([[0]] * rows), [on_grid(tokens - 64)]],
        checkpoint_slots=[*([[-1]] * rows), [3]],
        num_slots=num_slots,
        num_tokens=rows + tokens,
    )
    return plans


def gpu_ms(
    fn: Callable[[], object], device: torch.device, reps: int, *, backlog: bool = False
) -> float | None:
    """Median GPU time of ``fn`` in ms (CUDA events per call, after two warm-up calls).

    Without ``backlog`` the GPU is idle when each call starts, so where the host launches more
    slowly than the GPU executes, the span counts the GPU's waits for the launches too. With
    ``backlog`` each call is timed by the model's ``KernelTimer`` in ``"gpu"`` mode (a GPU-side
    spin that outlasts the call's launches, then events): the span is the GPU's execution
    alone, as inside a step whose launches run ahead of it; ``None`` when a call waits for the
    GPU itself (the timer counts an underrun: the spin drained before its launches ended).
    """
    for _ in range(2):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    if backlog:
        from prefixcache.models.timing import KernelTimer

        timer = KernelTimer(device, "gpu")
        for _ in range(reps):
            with timer.measure():
                fn()
            if timer.underruns:
                return None
            times.append(timer.take() * 1e3)
        return statistics.median(times)
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_breakdown(fn: Callable[[], object], calls: int = 5) -> list[dict[str, Any]]:
    """The GPU kernels (and copies) of one call of ``fn``: per kernel name, how many run in a
    call and their GPU time per call in us, from ``torch.profiler`` over ``calls`` calls after
    two warm-up calls, largest first. Profiled calls run slower on the host; the kernels' own
    durations are what the breakdown reports."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = totals.setdefault(event.name, [0.0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time
    rows = [
        {"kernel": name[:120], "per_call": count / calls, "us_per_call": total / calls}
        for name, (count, total) in totals.items()
    ]
    return sorted(rows, key=lambda row: -row["us_per_call"])


#: A GPU-side spin of about 0.1 s at an H100's or H200's clock: longer than any call timed here.
BACKLOG_CYCLES = 200_000_000


def host_ms(
    fn: Callable[[], object], device: torch.device, reps: int, *, backlog: bool = False
) -> float:
    """Median host time of one call in ms (launches only: the GPU is drained before each).

    With ``backlog`` each call starts behind a GPU-side spin of :data:`BACKLOG_CYCLES`, so a
    call that waits for the GPU takes the spin's time (tens of ms) and one that only queues
    work takes its own host time; ``fn`` may launch many steps' worth of work (up to CUDA's
    queue of pending launches, about a thousand, past which a launch blocks)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            if backlog:
                torch.cuda._sleep(BACKLOG_CYCLES)  # type: ignore[no-untyped-call]
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def fit(tokens: list[int], ms: list[float]) -> tuple[float, float]:
    """Least-squares ``fixed + per_token * T``: (fixed ms, per-token us)."""
    slope, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(ms, float), 1)
    return float(intercept), float(slope) * 1e3


def prefill_parts(
    record: Callable[[str, int, int, Callable[[], object]], None],
    attention: Any,
    cache: Any,
    table: np.ndarray,
    hidden: Callable[[int], torch.Tensor],
    results: dict[str, Any],
) -> None:
    """Where a prefill row's attention after a 128K cached prefix spends its fixed cost: the
    context gather, the key/value head repeat for the flash kernel, the kernel itself, and the
    kernel on unrepeated key/value heads (grouped-query flash, if this torch's op takes it), and
    the prefix split across the GPU (``kernels.prefill_attention``, the model's path)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    prefix, tokens = 131072, 2048
    context = prefix + tokens
    heads, dim = attention.num_heads, attention.head_dim
    groups = heads // attention.num_kv_heads
    q = hidden(tokens)[:, : heads * dim].reshape(tokens, heads, dim).transpose(0, 1)[None]
    key, value = cache.gather(table[0], context)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    k_rep, v_rep = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = causal_lower_right(tokens, context)
    record("part-gather", tokens, prefix, lambda: cache.gather(table[0], context))
    record(
        "part-repeat",
        tokens,
        prefix,
        lambda: (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)),
    )
    record(
        "part-flash",
        tokens,
        prefix,
        lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask),
    )
    reference = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask).float()

    def flash_gqa() -> torch.Tensor:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=dim**-0.5
        )[0]
        return out

    try:
        got = flash_gqa().float()
        results["flash_gqa_max_abs_difference"] = float((got - reference).abs().max())
        record("part-flash-gqa", tokens, prefix, flash_gqa)
    except (RuntimeError, TypeError) as error:
        results["flash_gqa_error"] = str(error)[:300]
    # The prefix cut into pieces that fill the GPU, merged by log-sum-exp (the model's path).
    from prefixcache.kernels import prefill_attention as split

    pieces = split.prefix_splits(tokens, prefix, heads)
    results["prefill_splits"] = pieces

    def flash_split() -> torch.Tensor:
        return split.split_prefix_attention(q, k, v, pieces, split.flash_attend)

    if pieces > 1:
        results["flash_split_max_abs_difference"] = float(
            (flash_split().float() - reference).abs().max()
        )
        record("part-flash-split", tokens, prefix, flash_split)
        # The merge alone, in torch (eight launches over S + 1 float32 copies) and in the
        # Triton kernel the model runs on CUDA (each partial read once).
        parts = split.split_partials(q, k, v, pieces, split.flash_attend)
        merges = {"torch": split.merge_partials_torch, "triton": split.merge_partials_triton}
        merged = {}
        for name, merge in merges.items():
            if name == "triton" and split.default_merge(q.device) is not merge:
                continue  # no Triton here (the CPU smoke run)
            merged[name] = merge(*parts).float()
            record(f"part-merge-{name}", tokens, prefix, lambda merge=merge: merge(*parts))
        if len(merged) == 2:
            difference = (merged["torch"] - merged["triton"]).abs().max()
            results["merge_max_abs_difference"] = float(difference)


def print_kernels(case: dict) -> None:
    """One case's kernel list (an entry of the JSON key 'kernels'): each kernel's time a layer
    call (summed over its launches in the call), then their total."""
    kernels_ = case["kernels"]
    print(f"    kernels of {case['kind']} T={case['tokens']} prefix={case['prefix']} (us a call):")
    for row in kernels_:
        print(f"    {row['us_per_call']:9.1f} x{row['per_call']:<4g} {row['kernel'][:90]}")
    print(f"    {sum(row['us_per_call'] for row in kernels_):9.1f}       all kernels of the call")


def show(path: str) -> int:
    """Print the kernel lists and fits of a saved ``--json`` file."""
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    for case in saved.get("kernels", []):
        print_kernels(case)
    for entry in saved.get("fits", []):
        busy = ""
        if "busy_fixed_ms" in entry:
            busy = f"  busy: {entry['busy_fixed_ms']:.3f} ms + {entry['busy_per_token_us']:.4f} us"
        print(
            f"{entry['kind']:<10} {entry['prefix']:>7}  fixed {entry['fixed_ms']:.3f} ms + "
            f"{entry['per_token_us']:.4f} us a token, host {entry['host_ms_at_max']:.3f} ms and "
            f"GPU {entry['gpu_ms_at_max']:.3f} ms at the largest T{busy}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="flashkda-op")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, kimi-k3-tp8/32, short")
    parser.add_argument(
        "--tokens",
        type=_counts,
        help=f"new tokens of a row, comma-separated (default {','.join(map(str, TOKENS))})",
    )
    parser.add_argument(
        "--prefixes",
        type=_prefixes,
        help="cached prefixes of the attention cases, comma-separated (default "
        f"{','.join(map(str, PREFIXES))}; the decode and parts cases take the largest)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also list the GPU kernels of the KDA, seed-step, MLP and attention cases at the "
        "two largest token counts (torch.profiler; JSON key 'kernels')",
    )
    parser.add_argument(
        "--show", metavar="JSON", help="print the kernel lists and fits of a saved --json file"
    )
    args = parser.parse_args(argv)
    if args.show:
        return show(args.show)

    from prefixcache import kernels
    from prefixcache.engine import build_model
    from prefixcache.kernels.decode_attention import DecodeRows
    from prefixcache.models import KDALayer, ModelConfig

    smoke = args.smoke
    device_name = "cpu" if smoke else "cuda"
    config = ModelConfig.kimi_k3_tp8(1, divisor=32 if smoke else 1)
    backend = "torch" if smoke else args.backend
    # The Triton decode kernel is timed beside the gathering path (both through the same
    # model); on the CPU (--smoke) Triton runs interpreted.
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    model = build_model(device_name, backend, config=config, decode_attention="torch")
    device, dtype = model.device, model.dtype
    token_counts = args.tokens or ((64, 128, 256) if smoke else TOKENS)
    prefixes = args.prefixes or ((0, 256) if smoke else PREFIXES)
    breakdown_cases = {
        (kind, tokens)
        for kind in ("kda", "kda-step", "mlp", "attention")
        for tokens in sorted(token_counts)[-2:]
    }
    reps = 2 if smoke else args.reps
    block = 128 if smoke else 1536
    kda = next(layer for layer in model.mixers if isinstance(layer, KDALayer))
    attention = next(layer for layer in model.mixers if not isinstance(layer, KDALayer))
    mlp = model.mlps[0]
    backend_ = model.backend
    d = config.hidden_size
    generator = torch.Generator(device=device).manual_seed(0)

    def hidden(tokens: int) -> torch.Tensor:
        return torch.randn(tokens, d, generator=generator, device=device).to(dtype)

    results: dict[str, Any] = {
        "model": config.name,
        "backend": model.backend.name,
        "conv": model.backend.conv_impl,
        "dtype": str(dtype),
        "macs_per_token": config.macs_per_token(),
        "cases": [],
    }
    state = kernels.StateCache.for_layer(kda.params, 5 + 2 * DECODE_ROWS, device=device)
    state.recurrent.normal_(generator=generator)
    rows: list[dict[str, Any]] = []

    breakdowns: list[dict[str, Any]] = []

    def record(kind: str, tokens: int, prefix: int, fn: Callable[[], object]) -> None:
        entry = {
            "kind": kind,
            "tokens": tokens,
            "prefix": prefix,
            "gpu_ms": gpu_ms(fn, device, reps),
            "host_ms": host_ms(fn, device, reps),
        }
        busy = ""
        if device.type == "cuda":
            entry["busy_ms"] = gpu_ms(fn, device, reps, backlog=True)
            busy = ", busy  n/a (the call waits for the GPU)"
            if entry["busy_ms"] is not None:
                busy = f", busy {entry['busy_ms']:8.3f} ms"
        rows.append(entry)
        print(
            f"{kind:>10} T={tokens:>6} prefix={prefix:>7}: GPU {entry['gpu_ms']:8.3f} ms"
            f"{busy}, host {entry['host_ms']:7.3f} ms",
            flush=True,
        )
        if args.kernels and device.type == "cuda" and (kind, tokens) in breakdown_cases:
            kernels_ = kernel_breakdown(fn)
            breakdowns.append(
                {"kind": kind, "tokens": tokens, "prefix": prefix, "kernels": kernels_}
            )
            print_kernels(breakdowns[-1])

    with torch.inference_mode():
        for tokens in token_counts:
            x = hidden(tokens)
            plan = model.backend.check_plan(
                query_start_loc=[0, tokens],
                initial_slot=[1],
                running_slot=[2],
                num_slots=state.num_blocks,
                num_tokens=tokens,
            )
            record("kda", tokens, 0, lambda x=x, plan=plan: kda.forward(x, backend_, state, plan))
            # The seed's prefill steps: the row exports checkpoints (one: in the same call; two:
            # a second, chained call), and shares its step with the other streams' decode rows.
            for kind, plan in kda_plans(model.backend, tokens, state.num_blocks).items():
                packed = hidden(plan.num_tokens)
                record(
                    kind,
                    tokens,
                    0,
                    lambda packed=packed, plan=plan: kda.forward(packed, backend_, state, plan),
                )
            record("mlp", tokens, 0, lambda x=x: mlp.forward(x))
        largest = max(prefixes) + max(token_counts)
        blocks = -(-largest // block) + 1
        cache = kernels.PagedKVCache(
            blocks, block, attention.num_kv_heads, attention.head_dim, dtype=dtype, device=device
        )
        cache.key.normal_(generator=generator)
        cache.value.normal_(generator=generator)
        table = np.arange(1, blocks, dtype=np.int32)[None, :]
        for prefix in prefixes:
            for tokens in token_counts:
                x = hidden(tokens)
                positions = np.arange(prefix, prefix + tokens)
                slots = table[0, positions // block].astype(np.int64) * block + positions % block
                slot_mapping = torch.from_numpy(slots).to(device)
                lens = np.array([prefix + tokens])
                loc = np.array([0, tokens], dtype=np.int32)

                def step(x=x, slot_mapping=slot_mapping, lens=lens, loc=loc) -> object:
                    return attention.forward(x, cache, slot_mapping, table, lens, loc)

                record("attention", tokens, prefix, step)
        if not smoke:
            prefill_parts(record, attention, cache, table, hidden, results)
        # Decode: 8 rows of one token each after the longest prefix (the decode step's shape).
        context = max(prefixes)
        x = hidden(8)
        tables = np.repeat(table, 8, axis=0)
        slot_mapping = torch.full(
            (8,), (context // block + 1) * block + context % block, dtype=torch.int64, device=device
        )
        lens = np.full(8, context + 1)
        loc = np.arange(9, dtype=np.int32)
        record(
            "attn-decode",
            8,
            context,
            lambda: attention.forward(x, cache, slot_mapping, tables, lens, loc),
        )
        # The same rows through the Triton paged decode kernel (no gather), and its difference
        # from the gathering path (bf16: a few ulps of outputs of magnitude ~1).
        decode_rows = DecodeRows.select(
            tables, lens, loc, num_blocks=cache.num_blocks, block_size=block, device=device
        )

        def triton_decode() -> torch.Tensor:
            return attention.forward(x, cache, slot_mapping, tables, lens, loc, decode=decode_rows)

        record("attn-decode-triton", 8, context, triton_decode)
        gathered = attention.forward(x, cache, slot_mapping, tables, lens, loc).float()
        results["decode_kernel_max_abs_difference"] = float(
            (triton_decode().float() - gathered).abs().max()
        )
        results["decode_output_max_abs"] = float(gathered.abs().max())
        # One layer group's decode step (3 KDA + 1 attention mixers and 4 MLPs on the 8 rows):
        # the GPU work a decode step of the proxy repeats per group.
        decode_state = kernels.StateCache.for_layer(kda.params, 16, device=device)
        decode_plan = model.backend.check_plan(
            query_start_loc=np.arange(9),
            initial_slot=list(range(8)),
            running_slot=list(range(8, 16)),
            num_slots=16,
            num_tokens=8,
        )

        def group_step(rows: DecodeRows | None) -> object:
            h = x
            for _ in range(3):
                h = h + kda.forward(h, backend_, decode_state, decode_plan)
                h = h + mlp.forward(h)
            h = h + attention.forward(h, cache, slot_mapping, tables, lens, loc, decode=rows)
            return h + mlp.forward(h)

        record("group-decode", 8, context, lambda: group_step(None))
        record("group-decode-triton", 8, context, lambda: group_step(decode_rows))
    results["cases"] = rows
    if breakdowns:
        results["kernels"] = breakdowns

    print()
    print("kind        prefix  fixed ms/step  per token us  host ms at max T  GPU ms at max T")
    fits = []
    kinds = [("kda", 0), *((kind, 0) for kind in KDA_PLANS), ("mlp", 0)]
    for kind, prefix in [*kinds, *(("attention", p) for p in prefixes)]:
        chosen = [r for r in rows if r["kind"] == kind and r["prefix"] == prefix]
        fixed, per_token = fit([r["tokens"] for r in chosen], [r["gpu_ms"] for r in chosen])
        last = chosen[-1]
        entry = {
            "kind": kind,
            "prefix": prefix,
            "fixed_ms": fixed,
            "per_token_us": per_token,
            "host_ms_at_max": last["host_ms"],
            "gpu_ms_at_max": last["gpu_ms"],
        }
        busy = ""
        if all(r.get("busy_ms") is not None for r in chosen):
            busy_fixed, busy_per_token = fit(
                [r["tokens"] for r in chosen], [r["busy_ms"] for r in chosen]
            )
            entry["busy_fixed_ms"], entry["busy_per_token_us"] = busy_fixed, busy_per_token
            busy = f"  busy: {busy_fixed:.3f} ms + {busy_per_token:.4f} us a token"
        fits.append(entry)
        print(
            f"{kind:<10} {prefix:>7}  {fixed:13.3f}  {per_token:12.4f}  {last['host_ms']:16.3f}"
            f"  {last['gpu_ms']:15.3f}{busy}"
        )
    results["fits"] = fits
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
