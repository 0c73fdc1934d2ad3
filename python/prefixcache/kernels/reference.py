"""The KDA math in plain torch: gates, normalisation, and the recurrence two ways.

Per sequence and head, with state ``S`` ``[K, V]`` (the caches store ``S^T``)::

    a_t    = lower_bound * sigmoid(exp(A_log) * (g_t + dt_bias))     bounded gate (Kimi-K3)
           | -exp(A_log) * softplus(g_t + dt_bias)                    original gate (Kimi-Linear)
    beta_t = sigmoid(b_t);  q^ = q / sqrt(sum q^2 + 1e-6);  k^ likewise;  scale = K ** -0.5
    S'_t   = diag(exp(a_t)) S_{t-1}
    u_t    = v_t - S'_t^T k^_t
    S_t    = S'_t + beta_t k^_t u_t^T
    o_t    = S_t^T (scale q^_t)

:func:`recurrence_loop` runs this token by token; :func:`recurrence_chunked` is the chunkwise (WY)
form: within a chunk of n tokens with cumulative log decays ``G_t = sum_{s<=t} a_s``,
``(I + M) U = V - (k^ * e^G) S_0`` with ``M[t, s] = beta_s k^_t . (e^(G_t - G_s) * k^_s)`` for
``s < t``, ``O = scale ((q^ * e^G) S_0 + P U)`` with ``P`` the same product of ``q^`` and ``k^``
for ``s <= t``, and ``S_n = e^(G_n) * S_0 + sum_s (e^(G_n - G_s) * k^_s) beta_s u_s^T``. Every
exponent is <= 0, so nothing overflows. Both functions act on one segment of one sequence,
vectorised over heads; they agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .params import KDALayerParams

__all__ = [
    "kda_gate",
    "l2_normalize",
    "prepare_inputs",
    "recurrence_chunked",
    "recurrence_loop",
]

L2_EPS = 1e-6


def kda_gate(g: torch.Tensor, params: KDALayerParams) -> torch.Tensor:
    """Log decay ``a`` ``[..., H, K]`` from the raw gate input ``g`` ``[..., H, K]``."""
    a_log = params.A_log.to(device=g.device, dtype=g.dtype)[:, None]
    biased = g + params.dt_bias.to(device=g.device, dtype=g.dtype)
    if params.lower_bound is None:
        return -torch.exp(a_log) * F.softplus(biased)
    return params.lower_bound * torch.sigmoid(torch.exp(a_log) * biased)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis (the kernels' in-kernel l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    params: KDALayerParams,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-conv ``q, k`` ``[T, H, K]``, ``v`` ``[T, H, V]``, raw ``g`` ``[T, H, K]`` and raw
    ``beta`` ``[T, H]`` -> ``(q^, k^, v, a, sigmoid(beta))`` in ``dtype``."""
    q_hat = l2_normalize(q.to(dtype))
    k_hat = l2_normalize(k.to(dtype))
    a = kda_gate(g.to(dtype), params)
    return q_hat, k_hat, v.to(dtype), a, torch.sigmoid(beta.to(dtype))


def recurrence_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence over one segment.

    Inputs as returned by :func:`prepare_inputs` (``[n, H, *]``), ``state`` ``[H, K, V]``.
    Returns ``(o [n, H, V], state after the segment)``; ``state`` is not modified.
    """
    out = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        state = state * torch.exp(a[t])[:, :, None]
        u = v[t] - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + (beta[t][:, None] * k[t])[:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", scale * q[t], state)
    return out, state


def recurrence_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise (WY) recurrence over one segment, chunks counted from the segment's start.

    Same contract as :func:`recurrence_loop`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    outputs = []
    for first in range(0, q.shape[0], chunk_size):
        last = min(first + chunk_size, q.shape[0])
        out, state = _chunk(
            q[first:last], k[first:last], v[first:last], a[first:last], beta[first:last],
            scale, state,
        )  # fmt: skip
        outputs.append(out)
    if not outputs:
        return v.new_empty(v.shape), state
    return torch.cat(outputs), state


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    n = q.shape[0]
    cumulative = torch.cumsum(a, dim=0)  # G [n, H, K]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    difference = cumulative[:, None] - cumulative[None, :]  # G_t - G_s [n, n, H, K]
    decay = torch.exp(difference.masked_fill(~causal[:, :, None, None], float("-inf")))
    beta_s = beta.transpose(0, 1)[:, None, :]  # [H, 1, n]: beta of the column token s
    key_key = torch.einsum("thk,shk,tshk->hts", k, k, decay) * beta_s
    query_key = torch.einsum("thk,shk,tshk->hts", q, k, decay) * beta_s
    system = torch.eye(n, dtype=q.dtype, device=q.device) + key_key.tril(-1)
    decay_all = torch.exp(cumulative)  # e^{G_t} [n, H, K]
    rhs = v.transpose(0, 1) - torch.einsum("thk,hkv->htv", k * decay_all, state)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = scale * (torch.einsum("thk,hkv->htv", q * decay_all, state) + query_key @ u)
    to_end = torch.exp(cumulative[-1][None] - cumulative) * k * beta[:, :, None]  # [n, H, K]
    state = decay_all[-1][:, :, None] * state + torch.einsum("shk,hsv->hkv", to_end, u)
    return out.transpose(0, 1), state
