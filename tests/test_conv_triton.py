"""The Triton short convolution (``kernels.conv_triton``) against the torch one.

On a machine without CUDA the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``kernels_support`` before they are first compiled); on a GPU
they are compiled.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from kernels_support import DEVICE, F64, fill_slot, kernels, make_batch, make_cache, make_params

pytest.importorskip("triton")  # after kernels_support, which sets TRITON_INTERPRET

conv = importlib.import_module(f"{kernels.__name__}.conv")
conv_triton = importlib.import_module(f"{kernels.__name__}.conv_triton")
W = 4


def state_plan(lengths, initial, running, checkpoints, num_slots):
    offsets = [[o for o, _ in row] + [0] * (2 - len(row)) for row in checkpoints]
    slots = [[s for _, s in row] + [-1] * (2 - len(row)) for row in checkpoints]
    return kernels.TorchBackend(1).check_plan(
        query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        initial_slot=initial,
        running_slot=running,
        checkpoint_offsets=offsets,
        checkpoint_slots=slots,
        num_slots=num_slots,
        num_tokens=sum(lengths),
    )


def conv_cache(params, num_slots, dtype, initial):
    cache = make_cache(params, num_slots, dtype=dtype)
    for slot in initial:
        if slot >= 0:
            fill_slot(cache, slot, seed=200 + slot)
    return cache.conv.to(DEVICE)


# Rows: a long one resuming from a window, one without an initial state, decode rows (one and two
# tokens, shorter than the window) and cuts below the conv width (windows reaching into the
# initial window).
LENGTHS = [45, 30, 1, 2]
INITIAL = [0, -1, 1, 2]
RUNNING = [4, 5, 6, 7]
CHECKPOINTS = [[(2, 8), (33, 9)], [(1, 10), (16, 11)], [], [(1, 12)]]
SLOTS = 14


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("splits", [None, (16, 16, 16)])
def test_triton_conv_equals_the_torch_conv(dtype, splits):
    params = make_params(heads=2, key_dim=8, seed=7)
    plan = state_plan(LENGTHS, INITIAL, RUNNING, CHECKPOINTS, SLOTS)
    x = make_batch(params, sum(LENGTHS), seed=8, dtype=dtype).x.to(DEVICE)
    expected_cache = conv_cache(params, SLOTS, dtype, INITIAL)
    got_cache = expected_cache.clone()
    expected = conv.causal_conv(x, params, expected_cache, plan, splits)
    got = conv_triton.causal_conv_triton(x, params, got_cache, plan, splits)
    assert len(got) == len(expected)
    rtol = 1e-12 if dtype == F64 else 1e-5
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)
    # Windows are copies of inputs: equal exactly; untouched slots keep their NaN poison.
    assert torch.allclose(got_cache, expected_cache, rtol=0, atol=0, equal_nan=True)
    written = {slot for row in CHECKPOINTS for _, slot in row} | set(RUNNING)
    untouched = [s for s in range(SLOTS) if s not in written and s not in INITIAL]
    assert torch.isnan(got_cache[untouched]).all()


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_column_slice_of_a_wider_tensor_is_read_where_it_lies(dtype):
    """The KDA layer hands the convolution ``q|k|v`` as columns of its merged input projection:
    rows one ``stride(0)`` apart, wider than the channels. The results, outputs and windows,
    are those of the same values packed contiguously, bit for bit; the columns beside the slice
    (filled with NaN) are never read."""
    params = make_params(heads=2, key_dim=8, seed=17)
    plan = state_plan(LENGTHS, INITIAL, RUNNING, CHECKPOINTS, SLOTS)
    x = make_batch(params, sum(LENGTHS), seed=18, dtype=dtype).x.to(DEVICE)
    channels = x.shape[1]
    wide = torch.full((x.shape[0], channels + 13), float("nan"), dtype=dtype, device=DEVICE)
    wide[:, 5 : 5 + channels] = x
    sliced = wide[:, 5 : 5 + channels]
    assert not sliced.is_contiguous() and sliced.stride() == (channels + 13, 1)
    packed_cache = conv_cache(params, SLOTS, dtype, INITIAL)
    sliced_cache = packed_cache.clone()
    packed = conv_triton.causal_conv_triton(x, params, packed_cache, plan, (16, 16, 16))
    got = conv_triton.causal_conv_triton(sliced, params, sliced_cache, plan, (16, 16, 16))
    for a, b in zip(got, packed, strict=True):
        assert a.is_contiguous() and torch.equal(a, b)
    assert torch.allclose(sliced_cache, packed_cache, rtol=0, atol=0, equal_nan=True)
    torch_cache = conv_cache(params, SLOTS, dtype, INITIAL)
    by_torch = conv.causal_conv(sliced, params, torch_cache, plan, (16, 16, 16))
    rtol = 1e-12 if dtype == F64 else 1e-5
    for a, b in zip(got, by_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


@pytest.mark.parametrize(
    "lengths",
    [
        [1] * 7 + [70],  # a mixed step: decode rows, then a prefill row spanning blocks
        [70] + [1] * 7,
        [3, 1, 40, 1, 1, 33, 2, 1, 1, 5, 64, 1, 1, 1, 1, 1, 9],  # 17 rows: five halvings
        [1],
    ],
)
def test_every_token_finds_its_row(lengths):
    """The kernel finds each token's row by a search of the query start locations: every row,
    whatever its neighbours' lengths, convolves over its own tokens and initial window only."""
    rows = len(lengths)
    initial = [i if i % 3 else -1 for i in range(rows)]  # some rows start without a window
    running = [rows + i for i in range(rows)]
    slots = 2 * rows
    params = make_params(heads=2, key_dim=8, seed=11)
    plan = state_plan(lengths, initial, running, [[] for _ in lengths], slots)
    x = make_batch(params, sum(lengths), seed=12, dtype=F64).x.to(DEVICE)
    expected_cache = conv_cache(params, slots, F64, initial)
    got_cache = expected_cache.clone()
    expected = conv.causal_conv(x, params, expected_cache, plan)[0]
    got = conv_triton.causal_conv_triton(x, params, got_cache, plan)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # Row by row, the same as convolving that row alone.
    start = 0
    for row, length in enumerate(lengths):
        alone_cache = conv_cache(params, slots, F64, initial)
        alone = conv_triton.causal_conv_triton(
            x[start : start + length].contiguous(),
            params,
            alone_cache,
            state_plan([length], [initial[row]], [running[row]], [[]], slots),
        )[0]
        assert torch.equal(got[start : start + length], alone)
        start += length
    assert torch.allclose(got_cache, expected_cache, rtol=0, atol=0, equal_nan=True)


