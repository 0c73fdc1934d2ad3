"""Lookup speed of prefixcache against Dynamo's KV router ``RadixTree`` (a Rust peer, in process).

Dynamo's router keeps, per worker, a radix tree of the blocks the workers reported (KV
events) and answers "how many leading blocks of this prompt does each worker hold". It is a
peer for lookup speed only: it allocates nothing. Both are filled with the same prompts
(``vs_vllm_workloads.py``, untimed), then every prompt is looked up again, in alternating passes
in one process:

- Dynamo (``ai-dynamo-runtime`` 1.6.1, ``dynamo.llm.RadixTree``): the request's block hashes
  (``compute_block_hash_for_seq(tokens, 16)``, XXH3-64 of each 16-token block, as the router
  hashes a request) and ``RadixTree.find_matches``. The tree is filled with one ``stored`` event
  per prompt for its blocks not reported before (``apply_event``, the JSON form of
  ``dump_tree_as_events``), one worker.
- prefixcache (a release wheel of this tree): ``add`` (XXH3-128 of each 16-token block; no hash
  reuse, every prompt hashed in full) and ``lookup`` of a new sequence with the prompt, on a
  manager whose pool holds every block of the workload, filled by prefilling each prompt
  (``schedule`` / ``build_plan`` / ``commit`` in 8,192-token chunks, then ``finish``). The probe
  sequence is finished after its lookup (untimed).

Each prompt's token list is made before its timed calls (Dynamo takes a Python list,
prefixcache a NumPy array). Ratio = Dynamo seconds / prefixcache seconds, hashing included,
per pass; min / median / max over the pairs; the lookup calls alone are reported beside. Hit
tokens are compared: the tree matches every block of a prompt it holds, prefixcache stops one
token short of the prompt (a hit leaves the last prompt token to compute: at most
``(N - 1) // 16 * 16``), which every difference must be. Target: 5x (a Rust peer).

Run: ``.venv-dynamo/bin/python benchmarks/peers_dynamo.py --scale 0.25 --pairs 3 --json PATH``
(``benchmarks/peers_kvbm.py`` runs it so, and ``make bench-peers`` runs that).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm_workloads import WORKLOAD_NAMES, Request, Workload, make_workload

PEER = "dynamo-radixtree-lookup"
CONFIG = "attention-b16-xxh3"
BLOCK = 16
CHUNK = 8192
TARGET_RATIO = 5.0
PROBE_IDS = 1 << 40

perf_counter = time.perf_counter


def all_requests(workload: Workload) -> list[Request]:
    pending = list(workload.initial())
    order: list[Request] = []
    while pending:
        request = pending.pop(0)
        order.append(request)
        pending.extend(workload.on_finished(request))
    return order


class Dynamo:
    """One worker's blocks in a ``RadixTree``, as the router learns them from KV events."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        from dynamo._core import compute_block_hash_for_seq
        from dynamo.llm import RadixTree

        self.hash = compute_block_hash_for_seq
        self.tree = RadixTree()
        # A block's external id stands for its whole prefix: (parent id, local hash) -> id.
        known: dict[tuple[int | None, int], int] = {}
        for event_id, array in enumerate(arrays):
            tokens = array.tolist()
            parent: int | None = None
            first_parent: int | None = None
            blocks: list[dict[str, int]] = []
            for local in self.hash(tokens, BLOCK):
                key = (parent, local)
                if not blocks and key in known:
                    parent = known[key]
                    continue
                if not blocks:
                    first_parent = parent
                known[key] = parent = len(known) + 1
                blocks.append({"block_hash": parent, "tokens_hash": local})
            if blocks:
                event = {
                    "event_id": event_id,
                    "data": {"stored": {"parent_hash": first_parent, "blocks": blocks}},
                }
                self.tree.apply_event(0, json.dumps(event).encode())

    def probe(self, arrays: list[np.ndarray]) -> tuple[dict[str, float], list[int]]:
        hash_seconds = match_seconds = 0.0
        hits = []
        for array in arrays:
            tokens = array.tolist()  # the router's request tokens (a list), made untimed
            t0 = perf_counter()
            hashes = self.hash(tokens, BLOCK)
            t1 = perf_counter()
            scores = self.tree.find_matches(hashes)
            t2 = perf_counter()
            hash_seconds += t1 - t0
            match_seconds += t2 - t1
            hits.append(max(scores.scores.values(), default=0) * BLOCK)
        return {"compute_block_hash_for_seq": hash_seconds, "find_matches": match_seconds}, hits


