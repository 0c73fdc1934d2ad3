"""The GPU backends' host-side logic, on the CPU, with stand-in kernels.

Segment chaining (how ``fla`` exact mode and both FlashKDA backends export checkpoints) with a
stand-in kernel built on the float64 reference: packed ``[1, n, H, *]`` inputs, ``cu_seqlens``, an
initial state per sequence, the final state per sequence, and (with ``per_call = 1``) one interior
state per sequence at ``checkpoint_offsets`` (0 = none). Chained through ``run_rounds`` it must
give exactly what the torch backend gives for the same plan.

Then the real ``FlaBackend``, ``FlashKDABackend`` and ``FlashKDAOpBackend`` classes with their
kernel replaced by stand-ins that check the kernels' documented argument contract (names, order,
shapes, dtypes) and compute with the reference, so the argument plumbing and the ``h`` indexing
are tested without a GPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_support import (
    F64,
    fill_slot,
    kernels,
    make_batch,
    make_cache,
    make_params,
    pad_checkpoints,
    reference_kernel,
)
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


def assert_chained_equals_the_reference(
    backend, lengths, checkpoints, with_initial, seed, slot_order=None
):
    """``backend``'s prefill of rows of ``lengths`` (checkpoints at the given offsets, an initial
    state where ``with_initial``) gives the torch backend's outputs, states and windows.
    ``slot_order``: a permutation of the scenario's slots (default: as ``scenario`` numbers them,
    consecutive within each kind, so rounds run on views of the cache; shuffled, they move)."""
    params = make_params(seed=seed)
    initial, running, planned, num_blocks = scenario(lengths, checkpoints, with_initial, params)
    if slot_order is not None:
        slot_order = list(slot_order) + list(range(len(slot_order), num_blocks))
        initial = [slot_order[s] if s >= 0 else -1 for s in initial]
        running = [slot_order[s] for s in running]
        planned = [[(offset, slot_order[s]) for offset, s in row] for row in planned]
    batch = make_batch(params, sum(lengths), seed=seed + 1)

    def cache():
        c = make_cache(params, num_blocks)
        for slot in initial:
            if slot >= 0:
                fill_slot(c, slot, seed=200 + slot)
        return c

    chained, expected = cache(), cache()
    out = prefill(backend, params, chained, batch, lengths, initial, running, planned)
    out_ref = prefill(
        kernels.TorchBackend(4, mode="loop"), params, expected, batch, lengths, initial, running,
        planned,
    )  # fmt: skip
    assert max_difference(out, out_ref) <= 1e-12
    assert max_difference(chained.recurrent, expected.recurrent) <= 1e-12
    assert max_difference(chained.conv, expected.conv) <= 1e-12


@settings(max_examples=20, deadline=None, database=None)
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
    backend = StandInBackend(per_call, alignment=4)
    # Sometimes the scenario's consecutive slots (the rounds run on views of the cache), else a
    # shuffle (the states are moved): the same results either way.
    slots = 2 * len(lengths) + sum(len(c) for c in checkpoints)
    order = data.draw(st.one_of(st.none(), st.permutations(list(range(slots)))))
    assert_chained_equals_the_reference(
        backend, lengths, checkpoints, with_initial, seed=21, slot_order=order
    )
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


# --- the real GPU backend classes with stand-in kernels ------------------------------------------


def fake_chunk_kda(**kw):
    """fla's ``chunk_kda`` contract (the keywords FlaBackend passes), computed by the reference."""
    assert kw["use_qk_l2norm_in_kernel"] and kw["use_gate_in_kernel"]
    assert kw["use_beta_sigmoid_in_kernel"] and kw["state_v_first"] and kw["output_final_state"]
    assert kw["safe_gate"] == (kw["lower_bound"] is not None)
    q, v = kw["q"], kw["v"]
    heads, key_dim = q.shape[2], q.shape[3]
    assert kw["dt_bias"].shape == (heads * key_dim,) and kw["A_log"].shape == (heads,)
    assert kw["initial_state"].dtype == torch.float32
    assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens_cpu"].device.type == "cpu"
    assert kw["scale"] == key_dim**-0.5
    out, final, _, h = reference_kernel(
        q, kw["k"], v, kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], kw["lower_bound"],
        kw["initial_state"], kw["cu_seqlens"], chunk=64,
    )  # fmt: skip
    if kw["return_intermediate_states"]:
        return out, final.float(), h.to(q.dtype)[None]
    return out, final.float()


