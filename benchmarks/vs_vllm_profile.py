"""Where prefixcache's side of the vLLM comparison spends its time, down to Rust functions.

Runs the prefixcache side of one workload / configuration of ``benchmarks/vs_vllm.py`` (no
vLLM needed) under ``py-spy record --native`` and groups the sampled leaf frames that lie
inside manager calls by core component (hit lookup, hash index, hashing, token conversion,
allocation, ...). Per-call wall times of the same runs are printed too.

    .venv-vllm/bin/pip install py-spy
    .venv-vllm/bin/python benchmarks/vs_vllm_profile.py growing-prefix attention-b16-xxh3 \\
        --extends --runs 4

Sampling pauses the process, so absolute times under the profiler are inflated; the shares
are what to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from vs_vllm import CONFIGS, simulate
from vs_vllm_backends import make_backend
from vs_vllm_workloads import make_workload

# Frame substrings per core component, first match wins. A sample belongs to the innermost
# frame that matches; a leaf in libc (memcpy, malloc, free, page faults behind them) is counted
# under that component with " [libc]" appended, so copies show where they are made.
COMPONENTS: list[tuple[str, tuple[str, ...]]] = [
    ("hashing", ("sha2::", "xxh3", "Hasher", "digest_blocks")),
    ("hit lookup", ("hit::", "compute_hit", "choose_block")),
    ("hash index", ("hashbrown", "HashIndex", "index::", "unindex")),
    ("commit", ("commit::",)),
    ("build_plan", ("plan::",)),
    ("schedule", ("schedule::",)),
    ("block pool", ("pool::",)),
    ("token conversion", ("convert::",)),
    ("add", ("prefixcache_core::manager::CacheManager::add", "shared_units")),
    ("finish", ("CacheManager::finish", "release_all", "Finished")),
    ("append", ("append_slot", "append_batch")),
]
LIBC = ("libc.so", "malloc", "realloc", "free", "RawVec", "finish_grow", "alloc::")


def component(frames: list[str]) -> str:
    """The component a native sample's stack belongs to (``frames``: outermost first)."""
    in_libc = any(key in frames[-1] for key in LIBC)
    for frame in reversed(frames):
        for name, keys in COMPONENTS:
            if any(key in frame for key in keys):
                return name + (" [libc]" if in_libc else "")
        if "_core.abi3.so" not in frame and not any(key in frame for key in LIBC):
            break
    return "PyO3 / NumPy glue" + (" [libc]" if in_libc else "")


def run(workload_name: str, config_name: str, extends: bool, live: bool, runs: int) -> None:
    workload = make_workload(workload_name, 1.0)
    base = next(c for c in CONFIGS[workload_name] if c.name == config_name)
    config = dataclasses.replace(base, reuse=extends, live_prefixes=extends or live)
    for _ in range(runs):
        result = simulate(workload, make_backend("prefixcache", config, workload))
        calls = sorted(result.by_call.items(), key=lambda kv: -kv[1])
        print(
            f"{result.seconds * 1e3:.0f} ms: "
            + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in calls),
            flush=True,
        )


def summarize(raw: Path) -> list[tuple[str, float]]:
    """Shares of the samples taken inside the native module, by component."""
    shares: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any("_core.abi3.so" in frame for frame in frames):
            continue
        total += int(count)
        shares[component(frames)] += int(count)
    return [(name, 100.0 * n / max(total, 1)) for name, n in shares.most_common()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(CONFIGS))
    parser.add_argument("config")
    parser.add_argument("--extends", action="store_true", help="hash reuse (add(extends=))")
    parser.add_argument(
        "--live", action="store_true", help="reuse_live_prefixes (implied by --extends)"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=int, default=1000, help="samples per second")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run(args.workload, args.config, args.extends, args.live, args.runs)
        return 0
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        child = [sys.executable, __file__, args.workload, args.config, "--runs", str(args.runs)]
        child += ["--child", *(["--extends"] if args.extends else [])]
        child += ["--live"] if args.live else []
        record = [py_spy, "record", "--native", "-r", str(args.rate), "-f", "raw", "-o", str(raw)]
        subprocess.run([*record, "--", *child], check=True)
        print(f"\nnative samples inside prefixcache calls, {args.workload} / {args.config}")
        for name, share in summarize(raw):
            print(f"{share:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
