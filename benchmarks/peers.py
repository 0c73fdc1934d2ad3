"""``make bench-peers``: prefixcache against every peer manager, merged into one document.

Each peer has a driver, ``benchmarks/peers_<peer>.py --scale S --pairs N --json PATH``, run in
that peer's own environment (vLLM's and SGLang's virtual environments, with prefixcache
installed there as a release wheel of this tree; the project's Python for kvbm, whose driver
builds a Rust binary). A driver writes ``{PEER: {WORKLOAD: {CONFIG: entry}}}``; this script
merges them into ``benchmarks/results/peers.json``::

    {"meta": {...}, "peers": {PEER: {WORKLOAD: {CONFIG: entry}}}}

An entry has ``vs_vllm.json``'s shape with the peer's keys named ``peer_*`` (``peer_seconds``,
``peer_calls``, ...): ratio min / median / max over alternating pairs (peer, prefixcache, peer,
... in one process), per-call medians, the hit comparison, ``target_ratio`` (50x for a Python
peer, 5x for a Rust one) and ``meets_target`` for the configuration judged
(``target_judged_here``). ``--merge`` keeps the peers already in the document that this run
does not measure (one peer per run, e.g. one per quiet-machine slot). Then the chart
(``docs/peers.png``) and a Markdown table of the judged entries are written from the document.
``--include PATH`` merges a document a driver wrote on its own run (its ``meta`` kept).

    python benchmarks/peers.py --peers sglang --scale 0.25 --pairs 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("vllm", "sglang", "kvbm")
PEER_FAMILIES = ("vllm", "sglang", "kvbm", "dynamo")
# Keys every measured entry carries (the driver contract).
ENTRY_KEYS = (
    "ratio_min",
    "ratio_median",
    "ratio_max",
    "ratios",
    "peer_seconds",
    "prefixcache_seconds",
    "target_ratio",
    "meets_target",
    "target_judged_here",
)


def check_document(peers: dict[str, Any]) -> list[str]:
    """What is wrong with a driver's ``{PEER: {WORKLOAD: {CONFIG: entry}}}`` (empty: fine)."""
    problems = []
    for peer, workloads in peers.items():
        if not any(family in peer for family in PEER_FAMILIES):
            problems.append(f"{peer}: a peer's name says which it is ({', '.join(PEER_FAMILIES)})")
        if not isinstance(workloads, dict):
            problems.append(f"{peer}: not a mapping of workloads")
            continue
        for workload, configs in workloads.items():
            for config, entry in configs.items():
                where = f"{peer} / {workload} / {config}"
                if entry.get("lookup_only"):
                    continue
                missing = [key for key in ENTRY_KEYS if key not in entry]
                if missing:
                    problems.append(f"{where}: missing {', '.join(missing)}")
                    continue
                low, mid, high = entry["ratio_min"], entry["ratio_median"], entry["ratio_max"]
                if not low <= mid <= high:
                    problems.append(f"{where}: ratios out of order ({low}, {mid}, {high})")
                if entry["meets_target"] != (mid >= entry["target_ratio"]):
                    problems.append(f"{where}: meets_target disagrees with the median")
    return problems


def merge(
    existing: dict[str, Any] | None, measured: dict[str, Any], meta: dict[str, Any]
) -> dict[str, Any]:
    """The new document: ``measured``'s peers replace those of the same name in ``existing``
    (kept otherwise, with the run that measured them named in ``meta.runs``)."""
    peers: dict[str, Any] = dict(existing["peers"]) if existing else {}
    runs: list[dict[str, Any]] = list(existing["meta"].get("runs", [])) if existing else []
    kept = set(peers) - set(measured)
    runs = [run for run in runs if set(run["peers"]) & kept]
    for run in runs:
        run["peers"] = [peer for peer in run["peers"] if peer in kept]
    peers.update(measured)
    runs.append({**meta, "peers": sorted(measured)})
    return {"meta": {"runs": runs}, "peers": dict(sorted(peers.items()))}


