#!/usr/bin/env python3
"""The host time of one copy-on-write row: the model's attention caches on one stacked storage
against separate caches.

A request resumed from a checkpoint inside a paged block copies that block's first tokens into
a block of its own before its forward (``kernels.copies.copy_checked_blocks``), in every
attention layer, while the GPU waits. With the layers' caches on one storage
(``PagedKVCache.stacked``, how the model allocates them) that is one copy for all layers; with a
cache each, one copy a layer. This times one row both ways for each layer count, at the
Kimi-K3 proxy's cache shape (its key/value heads and head size, blocks of 1,536, bf16), copying
``--tokens`` tokens (few by default, so that the host's part shows, not the bytes moved).

    python3 benchmarks/kv_copies.py                   # the CPU
    python3 benchmarks/kv_copies.py --device cuda     # the launches on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from typing import Any

import torch
from prefixcache.engine.workloads import workload_preset
from prefixcache.kernels import PagedKVCache
from prefixcache.kernels.copies import copy_checked_blocks
from prefixcache.models import ModelConfig

BLOCK_SIZE = workload_preset("growing-prefix", "seed").geometry.block_size  # 1,536


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", default="2,4,6", help="attention layer counts")
    parser.add_argument("--tokens", type=int, default=5, help="tokens copied (at most 1,536)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        layer_counts = [int(n) for n in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers takes comma-separated counts, got {args.layers!r}")
    if min(layer_counts) < 1 or not 1 <= args.tokens <= BLOCK_SIZE or args.reps < 1:
        parser.error(f"--layers >= 1, --tokens 1 to {BLOCK_SIZE} and --reps >= 1")
    if args.blocks < 4:
        parser.error("--blocks must be >= 4 (the row copies block 1 into block 3)")
    device = torch.device(args.device)
    config = ModelConfig.kimi_k3_tp8()
    shape = (args.blocks, BLOCK_SIZE, config.attention_kv_heads, config.attention_head_dim)
    row = [(0, 1, 3, args.tokens)]
    results: list[dict[str, Any]] = []
    for layers in layer_counts:
        timings = {}
        for kind in ("separate", "stacked"):
            if kind == "stacked":
                caches = PagedKVCache.stacked(layers, *shape, torch.bfloat16, device)
            else:
                caches = [PagedKVCache(*shape, torch.bfloat16, device) for _ in range(layers)]

            def copy(caches: list[PagedKVCache] = caches) -> None:
                copy_checked_blocks(row, {0: caches})

            copy()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(timeit.repeat(copy, number=args.reps, repeat=5)) / args.reps
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings[f"{kind}_us"] = 1e6 * best
        results.append({"layers": layers, **timings})
        print(
            f"{layers} attention layers: a cache each {timings['separate_us']:.1f} us, "
            f"one storage {timings['stacked_us']:.1f} us (host, one copy-on-write row)"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": str(device), "tokens": args.tokens, "cases": results}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
