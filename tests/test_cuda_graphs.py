"""CUDA graphs of decode-only steps (prefixcache.models.graphs).

On the CPU: which steps qualify and which graph they replay (stated here from the rule: one
token a row, every row sampled in order, every row resumes a state, no checkpoint; the context
bucket is the smallest power of two holding the longest row, at least 256 tokens) and the static
buffers' fills; that the KDA decode kernel reads its bound index tensors at every call (what a
replay relies on) is tested with the kernel (test_kda_decode_triton.py).
On the GPU (marked ``gpu``; the FlashKDA op): a replay equals the eager step bit for bit, in
its logits and in every cache entry it writes, for three different steps through one graph,
and steps of fewer rows or of a longer context get graphs of their own.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prefixcache.kernels.errors import UnsupportedLayerError
from prefixcache.kernels.step import PagedStep, StateStep, Step
from prefixcache.models import HybridModel, ModelCaches, ModelConfig
from prefixcache.models.graphs import StaticInputs, decode_graph_key


def key_of(loc, lens, logits=None, initial=None, checkpoints=0, block_size=64, max_rows=8):
    rows = len(lens)
    return decode_graph_key(
        np.asarray(loc),
        np.asarray(lens),
        np.arange(rows) if logits is None else np.asarray(logits),
        np.arange(rows) if initial is None else np.asarray(initial),
        checkpoints,
        block_size=block_size,
        max_rows=max_rows,
    )


def smallest_power_of_two_at_least(n: int) -> int:
    power = 1
    while power < n:
        power *= 2
    return power


@pytest.mark.parametrize("longest", [1, 255, 256, 257, 1000, 4096, 4097, 131072, 131073])
def test_a_decode_step_replays_the_graph_of_its_rows_and_context_bucket(longest: int) -> None:
    key = key_of([0, 1, 2, 3], [7, longest, 3], block_size=96)
    assert key is not None
    bucket = max(256, smallest_power_of_two_at_least(longest))
    assert (key.rows, key.context) == (3, bucket)
    assert key.columns * 96 >= bucket > (key.columns - 1) * 96


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("a prefill row", {"loc": [0, 1, 3], "lens": [5, 9]}),
        ("more rows than graphs", {"loc": list(range(10)), "lens": [5] * 9}),
        ("a row not sampled", {"loc": [0, 1, 2], "lens": [5, 9], "logits": [1]}),
        ("rows sampled out of order", {"loc": [0, 1, 2], "lens": [5, 9], "logits": [1, 0]}),
        ("a row without a state", {"loc": [0, 1, 2], "lens": [5, 9], "initial": [0, -1]}),
        ("a checkpoint", {"loc": [0, 1, 2], "lens": [5, 9], "checkpoints": 1}),
        ("no rows", {"loc": [0], "lens": []}),
    ],
)
def test_other_steps_run_eagerly(case: str, kwargs: dict) -> None:
    assert key_of(**kwargs) is None, case


@settings(max_examples=150, deadline=None)
@given(
    query_lens=st.lists(st.integers(0, 3), min_size=0, max_size=10),
    lens=st.lists(st.integers(0, 600_000), min_size=10, max_size=10),
    sampled=st.sets(st.integers(0, 9)),
    missing=st.sets(st.integers(0, 9)),
    checkpoints=st.integers(0, 2),
    block_size=st.sampled_from([16, 96, 1536]),
    max_rows=st.integers(1, 12),
)
def test_the_graph_rule_over_random_steps(
    query_lens, lens, sampled, missing, checkpoints, block_size, max_rows
) -> None:
    rows = len(query_lens)
    loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    logits = np.asarray(sorted(i for i in sampled if i < rows), dtype=np.int64)
    initial = np.asarray([-1 if r in missing else r for r in range(rows)], dtype=np.int64)
    key = decode_graph_key(
        loc, np.asarray(lens[:rows]), logits, initial, checkpoints,
        block_size=block_size, max_rows=max_rows,
    )  # fmt: skip
    qualifies = (
        1 <= rows <= max_rows
        and all(n == 1 for n in query_lens)
        and len(logits) == rows  # every row sampled (sorted: in order)
        and not any(r in missing for r in range(rows))
        and checkpoints == 0
        and min(lens[:rows]) >= 1
    )
    assert (key is not None) == qualifies
    if key is not None:
        longest = max(lens[:rows])
        assert key.rows == rows
        assert key.context >= max(256, longest) and key.context & (key.context - 1) == 0
        assert key.context < 2 * max(256, longest)
        assert (key.columns - 1) * block_size < key.context <= key.columns * block_size


def test_static_inputs_hold_the_latest_step_only() -> None:
    inputs = StaticInputs(2, 3, torch.device("cpu"))
    inputs.pack(
        np.array([10, 11]),
        np.array([1, 2]),
        np.array([3, 4]),
        np.array([100, 200]),
        np.array([[5, 6, 7, 8], [9, 10, 11, 12]]),  # wider than the graph: cut to 3 columns
    )
    inputs.upload()
    assert inputs.slots.tolist() == [10, 11]
    assert inputs.initial.tolist() == [1, 2]
    assert inputs.running.tolist() == [3, 4]
    assert inputs.lens.tolist() == [100, 200]
    assert inputs.tables.tolist() == [[5, 6, 7], [9, 10, 11]]
    # A narrower table leaves no entry of the previous step behind.
    inputs.pack(np.array([1, 2]), np.array([0, 0]), np.array([5, 6]), np.array([1, 2]),
                np.array([[4], [3]]))  # fmt: skip
    inputs.upload()
    assert inputs.tables.tolist() == [[4, 0, 0], [3, 0, 0]]
    assert inputs.running.tolist() == [5, 6]


def test_graphs_are_off_on_the_cpu_and_refused_when_asked_for() -> None:
    from prefixcache.kernels import TorchBackend

    config = ModelConfig.tiny()
    assert HybridModel(config, TorchBackend(chunk_size=32)).graphs is None
    with pytest.raises(UnsupportedLayerError, match="CUDA"):
        HybridModel(config, TorchBackend(chunk_size=32), cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        HybridModel(config, TorchBackend(chunk_size=32), cuda_graphs="yes")


def test_graphs_belong_to_one_run_and_do_not_keep_its_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The bookkeeping only (capture and replay need CUDA): a graph per key and caches object;
    # other caches start a new set; a finished run's caches are not kept alive by the graphs.
    import gc
    import weakref
    from types import SimpleNamespace

    from prefixcache.models import graphs as graphs_module

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    replays: list[int] = []

    def capture(self, model, key, token_ids, caches, host):
        inputs = StaticInputs(key.rows, key.columns, torch.device("cpu"))
        inputs.pack(*host)
        inputs.upload()
        graph = SimpleNamespace(replay=lambda: replays.append(key.rows))
        return graphs_module._Graph(graph, inputs, token_ids.clone(), torch.zeros(key.rows), ())

    monkeypatch.setattr(graphs_module.DecodeGraphs, "_capture", capture)
    graphs = graphs_module.DecodeGraphs(max_rows=4)
    key = key_of([0, 1, 2], [10, 20])
    assert key is not None
    host = (np.array([1, 2]), np.array([0, 1]), np.array([2, 3]), np.array([10, 20]),
            np.zeros((2, 1), dtype=np.int64))  # fmt: skip
    first = ModelCaches(states=[], kv=[])
    tokens = torch.tensor([3, 4])
    for _ in range(3):
        graphs.run(None, key, tokens, first, host)  # type: ignore[arg-type]
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 3, 1)
    second = ModelCaches(states=[], kv=[])
    graphs.run(None, key, tokens, second, host)  # type: ignore[arg-type]
    assert (graphs.captures, len(graphs)) == (2, 1)
    graphs.run(None, key, tokens, second, host)  # type: ignore[arg-type]
    assert (graphs.captures, graphs.replays, replays) == (2, 5, [2] * 5)
    # Neither the finished run's caches nor the latest ones are kept alive by the graphs.
    gone = [weakref.ref(first), weakref.ref(second)]
    del first, second
    gc.collect()
    assert [ref() for ref in gone] == [None, None]


def _tensors(caches: ModelCaches) -> list[torch.Tensor]:
    return [t for c in caches.states for t in (c.conv, c.recurrent)] + [
        t for c in caches.kv for t in (c.key, c.value)
    ]


def test_runs_of_one_geometry_share_zeroed_caches_while_reusing() -> None:
    # The rule: inside reusing_caches an allocation of the geometry last allocated returns that
    # same object with every entry zero and every tensor where it was (so graphs captured on it
    # stay valid); another geometry gets a new set, which replaces it; outside, and after the
    # context closes, every allocation is new and the held set is released.
    import gc
    import weakref

    from prefixcache.kernels import TorchBackend

    model = HybridModel(ModelConfig.tiny(), TorchBackend(chunk_size=32))
    geometry = {"paged_blocks": 6, "block_size": 16, "state_blocks": 5}
    apart = model.allocate_caches(**geometry)
    assert model.allocate_caches(**geometry) is not apart
    with model.reusing_caches():
        first = model.allocate_caches(**geometry)
        assert first is not apart
        addresses = [t.data_ptr() for t in _tensors(first)]
        for number, tensor in enumerate(_tensors(first), 1):
            tensor.fill_(number)  # a run's writes
        with model.reusing_caches():  # nested: the same set
            again = model.allocate_caches(**geometry)
        assert again is first
        assert [t.data_ptr() for t in _tensors(again)] == addresses
        assert all(not bool(t.any()) for t in _tensors(again))
        fresh = model._new_caches(6, 16, 5, 0, 1)
        assert [(t.shape, t.dtype) for t in _tensors(again)] == [
            (t.shape, t.dtype) for t in _tensors(fresh)
        ]
        other = model.allocate_caches(**(geometry | {"state_blocks": 7}))
        assert other is not first
        assert model.allocate_caches(**(geometry | {"state_blocks": 7})) is other
        assert model.allocate_caches(**geometry) not in (first, other)  # first was replaced
        held = weakref.ref(other)
        del first, again, other
        gc.collect()
        assert held() is None  # a replaced set is not kept
        last = weakref.ref(model.allocate_caches(**geometry))
        assert last() is not None  # held by the model while open
    gc.collect()
    assert last() is None  # released on exit
    assert model.allocate_caches(**geometry) is not model.allocate_caches(**geometry)


def test_every_run_of_a_simulation_gets_the_same_caches_and_outputs_still_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefixcache.engine import build_model, simulate
    from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload

    pytest.importorskip("prefixcache._core")
    spec = GrowingPrefixSpec(streams=2, first_prompt=150, growth=70, rounds=3, output_len=3)
    workload = PresetWorkload(
        "growing-prefix", "test", spec, Geometry(block_size=32, unit=8, token_budget=96,
                                                 max_running=2)
    )  # fmt: skip
    model = build_model("cpu", "torch")
    handed: list[ModelCaches] = []
    original = HybridModel.allocate_caches

    def recording(self: HybridModel, **kwargs: int) -> ModelCaches:
        caches = original(self, **kwargs)
        assert all(not bool(t.any()) for t in _tensors(caches))  # zeroed, every time
        handed.append(caches)
        return caches

    monkeypatch.setattr(HybridModel, "allocate_caches", recording)
    for warm_up in ("shapes", "full"):
        handed.clear()
        report = simulate(workload, ["block", "fine"], model, warm_up=warm_up, repeats=2)
        assert len(handed) == 3 + 1 + 4  # warm none, block, fine; none; block, fine twice
        assert all(caches is handed[0] for caches in handed), warm_up
        for name in ("block", "fine"):
            assert all(m is True for _, _, (m, _) in report.passes[name]), (warm_up, name)
        assert not any("graph_captures" in t for _, t, _ in report.passes["block"])  # no graphs
        assert all(t["gc_collections"] >= 0 for _, t, _ in report.passes["block"])


# --- on the GPU -------------------------------------------------------------------------------

BLOCK = 64
COLUMNS = 8  # blocks per row: contexts up to 512 tokens


def _step(qsl, lens, slots, tables, initial, running) -> Step:
    rows = len(running)
    return Step(
        query_start_loc=np.asarray(qsl, np.int32),
        seq_lens=np.asarray(lens, np.int64),
        copies=np.zeros((0, 4), np.int64),
        paged=(PagedStep(0, np.asarray(slots, np.int64), np.asarray(tables, np.int32)),),
        state=(
            StateStep(
                1,
                np.asarray(initial, np.int32),
                np.asarray(running, np.int32),
                np.zeros((rows, 0), np.int32),
                np.full((rows, 0), -1, np.int32),
                np.zeros((0, 2), np.int32),
            ),
        ),
    )


def _decode(rows: int, length: int, initial, running) -> Step:
    tables = [[COLUMNS * r + c for c in range(COLUMNS)] for r in range(rows)]
    position = length - 1
    slots = [tables[r][position // BLOCK] * BLOCK + position % BLOCK for r in range(rows)]
    return _step(list(range(rows + 1)), [length] * rows, slots, tables, initial, running)


def _gpu_model():
    from prefixcache.engine import build_model

    if not torch.cuda.is_available() or not os.environ.get("PREFIXCACHE_FLASHKDA_LIB"):
        pytest.skip("needs a CUDA device and the FlashKDA op (PREFIXCACHE_FLASHKDA_LIB)")
    return build_model("cuda", "flashkda-op", config=ModelConfig.kimi_k3_tp8(1))


def _prefilled(model: HybridModel, rows: int, length: int) -> ModelCaches:
    caches = model.allocate_caches(
        paged_blocks=COLUMNS * rows, block_size=BLOCK, state_blocks=3 * rows
    )
    tables = [[COLUMNS * r + c for c in range(COLUMNS)] for r in range(rows)]
    slots = [tables[r][p // BLOCK] * BLOCK + p % BLOCK for r in range(rows) for p in range(length)]
    step = _step(
        [r * length for r in range(rows + 1)], [length] * rows, slots, tables, [-1] * rows,
        list(range(rows)),
    )  # fmt: skip
    tokens = torch.randint(0, model.config.vocab_size, (rows * length,),
                           generator=torch.Generator().manual_seed(1)).cuda()  # fmt: skip
    model.execute(step, tokens, caches)
    return caches


def _same_caches(a: ModelCaches, b: ModelCaches) -> bool:
    return all(torch.equal(x.conv, y.conv) and torch.equal(x.recurrent, y.recurrent)
               for x, y in zip(a.states, b.states, strict=True)) and all(
        torch.equal(x.key, y.key) and torch.equal(x.value, y.value)
        for x, y in zip(a.kv, b.kv, strict=True))  # fmt: skip


@pytest.mark.gpu
def test_replayed_decode_steps_equal_the_eager_ones_bit_for_bit() -> None:
    model = _gpu_model()
    graphs = model.graphs
    assert graphs is not None
    rows, length = 3, 100
    eager_caches, graph_caches = _prefilled(model, rows, length), _prefilled(model, rows, length)
    assert _same_caches(eager_caches, graph_caches)
    model.kda_timer.enabled = False  # a decode step runs untimed, as the engine runs it
    # Three steps of one graph (same rows, same bucket) with different tokens, KV slots,
    # lengths and state slots (the running states double-buffered, as the core plans them).
    steps = [
        _decode(rows, length + 1, list(range(rows)), list(range(rows, 2 * rows))),
        _decode(rows, length + 2, list(range(rows, 2 * rows)), list(range(rows))),
        _decode(rows, length + 3, list(range(rows)), list(range(2 * rows, 3 * rows))),
    ]
    _check_replays(model, graphs, [(step, rows) for step in steps], eager_caches, graph_caches)
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 3, 1)
    # Fewer rows, then a context past the first bucket (256 tokens): two more graphs; then the
    # first graph again (what it reads outlived the later captures, which free cached memory).
    others = [
        (_decode(2, 300, [6, 7], [3, 4]), 2),
        (_decode(rows, 300, [3, 4, 8], [0, 1, 2]), rows),
        (_decode(rows, length + 4, [0, 1, 2], [3, 4, 5]), rows),
    ]
    _check_replays(model, graphs, others, eager_caches, graph_caches)
    assert (graphs.captures, graphs.replays, len(graphs)) == (3, 6, 3)


def _check_replays(model, graphs, cases, eager_caches, graph_caches, seed: int = 2) -> None:
    """Each ``(step, rows)`` of ``cases`` eagerly on ``eager_caches`` and through ``graphs``
    on ``graph_caches``, with the same random tokens: equal logits and caches after each."""
    generator = torch.Generator().manual_seed(seed)
    for number, (step, count) in enumerate(cases):
        tokens = torch.randint(0, model.config.vocab_size, (count,), generator=generator).cuda()
        model.graphs = None
        eager = model.execute(step, tokens, eager_caches)
        model.graphs = graphs
        replayed = model.execute(step, tokens, graph_caches)
        assert torch.equal(replayed, eager), number
        assert _same_caches(eager_caches, graph_caches), number


@pytest.mark.gpu
def test_runs_sharing_caches_replay_the_first_runs_graphs_and_others_are_freed() -> None:
    import gc
    import weakref

    model = _gpu_model()
    graphs = model.graphs
    assert graphs is not None
    model.kda_timer.enabled = False
    rows, length = 2, 100
    cases = [
        (_decode(rows, length + 1, [0, 1], [2, 3]), rows),
        (_decode(rows, length + 2, [2, 3], [0, 1]), rows),
    ]
    # The eager references first, outside reusing_caches (inside, they would be the same set).
    references = [_prefilled(model, rows, length) for _ in range(3)]
    with model.reusing_caches():
        held = None
        for run in range(2):
            caches = _prefilled(model, rows, length)  # the second run: the same set, zeroed
            assert held is None or caches is held, run
            held = caches
            _check_replays(model, graphs, cases, references[run], caches)
            # One capture in all: the second run replays the first run's graph.
            assert (graphs.captures, graphs.replays) == (1, 2 * (run + 1)), run
    # Apart from reusing_caches every run has caches of its own, and the graphs keep none alive.
    del held, caches
    caches = _prefilled(model, rows, length)
    _check_replays(model, graphs, cases[:1], references[2], caches)
    assert graphs.captures == 2
    gone = weakref.ref(caches)
    del caches
    gc.collect()
    assert gone() is None
