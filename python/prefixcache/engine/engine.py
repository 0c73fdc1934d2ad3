"""The reference continuous-batching engine: a scheduler loop around the cache manager.

One :class:`Engine` runs one caching policy over one workload with one model; each
:meth:`Engine.run` builds a fresh cache manager and fresh model caches. A step:

1. *Arrivals*: requests whose arrival time has come are added to the manager (``add``, with
   ``extends`` naming the request whose prompt they continue) and queued.
2. *Schedule* under a token budget, vLLM-style: running sequences first, in admission order
   (a decode takes 1 token, a prefill the rest of the budget, trimmed by the manager to the
   state alignment grid), then waiting sequences in arrival order while the budget and
   ``max_running`` allow. When ``schedule`` returns ``None`` (out of blocks) the newest running
   sequence is preempted (its blocks released; it is recomputed from a fresh lookup later) and
   the schedule retried, and nothing new is admitted in that step; a waiting sequence that
   does not fit simply waits.
3. The plan is written into one :class:`prefixcache.PlanBuffers` reused by every step
   (``build_plan_into``); the block tables (:class:`prefixcache.kernels.BlockTables`) apply its
   ``appended`` / ``replaced`` entries, and the model executes the whole
   :class:`prefixcache.kernels.Step` (copy-on-write copies, layers, snapshots). If any of this
   raises, the step is aborted (``abort``: nothing is published, every sequence is back at its
   pre-step position) and the block tables are rolled back, then the loop goes on and
   schedules the same sequences again (up to ``max_step_retries`` consecutive failures).
4. After the forward: each sequence whose known tokens are all computed gets a greedy token,
   the first one fixing its time to first token; the step is committed and the tokens
   appended; a sequence with all its output tokens is finished (``finish``), and the workload
   may release follow-up requests.

Overlapped (``EngineConfig.overlap``, the default): the manager is built with
``max_steps_in_flight = 2`` and the forwards run on a worker thread
(:class:`~prefixcache.engine.worker.ForwardWorker`, in submission order, like a device stream),
so the host schedules and plans step k+1 while the forward of step k runs:

- Step k+1 is planned before step k's tokens are on the host: each sequence step k samples
  (and that does not finish with it) gets a placeholder (``append_placeholders``), which
  step k+1 schedules like a known token; its id reaches step k+1 from step k's sampled ids
  on the worker (on CUDA, on the device), never through the host.
- Once step k+1 is submitted, the host waits for step k, commits it and ``resolve`` s the
  placeholders with the sampled ids (a sequence whose last output step k sampled was not
  scheduled in step k+1: its token is appended and it finishes), all while step k+1 runs.
- Two plans are in flight, in a ring of two ``PlanBuffers``; the block tables keep both
  plans' undo records. A failed forward aborts its plan, and with it the later one (the
  manager's cascading abort ends both and rewinds their placeholders; the worker skips the
  later forward, which would read what the failed one half wrote); both are rolled back from
  the block tables and rescheduled.
- Decode-only steps take ``decode_step_overlapped``: one call commits step k, resolves its
  tokens, appends the placeholders of step k+1's samples, schedules one token of each and
  plans step k+2 into the free buffer.
- When the pools run short with a plan in flight, the step is cut short (what is scheduled
  runs, nobody is admitted) and preemption waits for a step with nothing in flight, so that
  a preempted sequence's blocks are released at once.
- The pending answer (``EngineConfig.hold_pending``): a waiting request whose ``lookup``
  reports ``pending_tokens`` beyond its hit waits a step instead of recomputing the prefix a
  plan in flight is computing (``RunResult.holds`` counts those waits).

Not overlapped, decode-only steps take the fast path: when every running sequence got a
token, none finished and the next step would admit nobody, the commit is deferred to the next
step's
``decode_step``, which commits, appends the tokens, schedules one token of each and plans, in
one call. If the pools cannot supply a block there (a ``-1``), that plan is aborted and the
step is scheduled the general way, with preemption.

The engine keeps no copy of the manager's progress: positions come from the plan and from
``manager.num_computed``, block tables from ``BlockTables``. Time is the wall clock, except
that an idle engine jumps to the next arrival instead of sleeping.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

import prefixcache as pc

from ..kernels import BlockTables, Step
from ..kernels._convert import to_device
from ..models import HybridModel, ModelCaches
from .policy import PAGED_GROUP, STATE_GROUP, Policy
from .results import RequestResult, RunResult
from .worker import ForwardJob, ForwardResult, ForwardWorker
from .workloads import Request, Workload

__all__ = [
    "OVERLAP_DEPTH",
    "Engine",
    "EngineConfig",
    "EngineError",
    "ForwardFn",
    "PoolTooSmallError",
]

logger = logging.getLogger("prefixcache.engine")

ForwardFn = Callable[[Step, torch.Tensor, ModelCaches, np.ndarray], torch.Tensor]
"""``(step, token_ids, caches, logits_indices) -> logits``: ``HybridModel.execute``'s shape."""

OVERLAP_DEPTH = 2
"""Plans in flight in an overlapped engine (the manager's ``max_steps_in_flight``)."""


class EngineError(RuntimeError):
    """The engine cannot go on (a configuration that cannot serve the workload)."""


