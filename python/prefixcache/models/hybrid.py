"""The reference hybrid model: embeddings, a KDA / attention layer stack, greedy sampling.

:class:`HybridModel` holds seeded random weights (:class:`ModelConfig`) on one device in one
dtype. Its caches are a separate object, :class:`ModelCaches`: one :class:`StateCache` per KDA
layer (all indexed by the block ids of one state group) and one :class:`PagedKVCache` per
attention layer (all indexed by the block ids of one paged group), so an engine can build fresh
caches per run while keeping the weights.

One :meth:`HybridModel.forward` runs one engine step over a packed batch described by
:class:`StepInputs` (what the cache manager's step plan says: query boundaries, the paged
group's slot mapping and block tables, the state group's slots and checkpoints) and returns the
float32 logits of the tokens the engine asked to sample from. The state plan is validated by the
kernel backend once per step, before any layer writes anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import KDABackend, PagedKVCache, StateCache
from .config import ModelConfig
from .layers import MLP, AttentionLayer, KDALayer, rms_norm
from .timing import KernelTimer

__all__ = ["HybridModel", "ModelCaches", "StepInputs", "default_dtype"]


def default_dtype(device: torch.device, backend: KDABackend) -> torch.dtype:
    """float32 on the CPU and for the torch backend; bf16 for the GPU kernels (fla, FlashKDA)."""
    if device.type == "cpu" or backend.name == "torch":
        return torch.float32
    return torch.bfloat16


@dataclass
class ModelCaches:
    """The per-layer caches of one run: states of the KDA layers, K/V of the attention layers."""

    states: list[StateCache]
    kv: list[PagedKVCache]

    @property
    def block_size(self) -> int:
        """Tokens per paged block."""
        return self.kv[0].block_size if self.kv else 0


@dataclass(frozen=True)
class StepInputs:
    """Everything one forward step needs (host arrays come straight from the step plan).

    Attributes:
        token_ids: ``[T]`` int64 ids of the scheduled tokens, on the model's device.
        query_start_loc: ``[R+1]`` row boundaries in the packed batch.
        seq_lens: ``[R]`` each row's context length after this step.
        slot_mapping: ``[T]`` int64 KV slot of each scheduled token (paged group).
        block_tables: ``[R, C]`` int32 block table rows (paged group), null-padded.
        initial_slot, running_slot: ``[R]`` state slots read / written (state group).
        checkpoint_offsets, checkpoint_slots: ``[R, Cmax]`` interior checkpoints (0 / -1 none).
        logits_indices: ``[n]`` packed-batch indices of the tokens whose logits are returned.
    """

    token_ids: torch.Tensor
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    initial_slot: np.ndarray
    running_slot: np.ndarray
    checkpoint_offsets: np.ndarray
    checkpoint_slots: np.ndarray
    logits_indices: np.ndarray


class HybridModel:
    """A Kimi-Linear-shaped language model with seeded random weights (see the package doc)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: KDABackend,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.device = torch.device(device)
        self.dtype = default_dtype(self.device, backend) if dtype is None else dtype
        generator = torch.Generator().manual_seed(config.seed)
        depth_scale = 1.0 / math.sqrt(2 * len(config.layers))
        d = config.hidden_size
        self.embedding = torch.randn(config.vocab_size, d, generator=generator).to(
            self.device, self.dtype
        )
        self.mixers: list[KDALayer | AttentionLayer] = []
        self.mlps: list[MLP] = []
        for kind in config.layers:
            mixer: KDALayer | AttentionLayer
            if kind == "kda":
                mixer = KDALayer.random(config, generator, depth_scale)
            else:
                mixer = AttentionLayer.random(config, generator, depth_scale)
            self.mixers.append(mixer.to(self.device, self.dtype))
            self.mlps.append(MLP.random(config, generator, depth_scale).to(self.device, self.dtype))
        ones = torch.ones(d, device=self.device, dtype=self.dtype)
        self.mixer_norms = [ones.clone() for _ in config.layers]
        self.mlp_norms = [ones.clone() for _ in config.layers]
        self.final_norm = ones.clone()
        self.lm_head = (torch.randn(config.vocab_size, d, generator=generator) / math.sqrt(d)).to(
            self.device, self.dtype
        )
        for layer in self.mixers:
            if isinstance(layer, KDALayer):
                backend.check_layer(layer.params, self.dtype, self.device)
        self.kda_timer = KernelTimer(self.device)

    @property
    def kda_layers(self) -> list[KDALayer]:
        """The KDA layers in order."""
        return [layer for layer in self.mixers if isinstance(layer, KDALayer)]

    def allocate_caches(
        self, *, paged_blocks: int, block_size: int, state_blocks: int
    ) -> ModelCaches:
        """Fresh (zeroed) caches: ``paged_blocks`` blocks of ``block_size`` tokens per attention
        layer, ``state_blocks`` state slots per KDA layer (the two pools' sizes)."""
        states = [
            StateCache.for_layer(layer.params, state_blocks, device=self.device)
            for layer in self.kda_layers
        ]
        kv = [
            PagedKVCache(
                paged_blocks,
                block_size,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=self.dtype,
                device=self.device,
            )
            for layer in self.mixers
            if isinstance(layer, AttentionLayer)
        ]
        return ModelCaches(states=states, kv=kv)

    def forward(self, inputs: StepInputs, caches: ModelCaches) -> torch.Tensor:
        """Run one step; returns float32 logits ``[len(logits_indices), vocab_size]``.

        Writes K/V of the scheduled tokens, the KDA running states and planned checkpoints;
        raises ``KernelPlanError`` (nothing written) on a plan the backend refuses. Time spent
        in the KDA kernels accumulates in :attr:`kda_timer`.
        """
        num_slots = min((cache.num_blocks for cache in caches.states), default=0)
        plan = self.backend.check_plan(
            query_start_loc=inputs.query_start_loc,
            initial_slot=inputs.initial_slot,
            running_slot=inputs.running_slot,
            checkpoint_offsets=inputs.checkpoint_offsets,
            checkpoint_slots=inputs.checkpoint_slots,
            num_slots=num_slots,
            num_tokens=int(inputs.token_ids.shape[0]),
        )
        slot_mapping = torch.from_numpy(np.ascontiguousarray(inputs.slot_mapping)).to(self.device)
        eps = self.config.rms_eps
        states = iter(caches.states)
        kv = iter(caches.kv)
        with torch.inference_mode():
            x = self.embedding.index_select(0, inputs.token_ids)
            for mixer, mlp, mixer_norm, mlp_norm in zip(
                self.mixers, self.mlps, self.mixer_norms, self.mlp_norms, strict=True
            ):
                h = rms_norm(x, mixer_norm, eps)
                if isinstance(mixer, KDALayer):
                    x = x + mixer.forward(h, self.backend, next(states), plan, self.kda_timer)
                else:
                    x = x + mixer.forward(
                        h,
                        next(kv),
                        slot_mapping,
                        inputs.block_tables,
                        inputs.seq_lens,
                        inputs.query_start_loc,
                    )
                x = x + mlp.forward(rms_norm(x, mlp_norm, eps))
            index = torch.from_numpy(np.ascontiguousarray(inputs.logits_indices, dtype=np.int64))
            last = rms_norm(x.index_select(0, index.to(self.device)), self.final_norm, eps)
            return F.linear(last, self.lm_head).float()

    @staticmethod
    def sample(logits: torch.Tensor) -> list[int]:
        """Greedy sampling: the argmax id of each row."""
        ids: list[int] = logits.argmax(dim=-1).tolist()
        return ids
