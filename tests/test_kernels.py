"""The kernel layer's contract, checked with the float64 torch reference on the CPU.

One forward with checkpoints equals forwards split at the same offsets; nothing outside the plan's
slots is written; conv windows, initial states, index dtypes and decode behave as documented; and
every bad plan is refused before a slot is touched.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_support import (
    F64,
    fill_slot,
    kernels,
    make_batch,
    make_cache,
    make_params,
    naive_kda,
    pad_checkpoints,
)

KernelPlanError = kernels.KernelPlanError


def prefill(backend, params, cache, batch, lengths, initial, running, checkpoints=None):
    loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    offsets, slots = pad_checkpoints(checkpoints or [[] for _ in lengths])
    return kernels.kda_prefill(
        backend,
        batch.x,
        batch.g,
        batch.beta,
        params,
        cache,
        loc,
        np.asarray(initial, dtype=np.int32),
        np.asarray(running, dtype=np.int32),
        np.asarray(offsets, dtype=np.int32).reshape(len(lengths), -1),
        np.asarray(slots, dtype=np.int32).reshape(len(lengths), -1),
    )


def rows_of(batch, lengths, rows_and_ranges):
    """A Batch holding, for each ``(row, first, last)``, that row's tokens ``[first, last)``."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    index = torch.cat(
        [torch.arange(starts[r] + a, starts[r] + b) for r, a, b in rows_and_ranges]
    ).long()
    return type(batch)(batch.x[index], batch.g[index], batch.beta[index])