class Prefixcache:
    """A manager holding every block of the workload, probed with new sequences."""

    def __init__(self, requests: list[Request]) -> None:
        import prefixcache as pc

        blocks = sum(len(r.prompt) // BLOCK + 1 for r in requests) + 64
        self.manager = pc.CacheManager(
            pc.CacheConfig(
                pools=[pc.PoolConfig(num_blocks=blocks)],
                groups=[pc.FullAttention(block_size=BLOCK, pool=0)],
                hash=pc.HashConfig(algorithm="xxh3_128", seed=0, unit=BLOCK),
                reuse_live_prefixes=False,
                enable_events=False,
            )
        )
        m = self.manager
        for r in requests:
            m.add(r.request_id, r.prompt)
            while m.num_computed(r.request_id) < len(r.prompt):
                if m.schedule(r.request_id, CHUNK) is None:
                    raise RuntimeError("prefixcache's pool is too small for the workload")
                m.commit(m.build_plan())
            m.finish(r.request_id)
        self.next_id = PROBE_IDS

    def probe(self, arrays: list[np.ndarray]) -> tuple[dict[str, float], list[int]]:
        m = self.manager
        add_seconds = lookup_seconds = 0.0
        hits = []
        for tokens in arrays:
            sid = self.next_id
            self.next_id += 1
            t0 = perf_counter()
            m.add(sid, tokens)
            t1 = perf_counter()
            hit = m.lookup(sid)
            t2 = perf_counter()
            add_seconds += t1 - t0
            lookup_seconds += t2 - t1
            hits.append(hit.tokens)
            m.finish(sid)
        return {"add": add_seconds, "lookup": lookup_seconds}, hits


def frozen(call: Any, *args: Any) -> Any:
    """``call(*args)`` on a frozen heap (a pass does not pay for scanning another's objects)."""
    gc.collect()
    gc.freeze()
    try:
        return call(*args)
    finally:
        gc.unfreeze()


def entry(
    requests: list[Request],
    peer: list[tuple[dict[str, float], list[int]]],
    ours: list[tuple[dict[str, float], list[int]]],
    meta: dict[str, Any],
) -> dict[str, Any]:
    peer_s = [sum(p[0].values()) for p in peer]
    our_s = [sum(o[0].values()) for o in ours]
    ratios = [p / o for p, o in zip(peer_s, our_s, strict=True)]
    lookup_ratios = [p[0]["find_matches"] / o[0]["lookup"] for p, o in zip(peer, ours, strict=True)]
    peer_hits, our_hits = peer[0][1], ours[0][1]
    differing = [i for i, (a, b) in enumerate(zip(peer_hits, our_hits, strict=True)) if a != b]
    explained = sum(
        our_hits[i] == min(peer_hits[i], (len(requests[i].prompt) - 1) // BLOCK * BLOCK)
        for i in differing
    )
    median = statistics.median(ratios)

    def calls(runs: list[tuple[dict[str, float], list[int]]]) -> dict[str, dict[str, float]]:
        return {
            name: {
                "seconds": statistics.median(r[0][name] for r in runs),
                "calls": len(requests),
            }
            for name in runs[0][0]
        }

    return {
        "ratio_min": min(ratios),
        "ratio_median": median,
        "ratio_max": max(ratios),
        "peer_seconds": statistics.median(peer_s),
        "prefixcache_seconds": statistics.median(our_s),
        "hit_tokens_equal": not differing,
        "ratios": ratios,
        "peer_runs_seconds": peer_s,
        "prefixcache_runs_seconds": our_s,
        "peer_calls": calls(peer),
        "prefixcache_calls": calls(ours),
        "lookup_only_ratio_median": statistics.median(lookup_ratios),
        "lookup_only_ratios": lookup_ratios,
        "hits": {
            "requests": len(requests),
            "peer_hit_tokens": sum(peer_hits),
            "prefixcache_hit_tokens": sum(our_hits),
            "differing_requests": len(differing),
            "explained_last_token": explained,
            "differences": {"last_token": explained, "unexplained": len(differing) - explained},
            "same_in_every_pair": all(p[1] == peer_hits for p in peer)
            and all(o[1] == our_hits for o in ours),
        },
        "hash_reuse": False,
        "lookup_only": True,
        "target_judged_here": True,
        "target_ratio": TARGET_RATIO,
        "meets_target": median >= TARGET_RATIO,
        **meta,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="workload size (1.0 = full)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs")
    parser.add_argument(
        "--workload", nargs="+", choices=WORKLOAD_NAMES, default=list(WORKLOAD_NAMES)
    )
    parser.add_argument("--json", type=Path, required=True, help="where the entries go")
    args = parser.parse_args(argv)

    import prefixcache

    meta = {
        "scale": args.scale,
        "pairs": args.pairs,
        "peer": PEER,
        "dynamo_version": importlib.metadata.version("ai-dynamo-runtime"),
        "prefixcache_version": prefixcache.__version__,
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    results: dict[str, dict[str, Any]] = {}
    for name in args.workload:
        requests = all_requests(make_workload(name, args.scale))
        arrays = [r.prompt for r in requests]
        dynamo, ours = Dynamo(arrays), Prefixcache(requests)
        peer_runs, our_runs = [], []
        for pair in range(args.pairs):
            peer_runs.append(frozen(dynamo.probe, arrays))
            our_runs.append(frozen(ours.probe, arrays))
            print(
                f"{name} pair {pair}: RadixTree {sum(peer_runs[-1][0].values()):.4f} s, "
                f"prefixcache {sum(our_runs[-1][0].values()):.4f} s",
                flush=True,
            )
        e = entry(requests, peer_runs, our_runs, meta)
        results[name] = {CONFIG: e}
        print(
            f"{name}: ratio {e['ratio_min']:.1f} / {e['ratio_median']:.1f} / "
            f"{e['ratio_max']:.1f} (lookup calls alone {e['lookup_only_ratio_median']:.1f}), "
            f"hits differ on {e['hits']['differing_requests']} "
            f"({e['hits']['explained_last_token']} by the last-token rule)",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({PEER: results}, indent=1) + "\n")
    print(f"wrote {args.json}; load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
