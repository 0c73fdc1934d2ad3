"""prefixcache against SGLang 0.5.23's ``UnifiedRadixCache`` (its Rust and its Python tree core).

The loop is ``vs_vllm.py``'s ``simulate`` on the token streams of ``vs_vllm_workloads.py``;
``peers_sglang_backend.py`` says how the cache is built and which calls are timed. Each pair
runs SGLang, then prefixcache (without hash reuse, with ``extends``, with live prefixes where
the workload shares running prefixes), then prefixcache's hashing floor, in one process.

SGLang configurations: FULL at page sizes 1 and 16, each with the Rust and the Python tree
core, on both workloads; FULL + MAMBA (a hybrid model's cache) at pages 1 and 16 on
growing-prefix, as ``vs_vllm.py`` runs its hybrid configuration there. prefixcache runs
``attention-b16-xxh3`` against FULL (SGLang hashes nothing: its tree compares tokens, so
prefixcache uses its fastest digest) and ``hybrid-b1536-u128-xxh3`` against FULL + MAMBA.
Targets: 50x less manager time than the Python core, 5x less than the Rust core (median of
the pairs; judged with ``extends`` on growing-prefix, without reuse on shared-prompts).

Hit tokens per request are compared; each difference is classified (``hit_rule``):

- ``token_tree``: SGLang at page 1 hits to the token (its tree is keyed by token ids),
  prefixcache to whole 16-token blocks (it is keyed by block digests); this includes a hit a
  token or two past the shared system prompt, where an earlier request's random suffix happens
  to start with the same tokens;
- ``page_rounding``: both to whole pages / blocks, of different sizes;
- ``mamba_states``: a hybrid hit needs a recurrent state at its end: SGLang's is at a point
  where an earlier request of the stream left one (page 1, no tracking buffer: a chunk's or a
  request's end; page 16: each chunk's tracking snapshot, whole 64-token grid steps past the
  chunk's start), prefixcache's at the earlier prompt's tail checkpoint, the last 128-token
  unit boundary strictly before that prompt's end (``((N - 1) // U) * U``, the checkpoint its
  retention keeps for a resend), so a token-exact extension resumes up to a unit earlier;
- ``unexplained``: anything else (none is expected).

Run inside SGLang's environment (``make bench-peers`` creates ``.venv-sglang``)::

    .venv-sglang/bin/python benchmarks/peers_sglang.py --scale 0.25 --pairs 3 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
from peers_sglang_backend import SglangBackend, SglangConfig
from vs_vllm import (
    HitRule,
    RunResult,
    _all_requests,
    _cores,
    _git_commit,
    floor_to,
    run_config,
)
from vs_vllm_backends import ManagerConfig
from vs_vllm_workloads import WORKLOAD_NAMES, Request, Workload, make_workload

PYTHON_TARGET = 50.0
RUST_TARGET = 5.0
ATTENTION = ManagerConfig("attention-b16-xxh3", "attention", 16, 16, "xxh3_128")
HYBRID = ManagerConfig("hybrid-b1536-u128-xxh3", "hybrid", 1536, 128, "xxh3_128")
SGLANG_CONFIGS = [
    SglangConfig(core, page, mamba)
    for mamba in (False, True)
    for page in (1, 16)
    for core in ("rust", "python")
]


def workloads_of(config: SglangConfig) -> tuple[str, ...]:
    return ("growing-prefix",) if config.mamba else WORKLOAD_NAMES


def hit_rule(config: SglangConfig, backends: list[SglangBackend], workload: Workload) -> HitRule:
    """Classifies a request whose SGLang hit differs from prefixcache's (module docstring),
    from the publication rule both share (what the steps before its admission committed:
    SGLang checkpoints a chunk after its forward, prefixcache publishes at ``commit``)."""
    earlier: dict[int, list[Request]] = {}
    for request in _all_requests(workload):
        earlier.setdefault(request.prefix_key, []).append(request)

    def shared_by_chance(request: Request, hit: int) -> bool:
        """Whether an earlier request of the same prefix really shares ``hit`` tokens with
        this one: random suffixes that happen to start with the same token(s)."""
        head = request.prompt[:hit]
        return any(
            other.request_id < request.request_id
            and len(other.prompt) >= hit
            and np.array_equal(other.prompt[:hit], head)
            for other in earlier[request.prefix_key]
        )

    def rule(
        request: Request, ours_config: ManagerConfig, peer: RunResult, ours: RunResult
    ) -> str | None:
        rid = request.request_id
        limit = min(request.prefix_len, len(request.prompt) - 1)
        peer_cover = min(limit, peer.cover_at_admission[rid][0])
        our_cover = min(limit, ours.cover_at_admission[rid][0])
        peer_hit, our_hit = peer.hits[rid], ours.hits[rid]
        if config.mamba:
            # prefixcache keeps the earlier prompt's tail checkpoint: the last unit boundary
            # strictly before that prompt's end (its resend rule, ((N - 1) // U) * U).
            ours_ok = our_hit == floor_to(our_cover - 1, ours_config.unit)
            peer_ok = peer_hit <= peer_cover and backends[0].hit_at_state[rid]
            return "mamba_states" if ours_ok and peer_ok else None
        if peer_hit != floor_to(peer_cover, config.page_size) and not (
            config.page_size == 1 and peer_hit > peer_cover and shared_by_chance(request, peer_hit)
        ):
            return None
        if our_hit != floor_to(our_cover, ours_config.unit):
            return None
        return "token_tree" if config.page_size == 1 else "page_rounding"

    return rule


def run(scale: float, pairs: int, only: list[str] | None) -> dict[str, Any]:
    import prefixcache
    import sglang
    import torch

    # One intra-op thread: the CPU pools' tensor work on a shared 2-core machine.
    torch.set_num_threads(1)
    meta = {
        "scale": scale,
        "pairs": pairs,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {_cores()} cores, Python {platform.python_version()}",
        "sglang_version": sglang.__version__,
        "torch_version": torch.__version__,
        "prefixcache_version": prefixcache.__version__,
        "prefixcache_commit": _git_commit(),
        "command": "python benchmarks/peers_sglang.py " + " ".join(sys.argv[1:]),
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    results: dict[str, Any] = {}
    for config in SGLANG_CONFIGS:
        peer = config.peer
        tail = peer.removeprefix(f"sglang-{sglang.__version__}-")
        if only and not any(tail == word or tail.startswith(word + "-") for word in only):
            continue
        target = RUST_TARGET if config.core == "rust" else PYTHON_TARGET
        ours = HYBRID if config.mamba else ATTENTION
        for name in workloads_of(config):
            workload = make_workload(name, scale)
            # The token capacity of prefixcache's pool in the same run.
            kv_tokens = ours.attention_blocks(workload) * ours.block_size
            backends: list[SglangBackend] = []

            def make_peer(
                config: SglangConfig = config,
                workload: Any = workload,
                kv_tokens: int = kv_tokens,
                backends: list[SglangBackend] = backends,
            ) -> SglangBackend:
                backend = SglangBackend(config, workload, kv_tokens)
                backends.append(backend)
                return backend

            entries = run_config(
                workload,
                ours,
                pairs,
                make_peer,
                {**meta, "load_average": round(os.getloadavg()[0], 2)},
                peer="peer",
                rule=hit_rule(config, backends, workload),
                target=target,
            )
            for entry in entries.values():
                add_tree_split(entry)
            results.setdefault(peer, {})[name] = entries
    return results


TREE_CALLS = ("match", "lock", "checkpoint", "release")


def add_tree_split(entry: dict[str, Any]) -> None:
    """SGLang's time in its tree calls alone (match, lock, checkpoint, release), without the
    allocation calls, whose token-index tensor work runs here on the CPU (on a GPU server it
    is device kernels): the ratio over that part is reported beside the judged one."""
    calls = entry["peer_calls"]
    tree = sum(calls[name]["seconds"] for name in TREE_CALLS if name in calls)
    entry["peer_tree_seconds"] = tree
    entry["ratio_tree_only_median"] = tree / entry["prefixcache_seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument(
        "--only", nargs="*", help="these configurations (rust-p1: rust-p1 and rust-p1-mamba)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run(args.scale, args.pairs, args.only)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"# sglang: {time.perf_counter() - start:.0f} s, wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
