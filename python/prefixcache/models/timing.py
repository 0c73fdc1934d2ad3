"""Wall-clock timing of kernel calls, synchronising the GPU so the time is the kernels' own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["KernelTimer"]


class KernelTimer:
    """Accumulates seconds spent inside :meth:`measure` blocks on ``device``.

    On CUDA each block is bracketed by ``torch.cuda.synchronize`` (queued work is finished
    before the clock starts and the block's work before it stops); on the CPU it is plain
    ``time.perf_counter``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Time the enclosed block and add it to :attr:`seconds`."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        """The seconds accumulated since the last ``take``; resets the counter."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
