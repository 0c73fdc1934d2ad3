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

The merge is one Triton kernel on CUDA (:func:`merge_partials_triton`, as flash-decoding's
combine step and vLLM's ``merge_attn_states`` are): it reads each partial result once and writes
the merged one in the query's dtype. In torch (:func:`merge_partials_torch`, the CPU's) it is
a concatenation of the S + 1 partials in float32, a softmax, a product and a sum: eight launches
and as many passes over S + 1 copies of the chunk's output, about 0.33 ms a layer on the H200 at
T = 4,096 after 131K cached tokens (3 pieces). Since S shrinks as T grows, ``(S + 1) * T`` and so
that cost hardly change with the chunk: it was a fixed cost of every prefill step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "Attend",
    "Merge",
    "default_merge",
    "flash_attend",
    "math_attend",
    "merge_partials_torch",
    "merge_partials_triton",
    "prefix_splits",
    "split_partials",
    "split_prefix_attention",
]

#: ``attend(q [B, Hq, T, D], k [B, Hkv, L, D], v, causal, scale) -> (out [B, Hq, T, D] in q's
#: dtype, lse [B, Hq, T] float32)``; ``causal``: aligned to the bottom right.
Attend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]
]

#: ``merge(head_out [S, Hq, T, D], head_lse [S, Hq, T], tail_out [1, Hq, T, D], tail_lse [1, Hq, T])
#: -> [1, Hq, T, D]`` in the outputs' dtype: the S + 1 partial results merged by their
#: log-sum-exps (float32 or better inside).
Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

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
    merge: Merge | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[1, Hq, T, D]`` (the last T positions) over ``k``, ``v``
    ``[1, Hkv, C, D]`` (the whole context, ``C > T``), the prefix cut into ``splits`` pieces (module
    docstring), the pieces' results merged by ``merge`` (default: :func:`default_merge` of
    ``q``'s device). Returns ``[1, Hq, T, D]`` in ``q``'s dtype."""
    merge = default_merge(q.device) if merge is None else merge
    return merge(*split_partials(q, k, v, splits, attend, scale))


def split_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    splits: int,
    attend: Attend,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The S + 1 partial results :func:`split_prefix_attention` merges: ``(head_out [S, Hq, T,
    D], head_lse [S, Hq, T], tail_out [1, Hq, T, D], tail_lse [1, Hq, T])``, the arguments of a
    :data:`Merge`."""
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
    return head_out, head_lse, tail_out, tail_lse


def _check_partials(
    head_out: torch.Tensor, head_lse: torch.Tensor, tail_out: torch.Tensor, tail_lse: torch.Tensor
) -> None:
    pieces, heads, tokens, dim = head_out.shape
    if tail_out.shape != (1, heads, tokens, dim) or head_lse.shape != (pieces, heads, tokens):
        raise ValueError(
            f"partials do not line up: head {tuple(head_out.shape)} / {tuple(head_lse.shape)}, "
            f"tail {tuple(tail_out.shape)} / {tuple(tail_lse.shape)}"
        )
    if tail_lse.shape != (1, heads, tokens) or tail_out.dtype != head_out.dtype:
        raise ValueError(
            f"the tail's partial is {tuple(tail_lse.shape)} {tail_out.dtype}, the head's "
            f"{head_out.dtype}"
        )


def merge_partials_torch(
    head_out: torch.Tensor, head_lse: torch.Tensor, tail_out: torch.Tensor, tail_lse: torch.Tensor
) -> torch.Tensor:
    """:data:`Merge` in torch: a softmax over the S + 1 log-sum-exps weights the partials."""
    _check_partials(head_out, head_lse, tail_out, tail_lse)
    precise = torch.promote_types(head_out.dtype, torch.float32)
    lse = torch.cat([head_lse, tail_lse]).to(precise)  # [S + 1, Hq, T]
    outs = torch.cat([head_out, tail_out]).to(precise)  # [S + 1, Hq, T, D]
    weight = torch.softmax(lse, dim=0)  # exp(lse_i - M) / sum_j exp(lse_j - M)
    merged = (weight.unsqueeze(-1) * outs).sum(0, keepdim=True)
    return merged.to(head_out.dtype)


#: Query tokens per program of the Triton merge.
MERGE_TOKENS = 16