def test_a_forward_split_at_a_cut_equals_the_unsplit_one_exactly():
    params = make_params(heads=2, key_dim=8, seed=9)
    x = make_batch(params, 40, seed=10, dtype=torch.float32).x.to(DEVICE)
    cache = conv_cache(params, 8, torch.float32, [0])
    whole = conv_triton.causal_conv_triton(
        x, params, cache, state_plan([40], [0], [1], [[(17, 2)]], 8)
    )[0]
    first = conv_triton.causal_conv_triton(
        x[:17].contiguous(), params, cache, state_plan([17], [0], [3], [[]], 8)
    )[0]
    second = conv_triton.causal_conv_triton(
        x[17:].contiguous(), params, cache, state_plan([23], [3], [4], [[]], 8)
    )[0]
    assert torch.equal(torch.cat([first, second]), whole)
    assert torch.equal(cache[3], cache[2])  # the checkpoint equals the split's end window
    assert torch.equal(cache[4], cache[1])


def test_a_backend_set_to_the_triton_conv_runs_prefill_like_the_torch_conv():
    params = make_params(heads=2, key_dim=8, seed=11).to(DEVICE)
    batch = make_batch(params, sum(LENGTHS), seed=12)
    results = []
    for impl in ("torch", "triton"):
        backend = kernels.TorchBackend(1)
        backend.conv_impl = impl
        cache = kernels.StateCache.for_layer(
            params, SLOTS, conv_dtype=F64, state_dtype=F64, device=DEVICE
        ).fill_(float("nan"))
        for slot in INITIAL:
            if slot >= 0:
                fill_slot(cache, slot, seed=300 + slot)
        offsets = [[o for o, _ in row] + [0] * (2 - len(row)) for row in CHECKPOINTS]
        slots = [[s for _, s in row] + [-1] * (2 - len(row)) for row in CHECKPOINTS]
        out = kernels.kda_prefill(
            backend, batch.x.to(DEVICE), batch.g.to(DEVICE), batch.beta.to(DEVICE), params,
            cache, np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32), INITIAL, RUNNING,
            offsets, slots,
        )  # fmt: skip
        results.append((out, cache))
    (out_torch, cache_torch), (out_triton, cache_triton) = results
    torch.testing.assert_close(out_triton, out_torch, rtol=1e-10, atol=1e-10)
    for a, b in (
        (cache_triton.conv, cache_torch.conv),
        (cache_triton.recurrent, cache_torch.recurrent),
    ):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10, equal_nan=True)


def test_bad_arguments_are_refused():
    params = make_params(heads=2, key_dim=8, seed=13)
    plan = state_plan([6], [-1], [0], [[]], 2)
    cache = conv_cache(params, 2, F64, [])
    x = make_batch(params, 6, seed=14).x.to(DEVICE)
    with pytest.raises(ValueError, match="contiguous rows"):
        conv_triton.causal_conv_triton(x.t().contiguous().t(), params, cache, plan)
    with pytest.raises(ValueError, match="contiguous conv"):
        strided_cache = cache.transpose(1, 2).contiguous().transpose(1, 2)
        conv_triton.causal_conv_triton(x, params, strided_cache, plan)
    with pytest.raises(ValueError, match="1 to 3 sizes"):
        conv_triton.causal_conv_triton(x, params, cache, plan, splits=(12, 12, 12, 12))
    backend = kernels.TorchBackend(1)
    backend.conv_impl = "cuda"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="must be one of torch, triton"):
        kernels.run_prefill(
            backend, x.cpu(), torch.zeros(6, 2, 8, dtype=F64), torch.zeros(6, 2, dtype=F64), params,
            kernels.StateCache.for_layer(params, 2, conv_dtype=F64, state_dtype=F64), plan,
        )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = conv_triton.triton_unavailable_reason(torch.device("cpu"))
    assert reason is not None and "TRITON_INTERPRET=1" in reason