class PoolTooSmallError(EngineError):
    """A sequence cannot be scheduled even with nothing else running."""


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and memory settings of an engine.

    Attributes:
        token_budget: tokens per step (chunked prefill budget; decodes take 1 each).
        max_running: sequences running at once.
        paged_blocks: blocks of the attention pool (block 0 is the null block).
        state_blocks: KDA state slots (running buffers and checkpoints; slot 0 unused).
        checkpoint_cap: at most this many state slots hold checkpoints (``None``: no cap).
        max_step_retries: consecutive failed forwards tolerated before the error propagates.
        check: after every plan (and every abort), compare the engine's block tables with the
            manager's and run the manager's invariant checks (slow; for tests).
        overlap: plan step k+1 while the forward of step k runs on a worker thread, with
            :data:`OVERLAP_DEPTH` plans in flight (see the module docstring); ``False``: one
            step at a time.
        hold_pending: overlapped, a waiting request whose prefix a plan in flight is
            computing waits for it instead of recomputing it.
    """

    token_budget: int
    max_running: int
    paged_blocks: int
    state_blocks: int
    checkpoint_cap: int | None = None
    max_step_retries: int = 3
    check: bool = False
    overlap: bool = True
    hold_pending: bool = True

    def __post_init__(self) -> None:
        if min(self.token_budget, self.max_running) < 1:
            raise ValueError("token_budget and max_running must be >= 1")
        if min(self.paged_blocks, self.state_blocks) < 2:
            raise ValueError("paged_blocks and state_blocks must be >= 2 (block 0 is null)")
        if self.max_step_retries < 0:
            raise ValueError("max_step_retries must be >= 0")


class _Tokens:
    """A live sequence's token ids: its prompt, then each token it samples.

    The prompt is kept as it is when it is a read-only ``int64`` array (a ``Request``'s always
    is) and copied otherwise; the sampled ids go to an ``int64`` array of their own that grows
    by doubling. Admission used to turn the prompt into a Python list (``ndarray.tolist`` of a
    164K-token prompt: 22 ms on the VM under load), then to copy it (0.05 to 0.2 ms, up to 4
    ms where its pages were new): both ran between a request's arrival and its first step, so
    every request's TTFT carried a cost that grows with its context, not its new tokens. A
    span inside the prompt or inside the sampled ids is a view (the ids it covers never change:
    appending only writes past them, and growing copies to a new array); one across the two
    is a copy."""

    __slots__ = ("_count", "_prompt", "_sampled")

    def __init__(self, prompt: np.ndarray, spare: int) -> None:
        if prompt.dtype != np.int64 or prompt.flags.writeable or not prompt.flags.c_contiguous:
            prompt = np.array(prompt, dtype=np.int64)
            prompt.flags.writeable = False
        self._prompt = prompt
        self._sampled = np.empty(max(16, spare), dtype=np.int64)
        self._count = 0

    def __len__(self) -> int:
        return len(self._prompt) + self._count

    def append(self, token: int) -> None:
        if self._count == len(self._sampled):
            grown = np.empty(2 * len(self._sampled), dtype=np.int64)
            grown[: self._count] = self._sampled[: self._count]
            self._sampled = grown
        self._sampled[self._count] = token
        self._count += 1

    def span(self, start: int, end: int) -> np.ndarray:
        """The ids at positions ``start .. end - 1`` that exist (none before 0 or from
        ``len``): a view, or a copy when the span covers prompt and sampled ids both."""
        prompt = len(self._prompt)
        start, end = max(0, start), max(0, min(end, prompt + self._count))
        if end <= prompt:
            return self._prompt[start:end]
        if start >= prompt:
            return self._sampled[start - prompt : end - prompt]
        return np.concatenate((self._prompt[start:], self._sampled[: end - prompt]))

    def last(self) -> int:
        """The newest id."""
        if self._count:
            return int(self._sampled[self._count - 1])
        if not len(self._prompt):
            raise IndexError("no tokens")
        return int(self._prompt[-1])


@dataclass(eq=False)
class _Sequence:
    """The engine's view of one request while it is live (its progress is the manager's)."""

    request: Request
    tokens: _Tokens
    arrival: float
    outputs: list[int] = field(default_factory=list)
    prefilling: bool = True  # no token sampled since the sequence was (re)started
    hit_tokens: int | None = None
    computed_prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    kda_prefill_seconds: float = 0.0
    first_token_time: float | None = None
    final_logits: np.ndarray | None = None
    margins: list[float] = field(default_factory=list)
    preemptions: int = 0
    # Overlapped only: placeholders appended and not yet resolved (tokens being sampled), the
    # steps in flight it is in, the position after its latest scheduled chunk, its samples in
    # flight, and whether a hold was already counted for it.
    placeholders: int = 0
    in_flight: int = 0
    planned: int = 0
    samples_in_flight: int = 0
    held: bool = False

    @property
    def seq_id(self) -> int:
        return self.request.request_id


def _margin(logits: np.ndarray) -> float:
    """(top-1 - top-2) / max |logit| of one row of logits (1.0 for a single-entry row)."""
    if logits.shape[0] < 2:
        return 1.0
    top2 = np.partition(logits, -2)[-2:]
    scale = float(np.max(np.abs(logits))) or 1.0
    return float(top2[1] - top2[0]) / scale


def _stats_dict(stats: Any) -> dict[str, Any]:
    """The manager's statistics as plain data (whatever form the bindings return)."""
    if isinstance(stats, dict):
        return dict(stats)
    to_dict = getattr(stats, "to_dict", None)
    if callable(to_dict):
        result = to_dict()
        if isinstance(result, dict):
            return result
    return {
        name: getattr(stats, name)
        for name in dir(stats)
        if not name.startswith("_") and isinstance(getattr(stats, name), (int, float))
    }


