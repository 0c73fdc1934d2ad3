"""Timing of kernel calls: wall clock around synchronised blocks, or the GPU's own execution time.

Two ways to time a block of kernel launches, :class:`KernelTimer`'s ``mode``:

- ``"wall"`` (the default, and the only one on a CPU): the block is bracketed by
  ``torch.cuda.synchronize`` and timed with ``time.perf_counter``. On a GPU this is the time the
  block takes when nothing overlaps it: the GPU's execution *and* the host's time to launch the
  block's kernels, which a step of a small model spends mostly waiting for.
- ``"gpu"``: the time the GPU spends executing the block's kernels, without the host's launch
  time. Before the block the stream is given a backlog (``torch.cuda._sleep``, a GPU-side spin),
  so the host enqueues every kernel of the block before the GPU reaches the block's start event;
  the kernels then run back to back and the elapsed time between the start and end events is
  their execution time. A block whose launches outlast the backlog would count idle GPU time:
  the timer then counts an *underrun* (:attr:`KernelTimer.underruns`) and doubles the backlog for
  later blocks; after 64 blocks in a row without one it halves it again, down to the initial
  backlog (a one-off slow launch, such as a first call's set-up, does not slow a whole run).
  The synchronisation and the backlog cost every timed block several milliseconds of the
  model's own time, so use this mode for the KDA figure alone, not for a step's.
- ``"events"``: CUDA events recorded around each block, nothing synchronised and no backlog;
  :meth:`KernelTimer.take` waits for the last event and adds up the blocks' elapsed times. The
  model's time is untouched. A block's figure is its GPU execution time when the host enqueues
  faster than the GPU executes (a step whose kernels outlast their launches: the Kimi-K3 proxy's
  prefill steps); where the GPU waits for the host inside a block, that wait is counted too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

__all__ = ["TIMING_MODES", "KernelTimer", "TimingMode"]

TimingMode = Literal["wall", "gpu", "events"]
#: The timing modes, in the order the command line lists them.
TIMING_MODES: tuple[TimingMode, ...] = ("wall", "gpu", "events")

# GPU clock cycles of the initial backlog: about 5 ms at the H200's 1.98 GHz, several times the
# host time to launch one KDA layer of the reference model.
INITIAL_BACKLOG_CYCLES = 10_000_000
MAX_BACKLOG_CYCLES = 1_000_000_000
BLOCKS_BEFORE_SHRINKING = 64


class KernelTimer:
    """Accumulates seconds spent inside :meth:`measure` blocks on ``device``.

    ``enabled`` may be switched off for blocks that need no timing (the block then runs with no
    synchronisation at all). See the module docstring for the two modes.
    """

    def __init__(self, device: torch.device, mode: TimingMode = "wall") -> None:
        if mode not in TIMING_MODES:
            raise ValueError(f"timing mode must be one of {', '.join(TIMING_MODES)}, got {mode!r}")
        if mode != "wall" and device.type != "cuda":
            raise ValueError(f"timing mode {mode!r} needs a CUDA device, got {device}")
        self.device = device
        self.mode: TimingMode = mode
        self.enabled = True
        self.seconds = 0.0
        self.underruns = 0
        self.backlog_cycles = INITIAL_BACKLOG_CYCLES
        self._blocks_without_underrun = 0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Time the enclosed block and add it to :attr:`seconds`."""
        if not self.enabled:
            yield
            return
        if self.mode == "gpu":
            with self._measure_gpu():
                yield
            return
        if self.mode == "events":
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            finish = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
            try:
                yield
            finally:
                finish.record()
                self._pending.append((begin, finish))
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds += time.perf_counter() - start

    @contextmanager
    def _measure_gpu(self) -> Iterator[None]:
        self._sync()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda._sleep(self.backlog_cycles)  # type: ignore[no-untyped-call]
        start.record()
        try:
            yield
        finally:
            end.record()
            # Reached already: the GPU got to the block before the host finished launching it.
            if start.query():  # type: ignore[no-untyped-call]
                self.underruns += 1
                self.backlog_cycles = min(2 * self.backlog_cycles, MAX_BACKLOG_CYCLES)
                self._blocks_without_underrun = 0
            else:
                self._blocks_without_underrun += 1
                if self._blocks_without_underrun >= BLOCKS_BEFORE_SHRINKING:
                    self._blocks_without_underrun = 0
                    self.backlog_cycles = max(self.backlog_cycles // 2, INITIAL_BACKLOG_CYCLES)
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000.0

    def _collect(self) -> None:
        """Add the elapsed times of the blocks recorded in ``"events"`` mode (waits for them)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            for start, end in self._pending:
                self.seconds += start.elapsed_time(end) / 1000.0
            self._pending.clear()

    def take(self) -> float:
        """The seconds accumulated since the last ``take``; resets the counter."""
        self._collect()
        seconds, self.seconds = self.seconds, 0.0
        return seconds
