"""Segment chaining (how ``fla`` exact mode and both FlashKDA backends export checkpoints),
checked on the CPU with a stand-in kernel built on the float64 reference.

The stand-in has the GPU kernels' contract: packed ``[1, n, H, *]`` inputs, ``cu_seqlens``, an
initial state per sequence, the final state per sequence, and (with ``per_call = 1``) one interior
state per sequence at ``checkpoint_offsets`` (0 = none). Chained through ``run_rounds`` it must
give exactly what the torch backend gives for the same plan.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_support import F64, fill_slot, kernels, make_batch, make_cache, make_params
from test_kernels import max_difference, prefill, scenario

chaining = kernels.chaining
reference = kernels.reference


class StandInBackend(kernels.KDABackend):
    """A chaining backend whose kernel call is the reference token loop."""

    name = "stand-in"

    def __init__(self, per_call: int, alignment: int = 1) -> None:
        self.per_call = per_call
        self.checkpoint_alignment = alignment
        self.max_checkpoints_per_step = None
        self.calls: list[list[int]] = []

    def check_layer(self, params, dtype, device) -> None:
        pass

    def _call(self, params, batch):
        cu = batch.cu_seqlens_host.tolist()
        self.calls.append([b - a for a, b in itertools.pairwise(cu)])
        assert batch.cu_seqlens.dtype == torch.int64
        out = torch.empty_like(batch.v[0])
        final = torch.empty_like(batch.initial_state)
        interior = torch.full_like(batch.initial_state, float("nan"))
        offsets = (
            batch.checkpoint_offsets.tolist()
            if batch.checkpoint_offsets is not None
            else [0] * (len(cu) - 1)
        )
        scale = batch.q.shape[-1] ** -0.5
        for i, (a, b) in enumerate(itertools.pairwise(cu)):
            inputs = reference.prepare_inputs(
                *(x[0, a:b] for x in (batch.q, batch.k, batch.v, batch.g, batch.beta)), params, F64
            )
            state = batch.initial_state[i].to(F64).transpose(-1, -2)
            cuts = [offsets[i], b - a] if offsets[i] else [b - a]
            done = 0
            for cut in cuts:
                part = slice(done, cut)
                o, state = reference.recurrence_loop(*(x[part] for x in inputs), scale, state)
                out[a + done : a + cut] = o
                if cut != b - a:
                    interior[i] = state.transpose(-1, -2)
                done = cut
            final[i] = state.transpose(-1, -2)
        return out[None], final, interior if batch.checkpoint_offsets is not None else None

    def forward(self, q, k, v, g, beta, params, recurrent, plan):
        rounds = chaining.plan_rounds(plan, self.per_call)
        return chaining.run_rounds(
            plan, rounds, q, k, v, g, beta, recurrent, lambda b: self._call(params, b), F64
        )


def test_rounds_cut_rows_at_their_checkpoints():
    plan = kernels.check_state_plan(
        query_start_loc=[0, 100, 130, 200], initial_slot=[-1, 9, -1], running_slot=[0, 1, 2],
        checkpoint_offsets=[[64, 16, 32], [0, 0, 0], [48, 0, 0]],
        checkpoint_slots=[[3, 4, 5], [-1, -1, -1], [6, -1, -1]], num_slots=10,
    )  # fmt: skip
    S = chaining.Segment
    assert chaining.plan_rounds(plan, 0) == [
        chaining.Round((S(0, 0, 16, -1, None, 4), S(1, 100, 130, 9, None, 1),
                        S(2, 130, 178, -1, None, 6))),
        chaining.Round((S(0, 16, 32, 4, None, 5), S(2, 178, 200, 6, None, 2))),
        chaining.Round((S(0, 32, 64, 5, None, 3),)),
        chaining.Round((S(0, 64, 100, 3, None, 0),)),
    ]  # fmt: skip
    assert chaining.plan_rounds(plan, 1) == [
        chaining.Round((S(0, 0, 32, -1, (16, 4), 5), S(1, 100, 130, 9, None, 1),
                        S(2, 130, 200, -1, (48, 6), 2))),
        chaining.Round((S(0, 32, 100, 5, (32, 3), 0),)),
    ]  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(
    per_call=st.sampled_from([0, 1]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    data=st.data(),
)
def test_chained_calls_equal_the_reference(per_call, lengths, data):
    checkpoints = []
    for length in lengths:
        valid = list(range(4, length, 4))
        chosen = (
            data.draw(st.lists(st.sampled_from(valid), unique=True, max_size=3)) if valid else []
        )
        checkpoints.append(chosen)
    with_initial = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    params = make_params(seed=21)
    initial, running, planned, num_blocks = scenario(lengths, checkpoints, with_initial, params)
    batch = make_batch(params, sum(lengths), seed=22)

    def cache():
        c = make_cache(params, num_blocks)
        for slot in initial:
            if slot >= 0:
                fill_slot(c, slot, seed=200 + slot)
        return c

    chained, expected = cache(), cache()
    backend = StandInBackend(per_call, alignment=4)
    out = prefill(backend, params, chained, batch, lengths, initial, running, planned)
    out_ref = prefill(
        kernels.TorchBackend(4, mode="loop"), params, expected, batch, lengths, initial, running,
        planned,
    )  # fmt: skip
    assert max_difference(out, out_ref) <= 1e-12
    assert max_difference(chained.recurrent, expected.recurrent) <= 1e-12
    assert max_difference(chained.conv, expected.conv) <= 1e-12
    most = max(len(c) for c in checkpoints)
    expected_calls = most + 1 if per_call == 0 else most // 2 + 1
    assert len(backend.calls) == expected_calls


def test_one_checkpoint_per_row_takes_one_call_in_place():
    params = make_params(seed=23)
    lengths = [20, 12]
    batch = make_batch(params, 32, seed=24)
    cache = make_cache(params, 6)
    backend = StandInBackend(per_call=1)
    prefill(backend, params, cache, batch, lengths, [-1, -1], [0, 1], [[(8, 2)], [(4, 3)]])
    assert backend.calls == [[20, 12]]
    assert bool(torch.isfinite(cache.recurrent[:4]).all())
    assert bool(torch.isnan(cache.recurrent[4:]).all())


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_interior_offsets_reach_the_kernel_as_int64(dtype):
    params = make_params(seed=25)
    batch = make_batch(params, 16, seed=26)
    cache = make_cache(params, 4)
    backend = StandInBackend(per_call=1)
    kernels.kda_prefill(
        backend, batch.x, batch.g, batch.beta, params, cache, np.array([0, 16], dtype=dtype),
        np.array([-1]), np.array([0]), np.array([[8]], dtype=dtype), np.array([[1]], dtype=dtype),
    )  # fmt: skip
    assert bool(torch.isfinite(cache.recurrent[:2]).all())
