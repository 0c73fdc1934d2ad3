"""One-token KDA rows in the Triton decode kernel (``kernels.kda_decode_triton``), and how the
FlashKDA backends split a step between it and their chunked call.

The rule, stated here on its own: for each row of one query token, the state read from the row's
initial slot (zero for -1) takes one step of the KDA recurrence (``reference.recurrence_loop``
over that token); the new state goes to the row's running slot and the output row is that
step's output. Nothing else in the cache or in the output changes. On a machine without CUDA the
kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``, set by ``kernels_support``).

A FlashKDA backend runs a step's one-token rows there and chains its other rows through its
op, whose calls then see only those rows; a round whose slots are consecutive hands the op views
of the cache, so a prefill row beside decode rows moves no state at all.
"""

from __future__ import annotations

import importlib
import itertools
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_support import DEVICE, F64, kernels, make_batch, make_params

pytest.importorskip("triton")  # after kernels_support, which sets TRITON_INTERPRET
from test_kernels import max_difference, prefill
from test_kernels_backends import GPU_BACKENDS, FakeFlashKDAOps

decode = importlib.import_module(f"{kernels.__name__}.kda_decode_triton")
backend_module = importlib.import_module(f"{kernels.__name__}.backend")
reference = kernels.reference


def on_device(params):
    """The layer's kernel parameters where the kernel runs (the tests' own are on the CPU)."""
    return kernels.KDALayerParams(
        A_log=params.A_log.to(DEVICE), dt_bias=params.dt_bias.to(DEVICE),
        conv_weight=params.conv_weight.to(DEVICE), lower_bound=params.lower_bound,
        conv_activation=params.conv_activation,
    )  # fmt: skip


# Float64 arithmetic; on a GPU the kernel's float arguments are fp32 (Triton's default).
TOLERANCE = 1e-12 if DEVICE.type == "cpu" else 1e-7

# The stand-in FlashKDA op computes on the CPU, beside the decode kernel in Triton's interpreter.
cpu_only = pytest.mark.skipif(
    DEVICE.type != "cpu", reason="the stand-in op runs on the CPU (the real op's test is below)"
)


def expected_step(q, k, v, g, beta, params, state, compute=F64):
    """The rule for one token of one row: ``(o [H, V], new state [H, V, K])``."""
    inputs = reference.prepare_inputs(q[None], k[None], v[None], g[None], beta[None], params,
                                      compute)  # fmt: skip
    o, new = reference.recurrence_loop(
        *inputs, params.head_dim_k**-0.5, state.to(compute).transpose(-1, -2)
    )
    return o[0], new.transpose(-1, -2)


def decode_plan(initial, running):
    rows = len(running)
    return kernels.check_state_plan(
        query_start_loc=list(range(rows + 1)), initial_slot=initial, running_slot=running,
        num_slots=max([*running, *initial]) + 2,
    )  # fmt: skip


