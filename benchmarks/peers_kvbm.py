"""prefixcache's core against Dynamo's ``kvbm-logical`` 1.6.1 block manager (a Rust peer).

The Python ``kvbm`` 1.6.1 needs NIXL to import and a GPU driver to build its block manager, so
the pure-Rust ``kvbm-logical`` crate is driven instead, from the Rust binary of
``rust/peers`` (``kvbm_vs_prefixcache``), against ``prefixcache_core::CacheManager`` on the same
scheduler loop in the same process (``vs_vllm.py``'s ``simulate``, step for step, each step's
arrivals taken in with one ``add_batch``: prefixcache's hashes them across the machine's cores,
kvbm builds each one's sequence; the binary's documentation lists every call each side makes).
This driver writes the token streams of ``vs_vllm_workloads.py`` to a folder (``index.json`` +
one ``tokens.u32`` per workload), builds and runs the binary, and turns its runs into entries
of ``peers.json``.

Each pair runs kvbm, then prefixcache without hash reuse, then prefixcache with reuse
(``add(..., extends=)`` + live prefixes), in one process; ratio = kvbm / prefixcache seconds,
min / median / max over the pairs. Both hash as they do in an engine: kvbm builds a
``TokenBlockSequence`` per request (XXH3-64 lineage hash of every full block), prefixcache's
``add_batch`` hashes with XXH3-128 (the ``attention-b16-xxh3`` configuration of ``vs_vllm.py``).
Block size 16, full attention (kvbm-logical has no recurrent-state group). Judged as in
``vs_vllm.py``: growing-prefix with reuse, shared-prompts without. The target is 5x (a Rust
peer).

Dynamo's router ``RadixTree``, a peer for lookup speed only, runs from here too
(``benchmarks/peers_dynamo.py``, in ``.venv-dynamo``: ``ai-dynamo-runtime`` 1.6.1 and a release
wheel of this tree, both installed here when missing; the wheel ``make bench-peers`` built, in
``target/peers-wheel``, when there is one); its entries (``dynamo-radixtree-lookup``, marked
``lookup_only``) join this driver's document. ``--no-dynamo`` leaves it out.

Run: ``python benchmarks/peers_kvbm.py --scale 0.25 --pairs 3 --json /tmp/kvbm.json``
(``make bench-peers`` runs it through ``benchmarks/peers.py``). Instruction counts of one side
(deterministic, whatever the load)::

    python benchmarks/peers_kvbm.py --scale 0.1 --workload shared-prompts --dump /tmp/w
    valgrind --tool=callgrind --toggle-collect='*simulate*' \
        target/release/kvbm_vs_prefixcache /tmp/w 1 kvbm   # or prefixcache, prefixcache+extends
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm_workloads import WORKLOAD_NAMES, Request, Workload, make_workload

ROOT = Path(__file__).resolve().parent.parent
PEER = "kvbm-logical-1.6.1"
CONFIG = "attention-b16-xxh3"
BLOCK = 16
TARGET_RATIO = 5.0
REUSE_JUDGED = {"growing-prefix": True, "shared-prompts": False}


def all_requests(workload: Workload) -> tuple[list[Request], dict[int, list[int]]]:
    """Every request in the order the closed loop releases them, and each one's follow-ups."""
    pending = list(workload.initial())
    order: list[Request] = []
    follow: dict[int, list[int]] = {}
    while pending:
        request = pending.pop(0)
        order.append(request)
        nxt = workload.on_finished(request)
        follow[request.request_id] = [r.request_id for r in nxt]
        pending.extend(nxt)
    return order, follow