class Engine:
    """Runs workloads under one caching policy (see the module docstring).

    Args:
        model: the model (its backend configures the manager's state group).
        policy: the caching policy.
        config: scheduler and memory settings.
        forward: the step function, ``model.execute`` by default (tests wrap it to inject
            failures).
        observe: called with each run's manager (then built with events on); returns a
            callback the loop calls after every step (an event publisher's ``publish``).
    """

    def __init__(
        self,
        model: HybridModel,
        policy: Policy,
        config: EngineConfig,
        *,
        forward: ForwardFn | None = None,
        observe: Callable[[pc.CacheManager], Callable[[], object]] | None = None,
    ) -> None:
        self.observe = observe
        self.model = model
        self.policy = policy
        self.config = config
        minimum = self.manager_config().min_token_budget
        if config.token_budget < minimum:
            raise ValueError(
                f"token_budget {config.token_budget} is below {minimum}, the cache manager's "
                f"smallest budget for this configuration (non-final prefill chunks end on the "
                f"grid of the kernel's checkpoint alignment {model.backend.checkpoint_alignment}"
                f"), so no chunk could ever be scheduled; raise the budget to at least {minimum}"
            )
        self.forward: ForwardFn = model.execute if forward is None else forward

    def manager_config(self) -> pc.CacheConfig:
        """The cache manager's configuration for this engine."""
        config = self.policy.cache_config(
            self.model.backend,
            paged_blocks=self.config.paged_blocks,
            state_blocks=self.config.state_blocks,
            checkpoint_cap=self.config.checkpoint_cap,
        )
        if self.config.overlap:
            config = replace(config, max_steps_in_flight=OVERLAP_DEPTH)
        return config if self.observe is None else replace(config, enable_events=True)

    def run(
        self,
        workload: Workload,
        *,
        on_finished: Callable[[RequestResult], None] | None = None,
    ) -> RunResult:
        """Serve every request of ``workload``; ``on_finished`` is called per finished request."""
        loop = (_OverlapLoop if self.config.overlap else _Loop)(self, workload, on_finished)
        return loop.run()


