"""One-token rows of a KDA layer in one Triton kernel, reading and writing the state cache in place.

A decode row (one query token) needs one step of the recurrence (``reference``'s formulas)::

    a = gate(g);  S' = diag(exp(a)) S;  u = v - S'^T k^
    S_new = S' + beta k^ u^T;  o = S_new^T (scale q^)

A chunked kernel such as FlashKDA's op takes its initial states as one dense ``[N, H, V, K]``
tensor and returns its final states the same way, so every row of a call costs two state moves
(cache -> batch, batch -> cache) besides the kernel's own read and write. Here each program loads
a ``[BV, K]`` tile of the row's state from its initial slot (zeros for slot -1), applies the
step, and stores the tile into the row's running slot: the state crosses memory once each way
(a one-token row has no interior checkpoint: the plan check allows none at a query's end). This
is how serving engines run a hybrid model's decode rows (a fused recurrent kernel indexed by
state slots), beside a chunked kernel for the prefill rows.

The plan check guarantees that no slot a step writes is a slot it reads, so programs never read
what others write. The gate, normalisation and beta follow ``reference.prepare_inputs`` in
float32 (float64 for float64 inputs); the state is accumulated in that precision and stored in
the cache's dtype. Different from a chunked kernel's arithmetic by rounding only.

The kernel is compiled on first use; with ``TRITON_INTERPRET=1`` before that, Triton runs it on
CPU tensors through its interpreter (how the CPU tests check it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .backend import upload
from .params import KDALayerParams
from .plan import StatePlan
from .reference import L2_EPS

__all__ = ["DecodeInputs", "bind_decode_inputs", "kda_decode_triton", "one_token_rows"]

#: Rows of a state tile (of V) one program updates, and the warps of a program: the fastest of
#: ``benchmarks/gpu_kda_decode.py``'s settings on an H100 (2026-12-06, 7 rows of Kimi-K3's 12
#: heads at TP8: 5.29 us a launch, against 5.65 at 32 rows and 4 warps).
BLOCK_V = 16
NUM_WARPS = 2


def one_token_rows(plan: StatePlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(rows of one query token, the other rows)`` of ``plan``, in row order (computed once per
    plan)."""

    def split() -> tuple[tuple[int, ...], tuple[int, ...]]:
        single = tuple(r for r in range(plan.num_rows) if plan.query_len(r) == 1)
        other = tuple(r for r in range(plan.num_rows) if plan.query_len(r) != 1)
        return single, other

    return plan.derived(("one-token-rows",), split)


@dataclass(frozen=True)
class DecodeInputs:
    """The index arrays of a plan's one-token rows on a device (int64): each row's token in the
    packed batch, its initial slot (-1: zero state) and its running slot."""

    token: torch.Tensor
    initial: torch.Tensor
    running: torch.Tensor

    @classmethod
    def build(cls, plan: StatePlan, rows: tuple[int, ...], device: torch.device) -> DecodeInputs:
        """Every array in one host-to-device copy."""
        if any(plan.checkpoints[row] for row in rows):
            raise ValueError("a one-token row has no interior checkpoint (the plan check says so)")
        token, initial, running = upload(
            device,
            [plan.start(row) for row in rows],
            [plan.initial_slot[row] for row in rows],
            [plan.running_slot[row] for row in rows],
        )
        return cls(token, initial, running)


