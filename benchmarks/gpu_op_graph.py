#!/usr/bin/env python3
"""Can a CUDA graph take the FlashKDA op's host time out of a prefill step? A probe.

One op call costs the host 290 to 360 us (``gpu_op_host.py``, an H100), about half of a KDA + MLP
layer group's launches at the seed's prefill size, and the GPU waits for it inside the KDA
layers. A graph replay costs the host a few microseconds, but a graph holds fixed addresses and
shapes while every prefill step has its own token count. This probe tries what a prefill step
padded to a token bucket would run:

- **capture** one op call over static buffers of ``--bucket`` tokens holding two sequences:
  the step's row (T tokens, one interior checkpoint) and a padding sequence from T to the bucket
  (zeros, its own initial, final and checkpoint state rows, whose results nobody reads);
- **replay** it for several T below the bucket (the buffers filled, ``cu_seqlens`` rewritten on
  the device), and compare the row's output, final state and checkpoint with an eager call over
  exactly T tokens (equal bit for bit, or the largest difference) and with the same padded call
  run eagerly (what padding changes, apart from what the graph does);
- **time** the host per call behind a GPU-side spin (eager at T against a replay, and a replay
  with the fills a step would add) and the GPU's time per call (eager at T against the padded
  replay).

Last, the padding sequence made empty (``cu_seqlens`` ``[0, T, T]``): replays compared again and
the GPU time of one.

What it found (an H100, 2026-12-06 10:25 UTC, ``benchmarks/results/op_graph_h100_2026-12-06_
1025.json``): the op is captured, and every replay equals the eager call bit for bit (outputs,
final state, checkpoint) at T = 1,920 to 2,160 in a bucket of 2,176, with the padding sequence or
an empty one; host 182 us an eager call against 20 us a replay; GPU 126.8 us eager, 127.1 us a
padded replay, 126.2 us with the empty sequence. Two cautions for whoever builds on it: the op
reads the whole last 16-token chunk of a sequence, so what lies in a static buffer past T enters
the row's last tokens unless it is finite (NaN there came out in the last 7 tokens' outputs of a
2,087-token row; zeros and finite data do not); and in the model the saving did not show.
Built into the backend (one graph per layer, bucket and sequence count over shared static
buffers, inputs copied in and results out, 058b000), the seed preset's block TTFT p50 over
rounds 2 to 23 was 30.4 ms with the eager op and 30.6 ms with the graphs (one process each, one
H100, 10:44 and 10:46 UTC), fine against block -18.7% with them, as before; the median prefill
step's launches took 9.1 ms eager and 10.9 ms with the graphs' copies, against 28.7 / 29.1 ms of
GPU work in its layers. A prefill step's launches run well ahead of its GPU work, so host time
taken out of them is not on a request's path. The integration was withdrawn (docs/BENCHMARKS.md).

    PREFIXCACHE_FLASHKDA_LIB=<_flashkda_C.abi3.so> python3 benchmarks/gpu_op_graph.py \\
        --json "$OUT/op_graph.json"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_layers import gpu_ms, host_ms
from gpu_op_host import op_setup


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket", type=int, default=2176, help="the graph's tokens (17 x 128)")
    parser.add_argument(
        "--tokens",
        default="2048,2087,2119,1920,2160",
        help="the rows' token counts replayed (each below the bucket)",
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    bucket = args.bucket
    counts = [int(t) for t in args.tokens.split(",")]
    if any(not 16 < t < bucket for t in counts):
        raise SystemExit(f"every --tokens value must be in (16, {bucket})")
    setup = op_setup()
    ops, device, rnd = setup.ops, setup.device, setup.randn
    h, d, a_log, dt_bias = setup.heads, setup.head_dim, setup.a_log, setup.dt_bias
    scale, lower_bound = d**-0.5, -5.0

    def workspace(tokens: int, sequences: int) -> torch.Tensor:
        size = int(ops.get_workspace_size(tokens, h, sequences))
        return torch.empty(size, dtype=torch.uint8, device=device)

    # The row's inputs at the largest T; a smaller T takes their first T tokens.
    longest = max(counts)
    row = {
        "q": rnd(1, longest, h, d),
        "k": rnd(1, longest, h, d),
        "v": rnd(1, longest, h, d),
        "g": rnd(1, longest, h, d),
        "beta": rnd(1, longest, h),
    }
    initial_row = rnd(1, h, d, d, dtype=torch.float32) * 0.1

    def offset_of(tokens: int) -> int:
        return tokens // 2 // 16 * 16

    def eager(tokens: int) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """An op call over exactly ``tokens`` (its inputs built once), and where it writes."""
        inputs = [row[name][:, :tokens].contiguous() for name in ("q", "k", "v", "g", "beta")]
        out = torch.empty_like(inputs[2])
        final = torch.empty_like(initial_row)
        staging = torch.zeros_like(initial_row)
        cu = torch.tensor([0, tokens], dtype=torch.int64, device=device)
        offsets = torch.tensor([offset_of(tokens)], dtype=torch.int64, device=device)
        scratch = workspace(tokens, 1)

        def call() -> None:
            ops.fwd(
                *inputs, scale, out, scratch, a_log, dt_bias, lower_bound, initial_row, final,
                cu, staging, offsets,
            )  # fmt: skip

        return call, (out, final, staging)

    # The bucket's static buffers: two sequences, the row and the padding after it.
    static = {
        "q": torch.zeros(1, bucket, h, d, dtype=torch.bfloat16, device=device),
        "k": torch.zeros(1, bucket, h, d, dtype=torch.bfloat16, device=device),
        "v": torch.zeros(1, bucket, h, d, dtype=torch.bfloat16, device=device),
        "g": torch.zeros(1, bucket, h, d, dtype=torch.bfloat16, device=device),
        "beta": torch.zeros(1, bucket, h, dtype=torch.bfloat16, device=device),
    }
    out_s = torch.empty_like(static["v"])
    initial_s = torch.zeros(2, h, d, d, device=device)
    final_s = torch.empty_like(initial_s)
    staging_s = torch.zeros_like(initial_s)
    cu_s = torch.zeros(3, dtype=torch.int64, device=device)
    offsets_s = torch.zeros(2, dtype=torch.int64, device=device)
    workspace_s = workspace(bucket, 2)

    def fill(tokens: int, empty_tail: bool = False) -> None:
        for name, buffer in static.items():
            buffer[:, :tokens].copy_(row[name][:, :tokens])
            buffer[:, tokens:].zero_()
        initial_s[0].copy_(initial_row[0])
        initial_s[1].zero_()
        end = tokens if empty_tail else bucket
        cu_s.copy_(torch.tensor([0, tokens, end], dtype=torch.int64), non_blocking=True)
        offsets_s.copy_(torch.tensor([offset_of(tokens), 0], dtype=torch.int64), non_blocking=True)

    def op_static() -> None:
        ops.fwd(
            static["q"], static["k"], static["v"], static["g"], static["beta"], scale, out_s,
            workspace_s, a_log, dt_bias, lower_bound, initial_s, final_s, cu_s, staging_s,
            offsets_s,
        )  # fmt: skip

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "bucket": bucket,
        "heads": h,
        "head_dim": d,
    }
    fill(counts[0])
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op_static()  # compiles nothing, but lets the op set up whatever it sets up once
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            op_static()
    except Exception as error:  # the op cannot be captured: that is the answer
        results["captured"] = False
        results["capture_error"] = str(error).split("\n")[0][:300]
        print(f"capture refused: {results['capture_error']}")
        return _write(args.json, results)
    results["captured"] = True

    cases = []
    for tokens in counts:
        call, reference = eager(tokens)
        call()
        # The same padded call eagerly, then from the graph: padding's effect apart from the
        # graph's.
        fill(tokens)
        op_static()
        padded = tuple(x.clone() for x in (out_s[:, :tokens], final_s[:1], staging_s[:1]))
        fill(tokens)
        graph.replay()
        torch.cuda.synchronize()
        got = (out_s[:, :tokens], final_s[:1], staging_s[:1])
        equal = [torch.equal(a, b) for a, b in zip(got, reference, strict=True)]
        replay_equals_padded = all(torch.equal(a, b) for a, b in zip(got, padded, strict=True))
        worst = [
            float((a.float() - b.float()).abs().max()) for a, b in zip(got, reference, strict=True)
        ]
        case = {
            "tokens": tokens,
            "checkpoint_offset": offset_of(tokens),
            "equal_out_final_checkpoint": equal,
            "replay_equals_padded_eager": replay_equals_padded,
            "max_abs_difference": worst,
        }
        cases.append(case)
        print(
            f"T={tokens:5d} in a bucket of {bucket}: out / final / checkpoint equal {equal}, "
            f"largest differences {', '.join(f'{w:.3g}' for w in worst)}; the replay equals the "
            f"padded call run eagerly: {replay_equals_padded}"
        )
    results["cases"] = cases

    tokens = counts[0]
    call, _ = eager(tokens)
    fill(tokens)

    def fill_and_replay() -> None:
        fill(tokens)
        graph.replay()

    timing = {
        "eager_host_us": host_ms(call, device, 7, backlog=True) * 1e3,
        "replay_host_us": host_ms(graph.replay, device, 7, backlog=True) * 1e3,
        "fill_and_replay_host_us": host_ms(fill_and_replay, device, 7, backlog=True) * 1e3,
        "eager_gpu_us": _us(gpu_ms(call, device, 7, backlog=True)),
        "replay_gpu_us": _us(gpu_ms(graph.replay, device, 7, backlog=True)),
    }
    results["timing_at_tokens"] = tokens
    results["timing"] = timing
    print(
        f"T={tokens}: host {timing['eager_host_us']:.1f} us eager, "
        f"{timing['replay_host_us']:.1f} us a replay, {timing['fill_and_replay_host_us']:.1f} us "
        f"with the fills; GPU {timing['eager_gpu_us']} us eager, "
        f"{timing['replay_gpu_us']} us a padded replay"
    )
    _write(args.json, results)

    # Last, since a fault here ends the process: the second sequence empty (cu_seqlens
    # [0, T, T]) instead of padding, so that the tokens after T cost no work if the op's kernels
    # skip what lies past the last sequence.
    empty_cases = []
    for tokens in counts:
        call, reference = eager(tokens)
        call()
        fill(tokens, empty_tail=True)
        graph.replay()
        torch.cuda.synchronize()
        got = (out_s[:, :tokens], final_s[:1], staging_s[:1])
        empty_cases.append(
            {
                "tokens": tokens,
                "equal_out_final_checkpoint": [
                    torch.equal(a, b) for a, b in zip(got, reference, strict=True)
                ],
            }
        )
        print(f"T={tokens:5d}, empty tail: equal {empty_cases[-1]['equal_out_final_checkpoint']}")
    results["empty_tail_cases"] = empty_cases
    fill(counts[0], empty_tail=True)
    results["empty_tail_replay_gpu_us"] = _us(gpu_ms(graph.replay, device, 7, backlog=True))
    print(f"T={counts[0]}, empty tail: GPU {results['empty_tail_replay_gpu_us']} us a replay")
    return _write(args.json, results)


def _us(ms: float | None) -> float | None:
    """``gpu_ms``'s figure in us (None: the call's launches outlasted the spin)."""
    return None if ms is None else ms * 1e3


def _write(path: str | None, results: dict[str, Any]) -> int:
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(results, handle, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