class _Loop:
    """The state of one :meth:`Engine.run`."""

    def __init__(
        self,
        engine: Engine,
        workload: Workload,
        on_finished: Callable[[RequestResult], None] | None,
    ) -> None:
        self.engine = engine
        self.config = engine.config
        self.model = engine.model
        self.workload = workload
        self.on_finished = on_finished
        self.manager = pc.CacheManager(engine.manager_config())
        self.after_step = None if engine.observe is None else engine.observe(self.manager)
        block_size = engine.policy.block_size
        self.caches: ModelCaches = self.model.allocate_caches(
            paged_blocks=self.config.paged_blocks,
            block_size=block_size,
            state_blocks=self.config.state_blocks,
            paged_group=PAGED_GROUP,
            state_group=STATE_GROUP,
        )
        self.block_size = block_size
        self.buffers = pc.PlanBuffers(rows=self.config.max_running)
        self.tables = BlockTables(PAGED_GROUP, rows=self.config.max_running)
        self.result = RunResult(policy=engine.policy.name, overlap=self.config.overlap)
        self.pending: list[tuple[float, int, Request]] = []
        self.handed: list[Request] = []  # follow-ups arriving "now"
        self.live: dict[int, _Sequence] = {}
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        # The tokens of a step whose forward ran and whose commit waits for the next step's
        # ``decode_step`` (every running sequence decodes, in running order).
        self.deferred: dict[int, int] | None = None
        self.start = time.perf_counter()
        self.skipped = 0.0
        self.failures = 0

    # --- clock and arrivals -------------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.start + self.skipped

    def submit(self, requests: list[Request]) -> None:
        for request in requests:
            if request.arrival_s is None:
                self.handed.append(request)
            else:
                heapq.heappush(self.pending, (request.arrival_s, request.request_id, request))

    def admit_arrivals(self) -> None:
        now = self.now()
        arrived = self.handed
        self.handed = []
        while self.pending and self.pending[0][0] <= now:
            arrived.append(heapq.heappop(self.pending)[2])
        for request in arrived:
            arrival = now if request.arrival_s is None else request.arrival_s
            # int64 ids as they are: the bindings check each against the u32 range as they
            # copy them out (an astype here was one more copy of the prompt in every TTFT).
            self.manager.add(request.request_id, request.prompt, extends=request.extends)
            tokens = _Tokens(request.prompt, request.output_len)
            seq = _Sequence(request=request, tokens=tokens, arrival=arrival)
            self.live[seq.seq_id] = seq
            self.waiting.append(seq)

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> RunResult:
        try:
            return self._serve()
        finally:
            self.model.kda_timer.enabled = True  # steps switch it per step; leave it as found

    def _serve(self) -> RunResult:
        self.submit(self.workload.initial_requests())
        while True:
            self.admit_arrivals()
            stepped = self.step()
            if self.after_step is not None:
                self.after_step()
            if stepped:
                continue
            if self.running or self.waiting:
                head = self.waiting[0] if self.waiting else self.running[0]
                raise PoolTooSmallError(
                    f"request {head.seq_id} ({len(head.tokens)} tokens) cannot be scheduled "
                    f"even with nothing else running: the pools (attention: "
                    f"{self.config.paged_blocks} blocks of {self.block_size} tokens, state: "
                    f"{self.config.state_blocks} slots) are too small for it; give more blocks"
                )
            if self.handed:
                continue
            if not self.pending:
                break
            self.skipped += max(0.0, self.pending[0][0] - self.now())
        self.result.seconds = time.perf_counter() - self.start
        self.result.manager_stats = _stats_dict(self.manager.stats())
        return self.result

    def would_admit(self) -> bool:
        """Whether scheduling now would try to admit a waiting sequence after the decodes."""
        budget = self.config.token_budget - len(self.running)
        return bool(self.waiting) and budget > 0 and len(self.running) < self.config.max_running

    def step(self) -> bool:
        """One engine step; returns whether anything was scheduled."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            ids = np.fromiter((seq.seq_id for seq in self.running), dtype=np.uint64)
            tokens = np.fromiter((deferred[int(i)] for i in ids), dtype=np.uint32)
            if len(self.running) <= self.config.token_budget and not self.would_admit():
                scheduled = self.manager.decode_step(self.buffers, ids, tokens)
                if bool((scheduled == 1).all()):
                    self.result.decode_steps += 1
                    return self.execute()
                # Out of blocks for some sequence: schedule the general way (with preemption).
                self.manager.abort(self.buffers)
                self.result.decode_fallbacks += 1
            else:
                self.manager.commit(self.buffers)
                self.manager.append_batch(ids, tokens)
                if self.config.check:
                    self.check(self.running)
        if not self.schedule():
            return False
        self.manager.build_plan_into(self.buffers)
        return self.execute()

    def schedule(self) -> list[_Sequence]:
        """Schedule this step's sequences; returns them in schedule order."""
        manager = self.manager
        budget = self.config.token_budget
        scheduled: list[_Sequence] = []
        preemptions = self.result.preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            remaining = len(seq.tokens) - manager.num_computed(seq.seq_id)
            result = self.schedule_preempting(seq, min(remaining, budget))
            if result is None:
                break
            if result.num_tokens > 0:
                budget -= result.num_tokens
                scheduled.append(seq)
            index += 1
        if self.result.preemptions != preemptions:
            return scheduled  # memory is short: admit nobody in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            hit = manager.lookup(seq.seq_id)
            if hit.tokens and not self.engine.policy.caches_prefixes:
                raise EngineError(
                    f"sequence {seq.seq_id} hit {hit.tokens} tokens under policy 'none'"
                )
            remaining = len(seq.tokens) - int(hit.tokens)
            result = manager.schedule(seq.seq_id, min(remaining, budget))
            if result is None or result.num_tokens == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            budget -= result.num_tokens
            scheduled.append(seq)
        return scheduled

    def schedule_preempting(self, seq: _Sequence, tokens: int) -> pc.Scheduled | None:
        """Schedule `tokens` of running `seq`, preempting the newest running sequences while
        the pools cannot serve it; `None` once `seq` itself was preempted."""
        result = self.manager.schedule(seq.seq_id, tokens)
        while result is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return None
            result = self.manager.schedule(seq.seq_id, tokens)
        return result

    def preempt(self, seq: _Sequence) -> None:
        """Release a running sequence's blocks; it is recomputed from a fresh lookup later."""
        self.manager.preempt(seq.seq_id)
        self.tables.release(seq.seq_id)
        self.running.remove(seq)
        seq.prefilling = True
        seq.preemptions += 1
        self.result.preemptions += 1
        self.waiting.appendleft(seq)

    def execute(self) -> bool:
        """Execute the step the buffers hold; commit it (or defer the commit) or abort it."""
        buffers = self.buffers
        rows = [self.live[seq_id] for seq_id in buffers.seq_ids[: buffers.num_rows].tolist()]
        kda_timer = self.model.kda_timer
        # Only prefill rows are charged KDA time: a decode-only step runs untimed.
        kda_timer.enabled = any(seq.prefilling for seq in rows)
        underruns = kda_timer.underruns
        try:
            self.tables.apply_plan(buffers)
        except Exception:
            self.manager.abort(buffers)  # a plan the tables refuse is a bug: it propagates
            raise
        if self.config.check:
            self.check(rows)  # a mismatch is a bug too, never a step to retry
        try:
            step = Step.from_plan(buffers, [self.tables])
            token_ids, logits_indices = self.inputs(rows)
            kda_timer.take()
            started = time.perf_counter()
            logits = self.engine.forward(step, token_ids, self.caches, logits_indices)
            sampled = self.model.sample(logits)
            logits_host = logits.detach().to("cpu", torch.float32).numpy()
        except Exception as error:
            step_id = buffers.step_id
            self.manager.abort(buffers)
            self.tables.rollback()
            if self.config.check:
                self.check(rows)
            self.result.aborted_steps += 1
            self.failures += 1
            if self.failures > self.config.max_step_retries:
                raise
            logger.warning(
                "step %s failed (%s: %s); aborted, the %d sequence(s) will be rescheduled",
                step_id,
                type(error).__name__,
                error,
                len(rows),
            )
            return True
        self.failures = 0
        seconds = time.perf_counter() - started
        self.result.forward_seconds += seconds
        self.result.wait_seconds += seconds  # the host waits for a forward it does not overlap
        kda_seconds = kda_timer.take()
        self.result.kda_timing_underruns += kda_timer.underruns - underruns
        self.result.steps += 1
        self.after_forward(rows, sampled, logits_host, seconds, kda_seconds)
        return True

    def inputs(self, rows: list[_Sequence]) -> tuple[torch.Tensor, np.ndarray]:
        """The step's token ids (on the model's device) and the indices of the tokens sampled."""
        buffers = self.buffers
        count = len(rows)
        starts = buffers.num_computed[:count].tolist()
        ends = (buffers.num_computed[:count] + buffers.num_scheduled[:count]).tolist()
        query_end = buffers.query_start_loc[1 : count + 1].tolist()
        pieces: list[np.ndarray] = []
        logits_indices: list[int] = []
        for seq, start, end, last in zip(rows, starts, ends, query_end, strict=True):
            pieces.append(seq.tokens.span(start, end))
            if end == len(seq.tokens):
                logits_indices.append(last - 1)
        token_ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return (
            to_device(torch.from_numpy(token_ids), self.model.device),
            np.asarray(logits_indices, dtype=np.int64),
        )

    def after_forward(
        self,
        rows: list[_Sequence],
        sampled: list[int],
        logits: np.ndarray,
        seconds: float,
        kda_seconds: float,
    ) -> None:
        """Account the step, take the sampled tokens; commit, append and finish, or defer."""
        buffers = self.buffers
        count = len(rows)
        num_computed = buffers.num_computed[:count].tolist()
        num_scheduled = buffers.num_scheduled[:count].tolist()
        total_tokens = max(1, sum(num_scheduled))
        now = self.now()
        appended: list[tuple[_Sequence, int]] = []
        finished: list[_Sequence] = []
        sample_index = 0
        for seq, start, count_ in zip(rows, num_computed, num_scheduled, strict=True):
            if seq.hit_tokens is None:
                seq.hit_tokens = start
            if seq.prefilling:
                share = count_ / total_tokens
                seq.computed_prefill_tokens += count_
                seq.prefill_seconds += seconds * share
                seq.kda_prefill_seconds += kda_seconds * share
            if start + count_ < len(seq.tokens):
                continue
            token = sampled[sample_index]
            seq.final_logits = logits[sample_index]
            seq.margins.append(_margin(logits[sample_index]))
            sample_index += 1
            seq.prefilling = False
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.outputs.append(token)
            seq.tokens.append(token)
            if len(seq.outputs) >= seq.request.output_len:
                finished.append(seq)
            else:
                appended.append((seq, token))
        if not finished and len(appended) == len(self.running) == count:
            # Every running sequence decodes next: the next step's decode_step commits this one.
            self.deferred = {seq.seq_id: token for seq, token in appended}
            return
        self.manager.commit(buffers)
        if appended:
            self.manager.append_batch(
                np.asarray([seq.seq_id for seq, _ in appended], dtype=np.uint64),
                np.asarray([token for _, token in appended], dtype=np.uint32),
            )
        for seq in finished:
            self.finish(seq)
        if self.config.check:
            self.check(rows)

    def finish(self, seq: _Sequence) -> None:
        """Finish a sequence (its last token appended first, so ``extends`` sees it)."""
        self.manager.append(seq.seq_id, np.asarray(seq.outputs[-1:], dtype=np.uint32))
        self.manager.finish(seq.seq_id)
        self.tables.release(seq.seq_id)
        self.running.remove(seq)
        del self.live[seq.seq_id]
        assert seq.first_token_time is not None and seq.final_logits is not None
        result = RequestResult(
            request_id=seq.seq_id,
            round=seq.request.round,
            prompt_len=seq.request.prompt_len,
            hit_tokens=seq.hit_tokens or 0,
            computed_prefill_tokens=seq.computed_prefill_tokens,
            prefill_seconds=seq.prefill_seconds,
            kda_prefill_seconds=seq.kda_prefill_seconds,
            ttft_s=seq.first_token_time - seq.arrival,
            output_ids=list(seq.outputs),
            final_logits=seq.final_logits,
            margins=list(seq.margins),
            preemptions=seq.preemptions,
        )
        self.result.requests[seq.seq_id] = result
        if self.on_finished is not None:
            self.on_finished(result)
        self.submit(self.workload.on_finished(seq.request, result.output_ids))

    def check(self, rows: list[_Sequence]) -> None:
        """Compare the block tables of ``rows`` still live with the manager's; run its
        invariant checks."""
        ids = [seq.seq_id for seq in rows if seq.seq_id in self.live]
        if ids:
            expected = np.asarray(self.manager.block_table(PAGED_GROUP, ids))
            for row, seq_id in enumerate(ids):
                theirs = np.trim_zeros(expected[row], "b").tolist()
                ours = np.trim_zeros(np.asarray(self.tables.row(seq_id), dtype=np.int32), "b")
                if ours.tolist() != theirs:
                    raise EngineError(
                        f"sequence {seq_id}: engine block table {ours.tolist()} differs from "
                        f"the manager's {theirs}"
                    )
        self.manager.check_invariants()