@settings(max_examples=15, deadline=None, database=None)
@given(
    rows=st.integers(1, 5),
    gate=st.sampled_from(["bounded", "softplus"]),
    state_dtype=st.sampled_from([F64, torch.float32]),
    data=st.data(),
)
def test_one_token_rows_take_one_recurrence_step_in_place(rows, gate, state_dtype, data):
    params = make_params(heads=2, key_dim=8, value_dim=16, gate=gate, seed=rows)
    slots = data.draw(st.permutations(list(range(2 * rows + 2))))
    with_initial = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    initial = [slots[r] if with_initial[r] else -1 for r in range(rows)]
    running = [slots[rows + r] for r in range(rows)]
    plan = decode_plan(initial, running)
    num_slots = len(slots)
    generator = torch.Generator().manual_seed(rows)
    heads, kd, vd = 2, 8, 16
    q, k, g = (torch.randn(rows, heads, kd, generator=generator, dtype=F64) for _ in range(3))
    v = torch.randn(rows, heads, vd, generator=generator, dtype=F64)
    beta = torch.randn(rows, heads, generator=generator, dtype=F64)
    cache = torch.full((num_slots, heads, vd, kd), float("nan"), dtype=state_dtype)
    for slot in initial:
        if slot >= 0:
            cache[slot] = 0.3 * torch.randn(heads, vd, kd, generator=generator, dtype=F64)
    before = cache.clone()
    out = torch.full((rows, heads, vd), float("nan"), dtype=F64)
    on = [x.to(DEVICE) for x in (q, k, v, g, beta, cache, out)]
    decode.kda_decode_triton(*on[:5], on_device(params), on[5], plan, on[6])
    got_cache, got_out = on[5].cpu(), on[6].cpu()
    # Compiled for a GPU, Triton takes the kernel's float arguments (scale, lower bound) as fp32.
    tolerance = TOLERANCE if state_dtype == F64 else 1e-5
    for r in range(rows):
        state = torch.zeros(heads, vd, kd, dtype=F64) if initial[r] < 0 else before[initial[r]]
        o, new = expected_step(q[r], k[r], v[r], g[r], beta[r], params, state)
        assert max_difference(got_out[r], o) <= tolerance
        assert max_difference(got_cache[running[r]], new) <= tolerance
    untouched = [s for s in range(num_slots) if s not in running]
    assert torch.equal(got_cache[untouched].isnan(), before[untouched].isnan())
    kept = ~before[untouched].isnan()
    assert torch.equal(got_cache[untouched][kept], before[untouched][kept])


def test_rows_of_several_tokens_are_left_to_the_chunked_call():
    params = make_params(heads=2, key_dim=8, seed=3)
    plan = kernels.check_state_plan(
        query_start_loc=[0, 5, 6, 9, 10], initial_slot=[-1, 0, -1, 1],
        running_slot=[2, 3, 4, 5], num_slots=6,
    )  # fmt: skip
    assert decode.one_token_rows(plan) == ((1, 3), (0, 2))
    batch = make_batch(params, 10, seed=4)
    q = k = g = batch.g.to(DEVICE)
    v = torch.randn(10, 2, 8, dtype=F64).to(DEVICE)
    cache = torch.full((6, 2, 8, 8), float("nan"), dtype=F64)
    cache[0] = cache[1] = 0.1
    cache = cache.to(DEVICE)
    out = torch.full((10, 2, 8), float("nan"), dtype=F64, device=DEVICE)
    decode.kda_decode_triton(q, k, v, g, batch.beta.to(DEVICE), on_device(params), cache, plan, out)
    written = out.isnan().reshape(10, -1).all(1).cpu().tolist()
    assert written == [True] * 5 + [False] + [True] * 3 + [False]
    assert cache[[2, 4]].isnan().all() and not cache[[3, 5]].isnan().any()


def test_bound_decode_inputs_are_read_at_every_call():
    # A CUDA graph's static inputs are refilled between replays: each call reads their values.
    params = make_params(heads=1, key_dim=8, seed=5)
    plan = kernels.StatePlan(
        query_start_loc=(0, 1, 2), initial_slot=(0, 0), running_slot=(0, 1),
        checkpoints=((), ()),
    )  # fmt: skip
    token = torch.tensor([0, 1], device=DEVICE)
    initial = torch.tensor([2, -1], device=DEVICE)
    running = torch.tensor([4, 5], device=DEVICE)
    generator = torch.Generator().manual_seed(6)
    q, k, g = (torch.randn(2, 1, 8, generator=generator, dtype=F64) for _ in range(3))
    v = torch.randn(2, 1, 8, generator=generator, dtype=F64)
    beta = torch.randn(2, 1, generator=generator, dtype=F64)
    cache = 0.2 * torch.randn(8, 1, 8, 8, generator=generator, dtype=F64)
    start = cache.clone()
    on = [x.to(DEVICE) for x in (q, k, v, g, beta, cache)]
    # Bound under the cache's own device (what the kernel keys on: "cuda:0", not "cuda").
    decode.bind_decode_inputs(plan, on[5].device, token=token, initial=initial, running=running)
    out = torch.empty(2, 1, 8, dtype=F64, device=DEVICE)
    decode.kda_decode_triton(*on[:5], on_device(params), on[5], plan, out)
    _, new = expected_step(q[0], k[0], v[0], g[0], beta[0], params, start[2])
    assert max_difference(on[5][4].cpu(), new) <= TOLERANCE
    _, new = expected_step(q[1], k[1], v[1], g[1], beta[1], params, torch.zeros(1, 8, 8, dtype=F64))
    assert max_difference(on[5][5].cpu(), new) <= TOLERANCE
    initial.copy_(torch.tensor([3, 1]))
    running.copy_(torch.tensor([6, 7]))
    decode.kda_decode_triton(*on[:5], on_device(params), on[5], plan, out)
    for row, (source, target) in enumerate(((3, 6), (1, 7))):
        _, new = expected_step(q[row], k[row], v[row], g[row], beta[row], params, start[source])
        assert max_difference(on[5][target].cpu(), new) <= TOLERANCE