def split_forward(backend, params, cache, batch, lengths, initial, running, checkpoints):
    """Run each row's segments between its cuts as separate steps (round by round)."""
    cuts = [
        [*sorted(row), (length, run)]
        for row, length, run in zip(checkpoints, lengths, running, strict=True)
    ]
    outputs = [[] for _ in lengths]
    for step in range(max(len(c) for c in cuts)):
        members = [r for r in range(len(lengths)) if step < len(cuts[r])]
        ranges, seg_lengths, seg_initial, seg_running = [], [], [], []
        for r in members:
            first = 0 if step == 0 else cuts[r][step - 1][0]
            last, slot = cuts[r][step]
            ranges.append((r, first, last))
            seg_lengths.append(last - first)
            seg_initial.append(initial[r] if step == 0 else cuts[r][step - 1][1])
            seg_running.append(slot)
        part = rows_of(batch, lengths, ranges)
        out = prefill(backend, params, cache, part, seg_lengths, seg_initial, seg_running)
        for r, piece in zip(members, torch.split(out, seg_lengths), strict=True):
            outputs[r].append(piece)
    return torch.cat([torch.cat(o) for o in outputs])


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| where NaN == NaN; inf when NaNs sit in different places."""
    a, b = a.to(F64), b.to(F64)
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return math.inf
    keep = ~torch.isnan(a)
    return float((a[keep] - b[keep]).abs().max()) if bool(keep.any()) else 0.0


def scenario(lengths, checkpoints, with_initial, params, seed=0):
    """Slots: initial states 0..R-1, running R..2R-1, checkpoints after; spare slots at the end."""
    rows = len(lengths)
    initial = [r if with_initial[r] else -1 for r in range(rows)]
    running = [rows + r for r in range(rows)]
    next_slot = 2 * rows
    planned = []
    for row in checkpoints:
        planned.append([(offset, next_slot + i) for i, offset in enumerate(row)])
        next_slot += len(row)
    num_blocks = next_slot + 2
    return initial, running, planned, num_blocks


def fresh_cache(params, num_blocks, initial, dtype=F64):
    cache = make_cache(params, num_blocks, dtype=dtype)
    for slot in initial:
        if slot >= 0:
            fill_slot(cache, slot, seed=100 + slot)
    return cache


@st.composite
def plans(draw):
    alignment = draw(st.sampled_from([1, 4, 16]))
    rows = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 40)) for _ in range(rows)]
    checkpoints = []
    for length in lengths:
        valid = list(range(alignment, length, alignment))
        chosen = draw(st.lists(st.sampled_from(valid), unique=True, max_size=3)) if valid else []
        checkpoints.append(chosen)  # unsorted on purpose: the planner emits tail first
    with_initial = [draw(st.booleans()) for _ in range(rows)]
    mode = draw(st.sampled_from(["chunked", "loop"]))
    chunk = draw(st.sampled_from([4, 64]))
    gate = draw(st.sampled_from(["bounded", "softplus"]))
    return alignment, lengths, checkpoints, with_initial, mode, chunk, gate


@settings(
    max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(plans())
def test_checkpointed_forward_equals_split_forwards(plan):
    alignment, lengths, checkpoints, with_initial, mode, chunk, gate = plan
    params = make_params(gate=gate)
    backend = kernels.TorchBackend(alignment, mode=mode, chunk_size=chunk)
    initial, running, planned, num_blocks = scenario(lengths, checkpoints, with_initial, params)
    batch = make_batch(params, sum(lengths))

    one = fresh_cache(params, num_blocks, initial)
    out_one = prefill(backend, params, one, batch, lengths, initial, running, planned)
    split = fresh_cache(params, num_blocks, initial)
    out_split = split_forward(backend, params, split, batch, lengths, initial, running, planned)

    assert max_difference(out_one, out_split) <= 1e-12
    assert max_difference(one.recurrent, split.recurrent) <= 1e-12
    assert max_difference(one.conv, split.conv) <= 1e-12
    # Every written slot holds numbers; every other slot is still NaN; initial slots unchanged.
    written = set(running) | {slot for row in planned for _, slot in row}
    reference = fresh_cache(params, num_blocks, initial)
    for slot in range(num_blocks):
        if slot in written:
            assert bool(torch.isfinite(one.recurrent[slot]).all())
            assert bool(torch.isfinite(one.conv[slot]).all())
        else:
            assert max_difference(one.recurrent[slot], reference.recurrent[slot]) == 0.0
            assert max_difference(one.conv[slot], reference.conv[slot]) == 0.0
    assert bool(torch.isfinite(out_one).all())


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_prefill_matches_the_written_out_math(gate):
    params = make_params(heads=2, key_dim=4, value_dim=6, gate=gate, seed=3)
    lengths = [7, 2, 12]
    batch = make_batch(params, sum(lengths), seed=4)
    cache = make_cache(params, 8)
    fill_slot(cache, 0, seed=5)
    fill_slot(cache, 1, seed=6)
    out = prefill(kernels.TorchBackend(), params, cache, batch, lengths, [0, -1, 1], [2, 3, 4])
    expected, windows, states = naive_kda(
        params,
        batch,
        lengths,
        [cache.conv[0], None, cache.conv[1]],
        [cache.recurrent[0], None, cache.recurrent[1]],
    )
    assert float((out - expected).abs().max()) < 1e-10
    for row, slot in enumerate([2, 3, 4]):
        assert float((cache.conv[slot] - windows[row]).abs().max()) == 0.0
        assert float((cache.recurrent[slot] - states[row]).abs().max()) < 1e-10


def test_gates_stay_in_their_ranges():
    g = 3 * torch.randn(50, 2, 8, dtype=F64)
    bounded = kernels.reference.kda_gate(g, make_params(gate="bounded"))
    assert bool((bounded < 0).all()) and bool((bounded >= -5).all())
    softplus = kernels.reference.kda_gate(g, make_params(gate="softplus"))
    assert bool((softplus < 0).all())


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_chunked_form_matches_the_token_loop(chunk_size):
    params = make_params(heads=3, key_dim=8, gate="softplus", seed=7)
    lengths = [37, 5, 64]
    checkpoints = [[(16, 8), (3, 9)], [], [(63, 10)]]
    batch = make_batch(params, sum(lengths), seed=8)
    results = []
    for backend in (
        kernels.TorchBackend(mode="loop"),
        kernels.TorchBackend(mode="chunked", chunk_size=chunk_size),
    ):
        cache = fresh_cache(params, 12, [0, 1, 2])
        out = prefill(backend, params, cache, batch, lengths, [0, 1, 2], [3, 4, 5], checkpoints)
        results.append((out, cache))
    (out_loop, loop), (out_chunked, chunked) = results
    assert max_difference(out_loop, out_chunked) < 1e-10
    assert max_difference(loop.recurrent, chunked.recurrent) < 1e-10


def test_conv_checkpoints_below_the_conv_width_come_from_the_initial_window():
    params = make_params()
    batch = make_batch(params, 10)
    cache = make_cache(params, 8)
    fill_slot(cache, 0, seed=9)
    window = cache.conv[0].clone()  # [C, 3], oldest first
    prefill(
        kernels.TorchBackend(), params, cache, batch, [5, 5], [0, -1], [1, 2],
        [[(1, 3), (2, 4)], [(1, 5), (2, 6)]],
    )  # fmt: skip
    x = batch.x.T  # [C, T]
    assert torch.equal(cache.conv[3], torch.cat([window[:, 1:], x[:, :1]], dim=1))
    assert torch.equal(cache.conv[4], torch.cat([window[:, 2:], x[:, :2]], dim=1))
    zeros = torch.zeros(params.conv_channels, 1, dtype=F64)
    assert torch.equal(cache.conv[5], torch.cat([zeros, zeros, x[:, 5:6]], dim=1))
    assert torch.equal(cache.conv[6], torch.cat([zeros, x[:, 5:7]], dim=1))
    assert torch.equal(cache.conv[1], x[:, 2:5])
    assert torch.equal(cache.conv[2], x[:, 7:10])


def test_no_initial_state_equals_an_initial_state_of_zeros():
    params = make_params()
    batch = make_batch(params, 20)
    without = make_cache(params, 6)
    out_without = prefill(kernels.TorchBackend(), params, without, batch, [12, 8], [-1, -1], [2, 3])
    with_zeros = make_cache(params, 6)
    with_zeros.conv[0:2] = 0
    with_zeros.recurrent[0:2] = 0
    out_zeros = prefill(kernels.TorchBackend(), params, with_zeros, batch, [12, 8], [0, 1], [2, 3])
    assert torch.equal(out_without, out_zeros)
    assert torch.equal(without.recurrent[2:4], with_zeros.recurrent[2:4])
    assert torch.equal(without.conv[2:4], with_zeros.conv[2:4])
    # And a non-zero initial state does change the result.
    fill_slot(with_zeros, 0, seed=11)
    out_state = prefill(kernels.TorchBackend(), params, with_zeros, batch, [12, 8], [0, 1], [4, 5])
    assert not torch.allclose(out_state[:12], out_without[:12])


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("as_torch", [False, True])
def test_query_start_loc_in_int32_and_int64(index_dtype, as_torch):
    params = make_params()
    batch = make_batch(params, 30)
    arrays = {
        "query_start_loc": np.array([0, 17, 30], dtype=index_dtype),
        "initial_slot": np.array([0, -1], dtype=np.int32),
        "running_slot": np.array([1, 2], dtype=np.int32),
        "checkpoint_offsets": np.array([[8], [4]], dtype=np.int32),
        "checkpoint_slots": np.array([[3], [4]], dtype=np.int32),
    }
    if as_torch:
        arrays = {name: torch.from_numpy(value) for name, value in arrays.items()}
    cache = fresh_cache(params, 6, [0])
    out = kernels.kda_prefill(
        kernels.TorchBackend(4), batch.x, batch.g, batch.beta, params, cache, **arrays
    )
    expected_cache = fresh_cache(params, 6, [0])
    expected = prefill(
        kernels.TorchBackend(4), params, expected_cache, batch, [17, 13], [0, -1], [1, 2],
        [[(8, 3)], [(4, 4)]],
    )  # fmt: skip
    assert torch.equal(out, expected)
    assert max_difference(cache.recurrent, expected_cache.recurrent) == 0.0


@pytest.mark.parametrize("mode", ["chunked", "loop"])
def test_prefill_equals_shorter_prefill_plus_decode_steps(mode):
    params = make_params(seed=12)
    lengths, steps = [9, 14], 4
    batch = make_batch(params, sum(lengths), seed=13)
    backend = kernels.TorchBackend(mode=mode)
    whole = fresh_cache(params, 8, [0])
    out_whole = prefill(backend, params, whole, batch, lengths, [0, -1], [1, 2])

    cache = fresh_cache(params, 8, [0])
    prefix = rows_of(batch, lengths, [(r, 0, n - steps) for r, n in enumerate(lengths)])
    prefill(backend, params, cache, prefix, [n - steps for n in lengths], [0, -1], [3, 4])
    read, write = [3, 4], [5, 6]
    decoded = []
    for step in range(steps):
        token = rows_of(
            batch,
            lengths,
            [(r, n - steps + step, n - steps + step + 1) for r, n in enumerate(lengths)],
        )
        decoded.append(
            kernels.kda_decode(backend, token.x, token.g, token.beta, params, cache, read, write)
        )
        read, write = write, read
    ends = np.cumsum(lengths)
    for row in range(2):
        expected = out_whole[ends[row] - steps : ends[row]]
        got = torch.stack([d[row] for d in decoded])
        assert max_difference(got, expected) <= 1e-12
        assert max_difference(cache.recurrent[read[row]], whole.recurrent[1 + row]) <= 1e-12
        assert max_difference(cache.conv[read[row]], whole.conv[1 + row]) <= 1e-12


@pytest.mark.parametrize(
    ("conv_dtype", "state_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_split_equality_holds_in_serving_dtypes(conv_dtype, state_dtype):
    """bf16 / fp32 caches: conv windows are copies (exact); states and outputs agree to fp32
    rounding (CPU elementwise kernels may round a value differently at another position of a
    tensor, so bitwise equality is asserted on the GPU only)."""
    params = make_params(seed=14)
    params32 = kernels.KDALayerParams(
        params.A_log.float(), params.dt_bias.float(), params.conv_weight.float(), -5.0
    )
    lengths, checkpoints = [40, 23], [[(16, 6), (32, 7)], [(16, 8)]]
    batch = make_batch(params, sum(lengths), seed=15, dtype=conv_dtype)

    def cache():
        c = kernels.StateCache.for_layer(
            params32, 10, conv_dtype=conv_dtype, state_dtype=state_dtype
        )
        fill_slot(c, 0, seed=16)
        return c

    backend = kernels.TorchBackend(16)
    one, split = cache(), cache()
    out_one = prefill(backend, params32, one, batch, lengths, [0, -1], [2, 3], checkpoints)
    out_split = split_forward(
        backend, params32, split, batch, lengths, [0, -1], [2, 3], checkpoints
    )
    assert max_difference(out_one, out_split) <= 1e-5
    assert max_difference(one.recurrent, split.recurrent) <= 1e-5
    assert torch.equal(one.conv, split.conv)
    assert one.conv.dtype == conv_dtype and one.recurrent.dtype == state_dtype


# --- validation -------------------------------------------------------------------------------

BASE = {
    "query_start_loc": [0, 40, 64],
    "initial_slot": [0, -1],
    "running_slot": [1, 2],
    "checkpoint_offsets": [[16, 32], [16, 0]],
    "checkpoint_slots": [[3, 4], [5, -1]],
}


def bad(**changes):
    return {**BASE, **changes}


BAD_PLANS = [
    pytest.param(
        bad(checkpoint_offsets=[[16, 24], [16, 0]]),
        r"offset 24 is not exportable by backend 'torch' \(checkpoint_alignment 16\) from a "
        r"query of 40 tokens.*a multiple of 16; nearest valid offsets: 16, 32",
        id="off the grid",
    ),
    pytest.param(
        bad(checkpoint_offsets=[[16, 40], [16, 0]]),
        r"offset 40 is not exportable.*0 < offset < 40 \(the position at the end of the "
        r"query is taken by a snapshot.*nearest valid offsets: 32",
        id="offset at the query end",
    ),
    pytest.param(
        bad(checkpoint_offsets=[[16, 48], [16, 0]]),
        r"offset 48 is not exportable.*0 < offset < 40.*nearest valid offsets: 32",
        id="offset beyond the query",
    ),
    pytest.param(
        bad(checkpoint_offsets=[[16, -16], [16, 0]]),
        r"offset -16 is not exportable.*nearest valid offsets: 16",
        id="negative offset",
    ),
    pytest.param(
        bad(checkpoint_slots=[[3, 1], [5, -1]]),
        r"checkpoint slot 1 equals the row's running slot",
        id="checkpoint slot = own running slot",
    ),
    pytest.param(
        bad(checkpoint_slots=[[3, 2], [5, -1]]),
        r"row 1's running slot 2 is written twice in one step "
        r"\(also row 0's checkpoint slot \(offset 32\)\)",
        id="checkpoint slot = another running slot",
    ),
    pytest.param(
        bad(checkpoint_slots=[[3, 4], [4, -1]]),
        r"4 is written twice in one step \(also row 0's checkpoint slot",
        id="checkpoint slot repeated",
    ),
    pytest.param(
        bad(checkpoint_slots=[[3, 8], [5, -1]]),
        r"checkpoint slot 8 is out of range \[0, 8\)",
        id="checkpoint slot out of range",
    ),
    pytest.param(
        bad(checkpoint_slots=[[3, -2], [5, -1]]),
        r"checkpoint slot -2 is out of range",
        id="checkpoint slot negative",
    ),
    pytest.param(
        bad(running_slot=[1, 9]),
        r"row 1: running_slot 9 is out of range \[0, 8\)",
        id="running slot out of range",
    ),
    pytest.param(
        bad(running_slot=[-1, 2]),
        r"row 0: running_slot -1 is out of range",
        id="running slot -1",
    ),
    pytest.param(
        bad(initial_slot=[0, 8]),
        r"row 1: initial_slot 8 is out of range \[-1, 8\)",
        id="initial slot out of range",
    ),
    pytest.param(
        bad(initial_slot=[-2, -1]),
        r"initial_slot -2 is out of range",
        id="initial slot below -1",
    ),
    pytest.param(
        bad(initial_slot=[1, -1]),
        r"row 0: initial_slot equals running_slot \(1\).*double-buffered",
        id="initial = running",
    ),
    pytest.param(
        bad(initial_slot=[0, 3]),
        r"row 1: initial_slot 3 is also row 0's checkpoint slot \(offset 16\)",
        id="initial = another row's write",
    ),
    pytest.param(
        bad(checkpoint_slots=[[3, -1], [5, -1]]),
        r"offset 32 paired with slot -1",
        id="offset without slot",
    ),
    pytest.param(
        bad(checkpoint_offsets=[[16, 32], [0, 0]]),
        r"offset 0 paired with slot 5",
        id="slot without offset",
    ),
    pytest.param(
        bad(checkpoint_offsets=[[16, 16], [16, 0]]),
        r"offset 16 appears twice",
        id="offset twice",
    ),
    pytest.param(
        bad(query_start_loc=[1, 40, 64]),
        r"must start at 0",
        id="query_start_loc not from 0",
    ),
    pytest.param(
        bad(query_start_loc=[0, 40, 40]),
        r"row 1: query length 0",
        id="empty row",
    ),
    pytest.param(
        bad(query_start_loc=[0, 40, 60]),
        r"ends at 60 but the inputs have 64 tokens",
        id="tokens mismatch",
    ),
    pytest.param(
        bad(query_start_loc=np.array([0.0, 40.0, 64.0])),
        r"query_start_loc: .*integer dtype",
        id="float query_start_loc",
    ),
    pytest.param(
        bad(initial_slot=[0]),
        r"initial_slot has 1 entries, expected 2",
        id="short initial_slot",
    ),
    pytest.param(
        bad(checkpoint_slots=[[3], [5]]),
        r"checkpoint_offsets has 2 columns but checkpoint_slots has 1",
        id="ragged checkpoint arrays",
    ),
    pytest.param(
        bad(checkpoint_offsets=[[16, 32]], checkpoint_slots=[[3, 4]]),
        r"checkpoint_offsets must be \[R=2, Cmax\]",
        id="checkpoint rows",
    ),
]


@pytest.mark.parametrize(("plan", "message"), BAD_PLANS)
def test_bad_plans_are_refused_before_any_write(plan, message):
    params = make_params()
    batch = make_batch(params, 64)
    cache = fresh_cache(params, 8, [0])
    before_conv, before_state = cache.conv.clone(), cache.recurrent.clone()
    with pytest.raises(KernelPlanError, match=message):
        kernels.kda_prefill(
            kernels.TorchBackend(16), batch.x, batch.g, batch.beta, params, cache, **plan
        )
    assert max_difference(cache.conv, before_conv) == 0.0
    assert max_difference(cache.recurrent, before_state) == 0.0


def test_the_base_plan_of_the_bad_plan_cases_is_valid():
    params = make_params()
    batch = make_batch(params, 64)
    cache = fresh_cache(params, 8, [0])
    kernels.kda_prefill(
        kernels.TorchBackend(16), batch.x, batch.g, batch.beta, params, cache, **BASE
    )
    assert bool(torch.isfinite(cache.recurrent[1:6]).all())
    assert bool(torch.isnan(cache.recurrent[6:]).all())


def test_alignment_is_the_backends_and_the_gpu_grids_can_be_exercised_on_cpu():
    for alignment in (16, 64):
        backend = kernels.TorchBackend(alignment)
        assert backend.state_group_config() == {
            "checkpoint_alignment": alignment,
            "max_checkpoints_per_step": None,
        }
        loc = [0, 200]
        backend.check_plan(
            query_start_loc=loc, initial_slot=[-1], running_slot=[0],
            checkpoint_offsets=[[alignment]], checkpoint_slots=[[1]], num_slots=2,
        )  # fmt: skip
        with pytest.raises(KernelPlanError, match=f"alignment {alignment}"):
            backend.check_plan(
                query_start_loc=loc, initial_slot=[-1], running_slot=[0],
                checkpoint_offsets=[[alignment + 8]], checkpoint_slots=[[1]], num_slots=2,
            )  # fmt: skip


@pytest.mark.parametrize(
    ("offset", "query_len", "hint"),
    [
        (8, 200, "nearest valid offsets: 16$"),
        (40, 200, "nearest valid offsets: 32, 48$"),
        (8, 10, "the query has no valid offset$"),
    ],
)
def test_a_refused_offset_names_the_nearest_the_core_accepts(offset, query_len, hint):
    with pytest.raises(kernels.KernelPlanError, match=hint):
        kernels.check_state_plan(
            query_start_loc=[0, query_len], initial_slot=[-1], running_slot=[0],
            checkpoint_offsets=[[offset]], checkpoint_slots=[[1]], num_slots=2, alignment=16,
        )  # fmt: skip


def test_max_checkpoints_per_step_is_enforced():
    with pytest.raises(KernelPlanError, match="2 checkpoints exceed backend 'x''s max_checkpoints"):
        kernels.check_state_plan(
            query_start_loc=[0, 50], initial_slot=[-1], running_slot=[0],
            checkpoint_offsets=[[10, 20]], checkpoint_slots=[[1, 2]], num_slots=4,
            max_checkpoints=1, backend="x",
        )  # fmt: skip


def test_plan_sorts_checkpoints_and_lists_cuts():
    plan = kernels.check_state_plan(
        query_start_loc=np.array([0, 50, 60], dtype=np.int32), initial_slot=[-1, 7],
        running_slot=[0, 1], checkpoint_offsets=[[40, 10], [0, 0]],
        checkpoint_slots=[[2, 3], [-1, -1]], num_slots=8,
    )  # fmt: skip
    C = kernels.Checkpoint
    assert plan.cuts(0) == [C(10, 3), C(40, 2), C(50, 0)]
    assert plan.cuts(1) == [C(10, 1)]
    assert plan.all_cuts() == [(0, C(10, 3)), (0, C(40, 2)), (0, C(50, 0)), (1, C(10, 1))]
    assert sorted(plan.written_slots()) == [0, 1, 2, 3]


# --- decode, snapshots, copies ------------------------------------------------------------------


def test_decode_refuses_bad_slots_before_writing():
    params = make_params()
    batch = make_batch(params, 2)
    cache = fresh_cache(params, 4, [0])
    with pytest.raises(KernelPlanError, match="initial_slot equals running_slot"):
        kernels.kda_decode(
            kernels.TorchBackend(), batch.x, batch.g, batch.beta, params, cache, [0, 1], [0, 2]
        )
    assert bool(torch.isnan(cache.recurrent[1:]).all())


@pytest.mark.parametrize("moved", ["g", "beta", "A_log", "dt_bias"])
def test_a_layer_refuses_tensors_off_its_inputs_device_before_writing(moved):
    # The checks the backends' kernels rely on (the Triton decode kernel takes raw pointers):
    # every tensor of the layer on the inputs' device. The meta device stands for another one.
    params = make_params()
    batch = make_batch(params, 3)
    cache = fresh_cache(params, 4, [0])
    if moved in ("A_log", "dt_bias"):
        params = dataclasses.replace(params, **{moved: getattr(params, moved).to("meta")})
    else:
        batch = dataclasses.replace(batch, **{moved: getattr(batch, moved).to("meta")})
    with pytest.raises(ValueError, match=f"but {moved} is on meta"):
        prefill(kernels.TorchBackend(), params, cache, batch, [3], [0], [1])
    assert bool(torch.isnan(cache.recurrent[1:]).all())


def test_snapshots_copy_conv_and_state_and_refuse_bad_rows():
    params = make_params()
    caches = [fresh_cache(params, 6, [0, 1]), fresh_cache(params, 6, [0, 1])]
    kernels.apply_snapshots(caches, np.array([[0, 4], [1, 5]], dtype=np.int32))
    for cache in caches:
        assert torch.equal(cache.conv[4], cache.conv[0])
        assert torch.equal(cache.recurrent[5], cache.recurrent[1])
        assert bool(torch.isnan(cache.recurrent[2:4]).all())
    for rows, message in [
        ([[0, 6]], r"destination slot 6 is out of range \[0, 6\)"),
        ([[0, 0]], "source and destination are both 0"),
        ([[0, 4], [1, 4]], "destination slot 4 is written twice"),
        ([[0, 4], [4, 5]], "destination slot 4 is also a snapshot source"),
        ([[0, 4, 1]], r"snapshots must be \[S, 2\]"),
    ]:
        with pytest.raises(KernelPlanError, match=message):
            kernels.apply_snapshots(caches[0], np.array(rows))
    kernels.apply_snapshots(caches[0], np.zeros((0, 2), dtype=np.int32))  # nothing to do


def test_paged_kv_write_gather_and_copy_on_write():
    kv = kernels.PagedKVCache(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3, dtype=F64)
    key = torch.randn(7, 2, 3, dtype=F64)
    value = torch.randn(7, 2, 3, dtype=F64)
    table = [5, 2]  # tokens 0..3 in block 5, 4..6 in block 2
    slots = np.array([5 * 4 + i for i in range(4)] + [2 * 4 + i for i in range(3)], dtype=np.int64)
    kv.write(slots, key, value)
    got_key, got_value = kv.gather(np.array([*table, 0, 0]), 7)
    assert torch.equal(got_key, key) and torch.equal(got_value, value)
    kv.write(np.array([-1, 0, 11], dtype=np.int64), key[:3], value[:3])  # padding skipped
    assert torch.equal(kv.key[0, 0], key[1])

    other = kernels.PagedKVCache(6, 4, 2, 3, dtype=F64)
    other.key[2] = 7.0
    kernels.apply_copies(np.array([[1, 2, 3, 3]], dtype=np.int64), {1: [kv, other]})
    assert torch.equal(kv.key[3, :3], kv.key[2, :3])
    assert not torch.equal(kv.key[3, 3], kv.key[2, 3])  # only num_tokens slots copied
    assert bool((other.key[3, :3] == 7.0).all())
    for rows, message in [
        ([[0, 2, 3, 3]], "group 0 has no paged KV cache"),
        ([[1, 2, 6, 3]], r"destination block 6 is out of range \[0, 6\)"),
        ([[1, 2, 2, 3]], "source and destination are both block 2"),
        ([[1, 2, 3, 5]], r"num_tokens 5 is outside \[0, block_size=4\]"),
        ([[1, 2, 3, 1], [1, 4, 3, 1]], "destination block 3 is written twice"),
        ([[1, 2, 3, 1], [1, 3, 4, 1]], "destination block 3 is also a source"),
    ]:
        with pytest.raises(KernelPlanError, match=message):
            kernels.apply_copies(np.array(rows, dtype=np.int64), {1: kv})


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    subset=st.booleans(),
    rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 4)), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_stacked_caches_behave_as_caches_of_their_own(layers, subset, rows, seed):
    """Layers of one ``PagedKVCache.stacked`` storage, written and copied as a group (one copy
    for all of them) or a subset of them (a copy each), hold exactly what separate caches given
    the same writes and copies hold; no layer's writes reach another's."""
    generator = torch.Generator().manual_seed(seed)
    stacked = kernels.PagedKVCache.stacked(layers, 6, 4, 2, 3, dtype=F64)
    separate = [kernels.PagedKVCache(6, 4, 2, 3, dtype=F64) for _ in range(layers)]
    for layer in range(layers):
        slots = torch.randperm(24, generator=generator)[:10].numpy()
        key = torch.randn(10, 2, 3, generator=generator, dtype=F64)
        value = torch.randn(10, 2, 3, generator=generator, dtype=F64)
        for caches in (stacked, separate):
            caches[layer].write(slots, key, value)
    # Valid copy rows: a destination written once and never a source (check_copies' rule).
    copies, sources, destinations = [], set(), set()
    for src, dst, tokens in rows:
        if src != dst and dst not in destinations | sources and src not in destinations:
            copies.append([0, src, dst, tokens])
            sources.add(src)
            destinations.add(dst)
    chosen = slice(0, max(1, layers - 1)) if subset else slice(None)
    for caches in (stacked, separate):
        kernels.apply_copies(np.array(copies, dtype=np.int64).reshape(-1, 4), {0: caches[chosen]})
    for got, expected in zip(stacked, separate, strict=True):
        assert torch.equal(got.key, expected.key) and torch.equal(got.value, expected.value)
        assert got.key.is_contiguous() and got.value.is_contiguous()
        assert got.key.shape == expected.key.shape


def test_a_group_of_layers_from_two_stacks_copies_each_layer():
    """One copy covers a storage only when the group is exactly its layers: layer 0 of two
    storages of two layers each are copied one by one, and neither storage's layer 1 moves."""
    first, second = (kernels.PagedKVCache.stacked(2, 4, 2, 1, 1, dtype=F64) for _ in range(2))
    for caches in (first, second):
        for cache in caches:
            cache.key.copy_(torch.randn(cache.key.shape, dtype=F64))
            cache.value.copy_(torch.randn(cache.value.shape, dtype=F64))
    before = [(c.key.clone(), c.value.clone()) for c in (*first, *second)]
    kernels.apply_copies(np.array([[0, 1, 3, 2]]), {0: [first[0], second[0]]})
    for cache, (key, value) in zip((first[0], second[0]), before[::2], strict=True):
        assert torch.equal(cache.key[3], key[1]) and torch.equal(cache.value[3], value[1])
    for cache, (key, value) in zip((first[1], second[1]), before[1::2], strict=True):
        assert torch.equal(cache.key, key) and torch.equal(cache.value, value)


