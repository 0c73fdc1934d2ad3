"""The vLLM peer of ``benchmarks/peers.py``: ``vs_vllm.py``'s pairs, in peers.json's shape.

Same loop, configurations, variants and judging as ``make bench-vllm`` (``vs_vllm.py``), with
the peer's keys named ``peer_*``; the target is 50x (a Python peer). Runs inside vLLM's
environment (``make bench-peers`` creates and fills ``.venv-vllm`` as ``bench-vllm`` does)::

    .venv-vllm/bin/python benchmarks/peers_vllm.py --scale 0.25 --pairs 3 --json out.json
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
from vs_vllm import CONFIGS, TARGET_RATIO, _cores, _git_commit, run_config
from vs_vllm_backends import make_backend
from vs_vllm_workloads import make_workload


def run(scale: float, pairs: int) -> dict[str, Any]:
    import prefixcache
    import vllm

    meta = {
        "scale": scale,
        "pairs": pairs,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {_cores()} cores, Python {platform.python_version()}",
        "vllm_version": vllm.__version__,
        "prefixcache_version": prefixcache.__version__,
        "prefixcache_commit": _git_commit(),
        "command": "python benchmarks/peers_vllm.py " + " ".join(sys.argv[1:]),
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    peer = f"vllm-{vllm.__version__}"
    results: dict[str, Any] = {}
    for name, configs in CONFIGS.items():
        workload = make_workload(name, scale)
        results[name] = {}
        for config in configs:
            results[name].update(
                run_config(
                    workload,
                    config,
                    pairs,
                    lambda config=config, workload=workload: make_backend("vllm", config, workload),
                    {**meta, "load_average": round(os.getloadavg()[0], 2)},
                    peer="peer",
                    target=TARGET_RATIO,
                )
            )
    return {peer: results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    args.json.write_text(json.dumps(run(args.scale, args.pairs), indent=1) + "\n")
    print(f"# vllm: {time.perf_counter() - start:.0f} s, wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
