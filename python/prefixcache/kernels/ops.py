"""The entry points a model layer calls: ``kda_prefill`` and ``kda_decode``.

Both take the packed pre-conv projection ``x_qkv`` ``[T, 2*H*K + H*V]`` (or the tuple ``(q, k,
v)`` of its three parts), the raw gate input ``g`` ``[T, H, K]`` (or ``[T, H*K]``), the raw beta
logits ``beta`` ``[T, H]``, the layer's :class:`KDALayerParams`, its :class:`StateCache`, and the
state group's plan arrays (NumPy or torch; see ``validate``). They validate the plan with the
backend's rules *before writing anything*, run the short convolution (storing conv windows at
every cut), then the backend's recurrence (storing states at every cut), and return the output
``[T, H, V]`` in ``x_qkv``'s dtype. The output gate / norm / output projection belong to the model.

The inputs may be column slices of a wider tensor (the model computes them in one GEMM): the
convolution reads ``x_qkv``'s rows where they lie (each row's channels must be contiguous), and
``g`` and ``beta`` are made contiguous once before the backend sees them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._convert import ArrayLike
from .backend import CONV_IMPLS, KDABackend
from .conv import causal_conv
from .errors import UnsupportedLayerError
from .params import KDALayerParams
from .plan import StatePlan
from .state_cache import StateCache

__all__ = ["QKV", "conv_function", "default_conv", "kda_decode", "kda_prefill", "run_prefill"]

QKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _packed(x_qkv: QKV) -> torch.Tensor:
    if isinstance(x_qkv, torch.Tensor):
        return x_qkv
    return torch.cat(list(x_qkv), dim=-1)


def kda_prefill(
    backend: KDABackend,
    x_qkv: QKV,
    g: torch.Tensor,
    beta: torch.Tensor,
    params: KDALayerParams,
    cache: StateCache,
    query_start_loc: ArrayLike,
    initial_slot: ArrayLike,
    running_slot: ArrayLike,
    checkpoint_offsets: ArrayLike | None = None,
    checkpoint_slots: ArrayLike | None = None,
) -> torch.Tensor:
    """One KDA layer's short conv + recurrence over a packed batch (see the module docstring).

    Reads row r's initial state from slot ``initial_slot[r]`` (zero state for -1), writes the
    state (conv window and recurrent state) after each planned checkpoint offset into its slot
    and the final state into ``running_slot[r]``, and touches no other slot.
    Raises ``KernelPlanError`` on a plan the backend refuses and ``UnsupportedLayerError`` on a
    layer it cannot run; in both cases nothing has been written.
    """
    x = _packed(x_qkv)
    plan = backend.check_plan(
        query_start_loc=query_start_loc,
        initial_slot=initial_slot,
        running_slot=running_slot,
        checkpoint_offsets=checkpoint_offsets,
        checkpoint_slots=checkpoint_slots,
        num_slots=cache.num_blocks,
        num_tokens=x.shape[0],
    )
    return run_prefill(backend, x, g, beta, params, cache, plan)


def kda_decode(
    backend: KDABackend,
    x_qkv: QKV,
    g: torch.Tensor,
    beta: torch.Tensor,
    params: KDALayerParams,
    cache: StateCache,
    initial_slot: ArrayLike,
    running_slot: ArrayLike,
) -> torch.Tensor:
    """One token per sequence: ``x_qkv`` ``[R, C]``, ``g`` ``[R, H, K]``, ``beta`` ``[R, H]``.

    The same computation as :func:`kda_prefill` with ``query_start_loc = 0..R`` and no
    checkpoints (a position at the end of a decode step is kept by a snapshot). Returns
    ``[R, H, V]``.
    """
    x = _packed(x_qkv)
    rows = x.shape[0]
    plan = backend.check_plan(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int64),
        initial_slot=initial_slot,
        running_slot=running_slot,
        num_slots=cache.num_blocks,
        num_tokens=rows,
    )
    return run_prefill(backend, x, g, beta, params, cache, plan)


def run_prefill(
    backend: KDABackend,
    x: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    params: KDALayerParams,
    cache: StateCache,
    plan: StatePlan,
) -> torch.Tensor:
    """:func:`kda_prefill` on a plan already validated by ``backend.check_plan``."""
    heads, key_dim, value_dim = params.num_heads, params.head_dim_k, params.head_dim_v
    tokens = plan.num_tokens
    if x.dim() != 2 or x.shape != (tokens, params.conv_channels):
        raise ValueError(
            f"x_qkv must be [T={tokens}, C={params.conv_channels}], got {tuple(x.shape)}"
        )
    if g.numel() != tokens * heads * key_dim:
        raise ValueError(f"g must be [T={tokens}, H={heads}, K={key_dim}], got {tuple(g.shape)}")
    if beta.numel() != tokens * heads:
        raise ValueError(f"beta must be [T={tokens}, H={heads}], got {tuple(beta.shape)}")
    if (cache.num_heads, cache.head_dim_v, cache.head_dim_k) != (heads, value_dim, key_dim):
        raise ValueError(
            f"state cache is [H={cache.num_heads}, V={cache.head_dim_v}, K={cache.head_dim_k}], "
            f"the layer is [H={heads}, V={value_dim}, K={key_dim}]"
        )
    for name, tensor in (("the state cache", cache.recurrent), ("g", g), ("beta", beta),
                         ("A_log", params.A_log), ("dt_bias", params.dt_bias)):  # fmt: skip
        if tensor.device != x.device:
            raise ValueError(f"inputs are on {x.device} but {name} is on {tensor.device}")
    backend.check_layer(params, x.dtype, x.device)
    conv = conv_function(backend.conv_impl, x.device)
    q, k, v = conv(
        x, params, cache.conv, plan, splits=(heads * key_dim, heads * key_dim, heads * value_dim)
    )
    return backend.forward(
        q.view(tokens, heads, key_dim),
        k.view(tokens, heads, key_dim),
        v.view(tokens, heads, value_dim),
        # Contiguous for every backend (a no-op where they are): the model's projections
        # hand over column slices of one GEMM's output.
        g.reshape(tokens, heads, key_dim).contiguous(),
        beta.reshape(tokens, heads).contiguous(),
        params,
        cache.recurrent,
        plan,
    )


def default_conv(device: torch.device) -> str:
    """The short convolution a backend runs by default on ``device``: ``"triton"`` on CUDA when
    Triton is installed (one launch; 4 to 6x faster than the torch version on the H200
    and a quarter of its launch time), ``"torch"`` elsewhere (``conv_triton.triton_runs_on``)."""
    from .conv_triton import triton_runs_on

    return "triton" if triton_runs_on(device, "the short convolution") else "torch"


def conv_function(impl: str, device: torch.device) -> Callable[..., list[torch.Tensor]]:
    """The short-convolution implementation ``impl`` (a backend's ``conv_impl``) for tensors on
    ``device``. Raises ``ValueError`` on an unknown name and ``UnsupportedLayerError`` when the
    implementation cannot run there."""
    if impl == "torch":
        return causal_conv
    if impl == "triton":
        from .conv_triton import causal_conv_triton, triton_unavailable_reason

        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise UnsupportedLayerError(f"conv_impl 'triton': {reason}")
        return causal_conv_triton
    raise ValueError(f"conv_impl must be one of {', '.join(CONV_IMPLS)}, got {impl!r}")