def test_copies_of_two_paged_groups_reach_only_their_own_caches():
    """Rows of two paged groups, interleaved, move blocks in their own group's layers only:
    the same as each row's ``copy_prefix`` in each of its group's caches, one at a time."""
    generator = torch.Generator().manual_seed(3)

    def filled(caches):
        for cache in caches:
            cache.key.copy_(torch.randn(cache.key.shape, generator=generator, dtype=F64))
            cache.value.copy_(torch.randn(cache.value.shape, generator=generator, dtype=F64))
        return caches

    groups = {0: filled(kernels.PagedKVCache.stacked(2, 6, 4, 1, 2, dtype=F64)), 5: filled(
        [kernels.PagedKVCache(6, 4, 1, 2, dtype=F64)]
    )}  # fmt: skip
    expected = {
        g: [(c.key.clone(), c.value.clone()) for c in caches] for g, caches in groups.items()
    }
    rows = [[5, 0, 1, 3], [0, 2, 3, 4], [5, 2, 4, 1], [0, 0, 5, 2]]
    for group, src, dst, tokens in rows:
        for key, value in expected[group]:
            key[dst, :tokens] = key[src, :tokens]
            value[dst, :tokens] = value[src, :tokens]
    kernels.apply_copies(np.array(rows, dtype=np.int64), groups)
    for group, caches in groups.items():
        for cache, (key, value) in zip(caches, expected[group], strict=True):
            assert torch.equal(cache.key, key) and torch.equal(cache.value, value)