class FakeFlashKDAOps:
    """``torch.ops._flashkda_C`` as vLLM's build documents it, computed by the reference."""

    def get_workspace_size(self, tokens, heads, sequences):
        return 64 * tokens * heads + sequences

    def fwd(self, q, k, v, g, beta, scale, out, workspace, A_log, dt_bias, lower_bound,
            initial_state=None, final_state=None, cu_seqlens=None, checkpoint_state=None,
            checkpoint_offsets=None):  # fmt: skip
        for x in (q, k, v, g):
            assert x.dim() == 4 and x.shape[0] == 1 and x.is_contiguous()
        assert beta.shape == q.shape[:3] and out.shape == v.shape
        assert workspace.dtype == torch.uint8
        assert workspace.numel() == self.get_workspace_size(
            q.shape[1], q.shape[2], len(cu_seqlens) - 1
        )
        assert dt_bias.shape == q.shape[2:] and A_log.shape == q.shape[2:3]
        assert isinstance(scale, float) and isinstance(lower_bound, float)
        assert cu_seqlens.dtype == torch.int64
        assert initial_state.dtype == final_state.dtype == torch.float32
        if checkpoint_offsets is not None:
            assert checkpoint_offsets.dtype == cu_seqlens.dtype
            assert checkpoint_state.shape == final_state.shape
            assert checkpoint_state.dtype == final_state.dtype
        offsets = None if checkpoint_offsets is None else checkpoint_offsets.tolist()
        if offsets is not None:  # 0: none; else inside its sequence
            lengths = [b - a for a, b in itertools.pairwise(cu_seqlens.tolist())]
            assert len(offsets) == len(lengths)
            assert all(o == 0 or 0 < o < n for o, n in zip(offsets, lengths, strict=True))
        o, final, interior, _ = reference_kernel(
            q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, offsets
        )
        out.copy_(o)
        final_state.copy_(final)
        if offsets is not None:
            for i, offset in enumerate(offsets):
                if offset > 0 and offset % 16 == 0:  # off the grid: silently not written
                    checkpoint_state[i] = interior[i]


def fake_backend(cls, **attributes):
    backend = object.__new__(cls)
    for name, value in attributes.items():
        setattr(backend, name, value)
    backend.check_layer = lambda params, dtype, device: None
    return backend


GPU_BACKENDS = {
    "fla-h": lambda: fake_backend(
        kernels.FlaBackend, _chunk_kda=fake_chunk_kda, checkpoint_mode="h",
        checkpoint_alignment=64, max_checkpoints_per_step=None,
    ),
    "fla-chain": lambda: fake_backend(
        kernels.FlaBackend, _chunk_kda=fake_chunk_kda, checkpoint_mode="chain",
        checkpoint_alignment=64, max_checkpoints_per_step=None,
    ),
    "flashkda-op": lambda: fake_backend(
        kernels.FlashKDAOpBackend, _ops=FakeFlashKDAOps(), checkpoint_alignment=16,
        max_checkpoints_per_step=None,
    ),
    "flashkda": lambda: fake_backend(
        kernels.FlashKDABackend,
        _fwd=GPU_BACKENDS["flashkda-op"]().fwd_without_checkpoints(),
        checkpoint_alignment=16, max_checkpoints_per_step=None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GPU_BACKENDS))
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_gpu_backend_classes_execute_plans_like_the_reference(name, gate):
    if gate == "softplus" and name.startswith("flashkda"):
        pytest.skip("FlashKDA runs the bounded gate only")
    backend = GPU_BACKENDS[name]()
    grid = backend.checkpoint_alignment
    params = make_params(heads=2, key_dim=8, gate=gate, seed=31)
    lengths = [3 * grid + 5, 2 * grid, 4 * grid + 1, 7]
    checkpoints = [[3 * grid, grid], [grid], [grid, 2 * grid, 3 * grid], []]
    initial, running, planned, num_blocks = scenario(
        lengths, checkpoints, [True, False, True, False], params
    )
    batch = make_batch(params, sum(lengths), seed=32)

    def cache():
        c = make_cache(params, num_blocks)
        for slot in initial:
            if slot >= 0:
                fill_slot(c, slot, seed=300 + slot)
        return c

    got, expected = cache(), cache()
    out = prefill(backend, params, got, batch, lengths, initial, running, planned)
    out_ref = prefill(
        kernels.TorchBackend(grid, mode="loop"), params, expected, batch, lengths, initial,
        running, planned,
    )  # fmt: skip
    # The GPU paths stage states in fp32 (and fla's h in the inputs' dtype, float64 here).
    assert max_difference(out, out_ref) <= 1e-5
    assert max_difference(got.recurrent, expected.recurrent) <= 1e-5
    assert max_difference(got.conv, expected.conv) == 0.0


