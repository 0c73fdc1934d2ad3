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
3. ``build_plan`` -> copy-on-write copies -> model forward -> snapshots -> ``commit``. If any of
   these raises, the step is aborted (``abort``: nothing is published, every sequence is back at
   its pre-step position) and the engine's own bookkeeping is rolled back, then the loop goes on
   and schedules the same sequences again (up to ``max_step_retries`` consecutive failures).
4. After the commit: each sequence whose known tokens are all computed gets a greedy token
   (``append``), the first one fixing its time to first token; a sequence with all its output
   tokens is finished (``finish``), and the workload may release follow-up requests.

The engine keeps its own block table per sequence, updated from the plan's ``appended`` /
``replaced`` entries (undone on abort), and reads the KDA slots and checkpoints from the plan's
state group. Time is the wall clock, except that an idle engine jumps to the next arrival
instead of sleeping.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import prefixcache as pc

from ..kernels import apply_copies, apply_snapshots
from ..models import HybridModel, ModelCaches, StepInputs
from .policy import PAGED_GROUP, STATE_GROUP, Policy
from .results import RequestResult, RunResult
from .workloads import Request, Workload

__all__ = ["Engine", "EngineConfig", "EngineError", "ForwardFn", "PoolTooSmallError"]

logger = logging.getLogger("prefixcache.engine")

ForwardFn = Callable[[StepInputs, ModelCaches], torch.Tensor]


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
        check: after every commit, compare the engine's block tables with the manager's and
            run the manager's invariant checks (slow; for tests).
    """

    token_budget: int
    max_running: int
    paged_blocks: int
    state_blocks: int
    checkpoint_cap: int | None = None
    max_step_retries: int = 3
    check: bool = False

    def __post_init__(self) -> None:
        if min(self.token_budget, self.max_running) < 1:
            raise ValueError("token_budget and max_running must be >= 1")
        if min(self.paged_blocks, self.state_blocks) < 2:
            raise ValueError("paged_blocks and state_blocks must be >= 2 (block 0 is null)")
        if self.max_step_retries < 0:
            raise ValueError("max_step_retries must be >= 0")


@dataclass(eq=False)
class _Sequence:
    """The engine's view of one request while it is live."""

    request: Request
    tokens: list[int]
    arrival: float
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    started: bool = False
    prefilling: bool = True
    table: list[int] = field(default_factory=list)
    hit_tokens: int | None = None
    computed_prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    kda_prefill_seconds: float = 0.0
    first_token_time: float | None = None
    final_logits: np.ndarray | None = None
    margins: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def seq_id(self) -> int:
        return self.request.request_id