def test_only_a_plan_of_one_token_rows_has_bound_decode_inputs():
    plan = kernels.StatePlan(
        query_start_loc=(0, 1, 3), initial_slot=(0, 0), running_slot=(1, 2),
        checkpoints=((), ()),
    )  # fmt: skip
    index = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one-token rows"):
        decode.bind_decode_inputs(
            plan, torch.device("cpu"), token=index, initial=index, running=index
        )


def test_the_decode_kernel_refuses_shapes_it_cannot_run():
    params = make_params(heads=2, key_dim=8, value_dim=12, seed=7)
    plan = decode_plan([-1], [0])
    x = torch.zeros(1, 2, 8, dtype=F64)
    v = torch.zeros(1, 2, 12, dtype=F64)
    with pytest.raises(ValueError, match="powers of two"):
        decode.kda_decode_triton(x, x, v, x, torch.zeros(1, 2, dtype=F64), params,
                                 torch.zeros(2, 2, 12, 8, dtype=F64), plan, v.clone())  # fmt: skip
    params = make_params(heads=2, key_dim=8, seed=7)
    with pytest.raises(ValueError, match="contiguous"):
        decode.kda_decode_triton(x, x, x, x, torch.zeros(1, 2, dtype=F64), params,
                                 torch.zeros(2, 2, 8, 8, dtype=F64).transpose(2, 3), plan,
                                 x.clone())  # fmt: skip
    cache = torch.zeros(2, 2, 8, 8, dtype=F64)
    with pytest.raises(ValueError, match="block_v must be a power of two <= V = 8"):
        decode.kda_decode_triton(x, x, x, x, torch.zeros(1, 2, dtype=F64), params, cache, plan,
                                 x.clone(), block_v=16)  # fmt: skip
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="A_log is on cpu, the state cache on cuda"):
            on = [t.cuda() for t in (x, torch.zeros(1, 2, dtype=F64), cache)]
            decode.kda_decode_triton(on[0], on[0], on[0], on[0], on[1], params, on[2], plan,
                                     on[0].clone())  # fmt: skip


