"""Recurrent states moved between the state cache and a kernel's packed batch, one launch a move.

A chained kernel call (``chaining.run_rounds``) reads each row's initial state out of the cache
into a packed ``[n, H, V, K]`` batch, and writes the call's final states and interior checkpoints
back into their slots. In torch those are ``index_select`` and ``index_copy_``: for a handful of
indices over rows of 196,608 floats (Kimi-K3's 12 heads at TP8) torch picks its small-index
kernels; in the seed's step (8 states of 786 KB) a KDA layer's two selects took 15.7 us and its
two copies 10.6 us on an H100, and a checkpoint took a select of the exported rows and a copy.

:func:`copy_rows_triton` is that move as one Triton kernel: ``dst[dst_index[i]] =
src[src_index[i]]`` for each pair ``i`` (an absent index: row ``i`` itself), zeros where
``src_index[i] < 0`` (a row without an initial state), converted to ``dst``'s dtype, each program
a contiguous stretch of one row: 12.2 us a layer on the H100 for that step's three moves (8
states in, 8 out, one checkpoint out), each 8-state move (12.6 MB read and written) about 5 us,
near the memory's bandwidth, the checkpoint's 2 us. :func:`copy_rows_torch` is the same
contract in torch (the CPU's); :func:`default_row_copy` picks one for a device.

Index values are not checked here (that would wait for the device): callers pass slots of a plan
the backend validated, in range, and destination indices distinct.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RowCopy", "copy_rows_torch", "copy_rows_triton", "default_row_copy"]

#: ``copy(src, dst, src_index=None, dst_index=None)``: see the module docstring.
RowCopy = Callable[..., None]

#: Elements of one row a program moves.
BLOCK = 4096


def _pairs(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor | None,
    dst_index: torch.Tensor | None,
) -> int:
    """The number of rows moved, after checking that the arguments line up."""
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"rows differ: source {tuple(src.shape)}, destination {tuple(dst.shape)}")
    if src.device != dst.device:
        raise ValueError(f"source on {src.device}, destination on {dst.device}")
    counts = set()
    for name, index in (("src_index", src_index), ("dst_index", dst_index)):
        if index is None:
            continue
        if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {index.dtype} "
                             f"{tuple(index.shape)}")  # fmt: skip
        if index.device != src.device:
            raise ValueError(f"{name} is on {index.device}, the rows on {src.device}")
        counts.add(index.numel())
    if src_index is None:
        counts.add(src.shape[0])
    if dst_index is None:
        counts.add(dst.shape[0])
    if len(counts) != 1:
        raise ValueError(
            f"the pairs do not line up: source rows / indices and destination rows / indices "
            f"give {sorted(counts)}"
        )
    return counts.pop()


def copy_rows_torch(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor | None = None,
    dst_index: torch.Tensor | None = None,
) -> None:
    """The row move in torch: ``index_select`` (negative indices: zero rows) and
    ``index_copy_``."""
    if not _pairs(src, dst, src_index, dst_index):
        return
    if src_index is None:
        rows = src
    elif dst_index is None and dst.dtype == src.dtype:
        rows = torch.index_select(src, 0, src_index.clamp(min=0), out=dst)
    else:
        rows = src.index_select(0, src_index.clamp(min=0))
    if src_index is not None:
        rows.masked_fill_((src_index < 0).view(-1, *([1] * (src.dim() - 1))), 0.0)
    if dst_index is not None:
        dst.index_copy_(0, dst_index, rows.to(dst.dtype))
    elif rows is not dst:
        dst.copy_(rows)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def copy_rows_kernel(  # type: ignore[no-untyped-def]
        src, dst, src_index, dst_index, size,
        SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pair = tl.program_id(0).to(tl.int64)
        offset = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = offset < size
        # Each program: one stretch of one row. The absent-source test is a block, since masks
        # combine blocks only (the interpreter needs it).
        source = pair
        if SRC_INDEXED:
            source = tl.load(src_index + pair).to(tl.int64)
        target = pair
        if DST_INDEXED:
            target = tl.load(dst_index + pair).to(tl.int64)
        present = (offset * 0 + source) >= 0
        value = tl.load(
            src + tl.maximum(source, 0) * size + offset, mask=inside & present, other=0.0
        )
        tl.store(dst + target * size + offset, value.to(dst.dtype.element_ty), mask=inside)

    return copy_rows_kernel


def copy_rows_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor | None = None,
    dst_index: torch.Tensor | None = None,
) -> None:
    """The row move in one Triton kernel, between contiguous tensors (a read's source is the
    whole state cache: copying a strided one to move a few rows would cost more than the move,
    so it is refused). Needs CUDA tensors, or ``TRITON_INTERPRET=1`` on the CPU."""
    pairs = _pairs(src, dst, src_index, dst_index)
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("the Triton row copy moves between contiguous tensors only")
    size = math.prod(src.shape[1:])
    if not pairs or not size:
        return
    import triton

    _kernel()[(pairs, triton.cdiv(size, BLOCK))](
        src, dst,
        src if src_index is None else src_index, dst if dst_index is None else dst_index,
        size, SRC_INDEXED=src_index is not None, DST_INDEXED=dst_index is not None, BLOCK=BLOCK,
    )  # fmt: skip


@functools.cache
def default_row_copy(device: torch.device) -> RowCopy:
    """The row move used on ``device``: the Triton kernel where :func:`conv_triton.triton_runs_on`
    says so (CUDA with Triton), torch's elsewhere."""
    from .conv_triton import triton_runs_on

    return (
        copy_rows_triton
        if triton_runs_on(device, "the recurrent states' move")
        else copy_rows_torch
    )