@dataclass(eq=False)
class _Flight:
    """A plan in flight: built, submitted to the worker, not yet committed or aborted."""

    step_id: int
    buffers: pc.PlanBuffers
    rows: list[_Sequence]
    num_computed: list[int]
    num_scheduled: list[int]
    prefill: list[bool]  # per row: a prefill chunk (no sample of the sequence before it)
    samples: list[_Sequence]  # rows that sample a token, in sample order
    finishing: set[int]  # ids of the samples that are their sequence's last output
    future: Future[ForwardResult] | None  # None: an empty plan (nothing to run)
    placeholders: bool = False  # the placeholders of its non-finishing samples are appended
    result: ForwardResult | None = None

    def __post_init__(self) -> None:
        # Sequence id -> its index among the samples (a placeholder's source, in O(1)).
        self.sample_index = {seq.seq_id: index for index, seq in enumerate(self.samples)}


class _OverlapLoop(_Loop):
    """The state of one overlapped :meth:`Engine.run` (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        workload: Workload,
        on_finished: Callable[[RequestResult], None] | None,
    ) -> None:
        super().__init__(engine, workload, on_finished)
        rows = self.config.max_running
        self.ring = [pc.PlanBuffers(rows=rows) for _ in range(OVERLAP_DEPTH)]
        self.tables = BlockTables(PAGED_GROUP, rows=rows, depth=OVERLAP_DEPTH)
        self.flights: deque[_Flight] = deque()
        self.worker = ForwardWorker(self.model, self.engine.forward, self.caches)

    def run(self) -> RunResult:
        try:
            return self._serve()
        finally:
            self.worker.close()  # first: the worker switches the KDA timer per step
            self.model.kda_timer.enabled = True

    # --- one iteration ------------------------------------------------------------------------

    def step(self) -> bool:
        """Plan and submit the next step, then wait for the oldest in flight once two are;
        returns whether anything happened (a plan submitted, a step ended)."""
        done = self.flights[0] if self.flights and self.flights[0].result is not None else None
        launched = False
        if done is not None and self.fast_path_ready(done):
            launched = self.decode_overlapped(done)
        else:
            while self.flights and self.flights[0].result is not None:
                self.end_step(self.flights.popleft())
            self.admit_arrivals()  # follow-ups of the requests that finished
            self.append_placeholders()
            if self.schedule():
                launched = self.launch()
        waited = False
        if (
            self.flights
            and self.flights[0].result is None
            and (len(self.flights) == OVERLAP_DEPTH or not launched)
        ):
            self.wait_oldest()
            waited = True
        return launched or waited or done is not None

    def fast_path_ready(self, done: _Flight) -> bool:
        """Whether the next step is one token of every running sequence, each of which the
        step in flight samples (and none finishes), with nobody to admit."""
        if len(self.flights) != OVERLAP_DEPTH or done.finishing or not done.placeholders:
            return False
        newest = self.flights[-1]
        running = self.running
        return (
            not newest.finishing
            and len(newest.rows) == len(newest.samples) == len(running)
            and all(a is b for a, b in zip(newest.samples, running, strict=True))
            and len(running) <= self.config.token_budget
            and not self.would_admit()
        )

    def decode_overlapped(self, done: _Flight) -> bool:
        """Commit ``done``, resolve its tokens, append the placeholders of the step in flight,
        schedule one token each and plan, in one ``decode_step_overlapped`` call."""
        self.flights.popleft()
        assert done.result is not None
        newest = self.flights[-1]
        ids = np.fromiter((seq.seq_id for seq in self.running), dtype=np.uint64)
        resolve = np.fromiter((seq.seq_id for seq in done.samples), dtype=np.uint64)
        tokens = np.asarray(done.result.sampled, dtype=np.uint32)
        buffers = self.free_buffers()
        scheduled = self.manager.decode_step_overlapped(
            buffers, ids, resolve_ids=resolve, tokens=tokens, commit=done.step_id
        )
        self.took_tokens(done, resolved=True)
        newest.placeholders = True
        for seq in self.running:
            seq.placeholders += 1
        self.result.decode_steps += 1
        fell_back = not bool((scheduled == 1).all())
        if fell_back:
            # Out of blocks for some sequence: the plan holds the others; the rest are
            # scheduled the general way in a later step.
            self.result.decode_fallbacks += 1
        for seq, count in zip(self.running, scheduled.tolist(), strict=True):
            if count == 1:
                seq.planned += 1
        return self.submit_plan(buffers)

    # --- scheduling ---------------------------------------------------------------------------

    def append_placeholders(self) -> None:
        """Placeholders for the samples of the newest step in flight that do not finish."""
        if not self.flights or self.flights[-1].placeholders:
            return
        newest = self.flights[-1]
        newest.placeholders = True
        samples = [seq for seq in newest.samples if seq.seq_id not in newest.finishing]
        if samples:
            self.manager.append_placeholders(
                np.fromiter((seq.seq_id for seq in samples), dtype=np.uint64)
            )
            for seq in samples:
                seq.placeholders += 1

    def position(self, seq: _Sequence) -> int:
        """Where the sequence's next chunk starts: after its latest chunk in flight, or at
        what the manager has committed."""
        return seq.planned if seq.in_flight else self.manager.num_computed(seq.seq_id)

    def schedule(self) -> list[_Sequence]:
        """Schedule this step's sequences (running ones first, then admissions); with a plan
        in flight, a sequence the pools cannot serve ends the step's scheduling instead of
        preempting (a preempted sequence in flight would keep its blocks until its step
        ends)."""
        manager = self.manager
        budget = self.config.token_budget
        scheduled: list[_Sequence] = []
        preemptions = self.result.preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            remaining = len(seq.tokens) + seq.placeholders - self.position(seq)
            if remaining <= 0:  # its last output is being sampled
                index += 1
                continue
            if self.flights:
                result = manager.schedule(seq.seq_id, min(remaining, budget))
                if result is None:
                    return scheduled  # short of blocks: admit nobody, preempt once nothing flies
            else:
                result = self.schedule_preempting(seq, min(remaining, budget))
            if result is None:
                break
            if result.num_tokens > 0:
                budget -= result.num_tokens
                seq.planned = result.num_computed + result.num_tokens
                scheduled.append(seq)
            index += 1
        if self.result.preemptions != preemptions:
            return scheduled  # memory is short: admit nobody in a step that had to preempt
        held: list[_Sequence] = []
        while (
            self.waiting and budget > 0 and len(self.running) + len(held) < self.config.max_running
        ):
            seq = self.waiting[0]
            hit = manager.lookup(seq.seq_id)
            if hit.tokens and not self.engine.policy.caches_prefixes:
                raise EngineError(
                    f"sequence {seq.seq_id} hit {hit.tokens} tokens under policy 'none'"
                )
            pending = int(hit.pending_tokens) - int(hit.tokens)
            if self.config.hold_pending and hit.pending_plan is not None and pending > 0:
                # A plan in flight computes a longer prefix of it: wait for that instead of
                # recomputing it (the plan is the oldest or the next one: a step or two). The
                # requests behind it may be admitted meanwhile; a held one takes a running
                # place in this count, so a step looks up at most max_running requests.
                self.result.holds += 1
                if not seq.held:
                    seq.held = True
                    self.result.held_requests += 1
                    self.result.held_pending_tokens += pending
                held.append(self.waiting.popleft())
                continue
            remaining = len(seq.tokens) - int(hit.tokens)
            result = manager.schedule(seq.seq_id, min(remaining, budget))
            if result is None or result.num_tokens == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            budget -= result.num_tokens
            seq.planned = result.num_computed + result.num_tokens
            scheduled.append(seq)
        self.waiting.extendleft(reversed(held))  # in their places, ahead of the rest
        return scheduled

    def preempt(self, seq: _Sequence) -> None:
        assert not seq.in_flight and not seq.placeholders, "preempted only with nothing in flight"
        super().preempt(seq)

    def free_buffers(self) -> pc.PlanBuffers:
        """The buffers of the ring that no plan in flight holds."""
        held = {id(flight.buffers) for flight in self.flights}
        for buffers in self.ring:
            if id(buffers) not in held:
                return buffers
        raise EngineError("every plan buffer holds a plan in flight")  # a bug: at most D

    # --- launching ----------------------------------------------------------------------------

    def launch(self) -> bool:
        """Build the scheduled step into the free buffers and submit it."""
        buffers = self.free_buffers()
        self.manager.build_plan_into(buffers)
        return self.submit_plan(buffers)

    def submit_plan(self, buffers: pc.PlanBuffers) -> bool:
        """Apply the plan ``buffers`` hold to the block tables, prepare its inputs (holes for
        the tokens being sampled) and submit its forward; returns True."""
        count = buffers.num_rows
        step_id = buffers.step_id
        assert step_id is not None
        rows = [self.live[seq_id] for seq_id in buffers.seq_ids[:count].tolist()]
        try:
            self.tables.apply_plan(buffers)
        except Exception:
            self.abort_all()  # a plan the tables refuse is a bug: it propagates
            raise
        if self.config.check:
            self.check(rows)
        num_computed = buffers.num_computed[:count].tolist()
        num_scheduled = buffers.num_scheduled[:count].tolist()
        query_end = buffers.query_start_loc[1 : count + 1].tolist()
        pieces: list[np.ndarray] = []
        holes: dict[int, tuple[list[int], list[int]]] = {}  # step id -> positions, samples
        logits_indices: list[int] = []
        samples: list[_Sequence] = []
        finishing: set[int] = set()
        prefill: list[bool] = []
        for seq, start, scheduled_, last in zip(
            rows, num_computed, num_scheduled, query_end, strict=True
        ):
            end = start + scheduled_
            known = len(seq.tokens)
            pieces.append(seq.tokens.span(start, end))
            if end > known:
                # The tokens past the known ones are placeholders: each is the sample of the
                # step in flight that holds the sequence's oldest unresolved sample.
                source = self.sample_source(seq, end - max(start, known))
                for (source_step, index), position in zip(
                    source, range(max(start, known), end), strict=True
                ):
                    positions, indices = holes.setdefault(source_step, ([], []))
                    positions.append(last - end + position)
                    indices.append(index)
                pieces.append(np.zeros(end - max(start, known), dtype=np.int64))
            prefill.append(seq.prefilling and not seq.samples_in_flight)
            seq.in_flight += 1
            if end == known + seq.placeholders:
                logits_indices.append(last - 1)
                samples.append(seq)
                seq.samples_in_flight += 1
                if len(seq.outputs) + seq.samples_in_flight >= seq.request.output_len:
                    finishing.add(seq.seq_id)
        future = None
        if count:
            step = Step.from_plan(buffers, [self.tables])
            job = ForwardJob(
                step_id=step_id,
                step=step,
                token_ids=torch.from_numpy(np.concatenate(pieces)),
                fills=[
                    (
                        source_step,
                        np.asarray(positions, dtype=np.int64),
                        np.asarray(indices, dtype=np.int64),
                    )
                    for source_step, (positions, indices) in holes.items()
                ],
                logits_indices=np.asarray(logits_indices, dtype=np.int64),
                timed=any(prefill),
            )
            future = self.worker.submit(job)
        flight = _Flight(
            step_id=step_id,
            buffers=buffers,
            rows=rows,
            num_computed=num_computed,
            num_scheduled=num_scheduled,
            prefill=prefill,
            samples=samples,
            finishing=finishing,
            future=future,
        )
        if future is None:  # an empty plan (every decode out of blocks): nothing to run
            flight.result = ForwardResult(
                step_id=step_id,
                sampled_ids=torch.zeros(0, dtype=torch.int64),
                logits_host=torch.zeros((0, 0)),
                seconds=0.0,
                kda_seconds=0.0,
                underruns=0,
            ).materialize()
        self.flights.append(flight)
        return True

    def sample_source(self, seq: _Sequence, count: int) -> list[tuple[int, int]]:
        """``(step id, sample index)`` of the ``count`` newest placeholders of ``seq``."""
        found: list[tuple[int, int]] = []
        for flight in reversed(self.flights):
            if flight.placeholders and seq.seq_id not in flight.finishing:
                index = flight.sample_index.get(seq.seq_id)
                if index is not None:
                    found.append((flight.step_id, index))
            if len(found) == count:
                return found[::-1]
        raise EngineError(
            f"sequence {seq.seq_id}: {count} placeholder(s) scheduled but no step in flight "
            f"samples them"
        )

    # --- ending steps -------------------------------------------------------------------------

    def wait_oldest(self) -> None:
        """Wait for the oldest step in flight; on a failure abort it and every later one."""
        flight = self.flights[0]
        assert flight.future is not None
        started = time.perf_counter()
        try:
            flight.result = flight.future.result().materialize()
        except Exception as error:
            self.result.wait_seconds += time.perf_counter() - started
            self.failed(flight, error)
            return
        self.result.wait_seconds += time.perf_counter() - started
        self.result.forward_seconds += flight.result.seconds

    def failed(self, flight: _Flight, error: Exception) -> None:
        """The oldest step's forward raised: abort it and the later plans, collect their
        forwards (skipped), roll both back from the block tables."""
        flights = list(self.flights)
        self.flights.clear()
        ended = self.manager.abort(flight.buffers)
        if ended != [f.step_id for f in flights]:
            raise EngineError(f"abort of step {flight.step_id} ended {ended}, not {flights}")
        self.collect(flights[1:])
        self.tables.rollback(len(flights))
        self.forget(flights)
        self.result.aborted_steps += 1
        self.result.cascaded_aborts += len(flights) - 1
        self.failures += 1
        if self.config.check:
            self.check([seq for f in flights for seq in f.rows])
        if self.failures > self.config.max_step_retries:
            raise error
        logger.warning(
            "step %s failed (%s: %s); aborted with %d later step(s), the sequences will be "
            "rescheduled",
            flight.step_id,
            type(error).__name__,
            error,
            len(flights) - 1,
        )

    def forget(self, flights: list[_Flight]) -> None:
        """The engine's view of the sequences of aborted plans: nothing in flight, and the
        placeholders the manager kept (it rewinds those appended since the oldest plan)."""
        for seq in {id(s): s for f in flights for s in f.rows}.values():
            seq.in_flight = 0
            seq.samples_in_flight = 0
            if seq.seq_id in self.live:
                seq.placeholders = self.manager.num_placeholders(seq.seq_id)

    def abort_all(self) -> None:
        """Abort every plan in flight (after a bug: the error propagates)."""
        if self.flights:
            flights = list(self.flights)
            self.flights.clear()
            self.manager.abort(flights[0].buffers)
            self.collect(flights)

    def collect(self, flights: list[_Flight]) -> None:
        """Wait until the worker is done with aborted plans (each ran, failed or was
        skipped), then let it run new ones."""
        for flight in flights:
            if flight.future is not None:
                with contextlib.suppress(Exception):
                    flight.future.result()
        self.worker.recover()

    def end_step(self, flight: _Flight) -> None:
        """Commit the oldest step, take its tokens (resolving the placeholders), finish the
        sequences that got their last output."""
        self.manager.commit(flight.buffers)
        finished = self.took_tokens(flight, resolved=False)
        for seq in finished:
            self.finish(seq)
        if self.config.check:
            self.check(flight.rows)

    def took_tokens(self, flight: _Flight, *, resolved: bool) -> list[_Sequence]:
        """Account a committed step; give each sample to its sequence (``resolve`` of its
        placeholder unless ``resolved``: the fast path's call did it). Returns the sequences
        that got their last output (to finish)."""
        result = flight.result
        assert result is not None and result.logits is not None
        self.failures = 0
        self.result.steps += bool(flight.rows)
        self.result.kda_timing_underruns += result.underruns
        total_tokens = max(1, sum(flight.num_scheduled))
        for seq, start, count, prefill in zip(
            flight.rows, flight.num_computed, flight.num_scheduled, flight.prefill, strict=True
        ):
            seq.in_flight -= 1
            if seq.hit_tokens is None:
                seq.hit_tokens = start
            if prefill:
                share = count / total_tokens
                seq.computed_prefill_tokens += count
                seq.prefill_seconds += result.seconds * share
                seq.kda_prefill_seconds += result.kda_seconds * share
        now = self.now()
        finished: list[_Sequence] = []
        resolve: list[_Sequence] = []
        for index, seq in enumerate(flight.samples):
            token = result.sampled[index]
            seq.final_logits = result.logits[index]
            seq.margins.append(_margin(result.logits[index]))
            seq.samples_in_flight -= 1
            seq.prefilling = False
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.outputs.append(token)
            seq.tokens.append(token)
            if seq.seq_id in flight.finishing:
                finished.append(seq)
            else:
                resolve.append(seq)
        if resolve and flight.placeholders:
            for seq in resolve:
                seq.placeholders -= 1
            if not resolved:
                self.manager.resolve_batch(
                    np.fromiter((seq.seq_id for seq in resolve), dtype=np.uint64),
                    np.fromiter((seq.tokens.last() for seq in resolve), dtype=np.uint32),
                )
        elif resolve:
            self.manager.append_batch(
                np.fromiter((seq.seq_id for seq in resolve), dtype=np.uint64),
                np.fromiter((seq.tokens.last() for seq in resolve), dtype=np.uint32),
            )
        return finished

    def check(self, rows: list[_Sequence]) -> None:
        """The base checks, and each live sequence's placeholders against the manager's."""
        super().check(rows)
        for seq in rows:
            if seq.seq_id in self.live:
                theirs = self.manager.num_placeholders(seq.seq_id)
                if seq.placeholders != theirs:
                    raise EngineError(
                        f"sequence {seq.seq_id}: {seq.placeholders} placeholders in the "
                        f"engine, {theirs} in the manager"
                    )
