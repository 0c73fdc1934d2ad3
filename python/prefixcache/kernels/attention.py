"""Reference causal attention over a :class:`PagedKVCache` (for the tiny reference model).

Row r of a packed batch has ``query_len = query_start_loc[r+1] - query_start_loc[r]`` new tokens
at the end of a context of ``seq_lens[r]`` tokens (their keys and values already written with
``PagedKVCache.write``); query token i sits at position ``seq_lens[r] - query_len + i`` and attends
to positions ``<=`` its own. Grouped-query attention when the query has more heads than the cache.
Plain torch, one row at a time: for correctness, not speed.
"""

from __future__ import annotations

import torch

from ._convert import ArrayLike, as_host_tensor
from .paged_kv import PagedKVCache

__all__ = ["paged_attention"]


def paged_attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: ArrayLike,
    seq_lens: ArrayLike,
    query_start_loc: ArrayLike,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over each row's cached context.

    ``block_tables`` ``[R, max_blocks]`` (rows padded with any value), ``seq_lens`` ``[R]`` the
    context length including this step's tokens. Returns ``[T, Hq, D]`` in ``query``'s dtype.
    """
    tables = as_host_tensor(block_tables, "block_tables")
    lengths: list[int] = as_host_tensor(seq_lens, "seq_lens").reshape(-1).tolist()
    loc: list[int] = as_host_tensor(query_start_loc, "query_start_loc").reshape(-1).tolist()
    heads = query.shape[1]
    if heads % cache.num_kv_heads:
        raise ValueError(
            f"query heads {heads} are not a multiple of the cache's {cache.num_kv_heads} kv heads"
        )
    group = heads // cache.num_kv_heads
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    for row, context in enumerate(lengths):
        first, last = loc[row], loc[row + 1]
        query_len = last - first
        if query_len > context:
            raise ValueError(f"row {row}: {query_len} query tokens exceed seq_len {context}")
        key, value = cache.gather(tables[row], context)
        key = key.repeat_interleave(group, dim=1).to(query.dtype)
        value = value.repeat_interleave(group, dim=1).to(query.dtype)
        scores = torch.einsum("qhd,khd->hqk", query[first:last], key) * scale
        positions = torch.arange(context - query_len, context, device=query.device)
        mask = torch.arange(context, device=query.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        precise = torch.promote_types(scores.dtype, torch.float32)
        weights = torch.softmax(scores.to(precise), dim=-1).to(query.dtype)
        out[first:last] = torch.einsum("hqk,khd->qhd", weights, value)
    return out
