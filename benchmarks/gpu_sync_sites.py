#!/usr/bin/env python3
"""Where a simulate run makes the host wait for the GPU: every synchronising CUDA call, by stack.

Runs ``prefixcache simulate`` (the arguments after ``--``) with
``torch.cuda.set_sync_debug_mode("warn")``, which warns at each call that blocks the host on
the device (``.item()``, ``.tolist()`` and ``.cpu()`` of device tensors, copies to pageable
memory, ``nonzero``, ...), and counts the warnings by the call stack that raised them (the
innermost ``--depth`` frames of the project's code). An engine step syncs once on purpose, to
read its sampled tokens; any other site inside a step stalls the launches behind it and leaves
the GPU idle until the host catches up.

    PYTHONPATH=<site with the wheel> PREFIXCACHE_FLASHKDA_LIB=<_flashkda_C.abi3.so> \\
        python3 benchmarks/gpu_sync_sites.py --json sync.json -- --preset default \\
        --device cuda --backend flashkda-op --model kimi-k3-tp8 --no-reference --no-overlap
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from typing import Any


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the sites and their counts here")
    parser.add_argument("--depth", type=int, default=6, help="frames kept per site")
    parser.add_argument("simulate", nargs=argparse.REMAINDER, help="-- simulate's arguments")
    args = parser.parse_args(argv)
    simulate = [a for a in args.simulate if a != "--"]

    import torch
    from prefixcache.engine.cli import main as cli_main

    sites: collections.Counter[tuple[str, ...]] = collections.Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        frames = [
            f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
            for frame in traceback.extract_stack()[:-1]
            if "prefixcache" in frame.filename or "benchmarks" in frame.filename
        ]
        sites[(str(message).split("\n")[0][:80], *frames[-args.depth :])] += 1

    warnings.showwarning = record  # type: ignore[assignment]
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    code = cli_main(["simulate", *simulate])
    torch.cuda.set_sync_debug_mode("default")
    print(f"\nsynchronising calls: {sum(sites.values())} at {len(sites)} sites")
    for site, count in sites.most_common(25):
        print(f"{count:8d}  {site[0]}")
        for frame in site[1:]:
            print(f"          {frame}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                [{"count": c, "message": s[0], "stack": list(s[1:])} for s, c in sites.items()],
                handle,
                separators=(",", ":"),
            )
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