@dataclass
class _TableUndo:
    """How to take back one step's block-table updates."""

    entries: list[tuple[_Sequence, int, int]] = field(default_factory=list)  # seq, column, old
    lengths: list[tuple[_Sequence, int]] = field(default_factory=list)  # seq, length before

    def rollback(self) -> None:
        for seq, length in self.lengths:
            del seq.table[length:]
        for seq, column, old in reversed(self.entries):
            seq.table[column] = old


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
        forward: the step function, ``model.forward`` by default (tests wrap it to inject
            failures).
    """

    def __init__(
        self,
        model: HybridModel,
        policy: Policy,
        config: EngineConfig,
        *,
        forward: ForwardFn | None = None,
    ) -> None:
        alignment = model.backend.checkpoint_alignment
        if config.token_budget < alignment:
            raise ValueError(
                f"token_budget {config.token_budget} is below the kernel's checkpoint alignment "
                f"{alignment}: non-final prefill chunks end on multiples of it, so no chunk "
                f"could ever be scheduled; raise the budget to at least {alignment}"
            )
        self.model = model
        self.policy = policy
        self.config = config
        self.forward: ForwardFn = model.forward if forward is None else forward

    def manager_config(self) -> pc.CacheConfig:
        """The cache manager's configuration for this engine."""
        return self.policy.cache_config(
            self.model.backend,
            paged_blocks=self.config.paged_blocks,
            state_blocks=self.config.state_blocks,
            checkpoint_cap=self.config.checkpoint_cap,
        )

    def run(
        self,
        workload: Workload,
        *,
        on_finished: Callable[[RequestResult], None] | None = None,
    ) -> RunResult:
        """Serve every request of ``workload``; ``on_finished`` is called per finished request."""
        loop = _Loop(self, workload, on_finished)
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
        block_size = engine.policy.block_size
        self.caches = self.model.allocate_caches(
            paged_blocks=self.config.paged_blocks,
            block_size=block_size,
            state_blocks=self.config.state_blocks,
        )
        self.block_size = block_size
        self.result = RunResult(policy=engine.policy.name)
        self.pending: list[tuple[float, int, Request]] = []
        self.handed: list[Request] = []  # follow-ups arriving "now"
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
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
            self.manager.add(
                request.request_id, request.prompt.astype(np.uint32), extends=request.extends
            )
            tokens: list[int] = request.prompt.tolist()
            self.waiting.append(_Sequence(request=request, tokens=tokens, arrival=arrival))

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
            if self.step():
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

    def schedule(self) -> list[_Sequence]:
        """Schedule this step's sequences; returns them in schedule order."""
        manager = self.manager
        budget = self.config.token_budget
        scheduled: list[_Sequence] = []
        preemptions = self.result.preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            remaining = len(seq.tokens) - seq.num_computed
            result = manager.schedule(seq.seq_id, min(remaining, budget))
            while result is None:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
                result = manager.schedule(seq.seq_id, min(remaining, budget))
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
            remaining = len(seq.tokens) - int(hit.tokens)
            result = manager.schedule(seq.seq_id, min(remaining, budget))
            if result is None or result.num_tokens == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            budget -= result.num_tokens
            scheduled.append(seq)
        return scheduled

    def preempt(self, seq: _Sequence) -> None:
        """Release a running sequence's blocks; it is recomputed from a fresh lookup later."""
        self.manager.preempt(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.started = False
        seq.prefilling = True
        seq.table = []
        seq.preemptions += 1
        self.result.preemptions += 1
        self.waiting.appendleft(seq)

    def step(self) -> bool:
        """One engine step; returns whether anything was scheduled."""
        scheduled = self.schedule()
        if not scheduled:
            return False
        by_id = {seq.seq_id: seq for seq in scheduled}
        plan = self.manager.build_plan()
        rows = [by_id[int(seq_id)] for seq_id in plan.seq_ids]
        undo = _TableUndo()
        kda_timer = self.model.kda_timer
        # Only prefill rows are charged KDA time: a decode-only step runs untimed.
        kda_timer.enabled = any(seq.prefilling for seq in rows)
        underruns = kda_timer.underruns
        try:
            inputs = self.prepare(plan, rows, undo)
            kda_timer.take()
            started = time.perf_counter()
            apply_copies(plan.copies, {PAGED_GROUP: self.caches.kv})
            logits = self.engine.forward(inputs, self.caches)
            apply_snapshots(self.caches.states, plan.state_group(STATE_GROUP).snapshots)
            sampled = self.model.sample(logits)
            logits_host = logits.detach().to("cpu", torch.float32).numpy()
        except Exception as error:
            self.manager.abort(plan)
            undo.rollback()
            self.result.aborted_steps += 1
            self.failures += 1
            if self.failures > self.config.max_step_retries:
                raise
            logger.warning(
                "step %d failed (%s: %s); aborted, the %d sequence(s) will be rescheduled",
                plan.step_id,
                type(error).__name__,
                error,
                len(rows),
            )
            return True
        self.manager.commit(plan)
        self.failures = 0
        seconds = time.perf_counter() - started
        kda_seconds = kda_timer.take()
        self.result.kda_timing_underruns += kda_timer.underruns - underruns
        self.result.steps += 1
        self.after_commit(plan, rows, sampled, logits_host, seconds, kda_seconds)
        return True

    def prepare(self, plan: pc.StepPlan, rows: list[_Sequence], undo: _TableUndo) -> StepInputs:
        """Block tables updated from the plan (undoably) and the model's step inputs."""
        num_computed = np.asarray(plan.num_computed, dtype=np.int64)
        num_scheduled = np.asarray(plan.num_scheduled, dtype=np.int64)
        for row, seq in enumerate(rows):
            if seq.started and int(num_computed[row]) != seq.num_computed:
                raise EngineError(
                    f"sequence {seq.seq_id}: the plan resumes at {int(num_computed[row])} but "
                    f"the engine computed {seq.num_computed} tokens"
                )
        undo.lengths = [(seq, len(seq.table)) for seq in rows]
        lengths_before = [len(seq.table) for seq in rows]
        paged = plan.paged_group(PAGED_GROUP)
        for updates in (paged.appended, paged.replaced):
            for row, column, block in np.asarray(updates, dtype=np.int64).reshape(-1, 3).tolist():
                seq = rows[row]
                if column < lengths_before[row]:
                    undo.entries.append((seq, column, seq.table[column]))
                elif column >= len(seq.table):
                    seq.table.extend([0] * (column + 1 - len(seq.table)))
                seq.table[column] = block
        seq_lens = num_computed + num_scheduled
        width = max(len(seq.table) for seq in rows)
        block_tables = np.zeros((len(rows), width), dtype=np.int32)
        token_ids: list[int] = []
        logits_indices: list[int] = []
        query_start_loc = np.asarray(plan.query_start_loc)
        for row, seq in enumerate(rows):
            block_tables[row, : len(seq.table)] = seq.table
            start, end = int(num_computed[row]), int(seq_lens[row])
            token_ids.extend(seq.tokens[start:end])
            if end == len(seq.tokens):
                logits_indices.append(int(query_start_loc[row + 1]) - 1)
        state = plan.state_group(STATE_GROUP)
        return StepInputs(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.model.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=np.asarray(paged.slot_mapping),
            block_tables=block_tables,
            initial_slot=np.asarray(state.initial_slot),
            running_slot=np.asarray(state.running_slot),
            checkpoint_offsets=np.asarray(state.checkpoint_offsets),
            checkpoint_slots=np.asarray(state.checkpoint_slots),
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
        )

    def after_commit(
        self,
        plan: pc.StepPlan,
        rows: list[_Sequence],
        sampled: list[int],
        logits: np.ndarray,
        seconds: float,
        kda_seconds: float,
    ) -> None:
        """Advance the sequences, sample, append, finish (the step is committed)."""
        num_computed = np.asarray(plan.num_computed).tolist()
        num_scheduled = np.asarray(plan.num_scheduled).tolist()
        total_tokens = max(1, sum(num_scheduled))
        now = self.now()
        appended_ids: list[int] = []
        appended_tokens: list[int] = []
        finished: list[_Sequence] = []
        sample_index = 0
        for row, seq in enumerate(rows):
            start, count = int(num_computed[row]), int(num_scheduled[row])
            if not seq.started:
                seq.started = True
                if seq.hit_tokens is None:
                    seq.hit_tokens = start
                if start and not self.engine.policy.caches_prefixes:
                    raise EngineError(
                        f"sequence {seq.seq_id} hit {start} tokens under policy 'none'"
                    )
            if seq.prefilling:
                share = count / total_tokens
                seq.computed_prefill_tokens += count
                seq.prefill_seconds += seconds * share
                seq.kda_prefill_seconds += kda_seconds * share
            seq.num_computed = start + count
            if seq.num_computed < len(seq.tokens):
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
                appended_ids.append(seq.seq_id)
                appended_tokens.append(token)
        if appended_ids:
            self.manager.append_batch(
                np.asarray(appended_ids, dtype=np.uint64),
                np.asarray(appended_tokens, dtype=np.uint32),
            )
        for seq in finished:
            self.finish(seq)
        if self.config.check:
            self.check(rows)

    def finish(self, seq: _Sequence) -> None:
        """Finish a sequence (its last token appended first, so ``extends`` sees it)."""
        self.manager.append(seq.seq_id, np.asarray(seq.outputs[-1:], dtype=np.uint32))
        self.manager.finish(seq.seq_id)
        self.running.remove(seq)
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
        """Compare the engine's block tables with the manager's; run its invariant checks."""
        live = [seq for seq in rows if seq in self.running]
        if live:
            tables = np.asarray(self.manager.block_table(PAGED_GROUP, [seq.seq_id for seq in live]))
            for row, seq in enumerate(live):
                expected = [int(b) for b in tables[row]]
                while expected and expected[-1] == 0:  # null padding of shorter rows
                    expected.pop()
                if expected != seq.table:
                    raise EngineError(
                        f"sequence {seq.seq_id}: engine block table {seq.table} differs from "
                        f"the manager's {expected}"
                    )
        self.manager.check_invariants()
