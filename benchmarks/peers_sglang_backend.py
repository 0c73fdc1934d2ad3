"""SGLang 0.5.23's ``UnifiedRadixCache`` behind the comparison loop's ``Backend`` interface.

The cache is built on the CPU the way SGLang's own unit fixtures build it
(``sglang/test/kits/unified_radix_cache/fixtures.py``): ``ServerArgs`` set for the scheduler
first, real CPU ``ReqToTokenPool`` (``HybridReqToTokenPool`` with a Mamba2 state pool for the
hybrid configuration), an ``MHATokenToKVPool`` / ``HybridLinearKVPool`` behind a
``TokenToKVPoolAllocator``, ``CacheInitParams`` and ``UnifiedRadixCache`` with the tree core
chosen explicitly (``"rust"`` or ``"python"``), ``device="cpu"`` everywhere, token ids as
``array('q')``.

Per request it makes the calls SGLang's scheduler makes, in its order (timed each):

- admission: ``Req.init_next_round_input(tree_cache)`` (``match_kv_cache``: ``match_prefix``,
  with ``cow_mamba`` where the tree holds Mamba states), then ``tree_cache.lock(last_node)``
  (``PrefillAdder._commit_prefill_admission``); the chunk length follows the adder's rule
  (a chunk that does not finish the prompt ends on a page boundary; untimed: policy);
- each step's extends: ``alloc_for_extend`` (request-slot allocation, Mamba slots included,
  KV slots with eviction from the tree, the ``req_to_token`` writes), as ``prepare_for_extend``
  calls it, with the batch fields it sets; in the hybrid paged configuration the Mamba
  tracking entry of each extend (``_mamba_radix_cache_v2_req_prepare_for_extend``);
- each step's decodes: ``alloc_for_decode`` (one token per request, eviction included);
- after each prefill chunk's forward: ``checkpoint_kv_cache`` (a middle chunk's at the next
  step's start, ``stash_chunked_request``; the last chunk's once its first token is sampled);
- at finish: ``release_kv_cache(req, tree_cache, checkpoint=True)``.

Object construction (``Req``, the batch fields) and the loop's bookkeeping are not timed.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
from vs_vllm_backends import Backend
from vs_vllm_workloads import Request, Workload

perf_counter = time.perf_counter


@dataclass(frozen=True)
class SglangConfig:
    """One SGLang cache: tree core, page size, components.

    Attributes:
        core: ``"rust"`` or ``"python"`` (``CacheInitParams`` tree core).
        page_size: tokens per page (1: token-granular tree).
        mamba: FULL + MAMBA (a hybrid model's cache) instead of FULL alone.
    """

    core: Literal["rust", "python"]
    page_size: int
    mamba: bool = False

    @property
    def peer(self) -> str:
        import sglang

        parts = "-mamba" if self.mamba else ""
        return f"sglang-{sglang.__version__}-{self.core}-p{self.page_size}{parts}"


class SglangBackend(Backend):
    """``UnifiedRadixCache`` driven as SGLang's scheduler drives it."""

    label = "sglang"

    def __init__(self, config: SglangConfig, workload: Workload, kv_tokens: int) -> None:
        super().__init__()
        import torch
        from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
        from sglang.srt.mem_cache.allocation import alloc_for_decode, alloc_for_extend
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        page = config.page_size
        device = "cpu"
        # Mamba with pages > 1 needs the extra (tracking) buffer, as SGLang's fixtures set it.
        extra_buffer = config.mamba and page > 1
        server_args = ServerArgs(model_path="dummy", page_size=page, device=device)
        server_args._mamba_cache_chunk_size = max(CHUNK_SIZE, page)
        if config.mamba:
            server_args.mamba_scheduler_strategy = "extra_buffer" if extra_buffer else "no_buffer"
        set_global_server_args_for_scheduler(server_args)
        max_running = workload.shape.max_running
        self.max_context = workload.prompt_tokens() + 2 * page
        rows = max_running + 2
        dtype = torch.bfloat16
        if config.mamba:
            from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
            from sglang.srt.environ import envs
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

            # One Mamba2 layer, one attention layer, states of a few hundred bytes: the cache's
            # bookkeeping, not the copies of a real model's state, is what is timed.
            with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
                shape = Mamba2StateShape.create(
                    tp_world_size=1,
                    intermediate_size=32,
                    n_groups=1,
                    num_heads=2,
                    head_dim=16,
                    state_size=16,
                    conv_kernel=4,
                )
                params = Mamba2CacheParams(shape=shape, layers=[0])
            req_pool: Any = HybridReqToTokenPool(
                size=rows,
                mamba_size=16 * max_running + 1024,
                mamba_spec_state_size=rows,
                max_context_len=self.max_context,
                device=device,
                enable_memory_saver=False,
                cache_params=params,
                mamba_layer_ids=[0],
                enable_mamba_extra_buffer=extra_buffer,
                speculative_num_draft_tokens=3,
            )
            kv_pool: Any = HybridLinearKVPool(
                size=kv_tokens,
                dtype=dtype,
                page_size=page,
                head_num=1,
                head_dim=1,
                full_attention_layer_ids=[1],
                device=device,
                enable_memory_saver=False,
                mamba_pool=req_pool.mamba_pool,
            )
            components = (ComponentType.FULL, ComponentType.MAMBA)
        else:
            req_pool = ReqToTokenPool(
                size=rows,
                max_context_len=self.max_context,
                device=device,
                enable_memory_saver=False,
            )
            kv_pool = MHATokenToKVPool(
                size=kv_tokens,
                page_size=page,
                dtype=dtype,
                head_num=1,
                head_dim=1,
                layer_num=1,
                device=device,
                enable_memory_saver=False,
            )
            components = (ComponentType.FULL,)
        if page == 1:
            allocator: Any = TokenToKVPoolAllocator(
                size=kv_tokens, dtype=dtype, device=device, kvcache=kv_pool, need_sort=False
            )
        else:
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

            allocator = PagedTokenToKVPoolAllocator(
                size=kv_tokens,
                page_size=page,
                dtype=dtype,
                device=device,
                kvcache=kv_pool,
                need_sort=False,
            )
        params = CacheInitParams(
            req_to_token_pool=req_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=page,
            disable=False,
            tree_components=components,
            enable_mamba_extra_buffer=extra_buffer,
            enable_kv_cache_events=False,
            eviction_policy="lru",
            tree_core_backend=config.core,
        )
        self.cache = UnifiedRadixCache(params=params)
        if self.cache._tree_core_backend != config.core:
            raise RuntimeError(
                f"SGLang chose the {self.cache._tree_core_backend} tree core, not {config.core}"
            )
        self.config = config
        self.page = page
        self.req_pool = req_pool
        self.allocator = allocator
        self.torch = torch
        self.req_cls = Req
        self.params_cls = SamplingParams
        self.finish_reason = FINISH_LENGTH
        self.alloc_for_extend = alloc_for_extend
        self.alloc_for_decode = alloc_for_decode
        self.checkpoint_kv_cache = checkpoint_kv_cache
        self.release_kv_cache = release_kv_cache
        self.track_entry = ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend
        self.extra_buffer = extra_buffer
        if extra_buffer:
            from sglang.srt.runtime_context import mamba_checkpoint_grid

            self.grid = mamba_checkpoint_grid(page)
        self.mamba = config.mamba
        self.reqs: dict[int, Any] = {}
        self.extends: list[Any] = []
        self.decodes: list[Any] = []
        # Middle chunks waiting for their checkpoint at the next step's start.
        self.stashed: list[Any] = []
        # Hit-rule bookkeeping (untimed): the token counts at which each stream (prefix key)
        # has checkpointed or released, and whether each admission's hit ended at one.
        self.points: dict[int, set[int]] = {}
        self.keys: dict[int, int] = {}
        self.hit_at_state: dict[int, bool] = {}
        self.model_config = SimpleNamespace(
            is_encoder_decoder=False, hf_text_config=SimpleNamespace(mamba_chunk_size=64)
        )

    def _batch(self, reqs: list[Any]) -> Any:
        """The fields of a ``ScheduleBatch`` that its allocation calls read."""
        return SimpleNamespace(
            reqs=reqs,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.cache,
            device="cpu",
            hisparse_coordinator=None,
            model_config=self.model_config,
            is_dllm=lambda: False,
            maybe_evict_swa=lambda: None,
        )

    def start_step(self) -> None:
        if not self.stashed:
            return
        t0 = perf_counter()
        for req in self.stashed:
            self.checkpoint_kv_cache(req, self.cache)
        self.seconds["checkpoint"] += perf_counter() - t0
        self.calls["checkpoint"] += len(self.stashed)
        self.stashed = []

    def _chunk(self, req: Any, prefix: int, budget: int) -> int:
        """The adder's chunk: the rest of the prompt if it fits, else a page-aligned end."""
        rest = len(req.origin_input_ids) - prefix
        if rest <= budget:
            return rest
        end = (prefix + budget) // self.page * self.page
        return max(0, end - prefix)

    def admit(self, request: Request, budget: int) -> tuple[int, int] | None:
        rid = request.request_id
        req = self.reqs.get(rid)
        if req is None:
            params = self.params_cls(temperature=0, max_new_tokens=len(request.output))
            tokens = array("q")
            tokens.frombytes(request.prompt.astype(np.int64).tobytes())
            req = self.req_cls(
                rid=str(rid),
                origin_input_text="",
                origin_input_ids=tokens,
                sampling_params=params,
            )
            self.reqs[rid] = req
        cache = self.cache
        seconds = self.seconds
        t0 = perf_counter()
        req.init_next_round_input(cache)
        seconds["match"] += perf_counter() - t0
        self.calls["match"] += 1
        hit = int(req.prefix_len)
        self.keys[rid] = request.prefix_key
        self.hit_at_state[rid] = hit == 0 or hit in self.points.get(request.prefix_key, ())
        tokens = self._chunk(req, hit, budget)
        if tokens == 0:
            return hit, 0
        req.extend_end = hit + tokens
        t0 = perf_counter()
        req.lock = cache.lock(req.last_node)
        seconds["lock"] += perf_counter() - t0
        self.calls["lock"] += 1
        self.extends.append(req)
        return hit, tokens

    def schedule_prefill(self, request: Request, budget: int) -> int:
        req = self.reqs[request.request_id]
        req.init_next_round_input()
        tokens = self._chunk(req, req.prefix_len, budget)
        if tokens:
            req.extend_end = req.prefix_len + tokens
            self.extends.append(req)
        return tokens

    def schedule_decodes(self, requests: list[Request]) -> None:
        self.decodes = [self.reqs[r.request_id] for r in requests]

    def end_step(self, scheduled: list[tuple[Request, int]]) -> None:
        torch = self.torch
        seconds = self.seconds
        if self.extends:
            reqs, self.extends = self.extends, []
            batch = self._batch(reqs)
            seq_lens = [r.extend_end for r in reqs]
            batch.prefix_lens = [r.prefix_len for r in reqs]
            batch.extend_lens = [r.extend_end - r.prefix_len for r in reqs]
            batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
            batch.seq_lens_cpu = batch.seq_lens.clone()
            batch.extend_num_tokens = sum(batch.extend_lens)
            t0 = perf_counter()
            self.alloc_for_extend(batch)
            if self.extra_buffer:
                for req in reqs:
                    self.track_entry(batch, req)
            seconds["alloc_for_extend"] += perf_counter() - t0
            self.calls["alloc_for_extend"] += 1
            for req in reqs:
                if self.extra_buffer:
                    # The tracking entry's snapshot: whole grid steps past the chunk's start.
                    length = req.extend_end - req.prefix_len
                    if length >= self.grid:
                        self._point(req, req.prefix_len + length // self.grid * self.grid)
                if req.extend_end < len(req.origin_input_ids):
                    self.stashed.append(req)
                    if not self.extra_buffer:
                        self._point(req, req.extend_end)
        if self.decodes:
            reqs, self.decodes = self.decodes, []
            batch = self._batch(reqs)
            lens = [r.kv.kv_committed_len for r in reqs]
            batch.seq_lens = torch.tensor(lens, dtype=torch.int64)
            batch.seq_lens_cpu = batch.seq_lens.clone()
            indices = [r.kv.req_pool_idx for r in reqs]
            batch.req_pool_indices = torch.tensor(indices, dtype=torch.int64)
            batch.req_pool_indices_cpu = batch.req_pool_indices
            t0 = perf_counter()
            self.alloc_for_decode(batch, token_per_req=1)
            seconds["alloc_for_decode"] += perf_counter() - t0
            self.calls["alloc_for_decode"] += 1

    def append(self, requests: list[Request], tokens: list[int]) -> None:
        seconds = self.seconds
        for request, token in zip(requests, tokens, strict=True):
            req = self.reqs[request.request_id]
            first = not req.output_ids
            req.output_ids.append(token)
            if first and len(req.output_ids) < len(request.output):
                # The prefill's last chunk: published once its first token is sampled.
                t0 = perf_counter()
                self.checkpoint_kv_cache(req, self.cache)
                seconds["checkpoint"] += perf_counter() - t0
                self.calls["checkpoint"] += 1
                if not self.extra_buffer:
                    self._point(req, req.extend_end)

    def finish(self, request: Request) -> None:
        req = self.reqs.pop(request.request_id)
        req.finished_reason = self.finish_reason(length=len(req.output_ids))
        t0 = perf_counter()
        self.release_kv_cache(req, self.cache, checkpoint=True)
        self.seconds["release"] += perf_counter() - t0
        self.calls["release"] += 1
        if not self.extra_buffer:
            self._point(req, len(req.origin_input_ids) + len(req.output_ids) - 1)

    def _point(self, req: Any, end: int) -> None:
        """Records a token count at which the request left a Mamba state in the tree: without
        the tracking buffer (page 1) each checkpoint's end, with it (page 16) the snapshot of
        each chunk's tracking entry."""
        self.points.setdefault(self.keys[int(req.rid)], set()).add(end)