def pool_blocks(workload: Workload) -> int:
    """``ManagerConfig.attention_blocks`` of ``vs_vllm_backends.py`` at block 16."""
    per_sequence = -(-workload.prompt_tokens() // BLOCK) + 1
    return 2 * workload.shape.max_running * per_sequence + 64


def dump(workload: Workload, folder: Path) -> dict[str, Any]:
    """Writes the workload's tokens (prompts that are views of one array share its tokens)."""
    requests, follow = all_requests(workload)
    position = {r.request_id: i for i, r in enumerate(requests)}
    chunks: list[np.ndarray] = []
    offsets: dict[int, int] = {}
    size = 0

    def place(array: np.ndarray) -> list[int]:
        nonlocal size
        owner = array if array.base is None else array.base
        assert isinstance(owner, np.ndarray) and owner.dtype == np.uint32
        key = id(owner)
        if key not in offsets:
            offsets[key] = size
            flat = np.ascontiguousarray(owner).reshape(-1)
            chunks.append(flat)
            size += flat.size
        start = array.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
        assert array.flags.c_contiguous and start % 4 == 0
        return [offsets[key] + start // 4, int(array.size)]

    entries = []
    for r in requests:
        entries.append(
            {
                "id": r.request_id,
                "prompt": place(r.prompt),
                "output": place(r.output),
                "extends": r.extends,
                "prefix_key": r.prefix_key,
                "prefix_len": r.prefix_len,
                "follow_ups": [position[f] for f in follow[r.request_id]],
            }
        )
    name = f"{workload.name}.u32"
    with open(folder / name, "wb") as out:
        for chunk in chunks:
            out.write(chunk.astype("<u4", copy=False).tobytes())
    # Check the layout: every request's tokens read back from the file.
    tokens = np.fromfile(folder / name, dtype="<u4")
    for r, e in zip(requests, entries, strict=True):
        for array, (start, length) in ((r.prompt, e["prompt"]), (r.output, e["output"])):
            assert np.array_equal(tokens[start : start + length], array)
    return {
        "name": workload.name,
        "tokens": name,
        "block_size": BLOCK,
        "token_budget": workload.shape.token_budget,
        "max_running": workload.shape.max_running,
        "pool_blocks": pool_blocks(workload),
        "requests": entries,
        "initial": [position[r.request_id] for r in workload.initial()],
    }


DYNAMO_VENV = ROOT / ".venv-dynamo"


def run_dynamo(args: argparse.Namespace) -> dict[str, Any]:
    """``peers_dynamo.py`` in ``.venv-dynamo`` (made and filled when missing): its document."""
    python = DYNAMO_VENV / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(DYNAMO_VENV)], check=True)
        subprocess.run([*pip, "ai-dynamo-runtime==1.6.1", "numpy"], check=True)
    wheels = sorted((ROOT / "target" / "peers-wheel").glob("prefixcache-*.whl"))
    source = str(wheels[-1]) if wheels else str(ROOT)
    subprocess.run([*pip, "--force-reinstall", "--no-deps", source], check=True, cwd=ROOT)
    with tempfile.TemporaryDirectory(prefix="peers-dynamo-") as tmp:
        out = Path(tmp) / "dynamo.json"
        command = [str(python), str(ROOT / "benchmarks" / "peers_dynamo.py")]
        command += ["--scale", str(args.scale), "--pairs", str(args.pairs), "--json", str(out)]
        command += ["--workload", *args.workload]
        subprocess.run(command, check=True, cwd=ROOT)
        document: dict[str, Any] = json.loads(out.read_text())
    return document


def build_binary() -> Path:
    env = {**os.environ}
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "prefixcache-peers"],
        cwd=ROOT,
        check=True,
        env=env,
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "kvbm_vs_prefixcache"


