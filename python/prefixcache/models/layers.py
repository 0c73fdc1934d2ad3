"""The layers of the reference hybrid model: KDA, grouped-query attention, SwiGLU, RMS norm.

Each layer is a frozen dataclass of weights plus a ``forward`` that works on a packed batch
(``[T, hidden]``, several sequences back to back) and on the caches of the step:

- :class:`KDALayer` follows Kimi-Linear's KDA block: ``q|k|v``, gate (low-rank or full), beta and
  low-rank output-gate projections of its input (merged into one GEMM), the kernel layer's
  short conv + recurrence
  (:func:`prefixcache.kernels.run_prefill`, reading and writing a :class:`StateCache`), a gated
  per-head RMS norm and the output projection.
- :class:`AttentionLayer` is causal grouped-query attention without positional encoding (Kimi
  Linear's full-attention layers are NoPE as well); it writes this step's keys and values into a
  :class:`PagedKVCache` at the plan's ``slot_mapping`` and reads each sequence's context through
  its block table (:func:`paged_causal_attention`); rows of one query token (decode rows) go
  to the Triton paged decode kernel when the step hands them over
  (:mod:`prefixcache.kernels.decode_attention`), which reads the context where it lies.

Weights are random (seeded): the layers exist to exercise the caches exactly as a trained model
would, not to produce meaningful text. No autograd: callers run under ``torch.inference_mode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import KDABackend, KDALayerParams, PagedKVCache, StateCache, StatePlan, run_prefill
from ..kernels.decode_attention import DecodeRows, paged_decode_attention
from ..kernels.prefill_attention import flash_attend, prefix_splits, split_prefix_attention
from .config import ModelConfig
from .timing import KernelTimer

__all__ = ["MLP", "AttentionLayer", "KDALayer", "paged_causal_attention", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in ``x``'s dtype.

    ``torch.nn.functional.rms_norm``: on CUDA one fused kernel that accumulates in float32 (or
    float64) and rounds once, as engines run their norms (the same formula as nine separate
    float32 operations cost 8 times its GPU time and 6 times its launch time at the seed's
    prefill sizes: docs/BENCHMARKS.md). ``weight`` takes ``x``'s dtype first (the fused kernel
    needs the two to agree).
    """
    if weight.dtype != x.dtype:  # a no-op .to still costs a call on the host, every layer
        weight = weight.to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def paged_causal_attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    decode: DecodeRows | None = None,
    split_prefill: bool = True,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over each row's context in ``cache``.

    The contract of :func:`prefixcache.kernels.paged_attention` (row r's ``query_len`` tokens
    are the last of its ``seq_lens[r]``-token context, whose keys and values are already in the
    cache; grouped-query heads), computed with ``torch.nn.functional.scaled_dot_product_attention``
    on the context gathered through the block table: no ``[query, context]`` score matrix is
    kept, so a 164K-token context fits on a GPU (flash / memory-efficient kernels).

    ``decode``: the step's decode rows (:class:`DecodeRows`, selected from these same tables);
    they are computed in one launch by :func:`paged_decode_attention`, without a gather, and
    only the other rows take the per-row path. On CUDA in fp16/bf16, a chunk after a cached
    prefix goes to the flash kernel with its grouped key/value heads as they are, its prefix
    split across the GPU when the chunk alone would not fill it (``split_prefill``;
    :mod:`prefixcache.kernels.prefill_attention`).
    """
    tables = np.asarray(block_tables)
    lengths: list[int] = np.asarray(seq_lens).reshape(-1).tolist()
    loc: list[int] = np.asarray(query_start_loc).reshape(-1).tolist()
    out = torch.empty_like(query)
    skip: set[int] = set()
    if decode is not None and decode.num_rows:
        paged_decode_attention(query, cache.key, cache.value, decode, out)
        skip = set(decode.rows.tolist())
    for row, context in enumerate(lengths):
        if row in skip:
            continue
        first, last = loc[row], loc[row + 1]
        query_len = last - first
        key, value = cache.gather(tables[row], context)
        q = query[first:last].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        k = key.to(query.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, context, D]
        v = value.to(query.dtype).transpose(0, 1).unsqueeze(0)
        if query_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif query_len == context:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
            # A chunk after a cached prefix: causal aligned to the bottom right, by the flash
            # kernel without a [query, context] mask (1.3 GB at 8K x 164K) or repeated heads.
            prefix = context - query_len
            splits = prefix_splits(query_len, prefix, q.shape[1]) if split_prefill else 1
            if splits > 1:
                o = split_prefix_attention(q, k, v, splits, flash_attend)
            else:
                o = flash_attend(q, k, v, True, q.shape[-1] ** -0.5)[0]
        elif query.device.type == "cuda":
            # float32 (the torch backend): the flash kernel through SDPA's lower-right bias,
            # which takes equal head counts, so the key/value heads are repeated.
            # Imported here: torch.nn.attention.bias imports Triton, which the CPU never needs
            # (and Triton decides at its first import whether it runs interpreted).
            from torch.nn.attention.bias import causal_lower_right

            groups = q.shape[1] // k.shape[1]
            o = F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(groups, dim=1),
                v.repeat_interleave(groups, dim=1),
                attn_mask=causal_lower_right(query_len, context),
            )
        else:
            visible = torch.ones(query_len, context, dtype=torch.bool, device=query.device)
            visible = visible.tril(diagonal=context - query_len)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        out[first:last] = o.squeeze(0).transpose(0, 1)
    return out


#: Rows each part of a stacked projection starts on a multiple of: 64 bf16 values, 128 bytes.
#: The merged GEMM's output rows are then as wide as a multiple of 64 and every part's columns
#: start aligned, which keeps cuBLAS's and the Triton convolution's vectorised paths (a part of
#: Kimi's 12-row beta projection left unpadded made each output row start 8 bytes off, and the
#: KDA layer took twice its GPU time on the H100). For the Kimi-K3 proxy the padding is beta's
#: 52 zero rows, 0.8% of the stacked matrix's 6,336.
IN_PROJ_ALIGN = 64


def _stack_aligned(
    parts: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """``parts`` (``[rows_i, d]`` each) stacked by rows, each followed by zero rows up to a
    multiple of :data:`IN_PROJ_ALIGN`; with each part's ``(first row, rows)``."""
    blocks: list[torch.Tensor] = []
    layout: list[tuple[int, int]] = []
    start = 0
    for part in parts:
        rows = part.shape[0]
        padding = -rows % IN_PROJ_ALIGN
        layout.append((start, rows))
        blocks.append(part)
        if padding:
            blocks.append(part.new_zeros(padding, part.shape[1]))
        start += rows + padding
    return torch.cat(blocks), tuple(layout)


