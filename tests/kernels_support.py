"""Shared helpers of the kernel tests: the kernels, random layers, plans and naive math.

The kernel layer asks the core which checkpoint offsets are exportable, so its tests need the
Rust extension like every other test (``make install`` builds it).

The Triton kernels' tests run on :data:`DEVICE`: CUDA where there is one, else CPU tensors
through Triton's interpreter (``TRITON_INTERPRET=1``, set here, before any kernel is compiled).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prefixcache import kernels  # noqa: E402

F64 = torch.float64


@dataclass
class Batch:
    """Random inputs of one packed step."""

    x: torch.Tensor  # [T, C]
    g: torch.Tensor  # [T, H, K]
    beta: torch.Tensor  # [T, H]


def make_params(
    heads: int = 2,
    key_dim: int = 8,
    value_dim: int | None = None,
    gate: str = "bounded",
    seed: int = 0,
):
    generator = torch.Generator().manual_seed(seed)
    return kernels.KDALayerParams.random(
        heads, key_dim, head_dim_v=value_dim, gate=gate, dtype=F64, generator=generator
    )


def make_batch(params, num_tokens: int, seed: int = 1, dtype: torch.dtype = F64) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    heads, key_dim = params.num_heads, params.head_dim_k
    return Batch(
        x=torch.randn(num_tokens, params.conv_channels, generator=generator, dtype=F64).to(dtype),
        g=torch.randn(num_tokens, heads, key_dim, generator=generator, dtype=F64).to(dtype),
        beta=torch.randn(num_tokens, heads, generator=generator, dtype=F64).to(dtype),
    )


def make_cache(params, num_blocks: int, seed: int = 2, poison: bool = True, dtype=F64):
    """A cache with NaN in every slot (when ``poison``) except random states in ``fill``."""
    cache = kernels.StateCache.for_layer(params, num_blocks, conv_dtype=dtype, state_dtype=dtype)
    if poison:
        cache.fill_(float("nan"))
    return cache


def fill_slot(cache, slot: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    conv = torch.randn(cache.conv.shape[1:], generator=generator, dtype=F64)
    state = 0.3 * torch.randn(cache.recurrent.shape[1:], generator=generator, dtype=F64)
    cache.conv[slot] = conv.to(cache.conv.dtype)
    cache.recurrent[slot] = state.to(cache.recurrent.dtype)


def pad_checkpoints(rows: list[list[tuple[int, int]]]) -> tuple[list[list[int]], list[list[int]]]:
    """Rows of ``(offset, slot)`` -> padded ``checkpoint_offsets`` / ``checkpoint_slots``."""
    width = max((len(r) for r in rows), default=0)
    offsets = [[o for o, _ in r] + [0] * (width - len(r)) for r in rows]
    slots = [[s for _, s in r] + [-1] * (width - len(r)) for r in rows]
    return offsets, slots


def naive_kda(params, batch: Batch, lengths, initial_conv, initial_state):
    """The KDA recurrence, written out independently: per sequence, per head, per token.

    ``initial_conv[r]`` is ``[C, W-1]`` or None, ``initial_state[r]`` ``[H, V, K]`` or None.
    Returns ``(outputs [T, H, V], final conv windows, final states [H, V, K])`` per row.
    """
    heads, key_dim, value_dim = params.num_heads, params.head_dim_k, params.head_dim_v
    width = params.conv_width
    outputs, conv_windows, states = [], [], []
    start = 0
    for row, length in enumerate(lengths):
        x = batch.x[start : start + length].to(F64)
        history = (
            initial_conv[row].to(F64).T
            if initial_conv[row] is not None
            else torch.zeros(width - 1, x.shape[1], dtype=F64)
        )
        padded = torch.cat([history, x])  # [W-1+L, C]
        conv = F.conv1d(padded.T[None], params.conv_weight.to(F64)[:, None, :], groups=x.shape[1])[
            0
        ].T
        if params.conv_activation == "silu":
            conv = F.silu(conv)
        q = conv[:, : heads * key_dim].reshape(length, heads, key_dim)
        k = conv[:, heads * key_dim : 2 * heads * key_dim].reshape(length, heads, key_dim)
        v = conv[:, 2 * heads * key_dim :].reshape(length, heads, value_dim)
        g = batch.g[start : start + length].to(F64)
        b = torch.sigmoid(batch.beta[start : start + length].to(F64))
        out = torch.zeros(length, heads, value_dim, dtype=F64)
        final = torch.zeros(heads, value_dim, key_dim, dtype=F64)
        for h in range(heads):
            a_log = float(params.A_log[h])
            s = (
                initial_state[row][h].to(F64).T.clone()
                if initial_state[row] is not None
                else torch.zeros(key_dim, value_dim, dtype=F64)
            )
            for t in range(length):
                pre = g[t, h] + params.dt_bias[h].to(F64)
                if params.lower_bound is None:
                    a = -math.exp(a_log) * F.softplus(pre)
                else:
                    a = params.lower_bound * torch.sigmoid(math.exp(a_log) * pre)
                qh = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + 1e-6)
                kh = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + 1e-6)
                s = torch.diag(torch.exp(a)) @ s
                u = v[t, h] - s.T @ kh
                s = s + b[t, h] * torch.outer(kh, u)
                out[t, h] = s.T @ (key_dim**-0.5 * qh)
            final[h] = s.T
        outputs.append(out)
        conv_windows.append(padded[-(width - 1) :].T)
        states.append(final)
        start += length
    return torch.cat(outputs), conv_windows, states


def reference_kernel(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                     interior_offsets=None, chunk=None):  # fmt: skip
    """A float64 stand-in for the GPU kernels' common contract, on the CPU.

    Packed ``[1, T, H, *]`` inputs with raw gate and beta, ``initial_state`` ``[N, H, V, K]`` or
    None, ``cu_seqlens`` int64 ``[N+1]``. Returns ``(o [1, T, H, V], final [N, H, V, K],
    interior [N, H, V, K] (the state at ``interior_offsets[i]``, NaN where none or 0),
    h [NT, H, V, K]`` (with ``chunk``: the state before each chunk of each sequence, fla's
    ``h``, flattened over sequences) ``)``.
    """
    heads, key_dim = q.shape[2], q.shape[3]
    value_dim = v.shape[3]
    params = kernels.KDALayerParams(
        A_log=A_log.to(F64),
        dt_bias=dt_bias.reshape(heads, key_dim).to(F64),
        conv_weight=torch.zeros(2 * heads * key_dim + heads * value_dim, 4, dtype=F64),
        lower_bound=lower_bound,
    )
    cu = cu_seqlens.tolist()
    sequences = len(cu) - 1
    out = torch.empty(v.shape, dtype=v.dtype)
    final = torch.empty(sequences, heads, value_dim, key_dim, dtype=F64)
    interior = torch.full_like(final, float("nan"))
    chunk_states = []
    scale = key_dim**-0.5
    for i in range(sequences):
        a, b = cu[i], cu[i + 1]
        inputs = kernels.reference.prepare_inputs(
            q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], params, F64
        )
        state = (
            torch.zeros(heads, key_dim, value_dim, dtype=F64)
            if initial_state is None
            else initial_state[i].to(F64).transpose(-1, -2)
        )
        cuts = set(range(0, b - a, chunk)) if chunk else set()
        stop = 0 if interior_offsets is None else int(interior_offsets[i])
        for t in range(b - a):
            if t in cuts:
                chunk_states.append(state.transpose(-1, -2).clone())
            if t == stop and stop > 0:
                interior[i] = state.transpose(-1, -2)
            step = tuple(x[t : t + 1] for x in inputs)
            o, state = kernels.reference.recurrence_loop(*step, scale, state)
            out[0, a + t] = o[0].to(out.dtype)
        final[i] = state.transpose(-1, -2)
    h = torch.stack(chunk_states) if chunk_states else None
    return out, final, interior, h