def compare_hits(
    requests: dict[int, Request], peer: dict[str, Any], ours: dict[str, Any]
) -> dict[str, Any]:
    """Per-request hit tokens of both sides, every difference checked against each side's own
    publication rule, from the tokens of the request's shared prefix that earlier steps
    computed (``cover``, on that side's run): prefixcache keys a block once all its tokens are
    computed (the hit is ``cover`` rounded down to a block, below the prompt's last token);
    kvbm's ``apply_prefill`` registers every block allocated for the chunk whose tokens are
    known, and a prompt's tokens all are, so the block holding a non-final chunk's end is
    registered before its last tokens are computed (``cover`` rounded up to a block, within
    the shared prefix's whole blocks)."""
    peer_hits, our_hits = dict(map(tuple, peer["hits"])), dict(map(tuple, ours["hits"]))
    peer_cover = dict(map(tuple, peer["cover_at_admission"]))
    our_cover = dict(map(tuple, ours["cover_at_admission"]))
    differing: list[int] = []
    explained = 0
    for rid, peer_hit in peer_hits.items():
        our_hit = our_hits[rid]
        if our_hit == peer_hit:
            continue
        differing.append(rid)
        request = requests[rid]
        whole = request.prefix_len // BLOCK * BLOCK
        ours_expected = min(our_cover[rid], request.prefix_len, len(request.prompt) - 1)
        peer_expected = min(-(-peer_cover[rid] // BLOCK) * BLOCK, whole)
        if our_hit == ours_expected // BLOCK * BLOCK and peer_hit == peer_expected:
            explained += 1
    return {
        "requests": len(peer_hits),
        "peer_hit_tokens": sum(peer_hits.values()),
        "prefixcache_hit_tokens": sum(our_hits.values()),
        "differing_requests": len(differing),
        "explained_partial_block": explained,
        "differences": {
            "kvbm_partial_block": explained,
            "unexplained": len(differing) - explained,
        },
        "first_differing": [[rid, peer_hits[rid], our_hits[rid]] for rid in differing[:5]],
    }


def median_calls(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    names = sorted({name for run in runs for name in run["by_call"]})
    return {
        name: {
            "seconds": statistics.median(run["by_call"].get(name, 0.0) for run in runs),
            "calls": runs[0]["calls"].get(name, 0),
        }
        for name in names
    }


def entry(
    requests: dict[int, Request],
    peer: list[dict[str, Any]],
    ours: list[dict[str, Any]],
    judged: bool,
    reuse: bool,
    meta: dict[str, Any],
    floors: dict[str, list[float]] | None,
) -> dict[str, Any]:
    ratios = [p["seconds"] / o["seconds"] for p, o in zip(peer, ours, strict=True)]
    median = statistics.median(ratios)
    hits = compare_hits(requests, peer[0], ours[0])
    stable = all(r["hits"] == peer[0]["hits"] for r in peer) and all(
        r["hits"] == ours[0]["hits"] for r in ours
    )
    extra: dict[str, Any] = {}
    if floors:
        ceilings = [p["seconds"] / f for p, f in zip(peer, floors["prefixcache"], strict=True)]
        extra = {
            "hashing_floor_seconds": statistics.median(floors["prefixcache"]),
            "ratio_ceiling_median": statistics.median(ceilings),
            "ratio_ceilings": ceilings,
            "hashing_floor_parallel_seconds": statistics.median(floors["prefixcache_parallel"]),
            "peer_hashing_floor_seconds": statistics.median(floors["kvbm"]),
        }
    return {
        "ratio_min": min(ratios),
        "ratio_median": median,
        "ratio_max": max(ratios),
        "peer_seconds": statistics.median(r["seconds"] for r in peer),
        "prefixcache_seconds": statistics.median(r["seconds"] for r in ours),
        "hit_tokens_equal": hits["differing_requests"] == 0,
        "ratios": ratios,
        "peer_runs_seconds": [r["seconds"] for r in peer],
        "prefixcache_runs_seconds": [r["seconds"] for r in ours],
        "peer_calls": median_calls(peer),
        "prefixcache_calls": median_calls(ours),
        "steps": {"peer": peer[0]["steps"], "prefixcache": ours[0]["steps"]},
        "hits": {**hits, "same_in_every_pair": stable},
        "hash_reuse": reuse,
        **extra,
        "target_judged_here": judged,
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
    parser.add_argument("--json", type=Path, help="where the entries go")
    parser.add_argument("--no-dynamo", action="store_true", help="leave out Dynamo's RadixTree")
    parser.add_argument(
        "--kvbm-inactive",
        choices=("lineage", "lru"),
        default="lineage",
        help="kvbm's inactive-pool backend: the builder's default (Lineage) or LRU + TinyLFU",
    )
    parser.add_argument(
        "--dump", type=Path, help="only write the workloads' folder there (for callgrind)"
    )
    args = parser.parse_args(argv)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        index = {
            "workloads": [dump(make_workload(n, args.scale), args.dump) for n in args.workload]
        }
        (args.dump / "index.json").write_text(json.dumps(index))
        print(f"wrote {args.dump}")
        return 0
    if args.json is None:
        parser.error("--json is required (or --dump)")

    binary = build_binary()
    meta = {
        "scale": args.scale,
        "pairs": args.pairs,
        "peer": PEER,
        "kvbm_inactive_backend": args.kvbm_inactive,
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory(prefix="peers-kvbm-") as tmp:
        folder = Path(tmp)
        workloads = {n: make_workload(n, args.scale) for n in args.workload}
        index = {"workloads": [dump(w, folder) for w in workloads.values()]}
        (folder / "index.json").write_text(json.dumps(index))
        done = subprocess.run(
            [str(binary), str(folder), str(args.pairs)],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "KVBM_INACTIVE": args.kvbm_inactive},
        )
    raw = json.loads(done.stdout)
    results: dict[str, dict[str, Any]] = {}
    for name, data in raw.items():
        runs = data["runs"]
        by_side = {
            side: [r for r in runs if r["side"] == side] for side in {r["side"] for r in runs}
        }
        floors = {
            "prefixcache": data["hashing_floor_seconds"],
            "prefixcache_parallel": data["hashing_floor_parallel_seconds"],
            "kvbm": data["kvbm_hashing_floor_seconds"],
        }
        requests = {r.request_id: r for r in all_requests(workloads[name])[0]}
        results[name] = {}
        for side, config, reuse in (
            ("prefixcache", CONFIG, False),
            ("prefixcache+extends", CONFIG + "+extends", True),
        ):
            judged = reuse == REUSE_JUDGED[name]
            results[name][config] = entry(
                requests,
                by_side["kvbm"],
                by_side[side],
                judged,
                reuse,
                meta,
                None if reuse else floors,
            )
    for name, configs in results.items():
        for config, e in configs.items():
            mark = " (judged)" if e["target_judged_here"] else ""
            print(
                f"{name} {config}{mark}: kvbm {e['peer_seconds']:.4f} s, prefixcache "
                f"{e['prefixcache_seconds']:.4f} s, ratio {e['ratio_min']:.1f} / "
                f"{e['ratio_median']:.1f} / {e['ratio_max']:.1f}, hits equal "
                f"{e['hit_tokens_equal']} ({e['hits']['differing_requests']} differ, "
                f"{e['hits']['explained_partial_block']} by kvbm's partial-block rule)"
            )
    peer = PEER if args.kvbm_inactive == "lineage" else f"{PEER}-{args.kvbm_inactive}"
    document = {peer: results}
    if not args.no_dynamo:
        document.update(run_dynamo(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.json}; load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    status = main()
    print(f"# total {time.perf_counter() - start:.0f} s")
    sys.exit(status)