class CountingOps(FakeFlashKDAOps):
    """The fake op, recording each call's sequence lengths."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def fwd(self, q, k, v, g, beta, scale, out, workspace, *args):
        cu = args[5].tolist()
        self.calls.append([b - a for a, b in itertools.pairwise(cu)])
        super().fwd(q, k, v, g, beta, scale, out, workspace, *args)


def flashkda_op_with(ops):
    backend = GPU_BACKENDS["flashkda-op"]()
    backend._ops = ops
    return backend


def flashkda_with(ops):
    """``flashkda`` (no checkpoint argument: chains at every cut) over the counting op."""
    backend = GPU_BACKENDS["flashkda"]()
    backend._fwd = flashkda_op_with(ops).fwd_without_checkpoints()
    return backend


def fp32_cache(params, num_blocks, initial):
    cache = kernels.StateCache.for_layer(params, num_blocks, conv_dtype=F64,
                                         state_dtype=torch.float32)  # fmt: skip
    cache.fill_(float("nan"))
    generator = torch.Generator().manual_seed(11)
    for slot in initial:
        if slot >= 0:
            cache.conv[slot] = torch.randn(cache.conv.shape[1:], generator=generator, dtype=F64)
            cache.recurrent[slot] = 0.3 * torch.randn(cache.recurrent.shape[1:],
                                                      generator=generator)  # fmt: skip
    return cache


@cpu_only
@pytest.mark.parametrize(
    ("backend", "calls"),
    [
        # One call (one interior export a row), then the 37-token row's last segment.
        (flashkda_op_with, [[32, 20], [5]]),
        # A call at every cut: 16 | 16 of both rows, then 16 | 4, then the last 5.
        (flashkda_with, [[16, 16], [16, 4], [5]]),
    ],
)
@pytest.mark.parametrize("order", ["decode first", "decode last", "interleaved"])
def test_a_mixed_step_splits_its_rows_and_equals_the_reference(order, backend, calls):
    params = make_params(heads=2, key_dim=8, seed=13)
    prefill_rows = {"lengths": [37, 20], "checkpoints": [[16, 32], [16]]}
    layouts = {
        "decode first": [1, 1, 37, 20],
        "decode last": [37, 20, 1, 1, 1],
        "interleaved": [1, 37, 1, 20, 1],
    }
    lengths = layouts[order]
    rows = len(lengths)
    long_rows = [r for r, n in enumerate(lengths) if n > 1]
    checkpoints = [[] for _ in lengths]
    for r, cuts in zip(long_rows, prefill_rows["checkpoints"], strict=True):
        checkpoints[r] = cuts
    initial = [r if r % 2 == 0 else -1 for r in range(rows)]
    running = [rows + r for r in range(rows)]
    planned, next_slot = [], 2 * rows
    for cuts in checkpoints:
        planned.append([(offset, next_slot + i) for i, offset in enumerate(cuts)])
        next_slot += len(cuts)
    num_blocks = next_slot + 2
    batch = make_batch(params, sum(lengths), seed=14)
    ops = CountingOps()
    got = fp32_cache(params, num_blocks, initial)
    expected = fp32_cache(params, num_blocks, initial)
    read = [slot for slot in initial if slot >= 0]
    before = got.recurrent[read].clone()
    out = prefill(backend(ops), params, got, batch, lengths, initial, running, planned)
    out_ref = prefill(kernels.TorchBackend(16, mode="loop"), params, expected, batch, lengths,
                      initial, running, planned)  # fmt: skip
    assert max_difference(out, out_ref) <= 1e-5
    assert max_difference(got.recurrent, expected.recurrent) <= 1e-5
    assert torch.equal(got.recurrent[read], before)  # the states read stay as they were
    assert ops.calls == calls  # the op saw the long rows only


@cpu_only
def test_a_prefill_row_beside_decode_rows_moves_no_state(monkeypatch):
    params = make_params(heads=2, key_dim=8, seed=15)
    moves: list[int] = []
    original = backend_module.default_row_copy

    def counting(device):
        copy = original(device)

        def counted(src, dst, src_index=None, dst_index=None):
            moves.append(1)
            copy(src, dst, src_index, dst_index)

        return counted

    monkeypatch.setattr(backend_module, "default_row_copy", counting)
    lengths = [1, 40, 1, 1]
    initial = [0, 1, 2, 3]
    running = [4, 5, 6, 7]
    planned = [[], [(32, 8)], [], []]
    batch = make_batch(params, sum(lengths), seed=16)
    got = fp32_cache(params, 10, initial)
    expected = fp32_cache(params, 10, initial)
    ops = CountingOps()
    out = prefill(flashkda_op_with(ops), params, got, batch, lengths, initial, running, planned)
    assert ops.calls == [[40]]
    assert moves == []
    out_ref = prefill(kernels.TorchBackend(16, mode="loop"), params, expected, batch, lengths,
                      initial, running, planned)  # fmt: skip
    assert max_difference(out, out_ref) <= 1e-5
    assert max_difference(got.recurrent, expected.recurrent) <= 1e-5


@cpu_only
def test_a_plan_of_decode_rows_makes_no_chunked_call():
    params = make_params(heads=2, key_dim=8, seed=17)
    ops = CountingOps()
    lengths = [1, 1, 1]
    initial, running = [0, -1, 2], [3, 4, 5]
    batch = make_batch(params, 3, seed=18)
    got = fp32_cache(params, 6, initial)
    expected = fp32_cache(params, 6, initial)
    out = prefill(flashkda_op_with(ops), params, got, batch, lengths, initial, running)
    out_ref = prefill(kernels.TorchBackend(16, mode="loop"), params, expected, batch, lengths,
                      initial, running)  # fmt: skip
    assert ops.calls == []
    assert max_difference(out, out_ref) <= 1e-5
    assert max_difference(got.recurrent, expected.recurrent) <= 1e-5
    assert np.isnan(got.recurrent[[1]].numpy()).all()


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and os.environ.get("PREFIXCACHE_FLASHKDA_LIB")),
    reason="needs a CUDA device and the FlashKDA op (PREFIXCACHE_FLASHKDA_LIB)",
)
def test_flashkda_op_runs_a_mixed_step_like_the_reference():
    # The real op and the decode kernel in bf16 with fp32 states, against the torch backend in
    # float64 on the same (bf16-rounded) inputs: decode rows first and last, a prefill row with
    # an interior checkpoint, one fresh decode row.
    device = torch.device("cuda")
    cpu_params = make_params(heads=2, key_dim=128, seed=19)
    lengths = [1, 300, 1, 1]
    initial, running = [0, 1, 2, -1], [4, 5, 6, 7]
    planned = [[], [(256, 8)], [], []]
    batch = make_batch(cpu_params, sum(lengths), seed=20, dtype=torch.bfloat16)

    def run(backend, dtype, state_dtype):
        params = kernels.KDALayerParams(
            A_log=cpu_params.A_log.float().to(device),
            dt_bias=cpu_params.dt_bias.float().to(device),
            conv_weight=cpu_params.conv_weight.to(device, dtype),
            lower_bound=cpu_params.lower_bound, conv_activation=cpu_params.conv_activation,
        )  # fmt: skip
        cache = kernels.StateCache.for_layer(params, 10, conv_dtype=dtype, state_dtype=state_dtype)
        generator = torch.Generator().manual_seed(21)
        for slot in initial[:3]:
            cache.conv[slot] = torch.randn(cache.conv.shape[1:], generator=generator).to(dtype)
            cache.recurrent[slot] = 0.3 * torch.randn(cache.recurrent.shape[1:],
                                                      generator=generator)  # fmt: skip
        on = type(batch)(*(x.to(device, dtype) for x in (batch.x, batch.g, batch.beta)))
        before = cache.recurrent[initial[:3]].clone()
        out = prefill(backend, params, cache, on, lengths, initial, running, planned)
        # The op reads its initial states from views of the cache: they stay as they were.
        assert torch.equal(cache.recurrent[initial[:3]], before)
        return out.double().cpu(), cache.recurrent.double().cpu()

    out, states = run(kernels.get_backend("flashkda-op"), torch.bfloat16, torch.float32)
    out_ref, states_ref = run(kernels.TorchBackend(16, mode="loop"), F64, F64)
    scale = float(out_ref.abs().max())
    assert max_difference(out, out_ref) <= 2e-2 * scale
    written = [4, 5, 6, 7, 8]
    assert max_difference(states[written], states_ref[written]) <= 2e-2 * float(
        states_ref[written].abs().max()
    )
