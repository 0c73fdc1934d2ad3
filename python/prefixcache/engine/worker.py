"""The forward of an overlapped engine, run by one worker thread in submission order.

The overlapped engine (:mod:`prefixcache.engine.engine`, ``EngineConfig.overlap``) plans step
k+1 while the forward of step k runs. :class:`ForwardWorker` is what runs the forwards: one
thread that takes :class:`ForwardJob` s in the order they were submitted, like a device stream,
so that a step always runs after the step whose caches and sampled tokens it reads.

The tokens a step samples stay where the model computed them: a later job names, for each of
its tokens not yet known on the host (a placeholder in the cache manager), the job and the
sample index it comes from, and the worker fills it in from that job's sampled ids on the
model's device just before the forward. On the CPU that is a tensor of this thread; on CUDA
the ids never leave the device to feed the next step, the worker launches on the device's
default stream (the host thread launches nothing during a run, so nothing else orders against
it), and the host copies of ids and logits are asynchronous copies into pinned memory that the
host waits for through a CUDA event (:meth:`ForwardResult.materialize`).

A job that raises poisons every later job (they may read what it half wrote, and the sampled
ids they need do not exist): they fail with :class:`SkippedStepError` without running, until
the host, having aborted the plans and collected every outstanding job, calls
:meth:`ForwardWorker.recover`.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..kernels._convert import to_device

if TYPE_CHECKING:
    from ..kernels import Step
    from ..models import HybridModel, ModelCaches

__all__ = ["SWITCH_INTERVAL", "ForwardJob", "ForwardResult", "ForwardWorker", "SkippedStepError"]

#: Python's thread switch interval (seconds) while a worker runs, restored when it closes; None
#: (the default) leaves it as it is. A thread running Python keeps the GIL until the interval
#: ends (5 ms by default), so the worker, ready to launch the next forward, may wait that long
#: behind the host's planning; a shorter interval hands the GIL over sooner. On the CPU 0.5 ms
#: changed nothing measurable (docs/BENCHMARKS.md); with decode steps replayed from CUDA
#: graphs the worker's launches take little GIL time on a GPU anyway.
SWITCH_INTERVAL: float | None = None

Forward = Callable[["Step", torch.Tensor, "ModelCaches", np.ndarray], torch.Tensor]


class SkippedStepError(RuntimeError):
    """A job not run because an earlier job failed (its plan is aborted with the failed one)."""


@dataclass
class ForwardJob:
    """One step for the worker.

    Attributes:
        step_id: the plan's step id.
        step: the step (views of the plan's buffers, which stay untouched until it ends).
        token_ids: ``int64 [T]`` on the host; the positions ``fills`` names hold 0.
        fills: ``(step_id, positions, indices)``: ``token_ids[positions]`` are the ids that
            the job of ``step_id`` sampled at ``indices`` (``int64`` arrays).
        logits_indices: packed-batch indices of the tokens to sample from.
        timed: whether the KDA timer runs during this forward (prefill rows in the step).
    """

    step_id: int
    step: Step
    token_ids: torch.Tensor
    fills: list[tuple[int, np.ndarray, np.ndarray]]
    logits_indices: np.ndarray
    timed: bool


@dataclass
class ForwardResult:
    """What one job produced; :meth:`materialize` before reading it on the host."""

    step_id: int
    sampled_ids: torch.Tensor  # host int64 [S] (pinned on CUDA, filled asynchronously)
    logits_host: torch.Tensor  # host float32 [S, V]
    seconds: float  # the job's time, filling its tokens to the host copies (CPU: wall clock;
    # CUDA: between two events around the forward, sampling and copies)
    kda_seconds: float
    underruns: int
    done: Any = None  # the CUDA event after the copies (None on the CPU)
    start: Any = None  # the CUDA event before the forward
    sampled: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None

    def materialize(self) -> ForwardResult:
        """Wait for the device (CUDA) and take the sampled ids and logits as host data."""
        if self.logits is None:
            if self.done is not None:
                self.done.synchronize()
                self.seconds = self.start.elapsed_time(self.done) / 1000.0
            self.sampled = self.sampled_ids.tolist()
            self.logits = self.logits_host.numpy()
        return self


class ForwardWorker:
    """A thread running forwards in submission order (see the module docstring).

    Args:
        model: the model (its device and KDA timer).
        forward: ``(step, token_ids, caches, logits_indices) -> logits``.
        caches: the model's caches.
    """

    def __init__(self, model: HybridModel, forward: Forward, caches: ModelCaches) -> None:
        self.model = model
        self.forward = forward
        self.caches = caches
        self.device = model.device
        self._queue: queue.SimpleQueue[tuple[ForwardJob, Future[ForwardResult]] | None]
        self._queue = queue.SimpleQueue()
        self._failed = False
        # Sampled ids (on the model's device) of the latest jobs, by step id: a hole names one
        # of the two newest (the step before its own, or the one before that).
        self._samples: dict[int, torch.Tensor] = {}
        self._switch_before: float | None = None
        if SWITCH_INTERVAL is not None:
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL)
        self._thread = threading.Thread(target=self._serve, name="prefixcache-forward")
        self._thread.daemon = True
        self._thread.start()

    def submit(self, job: ForwardJob) -> Future[ForwardResult]:
        """Queue ``job`` after every job submitted before it; its future gets its result."""
        future: Future[ForwardResult] = Future()
        self._queue.put((job, future))
        return future

    def recover(self) -> None:
        """Accept jobs again after a failure; only once every outstanding future is done."""
        self._failed = False
        self._samples.clear()

    def close(self) -> None:
        """Stop the thread once the jobs queued so far have run (or been skipped)."""
        self._queue.put(None)
        self._thread.join()
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
            self._switch_before = None

    # --- the thread ---------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, future = item
            if self._failed:
                future.set_exception(
                    SkippedStepError(f"step {job.step_id} not run: an earlier step failed")
                )
                continue
            try:
                result = self._run(job)
            except BaseException as error:
                self._failed = True
                self._samples.clear()
                future.set_exception(error)
                continue
            future.set_result(result)

    def _run(self, job: ForwardJob) -> ForwardResult:
        device = self.device
        cuda = device.type == "cuda"
        began = time.perf_counter()
        # Host data reaches the device through pinned memory without waiting for it (a plain
        # copy of pageable memory synchronises the stream: the worker could not run ahead).
        token_ids = to_device(job.token_ids, device)
        for step_id, positions, indices in job.fills:
            sampled = self._samples[step_id]  # KeyError: a hole naming a job not run last
            token_ids[to_device(torch.from_numpy(positions), device)] = sampled[
                to_device(torch.from_numpy(indices), device)
            ]
        timer = self.model.kda_timer
        timer.enabled = job.timed
        underruns = timer.underruns
        timer.take()
        start = done = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        logits = self.forward(job.step, token_ids, self.caches, job.logits_indices)
        sampled = logits.argmax(dim=-1)
        self._samples[job.step_id] = sampled
        while len(self._samples) > 3:
            del self._samples[next(iter(self._samples))]  # the oldest (insertion order)
        values = logits.detach().to(torch.float32)
        if cuda:
            sampled_host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            logits_host = torch.empty(values.shape, dtype=torch.float32, pin_memory=True)
            sampled_host.copy_(sampled, non_blocking=True)
            logits_host.copy_(values, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            done.record()
        else:
            sampled_host, logits_host = sampled, values
        seconds = time.perf_counter() - began
        kda_seconds = timer.take()
        return ForwardResult(
            step_id=job.step_id,
            sampled_ids=sampled_host,
            logits_host=logits_host,
            seconds=seconds,
            kda_seconds=kda_seconds,
            underruns=timer.underruns - underruns,
            done=done,
            start=start,
        )
