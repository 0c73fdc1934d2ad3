"""The simulator's step clock (``StepClock``) and its split of a prefill step.

The rule, stated here independently of the code: every step the engine runs is recorded once,
as a decode step (every row one query token) or as a prefill step with its token count; a
prefill step is also split at the moment the model starts launching its layers
(``HybridModel.layers_starting``, called once per eager step, after the host's checks and
uploads): the host time before it (prep) and after it until the forward returns (launch) add up
to the step's wall time on the CPU, and ``summary()["prefill_parts"]`` holds the steps of at
most ``PART_STEP_TOKENS`` tokens with their medians. The hook is set only while a prefill step
runs: a decode step never calls it, and the model holds no hook after a step, even one that
failed.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import pytest

pytest.importorskip("prefixcache._core")

from prefixcache.engine import Engine, build_model, engine_config_for
from prefixcache.engine.policy import Policy
from prefixcache.engine.simulate import PART_STEP_TOKENS, StepClock
from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload
from prefixcache.kernels import Step

SPEC = GrowingPrefixSpec(streams=2, first_prompt=150, growth=70, rounds=3, output_len=3)
GEOMETRY = Geometry(block_size=32, unit=8, token_budget=96, max_running=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Recording(StepClock):
    """The clock, also noting each step's shape as the engine handed it over and whether the
    model's hook fired inside it."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.shapes: list[int | None] = []
        self.fired: list[int] = []
        self.hook_after: list[object] = []

    def __call__(self, step: Any, token_ids: Any, caches: Any, logits_indices: np.ndarray) -> Any:
        counts = np.diff(np.asarray(step.query_start_loc, dtype=np.int64))
        self.shapes.append(None if int(counts.max()) == 1 else int(counts.sum()))
        fired = len(self.parts)
        out = super().__call__(step, token_ids, caches, logits_indices)
        self.fired.append(len(self.parts) - fired)
        self.hook_after.append(self.model.layers_starting)
        return out


def _run() -> tuple[Any, _Recording]:
    model = build_model("cpu", "torch")
    workload = PresetWorkload("growing-prefix", "test", SPEC, GEOMETRY)
    geometry = workload.geometry.aligned(model.backend.checkpoint_alignment)
    config = engine_config_for(workload, geometry, model.backend, overlap=False)
    policy = Policy.named("fine", block_size=geometry.block_size, fine_unit=geometry.unit)
    clock = _Recording(model)
    Engine(model, policy, config, forward=clock).run(workload.build(model.config.vocab_size))
    return model, clock


def test_prefill_steps_are_split_where_the_layers_start() -> None:
    model, clock = _run()
    prefill = [t for t in clock.shapes if t is not None]
    assert prefill and None in clock.shapes  # the workload has both kinds of step
    # The hook fires once in each prefill step and never in a decode step.
    assert clock.fired == [0 if t is None else 1 for t in clock.shapes]
    assert all(hook is None for hook in clock.hook_after)
    assert model.layers_starting is None
    # On the CPU, prep + launch is the step's wall time, step by step.
    assert [t for t, *_ in clock.parts] == prefill
    assert [t for t, _ in clock.prefill] == prefill
    for (_, prep, launch, layers), (_, ms) in zip(clock.parts, clock.prefill, strict=True):
        assert prep >= 0 and launch > 0
        assert prep + launch == pytest.approx(ms, rel=1e-9, abs=1e-9)
        assert layers == launch  # no GPU: the layers' time is the host's
    summary = clock.summary()
    parts = summary["prefill_parts"]
    short = [p for p in clock.parts if p[0] <= PART_STEP_TOKENS]
    assert parts["steps"] == len(short) == len(prefill)
    assert parts["max_tokens"] == PART_STEP_TOKENS
    assert parts["tokens_p50"] == statistics.median(t for t, *_ in short)
    assert parts["prep"]["ms_p50"] == pytest.approx(statistics.median(p[1] for p in short))
    assert parts["launch"]["ms_p50"] == pytest.approx(statistics.median(p[2] for p in short))
    tokens = np.asarray([p[0] for p in short], dtype=float)
    if tokens.std() > 0:
        slope, intercept = np.polyfit(tokens, [p[2] for p in short], 1)
        assert parts["launch"]["fixed_ms"] == pytest.approx(intercept)
        assert parts["launch"]["per_token_us"] == pytest.approx(1e3 * slope)
    assert summary["decode_steps"] == clock.shapes.count(None)
    assert summary["prefill_steps"] == len(prefill)


