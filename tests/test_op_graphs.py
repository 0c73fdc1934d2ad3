"""``OpGraphs`` on the CPU: the FlashKDA op's calls replayed over static buffers.

The stand-in op (``FakeFlashKDAOps``: the op's argument contract, computed by the float64
reference) runs through ``OpGraphs`` with a capture that simply calls again, so every replay reads
the static buffers as a CUDA graph would. The rule checked: a call through the graphs writes
exactly what the same call made eagerly writes (outputs, final states, checkpoint rows, and the
checkpoint rows the op leaves alone), whatever came before it: other layers, other token and
sequence counts, calls with and without checkpoints, the same step's index tensors reused.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prefixcache.kernels.op_graphs import OpGraphs
from test_kernels_backends import FakeFlashKDAOps

HEADS, DIM = 2, 8
BUCKET, MAX_TOKENS, MAX_SEQUENCES = 16, 64, 2


class Layer:
    """One KDA layer's op parameters (the graph reads them where they lie)."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.A_log = torch.rand(HEADS, generator=generator, dtype=torch.float32)
        self.dt_bias = torch.randn(HEADS, DIM, generator=generator, dtype=torch.float32)


def graphs(ops: FakeFlashKDAOps, captured: list[int] | None = None) -> OpGraphs:
    def capture(call):
        if captured is not None:
            captured.append(1)
        return call

    return OpGraphs(
        ops.fwd, ops.get_workspace_size, capture=capture, max_tokens=MAX_TOKENS,
        max_sequences=MAX_SEQUENCES, bucket_tokens=BUCKET,
    )  # fmt: skip


def call_inputs(lengths, offsets, seed):
    """A call's arguments: packed inputs, initial states, index tensors, and where it writes
    (outputs and states pre-filled with NaN, checkpoint rows with a marker)."""
    generator = torch.Generator().manual_seed(seed)
    tokens, n = sum(lengths), len(lengths)

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    return {
        "q": randn(1, tokens, HEADS, DIM),
        "k": randn(1, tokens, HEADS, DIM),
        "v": randn(1, tokens, HEADS, DIM),
        "g": randn(1, tokens, HEADS, DIM),
        "beta": randn(1, tokens, HEADS),
        "initial": randn(n, HEADS, DIM, DIM) * 0.1,
        "cu": cu,
        "offsets": None if offsets is None else torch.tensor(offsets, dtype=torch.int64),
        "marker": randn(n, HEADS, DIM, DIM),
    }


def run(runner, ops, layer, inputs):
    """(out, final, checkpoint) of one call: through ``runner`` (an OpGraphs) or, with ``runner``
    None, the op called eagerly. Returns None where the graphs declined the call, having checked
    that they wrote nothing."""
    tokens, n = inputs["q"].shape[1], inputs["cu"].numel() - 1
    out = torch.full((1, tokens, HEADS, DIM), float("nan"), dtype=inputs["v"].dtype)
    final = torch.full((n, HEADS, DIM, DIM), float("nan"))
    checkpoint = None if inputs["offsets"] is None else inputs["marker"].clone()
    args = (
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], DIM**-0.5, out,
    )  # fmt: skip
    if runner is None:
        workspace = torch.empty(ops.get_workspace_size(tokens, HEADS, n), dtype=torch.uint8)
        ops.fwd(
            *args, workspace, layer.A_log, layer.dt_bias, -5.0, inputs["initial"], final,
            inputs["cu"], checkpoint, inputs["offsets"],
        )  # fmt: skip
        return out, final, checkpoint
    ran = runner.run(
        *args, layer.A_log, layer.dt_bias, -5.0, inputs["initial"], final, inputs["cu"],
        checkpoint, inputs["offsets"],
    )  # fmt: skip
    if not ran:
        assert out.isnan().all() and final.isnan().all()
        assert checkpoint is None or torch.equal(checkpoint, inputs["marker"])
        return None
    return out, final, checkpoint


def assert_same(got, expected):
    for a, b in zip(got, expected, strict=True):
        if b is None:
            assert a is None
        else:
            assert torch.equal(a, b)


# A call: its sequences' lengths and, per sequence, a checkpoint offset (0: none; a multiple of
# 16 inside the sequence is exported, any other the op skips) or no checkpoints at all.
calls = st.lists(st.integers(1, 40), min_size=1, max_size=3).flatmap(
    lambda lengths: st.tuples(
        st.just(lengths),
        st.none() | st.tuples(*(st.sampled_from([0, 16, 32, 5]) for _ in lengths)),
    )
)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.tuples(calls, st.permutations([0, 1])), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
# Fewer sequences after more: the empty last sequence must export nothing, whatever the
# previous call left in the static offsets.
@example(steps=[(([20, 20], (0, 16)), [0, 1]), (([20], (0,)), [1, 0])], seed=0)
def test_replayed_calls_write_what_eager_calls_write(steps, seed):
    ops = FakeFlashKDAOps()
    runner = graphs(ops)
    layers = [Layer(seed), Layer(seed + 1)]
    for index, ((lengths, offsets), order) in enumerate(steps):
        if offsets is not None:
            offsets = [o if o < n else 0 for o, n in zip(offsets, lengths, strict=True)]
        # Both layers of a step take the same index tensors (as chaining's per-plan arrays).
        inputs = call_inputs(lengths, offsets, seed + index)
        for which in order:
            layer = layers[which]
            got = run(runner, ops, layer, inputs)
            expected = run(None, ops, layer, inputs)
            fits = sum(lengths) <= MAX_TOKENS and len(lengths) <= MAX_SEQUENCES
            assert (got is not None) == fits
            if got is not None:
                assert_same(got, expected)


