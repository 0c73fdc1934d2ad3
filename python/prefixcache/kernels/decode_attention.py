"""Paged decode attention in Triton: one query token per row, read through the block table.

The torch path (``models.layers.paged_causal_attention``) gathers each row's whole context into
a contiguous copy before attending to it, one row at a time: at 164K cached tokens a decode row
copies its keys and values (168 MB per attention layer of the Kimi-K3 proxy) and launches a
dozen operations. Here one launch reads every decode row's keys and values where they lie, in
the cache's blocks, and a second combines the pieces (flash-decoding, split-K):

1. ``split``: program (row, key/value head, split) takes the row's context positions
   ``[split * S, (split + 1) * S)`` in tiles of ``BN`` tokens, finds each token's slot through the
   row's block table (``table[pos // block_size] * block_size + pos % block_size``), and keeps,
   for every query head of its group, the running maximum ``m`` of the scaled scores, the sum
   ``l`` of ``exp(score - m)`` and the ``exp``-weighted sum of the values, in float32;
2. ``combine``: program (row, query head) rescales the splits' partial sums to the largest
   maximum and divides: ``out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``.

The query token of row r sits at position ``seq_lens[r] - 1`` and attends to every position of
its context (its own included: its key and value are written before the call), which is what a
causal mask leaves a decode row. Grouped-query heads: query head ``h`` reads key/value head
``h // (Hq / Hkv)``. Scores are ``q . k * scale`` (default ``D ** -0.5``) computed in float32
(IEEE, no TF32, for float32 inputs); bf16 inputs multiply the softmax weights, rounded to bf16,
by the values, as flash kernels do. The output has the query's dtype.

Which rows of a step decode, and the block tables, lengths and token indices they need on the
device, are found once per step (:class:`DecodeRows`, checked on the host against the cache's
size, so the kernel never reads outside it) and shared by every attention layer of the step.

The kernels are compiled on first use. With ``TRITON_INTERPRET=1`` in the environment before
that, Triton runs them on CPU tensors through its interpreter: that is how the CPU tests check
them (``tests/test_decode_attention.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._convert import to_device
from .conv_triton import triton_unavailable_reason

__all__ = [
    "DECODE_BLOCK_N",
    "DecodeRows",
    "context_bucket",
    "paged_decode_attention",
    "triton_unavailable_reason",
]

#: Context tokens per tile of the split kernel (a multiple of 16, as ``tl.dot`` needs).
DECODE_BLOCK_N = 64
#: The split kernel aims at about this many programs (rows x key/value heads x splits), several
#: per multiprocessor of a large GPU, so that a few long rows still fill the device.
TARGET_PROGRAMS = 1024
MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows of one step (rows with one query token) and their device indices.

    ``rows`` are the rows' positions in the step (host), ``token_index`` ``[R]`` int32 the packed
    index of each row's query token, ``block_tables`` ``[R, C]`` int32 (each row's blocks, checked
    in range up to the last block its context needs; later entries are never read), ``seq_lens``
    ``[R]`` int32 (context length, this token included), ``max_seq_len`` the longest (host).
    """

    rows: np.ndarray
    token_index: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    block_size: int

    @property
    def num_rows(self) -> int:
        """Number of decode rows."""
        return int(self.rows.shape[0])

    @classmethod
    def select(
        cls,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
    ) -> DecodeRows | None:
        """The step's rows with one query token, or ``None`` when it has none.

        Checked on the host, for the rows chosen: a context of at least one token that the row's
        block table covers (``ValueError``), every block it needs in ``[0, num_blocks)``
        (``IndexError``). Uploaded once: every attention layer of the step reads the same tensors.
        """
        checked = cls.check(
            block_tables, seq_lens, query_start_loc, num_blocks=num_blocks, block_size=block_size
        )
        if checked is None:
            return None
        return cls.from_checked(checked, query_start_loc, block_size=block_size, device=device)

    @classmethod
    def from_checked(
        cls,
        checked: tuple[np.ndarray, np.ndarray, np.ndarray],
        query_start_loc: np.ndarray,
        *,
        block_size: int,
        device: torch.device | str,
    ) -> DecodeRows:
        """The rows :meth:`check` returned (``checked``), uploaded."""
        rows, lens, chosen = checked
        loc = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
        # One upload (pinned, without a host stall) for the three; they are views of it.
        count = rows.size
        packed = np.concatenate([loc[rows], lens, chosen.reshape(-1)]).astype(np.int32)
        flat = to_device(torch.from_numpy(packed), torch.device(device))
        return cls(
            rows=rows,
            token_index=flat[:count],
            block_tables=flat[2 * count :].view(count, chosen.shape[1]),
            seq_lens=flat[count : 2 * count],
            max_seq_len=int(lens.max()),
            block_size=block_size,
        )

    @staticmethod
    def check(
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        *,
        num_blocks: int,
        block_size: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """:meth:`select`'s host part: ``(rows, seq_lens, block_tables)`` of the decode rows as
        int64 host arrays (unused table entries zeroed), or ``None`` when there are none;
        raises as :meth:`select` does."""
        loc = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
        lengths = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        tables = np.asarray(block_tables)
        if (
            tables.ndim != 2
            or tables.shape[0] != lengths.shape[0]
            or loc.shape[0] != len(lengths) + 1
        ):
            raise ValueError(
                f"block_tables {tables.shape}, seq_lens {lengths.shape} and query_start_loc "
                f"{loc.shape} do not describe the same rows"
            )
        rows = np.flatnonzero(np.diff(loc) == 1)
        if rows.size == 0:
            return None
        lens = lengths[rows]
        if int(lens.min()) < 1:
            raise ValueError(f"decode rows need a context of at least 1 token, got {lens.tolist()}")
        needed = -(-lens // block_size)
        if int(needed.max()) > tables.shape[1]:
            raise ValueError(
                f"a context of {int(lens.max())} tokens needs {int(needed.max())} blocks but the "
                f"block tables have {tables.shape[1]} columns"
            )
        chosen = tables[rows].astype(np.int64)
        used = np.arange(tables.shape[1])[None, :] < needed[:, None]
        blocks = chosen[used]
        if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
            raise IndexError(f"a decode row's block table has a block outside [0, {num_blocks})")
        # Unused entries (padding may hold anything) are zeroed: nothing reads them, but an
        # int32 table must hold them.
        chosen = np.where(used, chosen, 0)
        return rows, lens, chosen


def context_bucket(max_seq_len: int) -> int:
    """The context length the split kernel is sized for: the next power of two of the step's
    longest decode context, at least :data:`MIN_SPLIT_TOKENS`. Steps whose longest context
    falls in one bucket launch the same grid, so a CUDA graph captured for the bucket replays
    exactly what the eager call would run."""
    return max(MIN_SPLIT_TOKENS, _next_power_of_two(max_seq_len))


def split_tokens(max_seq_len: int, programs_per_split: int, block_n: int = DECODE_BLOCK_N) -> int:
    """Context tokens per split: about :data:`TARGET_PROGRAMS` programs in all, at most
    :data:`MAX_SPLITS` splits and at least :data:`MIN_SPLIT_TOKENS` tokens per split, rounded up
    to whole tiles."""
    wanted = max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(1, programs_per_split))))
    wanted = min(wanted, max(1, max_seq_len // MIN_SPLIT_TOKENS))
    per_split = -(-max_seq_len // wanted)
    return -(-per_split // block_n) * block_n


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def split_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, token_ptr, acc_ptr, m_ptr, l_ptr,
        q_token_stride, q_head_stride, table_stride, kv_slot_stride,
        num_heads, num_splits, split, block_size, scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        GP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        length = tl.load(lens_ptr + row).to(tl.int64)
        token = tl.load(token_ptr + row).to(tl.int64)
        member = tl.arange(0, GP)
        head = kv_head * GROUP + member
        head_ok = member < GROUP
        dim = tl.arange(0, BD)
        dim_ok = dim < HEAD_DIM
        q = tl.load(
            q_ptr + token * q_token_stride + head[:, None] * q_head_stride + dim[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        m = tl.zeros((GP,), dtype=tl.float32) - float("inf")
        total = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, BD), dtype=tl.float32)
        begin = part.to(tl.int64) * split
        end = tl.minimum(begin + split, length)
        for start in range(begin, end, BN):
            pos = start + tl.arange(0, BN).to(tl.int64)
            ok = pos < end
            block = tl.load(
                table_ptr + row * table_stride + pos // block_size, mask=ok, other=0
            ).to(tl.int64)
            slot = block * block_size + pos % block_size
            where = slot[:, None] * kv_slot_stride + kv_head * HEAD_DIM + dim[None, :]
            kv_ok = ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + where, mask=kv_ok, other=0.0).to(q.dtype)
            if IEEE:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + where, mask=kv_ok, other=0.0).to(q.dtype)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        # Partial results of (row, head, split): [rows, heads, splits, BD], [rows, heads, splits].
        base = (row * num_heads + head) * num_splits + part
        tl.store(acc_ptr + base[:, None] * BD + dim[None, :], acc, mask=head_ok[:, None])
        tl.store(m_ptr + base, m, mask=head_ok)
        tl.store(l_ptr + base, total, mask=head_ok)

    @triton.jit  # type: ignore[untyped-decorator]
    def combine_kernel(  # type: ignore[no-untyped-def]
        acc_ptr, m_ptr, l_ptr, lens_ptr, token_ptr, out_ptr,
        out_token_stride, out_head_stride, num_heads, num_splits, split,
        HEAD_DIM: tl.constexpr, BD: tl.constexpr, SP: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        length = tl.load(lens_ptr + row).to(tl.int64)
        token = tl.load(token_ptr + row).to(tl.int64)
        used = (length + split - 1) // split  # this row's splits; the others saw no token
        part = tl.arange(0, SP)
        ok = part < used
        base = (row * num_heads + head) * num_splits + part
        m = tl.load(m_ptr + base, mask=ok, other=float("-inf"))
        total = tl.load(l_ptr + base, mask=ok, other=0.0)
        largest = tl.max(m, axis=0)
        weight = tl.where(ok, tl.exp(m - largest), 0.0)
        dim = tl.arange(0, BD)
        acc = tl.load(acc_ptr + base[:, None] * BD + dim[None, :], mask=ok[:, None], other=0.0)
        value = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
        tl.store(
            out_ptr + token * out_token_stride + head * out_head_stride + dim,
            value.to(out_ptr.dtype.element_ty),
            mask=dim < HEAD_DIM,
        )

    return split_kernel, combine_kernel


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: DecodeRows,
    out: torch.Tensor,
    *,
    scale: float | None = None,
    block_n: int = DECODE_BLOCK_N,
) -> None:
    """Attention of each decode row's query token over its whole context, written into ``out``.

    ``query`` and ``out`` ``[T, Hq, D]`` (the step's packed tokens; only the decode rows' tokens
    ``rows.token_index`` are read and written; the last axis contiguous), ``key_cache`` and
    ``value_cache`` ``[num_blocks, block_size, Hkv, D]`` contiguous (a ``PagedKVCache``'s), in the
    query's dtype or any dtype the kernel converts from. Raises ``ValueError`` on shapes that do
    not fit together.
    """
    if rows.num_rows == 0:
        return
    if query.dim() != 3 or out.shape != query.shape or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            f"query and out must both be [T, Hq, D] with a contiguous last axis, got "
            f"{tuple(query.shape)} and {tuple(out.shape)}"
        )
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4:
        raise ValueError(f"key and value caches differ: {key_cache.shape}, {value_cache.shape}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the key and value caches must be contiguous")
    _, block_size, kv_heads, head_dim = key_cache.shape
    heads = query.shape[1]
    if block_size != rows.block_size or query.shape[2] != head_dim or heads % kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} and cache {tuple(key_cache.shape)} (rows for block size "
            f"{rows.block_size}) do not fit: the head dim must match and Hq be a multiple of Hkv"
        )
    if block_n < 16 or block_n % 16:
        raise ValueError(f"block_n must be a positive multiple of 16, got {block_n}")
    group = heads // kv_heads
    span = context_bucket(rows.max_seq_len)
    split = split_tokens(span, rows.num_rows * kv_heads, block_n)
    num_splits = -(-span // split)
    bd = max(16, _next_power_of_two(head_dim))
    device = query.device
    acc = torch.empty(rows.num_rows * heads * num_splits * bd, dtype=torch.float32, device=device)
    m = torch.empty(rows.num_rows * heads * num_splits, dtype=torch.float32, device=device)
    total = torch.empty_like(m)
    split_kernel, combine_kernel = _kernels()
    split_kernel[(rows.num_rows, kv_heads, num_splits)](
        query, key_cache, value_cache, rows.block_tables, rows.seq_lens, rows.token_index,
        acc, m, total,
        query.stride(0), query.stride(1), rows.block_tables.stride(0), kv_heads * head_dim,
        heads, num_splits, split, block_size, head_dim**-0.5 if scale is None else scale,
        GROUP=group, HEAD_DIM=head_dim, GP=max(16, _next_power_of_two(group)), BD=bd,
        BN=block_n, IEEE=query.dtype == torch.float32,
    )  # fmt: skip
    combine_kernel[(rows.num_rows, heads)](
        acc, m, total, rows.seq_lens, rows.token_index, out,
        out.stride(0), out.stride(1), heads, num_splits, split,
        HEAD_DIM=head_dim, BD=bd, SP=_next_power_of_two(num_splits),
    )  # fmt: skip
