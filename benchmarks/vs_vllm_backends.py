"""The two managers of the vLLM comparison behind one scheduler-facing interface.

``benchmarks/vs_vllm.py`` runs one scheduler loop and asks a :class:`Backend` to admit a
request, extend a running prefill, schedule a batch of decodes, close a step, append sampled
tokens and finish a request. Each backend makes exactly the manager calls its engine makes for
that and times each of them with ``time.perf_counter`` (the loop's own bookkeeping is not
timed):

- :class:`VllmBackend`: vLLM 0.33.0's ``KVCacheManager`` built directly on the CPU, as vLLM's
  own unit tests build it (``KVCacheConfig`` + ``KVCacheGroupSpec`` + ``FullAttentionSpec`` /
  ``MambaSpec(mamba_cache_mode="align")``). Calls, as ``vllm.v1.core.sched.Scheduler`` makes
  them: request block hashing (``Request.update_block_hashes``), ``get_computed_blocks``,
  ``allocate_slots``, the block ids of what was allocated (``get_block_ids`` /
  ``get_blocks``, which the scheduler turns into its output), ``new_step_starts``, the
  per-step drains (``take_boundary_state_offloads``, ``take_kv_cache_block_copies`` and the
  release of the copy sources, ``take_new_block_ids``), ``append_output_token_ids`` (which
  hashes new full blocks) and ``free``. Chunk ends of the hybrid configuration come from the
  scheduler's own ``_mamba_block_aligned_split`` (untimed: it is scheduler policy).
- :class:`PrefixcacheBackend`: ``prefixcache.CacheManager``: ``add_batch`` of a step's arrivals
  (hashing, across cores), ``lookup``,
  ``schedule`` (admissions, prefill chunks), ``decode_step`` for a step that only decodes
  (commit of the previous step, append, schedule and plan in one call), otherwise
  ``commit`` + ``append_batch`` + ``schedule_tokens`` + ``build_plan_into`` (the plan written
  into the engine's persistent ``PlanBuffers``), reading the plan's block counts and arrays
  (``read_plan``: what vLLM's scheduler takes from its manager as block ids), ``finish``.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
from vs_vllm_workloads import Request, Workload

if TYPE_CHECKING:
    import prefixcache as pc

perf_counter = time.perf_counter
T = TypeVar("T")


@dataclass(frozen=True)
class ManagerConfig:
    """One cache geometry, built the same way in both managers.

    Attributes:
        name: the configuration's name in reports.
        kind: ``"attention"`` (one full-attention group) or ``"hybrid"`` (full attention and
            a recurrent-state group: vLLM's Mamba in align mode, prefixcache's state group).
        block_size: tokens per attention block (and per Mamba block in vLLM).
        unit: the hash unit (vLLM's ``hash_block_size``).
        hash: ``"sha256"`` or ``"xxh3_128"`` (vLLM: ``sha256`` / ``xxhash``, both of a pickle).
        reuse: prefixcache only: ``add(..., extends=...)`` reuses the hashes of the request the
            workload names (the previous round of the stream, or the latest request with the
            same system prompt).
        live_prefixes: prefixcache only: ``CacheConfig.reuse_live_prefixes`` (an ``add``
            without ``extends`` reuses the hashes of a live request with the same prefix). Off
            in the runs without reuse, so that every prompt is hashed in full as vLLM does.
    """

    name: str
    kind: Literal["attention", "hybrid"]
    block_size: int
    unit: int
    hash: Literal["sha256", "xxh3_128"]
    reuse: bool = False
    live_prefixes: bool = False

    def attention_blocks(self, workload: Workload) -> int:
        """Attention blocks for twice the running sequences' worth (running + cached)."""
        per_sequence = math.ceil(workload.prompt_tokens() / self.block_size) + 1
        return 2 * workload.shape.max_running * per_sequence + 64


class Backend(ABC):
    """What the scheduler loop asks of a manager; every manager call is timed."""

    label: str

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def start_step(self) -> None:  # noqa: B027 (optional hook: most managers need nothing)
        """Opens a scheduler step."""

    def add(self, request: Request) -> None:  # noqa: B027 (a manager that hashes nothing)
        """Takes in one arrived request (hashes its prompt, where the manager does)."""

    def add_batch(self, requests: list[Request]) -> None:
        """Takes in the requests that arrived for this step, in order (``add`` of each, unless
        the manager has a call for several)."""
        for request in requests:
            self.add(request)

    @abstractmethod
    def admit(self, request: Request, budget: int) -> tuple[int, int] | None:
        """Looks the request up and schedules its first chunk: ``(hit, tokens)``, or ``None``
        when the manager has no blocks for it (it stays waiting). ``tokens`` may be 0 (the
        chunk rounding left nothing); the request then waits with its lookup done."""
        ...

    @abstractmethod
    def schedule_prefill(self, request: Request, budget: int) -> int:
        """Schedules the next chunk of a running prefill; returns its tokens (may be 0)."""
        ...

    @abstractmethod
    def schedule_decodes(self, requests: list[Request]) -> None:
        """Schedules one token for each decoding request."""
        ...

    @abstractmethod
    def end_step(self, scheduled: list[tuple[Request, int]]) -> None:
        """Closes a step in which ``scheduled`` ran (the forward happens here)."""
        ...

    @abstractmethod
    def append(self, requests: list[Request], tokens: list[int]) -> None:
        """Appends one sampled token to each request."""
        ...

    @abstractmethod
    def finish(self, request: Request) -> None: ...

    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class VllmBackend(Backend):
    """vLLM 0.33.0's ``KVCacheManager``, driven as its scheduler drives it."""

    label = "vllm"

    def __init__(self, config: ManagerConfig, workload: Workload) -> None:
        super().__init__()
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256, xxhash
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
        )
        from vllm.v1.request import Request as VllmRequest
        from vllm.v1.request import RequestStatus

        hash_fn = sha256 if config.hash == "sha256" else xxhash
        init_none_hash(hash_fn)
        block = config.block_size
        groups = [
            KVCacheGroupSpec(
                ["attention"],
                FullAttentionSpec(
                    block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ]
        num_blocks = config.attention_blocks(workload)
        if config.kind == "hybrid":
            groups.append(
                KVCacheGroupSpec(
                    ["mamba"],
                    MambaSpec(
                        block_size=block,
                        shapes=((1, 1),),
                        dtypes=(torch.float32,),
                        mamba_cache_mode="align",
                    ),
                )
            )
            # One pool for both groups (vLLM's unified hybrid allocator).
            num_blocks = 2 * num_blocks + 1024
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.max_model_len = workload.prompt_tokens() + block
        self.manager = KVCacheManager(
            kv_cache_config,
            max_model_len=self.max_model_len,
            scheduler_block_size=block,
            hash_block_size=config.unit,
            enable_caching=True,
        )
        self.hybrid = config.kind == "hybrid"
        if self.hybrid:
            assert self.manager.coordinator.enable_partial_hash_hits, (
                "vLLM did not enable partial (hash-unit) hits for the hybrid configuration"
            )
        self.hasher = get_request_block_hasher(config.unit, hash_fn)
        self.request_cls = VllmRequest
        self.running_status = RequestStatus.RUNNING
        self.finished_status = RequestStatus.FINISHED_STOPPED
        self.sampling_params: dict[int, Any] = {}
        self.make_sampling_params = SamplingParams
        self.requests: dict[int, Any] = {}
        self.running_ids: set[int] = set()
        # The scheduler's chunk rule for Mamba "align" (attributes it reads, as the
        # Scheduler sets them for this configuration).
        self.split = Scheduler._mamba_block_aligned_split
        self.split_self = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=block),
            block_size=block,
            hash_block_size=config.unit,
            mamba_partial_cache_hit=self.hybrid and config.unit < block,
            use_eagle_block_drop=False,
            num_hash_lookahead_tokens=0,
            mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None,
            max_num_scheduled_tokens=workload.shape.token_budget,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
            mamba_shared_prefix_checkpoint=False,
        )

    def _vllm_request(self, request: Request) -> Any:
        existing = self.requests.get(request.request_id)
        if existing is not None:
            return existing
        params = self.make_sampling_params(max_tokens=len(request.output))
        params.update_from_generation_config({}, eos_token_id=None)
        vllm_request = self.request_cls(
            str(request.request_id), request.prompt.tolist(), params, None, block_hasher=None
        )
        # Hashing is timed on its own below (the engine hashes when a request arrives).
        vllm_request._block_hasher = self.hasher
        self.requests[request.request_id] = vllm_request
        seconds = self.seconds
        t0 = perf_counter()
        vllm_request.update_block_hashes()
        seconds["hash"] += perf_counter() - t0
        self.calls["hash"] += 1
        return vllm_request

    def add(self, request: Request) -> None:
        self._vllm_request(request)

    def _split(self, vllm_request: Any, tokens: int, hit: int = 0) -> int:
        if not self.hybrid:
            return tokens
        return int(self.split(self.split_self, vllm_request, tokens, hit, 0))

    def admit(self, request: Request, budget: int) -> tuple[int, int] | None:
        vllm_request = self._vllm_request(request)
        manager = self.manager
        seconds = self.seconds
        t0 = perf_counter()
        blocks, hit, shared_prefix_boundary = manager.get_computed_blocks(vllm_request)
        seconds["get_computed_blocks"] += perf_counter() - t0
        self.calls["get_computed_blocks"] += 1
        vllm_request.shared_prefix_boundary = shared_prefix_boundary
        tokens = min(vllm_request.num_tokens - hit, budget)
        tokens = self._split(vllm_request, tokens, hit)
        if tokens == 0:
            return hit, 0
        t0 = perf_counter()
        new_blocks = manager.allocate_slots(
            vllm_request,
            tokens,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            has_scheduled_reqs=bool(self.running_ids),
        )
        seconds["allocate_slots"] += perf_counter() - t0
        self.calls["allocate_slots"] += 1
        if new_blocks is None:
            return None
        t0 = perf_counter()
        manager.get_blocks(vllm_request.request_id).get_block_ids()
        seconds["block_ids"] += perf_counter() - t0
        self.calls["block_ids"] += 1
        vllm_request.status = self.running_status
        vllm_request.num_computed_tokens = hit
        self.running_ids.add(request.request_id)
        return hit, tokens

    def _allocate_running(self, vllm_request: Any, tokens: int) -> None:
        seconds = self.seconds
        t0 = perf_counter()
        new_blocks = self.manager.allocate_slots(vllm_request, tokens)
        t1 = perf_counter()
        if new_blocks is None:
            raise RuntimeError("vLLM ran out of blocks: the pool is sized too small")
        new_blocks.get_block_ids(allow_none=True)
        t2 = perf_counter()
        seconds["allocate_slots"] += t1 - t0
        seconds["block_ids"] += t2 - t1
        self.calls["allocate_slots"] += 1
        self.calls["block_ids"] += 1

    def schedule_prefill(self, request: Request, budget: int) -> int:
        vllm_request = self.requests[request.request_id]
        tokens = min(vllm_request.num_tokens - vllm_request.num_computed_tokens, budget)
        tokens = self._split(vllm_request, tokens)
        if tokens > 0:
            self._allocate_running(vllm_request, tokens)
        return tokens

    def schedule_decodes(self, requests: list[Request]) -> None:
        for request in requests:
            self._allocate_running(self.requests[request.request_id], 1)

    def start_step(self) -> None:
        t0 = perf_counter()
        self.manager.new_step_starts()
        self.seconds["step"] += perf_counter() - t0
        self.calls["step"] += 1

    def end_step(self, scheduled: list[tuple[Request, int]]) -> None:
        manager = self.manager
        t0 = perf_counter()
        manager.take_boundary_state_offloads()
        copies, retained = manager.take_kv_cache_block_copies()
        if copies:
            manager.block_pool.free_blocks(retained)
        manager.take_new_block_ids()
        self.seconds["step"] += perf_counter() - t0
        for request, tokens in scheduled:
            vllm_request = self.requests[request.request_id]
            vllm_request.num_computed_tokens += tokens
            vllm_request.is_prefill_chunk = (
                vllm_request.num_computed_tokens < vllm_request.num_tokens
            )

    def append(self, requests: list[Request], tokens: list[int]) -> None:
        seconds = self.seconds
        vllm_requests = [self.requests[r.request_id] for r in requests]
        for vllm_request, token in zip(vllm_requests, tokens, strict=True):
            t0 = perf_counter()
            vllm_request.append_output_token_ids(token)
            seconds["append_output_token_ids"] += perf_counter() - t0
        self.calls["append_output_token_ids"] += len(requests)

    def finish(self, request: Request) -> None:
        vllm_request = self.requests.pop(request.request_id)
        vllm_request.status = self.finished_status
        self.running_ids.discard(request.request_id)
        t0 = perf_counter()
        self.manager.free(vllm_request)
        self.seconds["free"] += perf_counter() - t0
        self.calls["free"] += 1