def judged(document: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(peer, workload, config, entry) of every judged entry."""
    return [
        (peer, workload, config, entry)
        for peer, workloads in document["peers"].items()
        for workload, configs in workloads.items()
        for config, entry in configs.items()
        if entry.get("target_judged_here")
    ]


def markdown_table(document: dict[str, Any]) -> str:
    lines = [
        "| peer | workload | prefixcache config (judged) | peer s | prefixcache s "
        "| ratio min / median / max | target | hashing floor s | hits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for peer, workload, config, e in judged(document):
        floor = document["peers"][peer][workload].get(config.split("+")[0], {})
        floor_s = floor.get("hashing_floor_seconds")
        hits = e.get("hits", {})
        diff = hits.get("differing_requests", 0)
        reasons = hits.get("differences") or (
            {"same_step": hits["explained_same_step"]} if "explained_same_step" in hits else {}
        )
        hit_text = (
            "equal"
            if not diff
            else f"{diff} differ: " + ", ".join(f"{k} {v}" for k, v in reasons.items())
        )
        met = "met" if e["meets_target"] else "missed"
        lines.append(
            f"| {peer} | {workload} | {config} | {e['peer_seconds']:.3f} | "
            f"{e['prefixcache_seconds']:.4f} | {e['ratio_min']:.1f} / "
            f"**{e['ratio_median']:.1f}** / {e['ratio_max']:.1f} | "
            f"{e['target_ratio']:.0f}x {met} | "
            f"{'-' if floor_s is None else f'{floor_s:.4f}'} | {hit_text} |"
        )
    return "\n".join(lines)


def write_chart(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = judged(document)
    labels = [f"{peer}\n{workload} / {config}" for peer, workload, config, _ in rows]
    medians = [e["ratio_median"] for *_, e in rows]
    low = [e["ratio_median"] - e["ratio_min"] for *_, e in rows]
    high = [e["ratio_max"] - e["ratio_median"] for *_, e in rows]
    colours = ["#2a7" if e["meets_target"] else "#d73" for *_, e in rows]
    figure, axis = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.4), dpi=90)
    ys = list(range(len(rows)))[::-1]
    axis.barh(ys, medians, xerr=[low, high], color=colours, capsize=3)
    for y, (*_, e) in zip(ys, rows, strict=True):
        target = e["target_ratio"]
        axis.plot([target, target], [y - 0.4, y + 0.4], color="black", linestyle="--", lw=1)
    axis.set_yticks(ys, labels, fontsize=7)
    axis.set_xscale("log")
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 2 * max([*medians, 60])]
    axis.set_xticks(ticks, [f"{t}x" for t in ticks])
    axis.minorticks_off()
    axis.set_xlabel("peer / prefixcache manager time (median, min-max); dashes: target")
    dates = sorted({run.get("date", "?") for run in document["meta"]["runs"]})
    axis.set_title(
        "prefixcache vs peer cache managers, judged configuration per workload\n"
        f"{', '.join(dates)}; green: target met (50x Python peers, 5x Rust peers)",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def run_driver(peer: str, python: str, args: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / f"{peer}.json"
        command = [python, str(ROOT / f"benchmarks/peers_{peer}.py"), *args, "--json", str(out)]
        print("#", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT)
        result: dict[str, Any] = json.loads(out.read_text())
    problems = check_document(result)
    if problems:
        raise SystemExit(f"peers_{peer}.py wrote a bad document:\n" + "\n".join(problems))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--driver-args", default="", help="more options for every driver")
    for peer in PEERS:
        parser.add_argument(f"--python-{peer}", default=sys.executable)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/peers.json")
    parser.add_argument("--chart", type=Path, default=ROOT / "docs/peers.png")
    parser.add_argument("--merge", action="store_true", help="keep peers not measured now")
    parser.add_argument("--report-only", action="store_true", help="chart + table from --json")
    parser.add_argument(
        "--include",
        type=Path,
        nargs="*",
        default=[],
        help="merge these drivers' documents as measured ({PEER: ...} or {meta, peers})",
    )
    args = parser.parse_args(argv)

    existing = json.loads(args.json.read_text()) if args.json.exists() else None
    for path in args.include:
        included = json.loads(path.read_text())
        measured_there = included.get("peers", included)
        problems = check_document(measured_there)
        if problems:
            raise SystemExit(f"{path}:\n" + "\n".join(problems))
        meta_there = {**included.get("meta", {}), "included_from": str(path)}
        existing = merge(existing, measured_there, meta_there)
    if args.report_only:
        if existing is None:
            raise SystemExit(f"{args.json} does not exist")
        document = existing
        if args.include:
            args.json.write_text(json.dumps(document, indent=1) + "\n")
    else:
        start = time.perf_counter()
        meta = {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "scale": args.scale,
            "pairs": args.pairs,
            "load_average_at_start": round(os.getloadavg()[0], 2),
        }
        measured: dict[str, Any] = {}
        common = ["--scale", str(args.scale), "--pairs", str(args.pairs)]
        common += args.driver_args.split()
        for peer in args.peers:
            measured.update(run_driver(peer, getattr(args, f"python_{peer}"), common))
        meta["load_average_at_end"] = round(os.getloadavg()[0], 2)
        meta["seconds"] = round(time.perf_counter() - start)
        document = merge(existing if args.merge else None, measured, meta)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.json}")
    write_chart(document, args.chart)
    print(markdown_table(document))
    print(f"wrote {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
