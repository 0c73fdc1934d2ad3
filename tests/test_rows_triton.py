"""The Triton row move of recurrent states (``kernels.rows_triton``) against the rule.

The rule, stated here on its own: for each pair ``i``, destination row ``dst_index[i]`` (row ``i``
without an index) becomes source row ``src_index[i]`` (row ``i`` without an index) converted to
the destination's dtype, or zeros where that source index is negative; no other destination row
changes. On a machine without CUDA the kernel runs through Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``kernels_support`` before it is first compiled).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_support import DEVICE, F64, kernels

pytest.importorskip("triton")  # after kernels_support, which sets TRITON_INTERPRET
from test_kernels_backends import StandInBackend, assert_chained_equals_the_reference

rows_triton = importlib.import_module(f"{kernels.__name__}.rows_triton")
backend_module = importlib.import_module(f"{kernels.__name__}.backend")
COPIES = [rows_triton.copy_rows_triton, rows_triton.copy_rows_torch]


def expected_move(src, dst, src_index, dst_index):
    """The rule, one row at a time."""
    out = dst.clone()
    pairs = len(src_index) if src_index is not None else src.shape[0]
    for i in range(pairs):
        source = i if src_index is None else int(src_index[i])
        target = i if dst_index is None else int(dst_index[i])
        out[target] = 0 if source < 0 else src[source].to(dst.dtype)
    return out


def rows(n, shape=(3, 5, 7), dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=generator, dtype=F64).to(dtype).to(DEVICE)


def index(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize(
    ("src_index", "dst_index", "src_rows", "dst_rows"),
    [
        ([4, -1, 0, 9], None, 10, 4),  # a read: packed states of slots, one missing
        (None, [7, 2, 5], 3, 9),  # a write of every packed row
        ([2, 0], [8, 1], 3, 9),  # a write of some packed rows (the interior checkpoints)
        ([], [], 3, 9),  # nothing to move
    ],
)
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.float32, torch.float32),
                                                      (F64, torch.float32),
                                                      (torch.float32, torch.bfloat16)])  # fmt: skip
def test_a_move_follows_the_rule(copy, src_index, dst_index, src_rows, dst_rows, src_dtype,
                                 dst_dtype):  # fmt: skip
    # Rows of 105 elements: not a multiple of a program's block, and 1,500 with several blocks.
    for shape in [(3, 5, 7), (3, 4, 1500)]:
        # Values the destination's dtype holds exactly: the move converts, it does not round
        # (the cache's states and the kernels' are float32 both; Triton's interpreter truncates
        # where the GPU rounds to nearest).
        src = rows(src_rows, shape, dst_dtype, seed=1).to(src_dtype)
        dst = torch.full((dst_rows, *shape), float("nan"), dtype=dst_dtype, device=DEVICE)
        si = None if src_index is None else index(src_index)
        di = None if dst_index is None else index(dst_index)
        expected = expected_move(src, dst, si, di)
        copy(src, dst, src_index=si, dst_index=di)
        assert torch.equal(torch.nan_to_num(dst, nan=123.0), torch.nan_to_num(expected, nan=123.0))


def test_torch_moves_a_strided_source_like_a_contiguous_one():
    base = rows(6, (4, 9), seed=2)
    src = base.transpose(1, 2)  # [6, 9, 4], not contiguous
    dst = torch.zeros(5, 9, 4, device=DEVICE)
    rows_triton.copy_rows_torch(src, dst, src_index=index([5, 1]), dst_index=index([0, 4]))
    assert torch.equal(dst[0], src[5]) and torch.equal(dst[4], src[1])
    assert not dst[1:4].any()


@pytest.mark.parametrize("copy", COPIES)
def test_moves_that_do_not_line_up_are_refused(copy):
    src, dst = rows(4), rows(4)
    with pytest.raises(ValueError, match="do not line up"):
        copy(src, dst, src_index=index([0, 1]))  # 2 sources for 4 destination rows
    with pytest.raises(ValueError, match="rows differ"):
        copy(src, rows(4, (3, 5, 8)))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        copy(src, dst, src_index=index([[0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        copy(src, dst, src_index=torch.zeros(4, device=DEVICE))


def test_the_triton_move_refuses_strided_tensors_rather_than_copy_them():
    strided = rows(3, (4, 9)).transpose(1, 2)
    untouched = strided.clone()
    with pytest.raises(ValueError, match="between contiguous tensors"):
        rows_triton.copy_rows_triton(rows(3, (9, 4)), strided)
    assert torch.equal(strided, untouched)
    dst = torch.zeros(2, 9, 4, device=DEVICE)
    with pytest.raises(ValueError, match="between contiguous tensors"):
        rows_triton.copy_rows_triton(strided, dst, src_index=index([2, 0]))
    assert not dst.any()


def test_the_cpu_moves_rows_in_torch():
    assert rows_triton.default_row_copy(torch.device("cpu")) is rows_triton.copy_rows_torch


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the stand-in kernel's CPU tensors reach Triton through the interpreter only; on a GPU "
    "the moves above run on CUDA and the engine's output check runs every path",
)
@pytest.mark.parametrize("per_call", [0, 1])
def test_chained_calls_with_the_triton_move_equal_the_reference(per_call, monkeypatch):
    """A whole chained prefill (rows without an initial state, two checkpoints in a row, rows
    whose interior states only some are exported) with every state read and write through the
    Triton kernel gives what the torch backend gives."""
    monkeypatch.setattr(
        backend_module, "default_row_copy", lambda device: rows_triton.copy_rows_triton
    )
    assert_chained_equals_the_reference(
        StandInBackend(per_call, alignment=4),
        lengths=[40, 1, 17, 1, 24],
        checkpoints=[[8, 24], [], [12], [], [4, 8, 16]],
        with_initial=[True, True, False, True, False],
        seed=31,
    )
