"""Attention of a prefill chunk after a cached prefix, with the prefix split across the GPU.

A chunk of T query tokens at the end of a C-token context (a prefix of P = C - T cached tokens)
attends to the whole prefix and causally to itself. One flash-attention call over the whole
context runs ``Hq * ceil(T / 128)`` blocks of work: 192 for the Kimi-K3 proxy's 12 query heads
at T = 2,048, too few to fill a 132-multiprocessor GPU, so a short chunk costs nearly what a
longer one costs (the H200 measured 4.0 us a token at T = 2,048 against 2.7 at T = 8,192, after
128K cached tokens). Flash-decoding's remedy, applied to a prefill chunk:

- the first ``S * L`` prefix tokens (``L = P // S``) are cut into S pieces of L tokens, which every
  query token sees whole: one batched, non-causal call of S x the blocks;
- the rest (the last ``P - S * L`` prefix tokens and the chunk itself) in one causal call aligned
  to the bottom right (query i sees every key up to its own position);
- the S + 1 partial results are merged exactly by their log-sum-exps:
  ``out = sum_i exp(lse_i - M) out_i / sum_i exp(lse_i - M)``, M the largest.

Grouped-query heads are passed as they are (flash kernels take fewer key/value heads), so no
key/value head is repeated. :func:`split_prefix_attention` takes the attention of one piece as an
argument: :func:`flash_attend` on CUDA (torch's flash kernel, which returns the log-sum-exp), or
:func:`math_attend` (plain softmax, any device), against which the CPU tests check the split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "Attend",
    "flash_attend",
    "math_attend",
    "prefix_splits",
    "split_prefix_attention",
]

#: ``attend(q [B, Hq, T, D], k [B, Hkv, L, D], v, causal, scale) -> (out [B, Hq, T, D] in q's
#: dtype, lse [B, Hq, T] float32)``; ``causal``: aligned to the bottom right.
Attend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]
]

#: Blocks of work the split aims at: a few waves of a 132-multiprocessor GPU.
TARGET_BLOCKS = 6 * 132
#: Query tokens per block of work of the flash kernel.
QUERY_TILE = 128
#: The shortest prefix piece worth a split (shorter ones cost more to merge than they save).
MIN_PIECE = 4096


def prefix_splits(query_len: int, prefix_len: int, heads: int) -> int:
    """S, the number of prefix pieces for a chunk of ``query_len`` tokens after ``prefix_len``
    cached ones with ``heads`` query heads: none (1) when one call has at least half of
    :data:`TARGET_BLOCKS` blocks of work, else enough pieces for :data:`TARGET_BLOCKS`, no piece
    under :data:`MIN_PIECE` tokens. On the H200 at 131,072 cached tokens, 5 pieces took a
    2,048-token chunk from 8.19 to 5.93 ms and 3 pieces a 4,096-token one from 14.74 to 10.63 ms,
    while 2 pieces made an 8,192-token chunk (768 blocks) 4% slower."""
    blocks = heads * -(-query_len // QUERY_TILE)
    if 2 * blocks >= TARGET_BLOCKS:
        return 1
    wanted = -(-TARGET_BLOCKS // max(1, blocks))
    return max(1, min(wanted, prefix_len // MIN_PIECE))


def split_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    splits: int,
    attend: Attend,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[1, Hq, T, D]`` (the last T positions) over ``k``, ``v``
    ``[1, Hkv, C, D]`` (the whole context, ``C > T``), the prefix cut into ``splits`` pieces (module
    docstring). Returns ``[1, Hq, T, D]`` in ``q``'s dtype."""
    query_len, context = q.shape[2], k.shape[2]
    prefix = context - query_len
    if splits < 1 or prefix < splits:
        raise ValueError(f"cannot cut a prefix of {prefix} tokens into {splits} pieces")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    piece = prefix // splits
    cut = splits * piece
    kv_heads, dim = k.shape[1], k.shape[3]

    def pieces(x: torch.Tensor) -> torch.Tensor:  # [1, Hkv, C, D] -> [S, Hkv, L, D], a view
        return x[0, :, :cut].view(kv_heads, splits, piece, dim).transpose(0, 1)

    assert k.shape == (1, kv_heads, context, dim)
    head_out, head_lse = attend(
        q.expand(splits, -1, -1, -1).contiguous(), pieces(k), pieces(v), False, scale
    )
    tail_out, tail_lse = attend(q, k[:, :, cut:], v[:, :, cut:], True, scale)
    precise = torch.promote_types(q.dtype, torch.float32)
    lse = torch.cat([head_lse, tail_lse]).to(precise)  # [S + 1, Hq, T]
    outs = torch.cat([head_out, tail_out]).to(precise)  # [S + 1, Hq, T, D]
    weight = torch.softmax(lse, dim=0)  # exp(lse_i - M) / sum_j exp(lse_j - M)
    merged = (weight.unsqueeze(-1) * outs).sum(0, keepdim=True)
    return merged.to(q.dtype)


def math_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its log-sum-exp, computed in float32 or better (any device)."""
    precise = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    key = k.to(precise).repeat_interleave(groups, dim=1)
    value = v.to(precise).repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(precise), key) * scale
    if causal:
        query_len, context = q.shape[2], k.shape[2]
        hidden = torch.ones(query_len, context, dtype=torch.bool, device=q.device).triu(
            diagonal=context - query_len + 1
        )
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - lse.unsqueeze(-1)), value)
    return out.to(q.dtype), lse


def flash_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flash-attention kernel (CUDA, fp16/bf16, fewer key/value heads allowed), with
    the log-sum-exp it returns (natural logarithm, float32); ``causal`` with fewer queries than
    keys is aligned to the bottom right."""
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal=causal, return_debug_mask=False, scale=scale
    )
    out, lse = result[0], result[1]
    return out, lse.reshape(q.shape[0], q.shape[1], q.shape[2])
