"""``benchmarks/engine_host_path.py`` on the default preset: the engine's host path timed with the
model stubbed out, every request's admission once, every step's parts once, nothing left patched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("prefixcache._core")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import engine_host_path
from prefixcache.engine.engine import _Loop
from prefixcache.kernels.step import Step
from prefixcache.models.hybrid import HybridModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_request_and_step_is_timed_once_and_the_engine_is_restored(tmp_path: Path) -> None:
    before = (HybridModel.execute, _Loop.__init__, _Loop.schedule, Step.__dict__["from_plan"])
    out = tmp_path / "host_path.json"
    argv = ["--preset", "default", "--policy", "fine", "--min-prompt", "1", "--json", str(out)]
    assert engine_host_path.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["add"]["count"] == 184  # the default preset's requests, each admitted once
    steps = result["inputs"]["count"]
    assert result["apply_plan"]["count"] == result["from_plan"]["count"] == steps > 184
    assert 0 < result["schedule"]["count"] <= steps
    assert all(result[part]["median_us"] > 0 for part in ("add", *engine_host_path.STEP_PARTS))
    after = (HybridModel.execute, _Loop.__init__, _Loop.schedule, Step.__dict__["from_plan"])
    assert after == before


def test_prep_times_each_prefill_step_with_the_layers_stubbed(tmp_path: Path) -> None:
    before = (HybridModel.execute, HybridModel.forward_layers)
    out = tmp_path / "host_path.json"
    argv = ["--preset", "default", "--policy", "fine", "--prep", "--json", str(out)]
    assert engine_host_path.main(argv) == 0
    result = json.loads(out.read_text())
    prefill = result["prefill_execute"]
    # The steps with a prefill row, and only those: some, not the decode-only ones.
    assert 0 < prefill["count"] < result["inputs"]["count"]
    assert prefill["median_us"] > 0
    # Fine resumes inside paged blocks, so some of its prefill steps copy one first.
    assert 0 < result["prefill_steps_with_copies"] <= prefill["count"]
    assert (HybridModel.execute, HybridModel.forward_layers) == before