class ScratchRecordingOps(FakeFlashKDAOps):
    """The fake op, recording each size query and each call's workspace (address, bytes)."""

    def __init__(self):
        self.size_queries = []
        self.workspaces = []
        self.checking = False

    def get_workspace_size(self, tokens, heads, sequences):
        if not self.checking:  # not the fake's own check inside fwd
            self.size_queries.append((tokens, heads, sequences))
        return super().get_workspace_size(tokens, heads, sequences)

    def fwd(self, q, k, v, g, beta, scale, out, workspace, *args):
        self.workspaces.append((workspace.data_ptr(), workspace.numel()))
        self.checking = True
        try:
            super().fwd(q, k, v, g, beta, scale, out, workspace, *args)
        finally:
            self.checking = False


def test_flashkda_op_sizes_its_workspace_once_a_shape_and_allocates_only_to_grow():
    ops = ScratchRecordingOps()
    backend = GPU_BACKENDS["flashkda-op"]()
    backend._ops = ops
    params = make_params(heads=2, key_dim=8, seed=41)
    size = FakeFlashKDAOps().get_workspace_size

    def layer(lengths):  # one KDA layer's call: one row, no checkpoint, so one op call
        initial, running, planned, num_blocks = scenario(lengths, [[]], [False], params)
        batch = make_batch(params, sum(lengths), seed=42)
        cache = make_cache(params, num_blocks)
        prefill(backend, params, cache, batch, lengths, initial, running, planned)

    for _ in range(3):  # three layers of one step
        layer([40])
    layer([72])  # a larger step: the workspace grows
    layer([24])  # a smaller one reuses the larger allocation
    layer([24])
    # Every call gets exactly the size the op asks for (FakeFlashKDAOps asserts it), asked
    # once each time the shape changes, never again for the same shape.
    assert [n for _, n in ops.workspaces] == [size(40, 2, 1)] * 3 + [size(72, 2, 1)] + [
        size(24, 2, 1)
    ] * 2
    assert ops.size_queries == [(40, 2, 1), (72, 2, 1), (24, 2, 1)]
    addresses = [address for address, _ in ops.workspaces]
    assert addresses[0] == addresses[1] == addresses[2]
    assert addresses[4] == addresses[5] == addresses[3]


def test_flashkda_op_skips_an_unaligned_offset_silently_so_the_plan_check_refuses_it():
    ops = FakeFlashKDAOps()
    batch = make_batch(make_params(heads=2, key_dim=8), 40)
    q = batch.g[None].contiguous()
    v = torch.randn(1, 40, 2, 8, dtype=F64)
    staging = torch.full((1, 2, 8, 8), float("nan"))
    ops.fwd(
        q, q.clone(), v, q.clone(), batch.beta[None], 8**-0.5, torch.empty_like(v),
        torch.empty(ops.get_workspace_size(40, 2, 1), dtype=torch.uint8), torch.zeros(2),
        torch.zeros(2, 8), -5.0, torch.zeros(1, 2, 8, 8), torch.empty(1, 2, 8, 8),
        torch.tensor([0, 40]), staging, torch.tensor([8]),
    )  # fmt: skip
    assert bool(torch.isnan(staging).all())
    backend = GPU_BACKENDS["flashkda-op"]()
    with pytest.raises(
        kernels.KernelPlanError, match="offset 8 is not exportable by backend 'flashkda-op'"
    ):
        backend.check_plan(
            query_start_loc=[0, 40], initial_slot=[-1], running_slot=[0],
            checkpoint_offsets=[[8]], checkpoint_slots=[[1]], num_slots=2,
        )  # fmt: skip


