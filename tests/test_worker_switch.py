"""The overlapped engine's worker shortens Python's thread switch interval while it runs.

A thread running Python keeps the GIL until the switch interval ends, so the worker, ready to
launch the next forward, may wait that long behind the host thread's planning. While a worker
is open the interval is the worker's ``SWITCH_INTERVAL``; closing it puts back the one before;
``None`` (the default) leaves the interpreter's alone.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from prefixcache.engine import worker as worker_module
from prefixcache.engine.worker import ForwardWorker


def _worker() -> ForwardWorker:
    model = SimpleNamespace(device=torch.device("cpu"))
    return ForwardWorker(model, lambda *args: None, caches=None)  # type: ignore[arg-type]


def test_the_interval_is_the_workers_while_it_runs_and_restored_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = sys.getswitchinterval()
    monkeypatch.setattr(worker_module, "SWITCH_INTERVAL", 0.0005)
    worker = _worker()
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        worker.close()
    assert sys.getswitchinterval() == before


def test_none_leaves_the_interval_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    before = sys.getswitchinterval()
    monkeypatch.setattr(worker_module, "SWITCH_INTERVAL", None)
    worker = _worker()
    try:
        assert sys.getswitchinterval() == before
    finally:
        worker.close()
    assert sys.getswitchinterval() == before
