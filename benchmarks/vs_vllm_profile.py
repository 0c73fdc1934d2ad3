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
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from vs_vllm import CONFIGS, simulate
from vs_vllm_backends import ManagerConfig, make_backend
from vs_vllm_workloads import make_workload

# Leaf-frame substrings per component, first match wins.
COMPONENTS: list[tuple[str, tuple[str, ...]]] = [
    ("hashing (sha256 / xxh3, Hasher::extend)", ("sha2::", "xxh3", "Hasher", "digest_blocks")),
    ("hit lookup (compute_hit, choose_block)", ("compute_hit", "choose_block", "hit::")),
    ("hash index (HashIndex, hashbrown)", ("hashbrown", "HashIndex", "index::", "unindex")),
    ("commit (publish_range, commit_step)", ("commit::", "publish")),
    ("build_plan", ("plan::", "emit_paged", "build_plan")),
    ("schedule (schedule_slot, admission)", ("schedule::", "schedule_slot")),
    ("block pool (allocate, decref, LRU)", ("pool::", "BlockPool")),
    ("token conversion (convert::from_array)", ("convert::", "from_array", "int_sequence")),
    ("add / finish (prefix compare, copies)", ("CacheManager::add", "shared_units", "Finished")),
    ("libc memcpy / malloc / free", ("libc.so", "malloc", "realloc", "free", "RawVec")),
    ("PyO3 / NumPy argument and result glue", ("pyo3", "PyArray", "numpy", "_core::")),
]


def run(workload_name: str, config_name: str, extends: bool, runs: int) -> None:
    workload = make_workload(workload_name, 1.0)
    base = next(c for c in CONFIGS[workload_name] if c.name == config_name)
    config = ManagerConfig(
        base.name, base.kind, base.block_size, base.unit, base.hash, reuse=extends
    )
    for _ in range(runs):
        result = simulate(workload, make_backend("prefixcache", config, workload))
        calls = sorted(result.by_call.items(), key=lambda kv: -kv[1])
        print(
            f"{result.seconds * 1e3:.0f} ms: "
            + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in calls),
            flush=True,
        )


def summarize(raw: Path) -> list[tuple[str, float]]:
    """Shares of the samples taken inside the native module, by component of the leaf."""
    shares: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any("_core.abi3.so" in frame for frame in frames):
            continue
        leaf = frames[-1]
        total += int(count)
        component = next(
            (name for name, keys in COMPONENTS if any(key in leaf for key in keys)), "other"
        )
        shares[component] += int(count)
    return [(name, 100.0 * n / max(total, 1)) for name, n in shares.most_common()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(CONFIGS))
    parser.add_argument("config")
    parser.add_argument("--extends", action="store_true", help="hash reuse (add(extends=))")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=int, default=1000, help="samples per second")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run(args.workload, args.config, args.extends, args.runs)
        return 0
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        child = [sys.executable, __file__, args.workload, args.config, "--runs", str(args.runs)]
        child += ["--child", *(["--extends"] if args.extends else [])]
        record = [py_spy, "record", "--native", "-r", str(args.rate), "-f", "raw", "-o", str(raw)]
        subprocess.run([*record, "--", *child], check=True)
        print(f"\nnative samples inside prefixcache calls, {args.workload} / {args.config}")
        for name, share in summarize(raw):
            print(f"{share:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