def test_flashkda_layers_must_use_the_bounded_gate_and_128_wide_heads():
    backend = GPU_BACKENDS["flashkda-op"]()
    del backend.check_layer  # the real check
    cuda = torch.device("cuda")
    with pytest.raises(kernels.UnsupportedLayerError, match="bounded gate only"):
        backend.check_layer(make_params(gate="softplus"), torch.bfloat16, cuda)
    with pytest.raises(kernels.UnsupportedLayerError, match="K = V = 128"):
        backend.check_layer(make_params(key_dim=64), torch.bfloat16, cuda)
    with pytest.raises(kernels.UnsupportedLayerError, match="bf16 inputs"):
        backend.check_layer(make_params(key_dim=128), torch.float32, cuda)
    with pytest.raises(kernels.UnsupportedLayerError, match="runs on CUDA"):
        backend.check_layer(make_params(key_dim=128), torch.bfloat16, torch.device("cpu"))
    backend.check_layer(make_params(key_dim=128), torch.bfloat16, cuda)


@pytest.mark.parametrize("name", ["flashkda-op", "fla-chain"])
def test_layers_sharing_one_plan_reuse_its_indices_and_equal_separate_plans(name):
    # A model runs one validated plan through every KDA layer; what the conv and the rounds
    # derive from it (index tensors, segment rounds) is computed once and must serve each
    # layer exactly as a freshly validated plan would.
    backend = GPU_BACKENDS[name]()
    grid = backend.checkpoint_alignment
    lengths = [3 * grid + 5, 2 * grid, 7]
    checkpoints = [[3 * grid, grid], [grid], []]
    layers = [make_params(heads=2, key_dim=8, gate="bounded", seed=seed) for seed in (41, 42)]
    initial, running, planned, num_blocks = scenario(
        lengths, checkpoints, [True, False, True], layers[0]
    )
    offsets, slots = pad_checkpoints(planned)

    def validated():
        return backend.check_plan(
            query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            initial_slot=initial, running_slot=running, checkpoint_offsets=offsets,
            checkpoint_slots=slots, num_slots=num_blocks, num_tokens=sum(lengths),
        )  # fmt: skip

    shared = validated()
    calls = []
    original = chaining._RoundInputs.build
    chaining._RoundInputs.build = classmethod(
        lambda cls, *a: calls.append(1) or original.__func__(cls, *a)
    )
    try:
        for layer, params in enumerate(layers):
            batch = make_batch(params, sum(lengths), seed=50 + layer)
            caches = []
            for plan in (shared, validated()):
                cache = make_cache(params, num_blocks)
                for slot in initial:
                    if slot >= 0:
                        fill_slot(cache, slot, seed=400 + slot)
                out = kernels.run_prefill(
                    backend, batch.x, batch.g, batch.beta, params, cache, plan
                )
                caches.append((out, cache))
            (out_a, cache_a), (out_b, cache_b) = caches
            assert torch.equal(out_a, out_b)
            # Untouched slots keep their NaN poison in both: compare them as equal.
            for a, b in ((cache_a.recurrent, cache_b.recurrent), (cache_a.conv, cache_b.conv)):
                assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    finally:
        chaining._RoundInputs.build = original
    rounds = len(chaining.plan_rounds(shared, backend_per_call(name)))
    # Shared plan: built for the first layer only; fresh plans: once per layer.
    assert len(calls) == rounds * (1 + len(layers))


def backend_per_call(name):
    return 1 if name == "flashkda-op" else 0
