"""``benchmarks/kv_copies.py`` on the CPU: one copy-on-write row timed with a cache per layer and
with the layers on one storage, for each layer count asked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("prefixcache._core")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import kv_copies

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_both_layouts_are_timed_for_each_layer_count(tmp_path: Path) -> None:
    out = tmp_path / "kv_copies.json"
    argv = ["--layers", "1,3", "--blocks", "4", "--reps", "5", "--json", str(out)]
    assert kv_copies.main(argv) == 0
    result = json.loads(out.read_text())
    assert [case["layers"] for case in result["cases"]] == [1, 3]
    assert all(case["separate_us"] > 0 and case["stacked_us"] > 0 for case in result["cases"])


@pytest.mark.parametrize(
    "argv",
    [["--blocks", "3"], ["--tokens", "0"], ["--tokens", "1537"], ["--layers", "2,0"],
     ["--layers", "two"], ["--reps", "0"]],
)  # fmt: skip
def test_sizes_it_cannot_time_are_refused(argv: list[str]) -> None:
    # Block 3 must exist, a copy moves 1 to 1,536 tokens of a block, every count is positive.
    with pytest.raises(SystemExit) as exited:
        kv_copies.main(argv)
    assert exited.value.code == 2