def bind_decode_inputs(
    plan: StatePlan,
    device: torch.device,
    *,
    token: torch.Tensor,
    initial: torch.Tensor,
    running: torch.Tensor,
) -> None:
    """Make :func:`kda_decode_triton` read ``plan``'s index arrays (a plan of one-token rows)
    from these int64 device tensors instead of uploading them: a CUDA graph's static inputs,
    refilled before each replay. Raises ``ValueError`` on a plan with other rows."""
    single, other = one_token_rows(plan)
    if other:
        raise ValueError("only a plan of one-token rows has bound decode inputs")
    inputs = DecodeInputs(token, initial, running)
    plan.derived(("kda-decode", device, single), lambda: inputs)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def kda_decode_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, a_log_ptr, dt_bias_ptr,
        token_ptr, initial_ptr, running_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
        stride_bt, stride_bh, stride_ot, stride_oh,
        heads, scale, lower_bound,
        K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BOUNDED: tl.constexpr,
        COMPUTE_F64: tl.constexpr, EPS: tl.constexpr,
    ):  # fmt: skip
        # One program: one row, one head, BV rows of the head's [V, K] state.
        row = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        vs = tl.program_id(2) * BV + tl.arange(0, BV).to(tl.int64)
        ks = tl.arange(0, K).to(tl.int64)
        compute = tl.float64 if COMPUTE_F64 else tl.float32
        token = tl.load(token_ptr + row).to(tl.int64)
        source = tl.load(initial_ptr + row).to(tl.int64)
        target = tl.load(running_ptr + row).to(tl.int64)

        q = tl.load(q_ptr + token * stride_qt + head * stride_qh + ks).to(compute)
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + ks).to(compute)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + EPS)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + EPS)
        g = tl.load(g_ptr + token * stride_gt + head * stride_gh + ks).to(compute)
        biased = g + tl.load(dt_bias_ptr + head * K + ks).to(compute)
        decay = tl.exp(tl.load(a_log_ptr + head).to(compute))
        if BOUNDED:
            a = lower_bound * (1.0 / (1.0 + tl.exp(-(decay * biased))))
        else:
            # -exp(A_log) * softplus(biased), softplus(x) = max(x, 0) + log(1 + exp(-|x|))
            a = -decay * (tl.maximum(biased, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(biased))))
        b = tl.load(beta_ptr + token * stride_bt + head * stride_bh).to(compute)
        b = 1.0 / (1.0 + tl.exp(-b))
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + vs).to(compute)

        tile = head * V * K + vs[:, None] * K + ks[None, :]
        size = heads * V * K
        present = (tile * 0 + source) >= 0
        state = tl.load(
            state_ptr + tl.maximum(source, 0) * size + tile, mask=present, other=0.0
        ).to(compute)
        state = state * tl.exp(a)[None, :]
        u = v - tl.sum(state * k[None, :], axis=1)
        state = state + (b * u)[:, None] * k[None, :]
        o = tl.sum(state * (scale * q)[None, :], axis=1)
        tl.store(state_ptr + target * size + tile, state.to(state_ptr.dtype.element_ty))
        tl.store(
            out_ptr + token * stride_ot + head * stride_oh + vs, o.to(out_ptr.dtype.element_ty)
        )

    return kda_decode_kernel


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    params: KDALayerParams,
    recurrent: torch.Tensor,
    out: torch.Tensor,
    block_v: int,
) -> None:
    """:func:`kda_decode_triton`'s checks (``ValueError``)."""
    heads, key_dim, value_dim = params.num_heads, params.head_dim_k, params.head_dim_v
    if not (_is_power_of_two(key_dim) and _is_power_of_two(value_dim)):
        raise ValueError(
            f"the decode kernel needs K and V powers of two, got {key_dim}, {value_dim}"
        )
    if recurrent.shape[1:] != (heads, value_dim, key_dim) or not recurrent.is_contiguous():
        raise ValueError(
            f"the state cache must be a contiguous [slots, {heads}, {value_dim}, {key_dim}], "
            f"got {tuple(recurrent.shape)}"
        )
    tensors = {"q": q, "k": k, "g": g, "v": v, "out": out}
    for name, tensor in tensors.items():
        if tensor.dim() != 3 or tensor.shape[1] != heads or tensor.stride(2) != 1:
            raise ValueError(
                f"{name} must be [T, {heads}, D] with a contiguous last axis, "
                f"got {tuple(tensor.shape)} strides {tensor.stride()}"
            )
    if beta.dim() != 2 or beta.shape[1] != heads:
        raise ValueError(f"beta must be [T, {heads}], got {tuple(beta.shape)}")
    device = recurrent.device
    for name, tensor in {**tensors, "beta": beta, "A_log": params.A_log,
                         "dt_bias": params.dt_bias}.items():  # fmt: skip
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, the state cache on {device}")
    if not (_is_power_of_two(block_v) and block_v <= value_dim):
        raise ValueError(f"block_v must be a power of two <= V = {value_dim}, got {block_v}")


def kda_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    params: KDALayerParams,
    recurrent: torch.Tensor,
    plan: StatePlan,
    out: torch.Tensor,
    *,
    block_v: int | None = None,
    num_warps: int = NUM_WARPS,
    checked: bool = False,
) -> None:
    """One recurrence step for each one-token row of ``plan`` (:func:`one_token_rows`), in place.

    Inputs are the packed batch's ``[T, H, K]`` post-conv ``q``, ``k``, raw ``g``, ``[T, H, V]``
    ``v`` and raw ``[T, H]`` ``beta`` (the last axis contiguous); ``recurrent`` is the contiguous
    ``[slots, H, V, K]`` state cache. Writes those rows' outputs into ``out`` ``[T, H, V]`` and
    their states into their running slots; other rows are untouched.
    ``plan`` must be validated (slots in range, written slots never read). K and V must be powers
    of two. Needs CUDA tensors, or ``TRITON_INTERPRET=1`` on the CPU. ``block_v`` (state rows a
    program updates, at most V; default ``min(BLOCK_V, V)``) and ``num_warps`` tune the launch,
    not the arithmetic. ``checked``: the caller has made this function's checks (a backend's
    ``forward`` after ``run_prefill`` validated the layer's shapes and devices and
    ``check_layer`` its K = V = 128): every layer of every step comes through here, so they are
    not made twice.
    """
    rows, _ = one_token_rows(plan)
    if not rows:
        return
    heads, key_dim, value_dim = params.num_heads, params.head_dim_k, params.head_dim_v
    if block_v is None:
        block_v = min(BLOCK_V, value_dim)
    if not checked:
        _check(q, k, v, g, beta, params, recurrent, out, block_v)
    device = recurrent.device
    inputs = plan.derived(
        ("kda-decode", device, rows), lambda: DecodeInputs.build(plan, rows, device)
    )
    lower_bound = params.lower_bound
    _kernel()[(len(rows), heads, value_dim // block_v)](
        q, k, v, g, beta, out, recurrent, params.A_log, params.dt_bias,
        inputs.token, inputs.initial, inputs.running,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        heads, float(key_dim**-0.5), 0.0 if lower_bound is None else float(lower_bound),
        K=key_dim, V=value_dim, BV=block_v, BOUNDED=lower_bound is not None,
        COMPUTE_F64=recurrent.dtype == torch.float64, EPS=L2_EPS, num_warps=num_warps,
    )  # fmt: skip