class PrefixcacheBackend(Backend):
    """prefixcache's ``CacheManager`` through its Python API."""

    label = "prefixcache"

    def __init__(self, config: ManagerConfig, workload: Workload) -> None:
        super().__init__()
        import prefixcache as pc

        attention_blocks = config.attention_blocks(workload)
        pools = [pc.PoolConfig(num_blocks=attention_blocks)]
        groups: list[pc.Group] = [pc.FullAttention(block_size=config.block_size, pool=0)]
        if config.kind == "hybrid":
            # A = 64, C unbounded: what the FLA / FlashKDA kernel backends declare.
            pools.append(pc.PoolConfig(num_blocks=16 * workload.shape.max_running + 1024))
            groups.append(pc.StateGroup(alignment=64, max_checkpoints_per_step=None, pool=1))
        self.manager = pc.CacheManager(
            pc.CacheConfig(
                pools=pools,
                groups=groups,
                hash=pc.HashConfig(algorithm=config.hash, seed=0, unit=config.unit),
                reuse_live_prefixes=config.live_prefixes,
                enable_events=False,
            )
        )
        self.reuse = config.reuse
        # The engine's persistent plan arrays (`build_plan_into` writes each step there).
        self.plan = pc.PlanBuffers(rows=workload.shape.max_running)
        self.block_arrays = BlockArrays()
        self.in_flight = False
        self.pending: dict[int, int] = {}
        self.decodes: np.ndarray | None = None

    # An engine's decode step is one call, `decode_step`: it commits the previous step (kept
    # in flight until then), appends the tokens sampled from it, schedules one token of each
    # sequence and writes the plan into the buffers. The loop reports the step's parts
    # separately, so the backend defers them: sampled tokens wait in `pending` and the
    # decodes in `decodes`; a step that only decodes the sequences that sampled makes the one
    # call in `end_step`. Anything else (an admission, a prefill chunk, a finish) first makes
    # the deferred calls separately (`flush`), as an engine would.

    def _timed(self, name: str, call: Callable[[], T]) -> T:
        t0 = perf_counter()
        result = call()
        self.seconds[name] += perf_counter() - t0
        self.calls[name] += 1
        return result

    def flush(self) -> None:
        """Commits the step in flight, appends the pending tokens, schedules the decodes."""
        manager = self.manager
        if self.in_flight:
            self._timed("commit", lambda: manager.commit(self.plan))
            self.in_flight = False
        if self.pending:
            ids = np.fromiter(self.pending, dtype=np.int64, count=len(self.pending))
            values = np.fromiter(self.pending.values(), dtype=np.uint32, count=len(ids))
            self._timed("append_batch", lambda: manager.append_batch(ids, values))
            self.pending = {}
        if self.decodes is not None:
            decodes = self.decodes
            scheduled = self._timed("schedule_tokens", lambda: manager.schedule_tokens(decodes, 1))
            self.decodes = None
            if (scheduled < 0).any():
                raise RuntimeError("prefixcache ran out of blocks: the pool is sized too small")

    def add(self, request: Request) -> None:
        self.add_batch([request])

    def add_batch(self, requests: list[Request]) -> None:
        ids = [r.request_id for r in requests]
        prompts = [r.prompt for r in requests]
        extends = [r.extends for r in requests] if self.reuse else None
        manager = self.manager
        self._timed("add", lambda: manager.add_batch(ids, prompts, extends=extends))

    def admit(self, request: Request, budget: int) -> tuple[int, int] | None:
        self.flush()
        manager = self.manager
        seconds = self.seconds
        rid = request.request_id
        t0 = perf_counter()
        manager.lookup(rid)
        t1 = perf_counter()
        scheduled = manager.schedule(rid, budget)
        t2 = perf_counter()
        seconds["lookup"] += t1 - t0
        seconds["schedule"] += t2 - t1
        self.calls["lookup"] += 1
        self.calls["schedule"] += 1
        if scheduled is None:
            return None
        return scheduled.num_computed, scheduled.num_tokens

    def schedule_prefill(self, request: Request, budget: int) -> int:
        self.flush()
        t0 = perf_counter()
        scheduled = self.manager.schedule(request.request_id, budget)
        self.seconds["schedule"] += perf_counter() - t0
        self.calls["schedule"] += 1
        if scheduled is None:
            raise RuntimeError("prefixcache ran out of blocks: the pool is sized too small")
        return int(scheduled.num_tokens)

    def schedule_decodes(self, requests: list[Request]) -> None:
        ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests))
        if self.pending.keys() != set(ids.tolist()):
            self.flush()
        self.decodes = ids

    def end_step(self, scheduled: list[tuple[Request, int]]) -> None:
        if not scheduled:
            return
        manager = self.manager
        if self.decodes is not None and self.pending:
            # A step of decodes only, of the sequences that sampled: one call.
            ids = self.decodes
            tokens = np.fromiter(
                (self.pending[i] for i in ids.tolist()), dtype=np.uint32, count=len(ids)
            )
            got = self._timed("decode_step", lambda: manager.decode_step(self.plan, ids, tokens))
            self.pending, self.decodes = {}, None
            if (got < 0).any():
                raise RuntimeError("prefixcache ran out of blocks: the pool is sized too small")
        else:
            self.flush()
            self._timed("build_plan", lambda: manager.build_plan_into(self.plan))
        self.in_flight = True
        self._timed("read_plan", lambda: self.block_arrays.read(self.plan))

    def append(self, requests: list[Request], tokens: list[int]) -> None:
        self.pending.update(zip((r.request_id for r in requests), tokens, strict=True))

    def finish(self, request: Request) -> None:
        self.flush()
        t0 = perf_counter()
        self.manager.finish(request.request_id)
        self.seconds["finish"] += perf_counter() - t0
        self.calls["finish"] += 1


