"""The reference hybrid model: embeddings, a KDA / attention layer stack, greedy sampling.

:class:`HybridModel` holds seeded random weights (:class:`ModelConfig`) on one device in one
dtype. Its caches are a separate object, :class:`ModelCaches`: one :class:`StateCache` per KDA
layer (all indexed by the block ids of one state group) and one :class:`PagedKVCache` per
attention layer (all indexed by the block ids of one paged group), so an engine can build fresh
caches per run while keeping the weights.

One :meth:`HybridModel.execute` runs one whole engine step from a
:class:`prefixcache.kernels.Step` (what the cache manager's step plan says: the copy-on-write
copies, query boundaries, the paged group's slot mapping and block tables, the state group's
slots, checkpoints and snapshots): copies, then the layers, then snapshots, and returns the
float32 logits of the tokens the engine asked to sample from. The copies, the state plan (by the
kernel backend) and the snapshots are all validated once per step, before anything is written.
On CUDA a decode-only step replays a CUDA graph of the layers instead of launching them
(:mod:`prefixcache.models.graphs`); nothing inside a step waits for the GPU. Inside
:meth:`HybridModel.reusing_caches` the runs of one pool geometry share one set of caches, zeroed
at every allocation, so the graphs captured in one run are replayed by the next.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import KDABackend, PagedKVCache, StateCache, StatePlan, Step
from ..kernels._convert import to_device
from ..kernels.copies import copy_checked_blocks, copy_checked_states, copy_shapes
from ..kernels.decode_attention import DecodeRows, triton_unavailable_reason
from ..kernels.errors import UnsupportedLayerError
from ..kernels.validate import check_copies, check_snapshots
from .config import ModelConfig
from .graphs import DEFAULT_MAX_ROWS, DecodeGraphs, decode_graph_key, graphs_unavailable_reason
from .layers import MLP, AttentionLayer, KDALayer, rms_norm
from .timing import KernelTimer

__all__ = [
    "DECODE_ATTENTIONS",
    "HybridModel",
    "ModelCaches",
    "default_decode_attention",
    "default_dtype",
]

#: How the attention layers compute decode rows (one query token): ``torch`` gathers each row's
#: context and calls ``scaled_dot_product_attention`` per row; ``triton`` reads every decode
#: row's context through the block table in one launch (``kernels.decode_attention``).
DECODE_ATTENTIONS = ("torch", "triton")


def default_decode_attention(device: torch.device) -> str:
    """``"triton"`` on CUDA when Triton is installed, ``"torch"`` elsewhere (the CPU never
    imports Triton unless asked to)."""
    if device.type == "cuda" and triton_unavailable_reason(device) is None:
        return "triton"
    return "torch"


def default_dtype(device: torch.device, backend: KDABackend) -> torch.dtype:
    """float32 on the CPU and for the torch backend; bf16 for the GPU kernels (fla, FlashKDA)."""
    if device.type == "cpu" or backend.name == "torch":
        return torch.float32
    return torch.bfloat16


@dataclass
class ModelCaches:
    """The per-layer caches of one run: states of the KDA layers, K/V of the attention layers.

    ``paged_group`` / ``state_group`` are the cache-configuration groups whose blocks index
    ``kv`` and ``states`` (the hybrid layout: group 0 full attention, group 1 state).
    """

    states: list[StateCache]
    kv: list[PagedKVCache]
    paged_group: int = 0
    state_group: int = 1

    @property
    def block_size(self) -> int:
        """Tokens per paged block."""
        return self.kv[0].block_size if self.kv else 0

    def zero_(self) -> ModelCaches:
        """Every entry set to zero in place (the tensors keep their addresses); returns self."""
        for cache in self.states:
            cache.conv.zero_()
            cache.recurrent.zero_()
        for kv in self.kv:
            kv.key.zero_()
            kv.value.zero_()
        return self


#: The longest spin :meth:`HybridModel.set_layers_backlog` takes (about 1 s at 2 GHz).
MAX_LAYERS_BACKLOG_CYCLES = 2_000_000_000


class HybridModel:
    """A Kimi-Linear-shaped language model with seeded random weights (see the package doc)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: KDABackend,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        decode_attention: str = "auto",
        split_prefill: bool = True,
        cuda_graphs: bool | str = "auto",
        graph_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        self.config = config
        self.backend = backend
        self.device = torch.device(device)
        self.dtype = default_dtype(self.device, backend) if dtype is None else dtype
        self.decode_attention = self.check_decode_attention(decode_attention, self.device)
        # Whether a prefill chunk's cached prefix may be split across the GPU (CUDA, bf16).
        self.split_prefill = split_prefill
        # On a GPU the large matrices are drawn there (the Kimi-K3 proxy has billions of
        # weights: drawing them on the host would cost seconds per process), the kernel
        # parameters on the host; on the CPU one generator draws everything.
        params_generator = torch.Generator().manual_seed(config.seed)
        generator = params_generator
        if self.device.type != "cpu":
            generator = torch.Generator(device=self.device).manual_seed(config.seed)
        depth_scale = 1.0 / math.sqrt(2 * len(config.layers))
        d = config.hidden_size
        self.embedding = torch.randn(
            config.vocab_size, d, generator=generator, device=generator.device
        ).to(self.device, self.dtype)
        self.mixers: list[KDALayer | AttentionLayer] = []
        self.mlps: list[MLP] = []
        for kind in config.layers:
            mixer: KDALayer | AttentionLayer
            if kind == "kda":
                mixer = KDALayer.random(config, generator, depth_scale, params_generator)
            else:
                mixer = AttentionLayer.random(config, generator, depth_scale)
            self.mixers.append(mixer.to(self.device, self.dtype))
            self.mlps.append(MLP.random(config, generator, depth_scale).to(self.device, self.dtype))
        ones = torch.ones(d, device=self.device, dtype=self.dtype)
        self.mixer_norms = [ones.clone() for _ in config.layers]
        self.mlp_norms = [ones.clone() for _ in config.layers]
        self.final_norm = ones.clone()
        self.lm_head = (
            torch.randn(config.vocab_size, d, generator=generator, device=generator.device)
            / math.sqrt(d)
        ).to(self.device, self.dtype)
        for layer in self.mixers:
            if isinstance(layer, KDALayer):
                backend.check_layer(layer.params, self.dtype, self.device)
        self.kda_timer = KernelTimer(self.device)
        # Called by ``execute`` on the eager path once the step's host checks and uploads are
        # done, just before its layers are launched (never inside a graph capture or replay):
        # the simulator's step clock marks there where a step's host preparation ends.
        self.layers_starting: Callable[[], None] | None = None
        # GPU clock cycles of a spin put on the stream before an eager step's layers, ahead of
        # layers_starting (0: none; set_layers_backlog): a diagnosis of how long the layers take
        # the GPU once every launch is ahead of it.
        self.layers_backlog_cycles = 0
        # Decode-only steps replayed from CUDA graphs (models.graphs): "auto" where they can run.
        self.graphs: DecodeGraphs | None = None
        reason = graphs_unavailable_reason(self)
        if cuda_graphs is True and reason is not None:
            raise UnsupportedLayerError(f"cuda_graphs: {reason}")
        if cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
        if cuda_graphs is not False and reason is None:
            self.graphs = DecodeGraphs(graph_rows)
        # Inside reusing_caches: open, and the pool geometry and caches last handed out.
        self._reusing = False
        self._held: tuple[tuple[int, ...], ModelCaches] | None = None

    @staticmethod
    def check_decode_attention(name: str, device: torch.device) -> str:
        """``name`` (``"auto"`` resolved for ``device``) if it can run there. Raises
        ``ValueError`` on an unknown name, ``UnsupportedLayerError`` for ``triton`` where Triton
        cannot run (a CPU without ``TRITON_INTERPRET=1``)."""
        if name == "auto":
            return default_decode_attention(device)
        if name not in DECODE_ATTENTIONS:
            raise ValueError(
                f"decode_attention must be auto or one of {', '.join(DECODE_ATTENTIONS)}, "
                f"got {name!r}"
            )
        if name == "triton":
            reason = triton_unavailable_reason(device)
            if reason is not None:
                raise UnsupportedLayerError(f"decode_attention 'triton': {reason}")
        return name

    @property
    def kda_layers(self) -> list[KDALayer]:
        """The KDA layers in order."""
        return [layer for layer in self.mixers if isinstance(layer, KDALayer)]

    def allocate_caches(
        self,
        *,
        paged_blocks: int,
        block_size: int,
        state_blocks: int,
        paged_group: int = 0,
        state_group: int = 1,
    ) -> ModelCaches:
        """Zeroed caches: ``paged_blocks`` blocks of ``block_size`` tokens per attention
        layer, ``state_blocks`` state slots per KDA layer (the two pools' sizes), indexed by
        the blocks of groups ``paged_group`` and ``state_group``. New ones, except inside
        :meth:`reusing_caches`, where the same geometry gets the same set again."""
        geometry = (paged_blocks, block_size, state_blocks, paged_group, state_group)
        if self._reusing:
            if self._held is not None and self._held[0] == geometry:
                return self._held[1].zero_()
            self._held = None  # another geometry: the old set is freed first
        caches = self._new_caches(*geometry)
        if self._reusing:
            self._held = (geometry, caches)
        return caches

    @contextmanager
    def reusing_caches(self) -> Iterator[None]:
        """Runs of one pool geometry share one set of caches while this is open.

        Every :meth:`allocate_caches` of the geometry last allocated returns that same object,
        zeroed (what a fresh set holds), so its tensors keep their addresses: the decode graphs
        captured on it stay valid, and no run pays captures, allocator growth or the freeing of
        the previous run's caches. Another geometry replaces the held set. Only for runs one
        after the other (each set is handed to one run at a time); on exit the set is released.
        """
        if self._reusing:
            yield  # already open: the outer one releases
            return
        self._reusing = True
        try:
            yield
        finally:
            self._reusing, self._held = False, None

    def _new_caches(
        self,
        paged_blocks: int,
        block_size: int,
        state_blocks: int,
        paged_group: int,
        state_group: int,
    ) -> ModelCaches:
        states = [
            StateCache.for_layer(layer.params, state_blocks, device=self.device)
            for layer in self.kda_layers
        ]
        # One storage for every attention layer (the config gives them one shape): a
        # copy-on-write copy is one launch for all of them, not two a layer.
        config = self.config
        kv = []
        if config.num_attention_layers:
            kv = PagedKVCache.stacked(
                config.num_attention_layers, paged_blocks, block_size, config.attention_kv_heads,
                config.attention_head_dim, self.dtype, self.device,
            )  # fmt: skip
        return ModelCaches(states=states, kv=kv, paged_group=paged_group, state_group=state_group)

    def set_layers_backlog(self, cycles: int) -> None:
        """Put a GPU-side spin of ``cycles`` clock cycles (``torch.cuda._sleep``) on the stream
        before each eager step's layers, ahead of ``layers_starting``; 0 removes it.

        A diagnosis, not a serving mode: while the GPU spins the host launches the layers, so
        when the spin outlasts the launches, the GPU's time from ``layers_starting`` to the
        step's end is the layers' execution alone, without any wait for the host (the step
        clock's ``layers`` part then says how much of a step's fixed time such waits were).
        Every step pays the spin. Raises ``ValueError`` off CUDA or for a count outside
        ``[0, MAX_LAYERS_BACKLOG_CYCLES]`` (about a second at the H200's clock)."""
        if not 0 <= cycles <= MAX_LAYERS_BACKLOG_CYCLES:
            raise ValueError(f"cycles must be in [0, {MAX_LAYERS_BACKLOG_CYCLES}], got {cycles}")
        if cycles and self.device.type != "cuda":
            raise ValueError(f"a layers backlog needs a CUDA device, got {self.device}")
        self.layers_backlog_cycles = int(cycles)

    def execute(
        self,
        step: Step,
        token_ids: torch.Tensor,
        caches: ModelCaches,
        logits_indices: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Run one whole step; returns float32 logits ``[len(logits_indices), vocab_size]``.

        ``token_ids`` ``[T]`` int64 are the step's tokens on the model's device,
        ``logits_indices`` the packed-batch indices of the tokens whose logits are returned
        (default: every row's last token). Runs the step's copy-on-write copies, then the
        layers (writing K/V of the scheduled tokens, the KDA running states and planned
        checkpoints), then the snapshots. Everything is validated first: a plan the backend
        refuses, or a bad copy or snapshot, raises ``KernelPlanError`` with nothing written.
        Time spent in the KDA kernels accumulates in :attr:`kda_timer`.
        """
        num_tokens = int(token_ids.shape[0])
        copies = check_copies(step.copies, copy_shapes({caches.paged_group: caches.kv}))
        state = step.state_group(caches.state_group) if caches.states else None
        plan = None
        snapshots: list[tuple[int, int]] = []
        if state is not None:
            num_slots = min(cache.num_blocks for cache in caches.states)
            plan = self.backend.check_plan(
                query_start_loc=step.query_start_loc,
                initial_slot=state.initial_slot,
                running_slot=state.running_slot,
                checkpoint_offsets=state.checkpoint_offsets,
                checkpoint_slots=state.checkpoint_slots,
                num_slots=num_slots,
                num_tokens=num_tokens,
            )
            snapshots = check_snapshots(state.snapshots, num_slots)
        paged = step.paged_group(caches.paged_group) if caches.kv else None
        if logits_indices is None:
            logits_indices = np.asarray(step.query_start_loc[1:], dtype=np.int64) - 1
        host_slots = None
        slots_checked = False
        if paged is not None:
            host_slots = np.ascontiguousarray(paged.slot_mapping, dtype=np.int64)
            # Checked once on the host for every layer and uploaded once: no layer reads the
            # slots back from the GPU (a synchronisation per layer). A plan with padding (-1)
            # or a bad slot takes each cache's own checks instead.
            slots_checked = all(cache.slots_in_range(host_slots) for cache in caches.kv)
        decode_host = None
        if paged is not None and self.decode_attention == "triton":
            decode_host = DecodeRows.check(
                paged.block_tables,
                step.seq_lens,
                step.query_start_loc,
                num_blocks=min(cache.num_blocks for cache in caches.kv),
                block_size=caches.kv[0].block_size,
            )
        graph_key = None
        if (
            self.graphs is not None
            and plan is not None
            and state is not None
            and host_slots is not None
            and slots_checked
            and decode_host is not None
            and not self.kda_timer.enabled  # a timed step runs eagerly
        ):
            graph_key = decode_graph_key(
                step.query_start_loc,
                step.seq_lens,
                logits_indices,
                state.initial_slot,
                plan.num_checkpoints,
                block_size=caches.block_size,
                max_rows=self.graphs.max_rows,
            )
        copy_checked_blocks(copies, {caches.paged_group: caches.kv})
        if graph_key is not None:
            assert state is not None and host_slots is not None and decode_host is not None
            logits = self.graphs.run(  # type: ignore[union-attr]
                self,
                graph_key,
                token_ids,
                caches,
                (
                    host_slots,
                    np.asarray(state.initial_slot, dtype=np.int64),
                    np.asarray(state.running_slot, dtype=np.int64),
                    np.asarray(step.seq_lens, dtype=np.int64),
                    decode_host[2],
                ),
            )
        else:
            slot_mapping: torch.Tensor | np.ndarray | None = None
            if host_slots is not None:
                slot_mapping = host_slots
                if slots_checked:
                    slot_mapping = to_device(torch.from_numpy(host_slots), self.device)
            decode = None
            if decode_host is not None:
                decode = DecodeRows.from_checked(
                    decode_host,
                    step.query_start_loc,
                    block_size=caches.block_size,
                    device=self.device,
                )
            index = torch.from_numpy(np.ascontiguousarray(logits_indices, dtype=np.int64))
            logits_index = to_device(index, self.device)
            if self.layers_backlog_cycles:
                torch.cuda._sleep(self.layers_backlog_cycles)  # type: ignore[no-untyped-call]
            if self.layers_starting is not None:
                self.layers_starting()
            logits = self.forward_layers(
                token_ids,
                caches,
                plan=plan,
                slot_mapping=slot_mapping,
                slots_checked=slots_checked,
                block_tables=None if paged is None else paged.block_tables,
                seq_lens=step.seq_lens,
                query_start_loc=step.query_start_loc,
                decode=decode,
                logits_index=logits_index,
            )
        copy_checked_states(caches.states, snapshots)
        return logits

    def forward_layers(
        self,
        token_ids: torch.Tensor,
        caches: ModelCaches,
        *,
        plan: StatePlan | None,
        slot_mapping: torch.Tensor | np.ndarray | None,
        slots_checked: bool,
        block_tables: np.ndarray | None,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        decode: DecodeRows | None,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """The layers of a step already checked by :meth:`execute`, from its device inputs:
        the embedding, every layer (writing K/V and states), the final norm and the logits of
        the packed rows ``logits_index``. Launches only device work (a CUDA graph captures it
        with static inputs: ``models.graphs``)."""
        eps = self.config.rms_eps
        states = iter(caches.states)
        kv = iter(caches.kv)
        with torch.inference_mode():
            x = self.embedding.index_select(0, token_ids)
            for mixer, mlp, mixer_norm, mlp_norm in zip(
                self.mixers, self.mlps, self.mixer_norms, self.mlp_norms, strict=True
            ):
                h = rms_norm(x, mixer_norm, eps)
                if isinstance(mixer, KDALayer):
                    assert plan is not None
                    x = x + mixer.forward(h, self.backend, next(states), plan, self.kda_timer)
                else:
                    assert slot_mapping is not None and block_tables is not None
                    x = x + mixer.forward(
                        h,
                        next(kv),
                        slot_mapping,
                        block_tables,
                        seq_lens,
                        query_start_loc,
                        slots_checked=slots_checked,
                        decode=decode,
                        split_prefill=self.split_prefill,
                    )
                x = x + mlp.forward(rms_norm(x, mlp_norm, eps))
            last = rms_norm(x.index_select(0, logits_index), self.final_norm, eps)
            return F.linear(last, self.lm_head).float()

    @staticmethod
    def sample(logits: torch.Tensor) -> list[int]:
        """Greedy sampling: the argmax id of each row."""
        ids: list[int] = logits.argmax(dim=-1).tolist()
        return ids
