"""``benchmarks/gpu_norms.py`` on the CPU: the model's norm against the float32 formula it
replaced, every case timed and compared (float32 inputs: the two agree to rounding)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("prefixcache._core")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_norms

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_smoke_run_times_and_compares_both_norms(tmp_path: Path) -> None:
    out = tmp_path / "norms.json"
    assert gpu_norms.main(["--smoke", "--tokens", "32,48", "--reps", "2", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["tokens"], c["impl"]) for c in cases] == [
        (tokens, impl) for tokens in (32, 48) for _ in range(2) for impl in ("formula", "model")
    ]
    assert all(c["host_us"] > 0 and c["busy_us"] > 0 for c in cases)
    assert all(c["max_abs_difference"] <= 1e-5 for c in cases)