def test_stacked_caches_refuse_bad_sizes():
    with pytest.raises(ValueError, match="layers must be >= 1"):
        kernels.PagedKVCache.stacked(0, 6, 4, 2, 3)
    with pytest.raises(ValueError, match="must all be >= 1, got 0, 4, 2, 3"):
        kernels.PagedKVCache.stacked(2, 0, 4, 2, 3)


def test_paged_attention_matches_dense_causal_attention():
    torch.manual_seed(0)
    kv = kernels.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=F64)
    seq_lens, query_lens = [10, 5], [3, 5]
    tables = np.array([[6, 1, 3], [0, 7, -1]])
    keys, values, queries = [], [], []
    for row, (length, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        k, v = torch.randn(length, 2, 8, dtype=F64), torch.randn(length, 2, 8, dtype=F64)
        slots = [tables[row][i // 4] * 4 + i % 4 for i in range(length)]
        kv.write(np.array(slots), k, v)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, 4, 8, dtype=F64))
    out = kernels.paged_attention(torch.cat(queries), kv, tables, seq_lens, [0, 3, 8])
    first = 0
    for row, (length, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        q = queries[row].transpose(0, 1)  # [4, q, 8]
        k = keys[row].repeat_interleave(2, dim=1).transpose(0, 1)
        v = values[row].repeat_interleave(2, dim=1).transpose(0, 1)
        mask = torch.ones(q_len, length, dtype=torch.bool).tril(length - q_len)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.allclose(out[first : first + q_len], expected.transpose(0, 1), atol=1e-12)
        first += q_len


# --- backends -----------------------------------------------------------------------------------


def test_unknown_and_unavailable_backends_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown backend 'cuda'; choose one of torch, fla"):
        kernels.get_backend("cuda")
    if not torch.cuda.is_available():
        for name in ("fla", "flashkda", "flashkda-op"):
            with pytest.raises(kernels.BackendUnavailableError, match=f"backend '{name}' needs"):
                kernels.get_backend(name)


def test_flashkda_op_names_the_missing_library(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("the library check comes after the GPU check")
    monkeypatch.delenv(kernels.LIBRARY_ENV, raising=False)
    with pytest.raises(kernels.BackendUnavailableError, match=kernels.LIBRARY_ENV):
        kernels.get_backend("flashkda-op", library=None)


def test_auto_picks_an_available_backend_and_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="prefixcache.kernels"):
        backend = kernels.get_backend("auto")
    assert backend.name in kernels.registry.BACKEND_NAMES
    assert f"chose '{backend.name}'" in caplog.text
    if not torch.cuda.is_available():
        assert backend.name == "torch"
        assert "passed over: flashkda-op: backend 'flashkda-op' needs a CUDA GPU" in caplog.text
    available = kernels.available_backends()
    assert available["torch"] is None
    with pytest.raises(ValueError, match="'auto' takes only the option 'library'"):
        kernels.get_backend("auto", mode="loop")


def test_torch_backend_options_are_checked():
    with pytest.raises(ValueError, match="checkpoint_alignment must be >= 1"):
        kernels.TorchBackend(0)
    with pytest.raises(ValueError, match="mode must be"):
        kernels.get_backend("torch", mode="fast")


@pytest.mark.parametrize(
    "as_input", [np.asarray, torch.as_tensor, list], ids=["numpy", "torch", "list"]
)
def test_paged_kv_refuses_bad_indices_before_writing(as_input):
    cache = kernels.PagedKVCache(4, 8, 1, 2, dtype=F64)
    before = cache.key.clone()
    kv = torch.ones(3, 1, 2, dtype=F64)
    with pytest.raises(IndexError, match="slot 32 is beyond the cache's 32 slots"):
        cache.write(as_input([0, 5, 32]), kv, kv)
    assert torch.equal(cache.key, before)
    cache.write(as_input([-1, 9, 10]), kv, 2 * kv)  # -1 is padding: skipped
    assert torch.equal(cache.value[1, 1:3], 2 * kv[1:].reshape(2, 1, 2))
    assert bool((cache.key[0] == 0).all())
    with pytest.raises(IndexError, match=r"has a block outside \[0, 4\)"):
        cache.gather(as_input([1, 4]), 12)
    with pytest.raises(ValueError, match="needs 2 blocks but the block table row has 1"):
        cache.gather(as_input([1]), 9)
    key, value = cache.gather(as_input([1, 0]), 11)
    assert key.shape == (11, 1, 2) and torch.equal(value[1:3], 2 * kv[1:])


def test_paged_kv_slots_in_range_is_what_a_checked_write_relies_on():
    cache = kernels.PagedKVCache(4, 8, 1, 2, dtype=F64)
    assert cache.slots_in_range(np.array([0, 5, 31]))
    assert cache.slots_in_range(np.zeros(0, dtype=np.int64))
    assert not cache.slots_in_range(np.array([0, 32]))  # beyond the cache
    assert not cache.slots_in_range(np.array([-1, 3]))  # padding: the general path skips it
    # Host slots are checked on the host whatever ``checked`` says.
    kv = torch.ones(2, 1, 2, dtype=F64)
    with pytest.raises(IndexError, match="slot 32 is beyond"):
        cache.write(np.array([3, 32]), kv, kv, checked=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_checked_write_of_device_slots_equals_the_checked_path():
    device = torch.device("cuda")
    slots = np.array([3, 17, 8, 30])
    kv = torch.randn(4, 1, 2, dtype=F64, device=device)
    fast = kernels.PagedKVCache(4, 8, 1, 2, dtype=F64, device=device)
    slow = kernels.PagedKVCache(4, 8, 1, 2, dtype=F64, device=device)
    fast.write(torch.from_numpy(slots).to(device), kv, 2 * kv, checked=True)
    slow.write(slots, kv, 2 * kv)
    assert torch.equal(fast.key, slow.key) and torch.equal(fast.value, slow.value)
    with pytest.raises(ValueError, match="key and value must both be"):
        fast.write(torch.from_numpy(slots).to(device), kv[:3], kv[:3], checked=True)