def _linear_weight(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A ``[out, in]`` weight with entries ``N(0, 1/in)`` (unit-variance outputs), drawn on the
    generator's device."""
    weight = torch.randn(out_features, in_features, generator=generator, device=generator.device)
    return weight / math.sqrt(in_features)


@dataclass(frozen=True)
class MLP:
    """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

    gate_up: torch.Tensor  # [2F, d]
    down: torch.Tensor  # [d, F]

    @classmethod
    def random(cls, config: ModelConfig, generator: torch.Generator, depth_scale: float) -> MLP:
        """Seeded weights; ``depth_scale`` shrinks the output projection (residual growth)."""
        hidden, inner = config.hidden_size, config.mlp_hidden_size
        return cls(
            gate_up=_linear_weight(2 * inner, hidden, generator),
            down=_linear_weight(hidden, inner, generator) * depth_scale,
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> MLP:
        """The same weights on ``device`` in ``dtype``."""
        return MLP(self.gate_up.to(device, dtype), self.down.to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, d] -> [T, d]``."""
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


@dataclass(frozen=True)
class KDALayer:
    """One Kimi Delta Attention layer (weights); its recurrent state lives in a StateCache."""

    # The four projections of the layer's input, stacked by rows into one matrix so that a step
    # runs them as one GEMM (one launch and one read of the input instead of four), as engines
    # merge q|k|v: ``in_proj = [qkv; gate_down; beta; out_gate_down]``, each part followed by
    # zero rows up to a multiple of IN_PROJ_ALIGN, ``in_parts`` each part's (first row, rows).
    in_proj: torch.Tensor  # [2HK + HV, K or HK, H, V rows, each rounded up to the alignment; d]
    in_parts: tuple[tuple[int, int], ...]
    gate_up: torch.Tensor | None  # [HK, K] (f_b); None with a full-rank gate
    out_gate_up: torch.Tensor  # [HV, V]  (g_b)
    out_norm: torch.Tensor  # [V]
    out: torch.Tensor  # [d, HV]
    params: KDALayerParams
    rms_eps: float

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        generator: torch.Generator,
        depth_scale: float,
        params_generator: torch.Generator | None = None,
    ) -> KDALayer:
        """Seeded weights in the ranges of trained Kimi layers (kernel parameters included).

        The projections are drawn from ``generator`` (on its device), the kernel parameters
        from ``params_generator`` (a CPU generator; default ``generator``).
        """
        d, heads, dim = config.hidden_size, config.kda_heads, config.kda_head_dim
        params = KDALayerParams.random(
            heads,
            dim,
            gate=config.kda_gate,
            conv_width=config.conv_width,
            generator=generator if params_generator is None else params_generator,
        )
        qkv = _linear_weight(3 * heads * dim, d, generator)
        if config.kda_full_rank_gate:
            gate_down, gate_up = _linear_weight(heads * dim, d, generator), None
        else:
            gate_down = _linear_weight(dim, d, generator)
            gate_up = _linear_weight(heads * dim, dim, generator)
        beta = _linear_weight(heads, d, generator)
        out_gate_down = _linear_weight(dim, d, generator)
        in_proj, in_parts = _stack_aligned((qkv, gate_down, beta, out_gate_down))
        return cls(
            in_proj=in_proj,
            in_parts=in_parts,
            gate_up=gate_up,
            out_gate_up=_linear_weight(heads * dim, dim, generator),
            out_norm=torch.ones(dim),
            out=_linear_weight(d, heads * dim, generator) * depth_scale,
            params=params,
            rms_eps=config.rms_eps,
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> KDALayer:
        """Projections on ``device`` in ``dtype``; kernel parameters keep their dtypes.

        The conv weight follows ``dtype`` (the kernels read it in float32 or better).
        """
        params = KDALayerParams(
            A_log=self.params.A_log.to(device),
            dt_bias=self.params.dt_bias.to(device),
            conv_weight=self.params.conv_weight.to(device, dtype),
            lower_bound=self.params.lower_bound,
            conv_activation=self.params.conv_activation,
        )
        return KDALayer(
            in_proj=self.in_proj.to(device, dtype),
            in_parts=self.in_parts,
            gate_up=None if self.gate_up is None else self.gate_up.to(device, dtype),
            out_gate_up=self.out_gate_up.to(device, dtype),
            out_norm=self.out_norm.to(device, dtype),
            out=self.out.to(device, dtype),
            params=params,
            rms_eps=self.rms_eps,
        )

    def forward(
        self,
        x: torch.Tensor,
        backend: KDABackend,
        cache: StateCache,
        plan: StatePlan,
        timer: KernelTimer | None = None,
    ) -> torch.Tensor:
        """``[T, d] -> [T, d]`` for a packed batch whose state slots ``plan`` names.

        ``plan`` was validated by ``backend.check_plan``; the kernel reads each row's initial
        state, writes every planned checkpoint and each row's running state, nothing else.
        ``timer`` accumulates the time spent in the kernel layer (conv + recurrence).
        """
        tokens = x.shape[0]
        heads, dim = self.params.num_heads, self.params.head_dim_k
        # One GEMM for the four input projections; each part is a column slice of its output
        # (rows apart by the merged width), which the kernel layer reads where it lies.
        projected = F.linear(x, self.in_proj)
        x_qkv, gate, beta, out_gate = (
            projected.narrow(1, start, size) for start, size in self.in_parts
        )
        if self.gate_up is not None:
            gate = F.linear(gate, self.gate_up)
        gate = gate.view(tokens, heads, dim)
        # Launched before the kernel layer, whose host work (two Triton launches and the
        # recurrence's) is the longest stretch of a layer without GPU work of its own: the
        # output gate (its up projection and sigmoid) is more work queued for the GPU meanwhile.
        out_gate = torch.sigmoid(F.linear(out_gate, self.out_gate_up).view(tokens, heads, dim))
        if timer is None:
            o = run_prefill(backend, x_qkv, gate, beta, self.params, cache, plan)
        else:
            with timer.measure():
                o = run_prefill(backend, x_qkv, gate, beta, self.params, cache, plan)
        o = rms_norm(o, self.out_norm, self.rms_eps) * out_gate
        return F.linear(o.reshape(tokens, heads * dim), self.out)


@dataclass(frozen=True)
class AttentionLayer:
    """Causal grouped-query attention over a paged KV cache, no positional encoding."""

    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, d]
    out: torch.Tensor  # [d, Hq D]
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def random(
        cls, config: ModelConfig, generator: torch.Generator, depth_scale: float
    ) -> AttentionLayer:
        """Seeded weights."""
        d = config.hidden_size
        heads, kv_heads = config.attention_heads, config.attention_kv_heads
        dim = config.attention_head_dim
        return cls(
            qkv=_linear_weight((heads + 2 * kv_heads) * dim, d, generator),
            out=_linear_weight(d, heads * dim, generator) * depth_scale,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> AttentionLayer:
        """The same weights on ``device`` in ``dtype``."""
        return AttentionLayer(
            qkv=self.qkv.to(device, dtype),
            out=self.out.to(device, dtype),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def forward(
        self,
        x: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor | np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        *,
        slots_checked: bool = False,
        decode: DecodeRows | None = None,
        split_prefill: bool = True,
    ) -> torch.Tensor:
        """``[T, d] -> [T, d]``: writes this step's K/V at ``slot_mapping``, then attends.

        ``block_tables`` ``[R, C]`` lists each row's blocks (its whole context, this step's
        tokens included); ``seq_lens`` ``[R]`` is each row's context length after the step.
        ``slots_checked``: see ``PagedKVCache.write``'s ``checked``. ``decode``: the step's
        decode rows for the Triton decode kernel, ``split_prefill`` whether a chunk's cached
        prefix may be split across the GPU (both: :func:`paged_causal_attention`).
        """
        tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = torch.split(
            F.linear(x, self.qkv), [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1
        )
        cache.write(
            slot_mapping,
            k.view(tokens, kv_heads, dim),
            v.view(tokens, kv_heads, dim),
            checked=slots_checked,
        )
        o = paged_causal_attention(
            q.reshape(tokens, heads, dim),
            cache,
            block_tables,
            seq_lens,
            query_start_loc,
            decode,
            split_prefill,
        )
        return F.linear(o.reshape(tokens, heads * dim), self.out)