def test_a_failed_step_leaves_no_hook_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model("cpu", "torch")
    clock = StepClock(model)

    def failing(*args: Any, **kwargs: Any) -> None:
        assert model.layers_starting is not None  # set while the prefill step runs
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(model, "execute", failing)

    with pytest.raises(RuntimeError, match="the forward failed"):
        clock(_step([0, 5]), None, None, np.zeros(1, dtype=np.int64))
    assert model.layers_starting is None
    assert clock.prefill == [] and clock.parts == []
    assert "prefill_parts" not in clock.summary()


def test_a_layers_backlog_needs_a_gpu_and_a_count() -> None:
    # The spin runs on a CUDA stream: a CPU model refuses one (rather than timing without it),
    # takes 0 (none), and no model takes a negative count or one past about a second.
    model = build_model("cpu", "torch")
    with pytest.raises(ValueError, match="CUDA"):
        model.set_layers_backlog(1_000)
    with pytest.raises(ValueError, match="must be in"):
        model.set_layers_backlog(-1)
    with pytest.raises(ValueError, match="must be in"):
        model.set_layers_backlog(2_000_000_001)
    model.set_layers_backlog(0)
    assert model.layers_backlog_cycles == 0


@pytest.mark.gpu
def test_a_layers_backlog_leaves_the_outputs_unchanged() -> None:
    # The spin only delays the GPU: the same steps compute the same tokens.
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = build_model("cuda", "auto")
    spec = GrowingPrefixSpec(streams=2, first_prompt=600, growth=200, rounds=2, output_len=2)
    geometry = Geometry(block_size=64, unit=16, token_budget=512, max_running=2)
    workload = PresetWorkload("growing-prefix", "backlog", spec, geometry)
    aligned = geometry.aligned(model.backend.checkpoint_alignment)
    config = engine_config_for(workload, aligned, model.backend, overlap=False)
    policy = Policy.named("fine", block_size=aligned.block_size, fine_unit=aligned.unit)
    outputs = []
    for cycles in (0, 20_000_000):
        model.set_layers_backlog(cycles)
        clock = StepClock(model)
        run = Engine(model, policy, config, forward=clock).run(
            workload.build(model.config.vocab_size)
        )
        outputs.append({r.request_id: r.output_ids for r in run.requests.values()})
        assert clock.summary()["prefill_steps"] > 0
    model.set_layers_backlog(0)
    assert outputs[0] == outputs[1]


def _step(query_start_loc: list[int]) -> Step:
    rows = len(query_start_loc) - 1
    return Step(
        query_start_loc=np.asarray(query_start_loc, dtype=np.int32),
        seq_lens=np.full(rows, 4096, dtype=np.int64),
        copies=np.zeros((0, 4), dtype=np.int64),
        paged=(),
        state=(),
    )


@pytest.mark.parametrize(
    ("query_start_loc", "expected"),
    [
        ([0, 1, 2, 3], None),  # three decode rows
        ([0, 1], None),  # one decode row
        ([0], None),  # no rows: nothing is prefilled
        ([0, 1, 6, 7], 7),  # a prefill row of 5 among decode rows: every token counts
        ([0, 4096], 4096),  # one prefill chunk
        ([0, 2], 2),  # the shortest prefill row
    ],
)
def test_a_step_prefills_when_some_row_has_more_than_one_token(query_start_loc, expected):
    assert _step(query_start_loc).prefill_tokens == expected