class BlockArrays:
    """What an engine takes from `PlanBuffers` each step, as vLLM's scheduler takes block ids
    from its manager: the step's counts (`counts`: rows, copies, block-table updates, state
    checkpoints and snapshots) and the arrays that name blocks (copies, block-table updates,
    state slots and snapshots), kept and fetched again only when the buffers say one was
    replaced (`generation`). The rest of the plan (slot mapping, query starts, positions,
    checkpoint offsets) is what vLLM's model runner derives itself."""

    def __init__(self) -> None:
        self.generation = -1
        self.arrays: list[object] = []

    def read(self, plan: pc.PlanBuffers) -> tuple[int, ...]:
        if plan.generation != self.generation:
            self.generation = plan.generation
            self.arrays = [plan.copies]
            for paged in plan.paged:
                self.arrays += (paged.appended, paged.replaced)
            for state in plan.state:
                self.arrays += (state.running_slot, state.initial_slot, state.checkpoint_slots)
                self.arrays.append(state.snapshots)
        return plan.counts


def make_backend(side: str, config: ManagerConfig, workload: Workload) -> Backend:
    """``side``: ``"vllm"`` or ``"prefixcache"``."""
    if side == "vllm":
        return VllmBackend(config, workload)
    return PrefixcacheBackend(config, workload)