@functools.cache
def _merge_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def merge_kernel(  # type: ignore[no-untyped-def]
        head_out, head_lse, tail_out, tail_lse, dest,
        pieces, tokens,
        ho_piece, ho_head, ho_token, hl_piece, hl_head, hl_token,
        to_head, to_token, tl_head, tl_token, d_head, d_token,
        DIM: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, F64: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(1).to(tl.int64)
        token = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
        lane = tl.arange(0, BD).to(tl.int64)
        in_tokens = token < tokens
        mask = in_tokens[:, None] & (lane < DIM)[None, :]
        precise = tl.float64 if F64 else tl.float32
        # The largest log-sum-exp of each token: every weight is exp(lse - M) <= 1.
        tail_at = tail_lse + head * tl_head + token * tl_token
        last = tl.load(tail_at, mask=in_tokens, other=0.0).to(precise)
        top = last
        for piece in range(pieces):
            lse = tl.load(
                head_lse + piece * hl_piece + head * hl_head + token * hl_token,
                mask=in_tokens,
                other=0.0,
            ).to(precise)
            top = tl.maximum(top, lse)
        weight = tl.exp(last - top)
        value = tl.load(
            tail_out + head * to_head + token[:, None] * to_token + lane[None, :],
            mask=mask,
            other=0.0,
        ).to(precise)
        total = weight
        acc = weight[:, None] * value
        for piece in range(pieces):
            lse = tl.load(
                head_lse + piece * hl_piece + head * hl_head + token * hl_token,
                mask=in_tokens,
                other=0.0,
            ).to(precise)
            weight = tl.exp(lse - top)
            value = tl.load(
                head_out + piece * ho_piece + head * ho_head + token[:, None] * ho_token
                + lane[None, :],
                mask=mask,
                other=0.0,
            ).to(precise)  # fmt: skip
            total += weight
            acc += weight[:, None] * value
        merged = acc / total[:, None]
        tl.store(
            dest + head * d_head + token[:, None] * d_token + lane[None, :],
            merged.to(dest.dtype.element_ty),
            mask=mask,
        )

    return merge_kernel


def merge_partials_triton(
    head_out: torch.Tensor, head_lse: torch.Tensor, tail_out: torch.Tensor, tail_lse: torch.Tensor
) -> torch.Tensor:
    """:data:`Merge` in one Triton kernel: each program merges 16 tokens of one head, reading
    each partial once (float32 inside, float64 for float64 partials). The result is laid out
    token-major (``[T, Hq, D]`` storage, as the model's output is) behind its ``[1, Hq, T, D]``
    shape. Needs CUDA tensors, or ``TRITON_INTERPRET=1`` on the CPU."""
    _check_partials(head_out, head_lse, tail_out, tail_lse)
    pieces, heads, tokens, dim = head_out.shape
    if head_out.stride(-1) != 1:
        head_out = head_out.contiguous()
    if tail_out.stride(-1) != 1:
        tail_out = tail_out.contiguous()
    dest = head_out.new_empty(tokens, heads, dim)
    if tokens:
        import triton

        _merge_kernel()[(triton.cdiv(tokens, MERGE_TOKENS), heads)](
            head_out, head_lse, tail_out, tail_lse, dest, pieces, tokens,
            head_out.stride(0), head_out.stride(1), head_out.stride(2),
            head_lse.stride(0), head_lse.stride(1), head_lse.stride(2),
            tail_out.stride(1), tail_out.stride(2), tail_lse.stride(1), tail_lse.stride(2),
            dest.stride(1), dest.stride(0),
            DIM=dim, BD=triton.next_power_of_2(dim), BT=MERGE_TOKENS,
            F64=head_out.dtype == torch.float64,
        )  # fmt: skip
    return dest.transpose(0, 1).unsqueeze(0)


@functools.cache
def default_merge(device: torch.device) -> Merge:
    """The merge :func:`split_prefix_attention` uses on ``device`` by default: the Triton kernel
    where :func:`conv_triton.triton_runs_on` says so (CUDA with Triton), the torch one
    elsewhere."""
    from .conv_triton import triton_runs_on

    if triton_runs_on(device, "the split prefill attention's merge"):
        return merge_partials_triton
    return merge_partials_torch


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