def test_one_graph_per_layer_bucket_sequence_count_and_checkpoints():
    ops = FakeFlashKDAOps()
    captured: list[int] = []
    runner = graphs(ops, captured)
    first, second = Layer(1), Layer(2)
    for lengths, offsets, layer in [
        ([20], None, first),  # bucket 32, one sequence: a graph
        ([20], None, second),  # another layer: a graph
        ([30], None, first),  # the same bucket: no new graph
        ([10, 7], None, first),  # two sequences: a graph
        ([20], [16], first),  # with checkpoints: a graph
        ([33], None, first),  # bucket 48: a graph
        ([65], None, first),  # over MAX_TOKENS: eager
        ([5, 5, 5], None, first),  # over MAX_SEQUENCES: eager
    ]:
        inputs = call_inputs(lengths, offsets, seed=len(captured))
        got = run(runner, ops, layer, inputs)
        if got is not None:
            assert_same(got, run(None, ops, layer, inputs))
    assert len(captured) == len(runner) == 5


def test_bucket_rounds_up_and_refuses_what_does_not_fit():
    runner = graphs(FakeFlashKDAOps())
    assert [runner.bucket(t, 1) for t in (1, 16, 17, 64)] == [16, 16, 32, 64]
    assert runner.bucket(65, 1) is None and runner.bucket(0, 1) is None
    assert runner.bucket(10, 3) is None and runner.bucket(10, 0) is None
    with pytest.raises(ValueError, match="multiple of bucket_tokens"):
        OpGraphs(FakeFlashKDAOps().fwd, FakeFlashKDAOps().get_workspace_size, max_tokens=100,
                 bucket_tokens=64)  # fmt: skip
    with pytest.raises(ValueError, match="max_sequences"):
        OpGraphs(FakeFlashKDAOps().fwd, FakeFlashKDAOps().get_workspace_size, max_sequences=0)


def test_a_new_layout_drops_the_graphs_of_the_old_buffers():
    ops = FakeFlashKDAOps()
    runner = graphs(ops)
    layer = Layer(3)
    inputs = call_inputs([12], None, seed=4)
    assert_same(run(runner, ops, layer, inputs), run(None, ops, layer, inputs))
    assert len(runner) == 1
    # The same call in float64: other buffers, so the float32 graph must not replay.
    wide = {k: v.double() if v is not None and v.is_floating_point() and k not in
            ("initial", "marker") else v for k, v in inputs.items()}  # fmt: skip
    got = run(runner, ops, layer, wide)
    assert len(runner) == 1 and got is not None and got[0].dtype == torch.float64
    assert_same(got, run(None, ops, layer, wide))


def test_the_backend_replays_only_layers_whose_gate_tensors_it_passes_as_they_are():
    """A graph reads ``A_log`` and ``dt_bias`` where they lie: the backend replays calls whose
    parameters are float32 already, and calls the op eagerly where it converts them (a copy that
    lives for one call), with the same results."""
    from kernels_support import make_batch, make_cache, make_params
    from test_kernels import prefill, scenario
    from test_kernels_backends import GPU_BACKENDS

    lengths, checkpoints = [40, 25], [[16], []]
    results = []
    for gate_dtype in (torch.float64, torch.float32):
        backend = GPU_BACKENDS["flashkda-op-graphs"]()
        params = make_params(heads=HEADS, key_dim=DIM, seed=7)
        params = dataclasses.replace(
            params,
            A_log=params.A_log.float().to(gate_dtype),
            dt_bias=params.dt_bias.float().to(gate_dtype),
        )
        initial, running, planned, num_blocks = scenario(
            lengths, checkpoints, [False, False], params
        )
        cache = make_cache(params, num_blocks)
        batch = make_batch(params, sum(lengths), seed=8)
        out = prefill(backend, params, cache, batch, lengths, initial, running, planned)
        results.append((out, cache.recurrent.nan_to_num(7.0)))
        assert len(backend.graphs) == (1 if gate_dtype == torch.float32 else 0)
    (out64, states64), (out32, states32) = results
    # The same float32 values reach the op either way (widened exactly in the first run).
    assert torch.equal(out64, out32)
    assert torch.equal(states64, states32)


def test_build_model_refuses_op_graphs_where_no_op_runs():
    from prefixcache.engine.simulate import build_model
    from prefixcache.kernels import UnsupportedLayerError

    with pytest.raises(UnsupportedLayerError, match="kda_op_graphs: the flashkda-op backend"):
        build_model("cpu", "torch", kda_op_graphs=True)
    with pytest.raises(ValueError, match="kda_op_graphs must be True, False or 'auto'"):
        build_model("cpu", "torch", kda_op_graphs="yes")
    assert build_model("cpu", "torch", kda_op_graphs=False).backend.name == "torch"
