"""The reference engine: caching never changes an output, and hits are what the rules promise.

Every run here uses the real cache manager, the tiny model and the torch kernel backend on the
CPU, with ``check=True`` (the engine's block tables are compared with the manager's after every
commit and the manager's invariants are checked). Outputs of ``block`` and ``fine`` are compared
with a no-cache run: generated ids equal, final logits within 1e-4 relative (float32).

Runs are overlapped (the default) unless a test checks what one step at a time does (its
preemption, its decode_step fast path's abort, its one aborted plan per failure); the
overlapped counterparts of those are in tests/test_engine_overlap.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("prefixcache._core")

import prefixcache as pc
from prefixcache import kernels
from prefixcache.engine import (
    FLOAT32_RTOL,
    Engine,
    EngineConfig,
    EngineError,
    ForwardFn,
    Policy,
    PoolTooSmallError,
    RequestResult,
    RunResult,
    build_model,
    engine_config_for,
    outputs_match,
    relative_difference,
    simulate,
)
from prefixcache.engine.workloads import (
    AgenticSpec,
    Geometry,
    GrowingPrefixSpec,
    PresetWorkload,
    Request,
    TraceSpec,
    WorkloadSpec,
)
from prefixcache.kernels import BlockTables, Step
from prefixcache.models import HybridModel, ModelCaches

GROWING = GrowingPrefixSpec(streams=3, first_prompt=150, growth=70, rounds=4, output_len=4)
AGENTIC = AgenticSpec(conversations=2, turns=3, first_prompt=100, user_turn=20, output_len=10)
GEOMETRY = Geometry(block_size=32, unit=8, token_budget=96, max_running=3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return build_model("cpu", "torch")


def run(
    model: HybridModel,
    spec: WorkloadSpec,
    policy: str,
    *,
    geometry: Geometry = GEOMETRY,
    config: EngineConfig | None = None,
    forward: ForwardFn | None = None,
    overlap: bool = True,
    observe: object = None,
) -> RunResult:
    workload = PresetWorkload("test", "test", spec, geometry)
    config = config or engine_config_for(
        workload, geometry, model.backend, check=True, overlap=overlap
    )
    engine = Engine(
        model,
        Policy.named(policy, block_size=geometry.block_size, fine_unit=geometry.unit),
        config,
        forward=forward,
        observe=observe,  # type: ignore[arg-type]
    )
    return engine.run(workload.build(model.config.vocab_size))


@pytest.fixture(scope="module")
def reference(model: HybridModel) -> dict[str, RunResult]:
    """No-cache runs with pools that evict nothing."""
    return {"growing": run(model, GROWING, "none"), "agentic": run(model, AGENTIC, "none")}


def assert_matches(run_result: RunResult, reference_result: RunResult) -> None:
    ok, detail = outputs_match(run_result, reference_result, FLOAT32_RTOL)
    assert ok, detail


@pytest.mark.parametrize("workload", ["growing", "agentic"])
@pytest.mark.parametrize("policy", ["block", "fine"])
def test_every_policy_reproduces_the_no_cache_outputs(
    model: HybridModel, reference: dict[str, RunResult], workload: str, policy: str
) -> None:
    spec = GROWING if workload == "growing" else AGENTIC
    result = run(model, spec, policy)
    assert len(result.requests) == spec.num_requests
    assert result.hit_tokens > 0
    assert_matches(result, reference[workload])
    assert reference[workload].hit_tokens == 0
    assert reference[workload].computed_prefill_tokens == reference[workload].prompt_tokens


def test_fine_resumes_agentic_turns_from_the_decode_tail(model: HybridModel) -> None:
    # Turn t+1 = turn t's prompt + its 10 outputs + 20 new tokens. The model processed the
    # prompt and 9 outputs; the decode-tail checkpoint sits on the last unit boundary of those.
    result = run(model, AGENTIC, "fine")
    unit = GEOMETRY.unit
    for request in result.requests.values():
        if request.round == 1:
            continue
        previous = result.requests[request.request_id - 1]
        processed = previous.prompt_len + AGENTIC.output_len - 1
        assert request.hit_tokens == processed // unit * unit


@pytest.mark.parametrize(
    ("alignment", "block_size", "unit"), [(1, 32, 8), (16, 64, 16), (64, 128, 64)]
)
def test_growing_prefix_hits_follow_the_formulas(
    alignment: int, block_size: int, unit: int
) -> None:
    model = build_model("cpu", "torch", backend_options={"checkpoint_alignment": alignment})
    assert model.backend.checkpoint_alignment == alignment
    spec = GrowingPrefixSpec(streams=2, first_prompt=300, growth=90, rounds=4, output_len=3)
    geometry = Geometry(block_size=block_size, unit=unit, token_budget=256, max_running=2)
    for policy, step in (("fine", unit), ("block", block_size)):
        result = run(model, spec, policy, geometry=geometry)
        assert result.preemptions == 0
        assert result.manager_stats["evictions"] == 0
        for request in result.requests.values():
            if request.round == 1:
                assert request.hit_tokens == 0
                continue
            previous = spec.prompt_len(request.round - 1)
            expected = (previous - 1) // step * step
            assert request.hit_tokens == expected, (policy, request.request_id)
            assert request.computed_prefill_tokens == request.prompt_len - expected


@pytest.mark.parametrize("policy", ["none", "block", "fine"])
def test_small_pools_preempt_and_evict_without_changing_outputs(
    model: HybridModel, reference: dict[str, RunResult], policy: str
) -> None:
    config = EngineConfig(
        token_budget=GEOMETRY.token_budget,
        max_running=3,
        paged_blocks=20,
        state_blocks=10,
        check=True,
        overlap=False,
    )
    result = run(model, GROWING, policy, config=config)
    assert result.preemptions > 0
    assert result.manager_stats["evictions"] > 0
    assert any(r.preemptions for r in result.requests.values())
    assert_matches(result, reference["growing"])
    assert (result.hit_tokens > 0) == (policy != "none")


def test_decode_only_steps_take_the_fast_path(
    model: HybridModel, reference: dict[str, RunResult]
) -> None:
    # Once every running sequence decodes and nobody waits, each step is one decode_step
    # (commit, append, schedule, plan); the outputs stay the no-cache run's.
    result = run(model, AGENTIC, "fine")
    assert result.decode_steps > result.steps // 2
    assert result.decode_fallbacks == 0
    assert_matches(result, reference["agentic"])


@pytest.mark.parametrize("policy", ["none", "block", "fine"])
def test_a_decode_step_out_of_blocks_falls_back_to_preemption(
    model: HybridModel, policy: str
) -> None:
    # Three 50-token prompts decoding 30 tokens in 8 blocks of 32: a decode crosses into a
    # block the pool cannot supply, so decode_step reports -1; the engine aborts that plan and
    # schedules the step the general way, which preempts the newest sequence.
    prompts = np.random.default_rng(0).integers(0, 1000, size=(3, 50))
    spec = TraceSpec(
        path=Path("inline"),
        requests=tuple(Request(i, prompts[i], output_len=30, arrival_s=0.0) for i in range(3)),
    )
    expected = run(model, spec, "none")
    config = EngineConfig(
        token_budget=96, max_running=3, paged_blocks=8, state_blocks=16, check=True, overlap=False
    )
    result = run(model, spec, policy, config=config)
    assert result.decode_fallbacks > 0
    assert result.preemptions > 0
    assert result.aborted_steps == 0
    assert result.manager_stats["aborts"] == result.decode_fallbacks
    assert_matches(result, expected)


def test_check_mode_catches_block_tables_that_drift_from_the_manager(
    model: HybridModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check must be able to fail: on the third plan the tables get a wrong block. The
    # mismatch is a bug, not a failed step: it propagates at once, without a retry.
    original = BlockTables.apply_plan
    calls = 0

    def drifting(self: BlockTables, plan: pc.StepPlanLike) -> None:
        nonlocal calls
        calls += 1
        original(self, plan)
        if calls == 3:
            self.apply(plan.seq_ids[:1], [[0, 0, 999]], np.zeros((0, 3), dtype=np.int32))

    monkeypatch.setattr(BlockTables, "apply_plan", drifting)
    with pytest.raises(EngineError, match="differs from the manager's"):
        run(model, GROWING, "fine")
    assert calls == 3


def poisoning_forward(model: HybridModel, fail_every: int) -> tuple[ForwardFn, list[int]]:
    """A forward that, on every ``fail_every``-th call, executes the real step (writing the
    caches: copies, layers, snapshots), overwrites everything it wrote with NaN, then raises."""
    failures: list[int] = []
    calls = 0

    def forward(
        step: Step, token_ids: torch.Tensor, caches: ModelCaches, logits_indices: np.ndarray
    ) -> torch.Tensor:
        nonlocal calls
        calls += 1
        logits = model.execute(step, token_ids, caches, logits_indices)
        if calls % fail_every:
            return logits
        state = step.state_group(caches.state_group)
        written = [
            int(s)
            for s in (
                *state.running_slot,
                *state.checkpoint_slots.reshape(-1),
                *state.snapshots[:, 1],
            )
        ]
        for cache in caches.states:
            for slot in written:
                if slot >= 0:
                    cache.recurrent[slot] = float("nan")
                    cache.conv[slot] = float("nan")
        slots = torch.from_numpy(
            np.ascontiguousarray(step.paged_group(caches.paged_group).slot_mapping)
        )
        copied = [int(dst) for group, _, dst, _ in step.copies if group == caches.paged_group]
        for kv in caches.kv:
            kv.key.view(-1, kv.num_kv_heads, kv.head_dim)[slots] = float("nan")
            kv.value.view(-1, kv.num_kv_heads, kv.head_dim)[slots] = float("nan")
            for block in copied:
                kv.key[block] = float("nan")
                kv.value[block] = float("nan")
        failures.append(calls)
        raise RuntimeError(f"injected failure at forward call {calls}")

    return forward, failures


@pytest.mark.parametrize("workload", ["growing", "agentic"])
@pytest.mark.parametrize("policy", ["none", "block", "fine"])
def test_a_failed_forward_is_aborted_and_nothing_it_wrote_is_ever_hit(
    model: HybridModel, reference: dict[str, RunResult], workload: str, policy: str
) -> None:
    forward, failures = poisoning_forward(model, fail_every=3)
    spec = GROWING if workload == "growing" else AGENTIC
    result = run(model, spec, policy, forward=forward, overlap=False)
    assert len(failures) > 3
    assert result.aborted_steps == len(failures)
    assert result.manager_stats["aborts"] == len(failures)
    assert_matches(result, reference[workload])
    for request in result.requests.values():
        assert np.isfinite(request.final_logits).all()


def test_a_forward_that_keeps_failing_propagates_after_the_retries(model: HybridModel) -> None:
    calls = 0

    def forward(
        step: Step, token_ids: torch.Tensor, caches: ModelCaches, logits_indices: np.ndarray
    ) -> torch.Tensor:
        nonlocal calls
        calls += 1
        raise RuntimeError("device lost")

    workload = PresetWorkload("test", "test", GROWING, GEOMETRY)
    config = engine_config_for(workload, GEOMETRY, model.backend)
    engine = Engine(
        model, Policy.named("fine", block_size=32, fine_unit=8), config, forward=forward
    )
    with pytest.raises(RuntimeError, match="device lost"):
        engine.run(workload.build(1000))
    assert calls == config.max_step_retries + 1


def test_a_pool_too_small_for_one_sequence_is_reported(model: HybridModel) -> None:
    config = EngineConfig(token_budget=96, max_running=3, paged_blocks=4, state_blocks=16)
    with pytest.raises(PoolTooSmallError, match="too small"):
        run(model, GROWING, "fine", config=config)


def test_a_budget_below_the_alignment_is_refused() -> None:
    model = build_model("cpu", "torch", backend_options={"checkpoint_alignment": 64})
    config = EngineConfig(token_budget=32, max_running=2, paged_blocks=64, state_blocks=16)
    with pytest.raises(ValueError, match="alignment 64"):
        Engine(model, Policy.named("fine", block_size=128, fine_unit=64), config)


def test_idle_time_before_an_arrival_is_skipped_and_not_counted(model: HybridModel) -> None:
    prompts = np.random.default_rng(0).integers(0, 1000, size=(2, 40))
    spec = TraceSpec(
        path=Path("inline"),
        requests=(
            Request(0, prompts[0], output_len=3, arrival_s=0.0),
            Request(1, prompts[1], output_len=3, arrival_s=3600.0),
        ),
    )
    result = run(model, spec, "fine")
    assert set(result.requests) == {0, 1}
    assert result.seconds < 600
    for request in result.requests.values():
        assert 0 < request.ttft_s < 600
        assert request.computed_prefill_tokens == 40


def test_time_to_first_token_includes_queueing(model: HybridModel) -> None:
    # Three 150-token prompts, a budget of 96 tokens per step, all arriving at once: the
    # requests finish their prefills one after another, so their TTFTs are ordered.
    result = run(model, GROWING, "none")
    first_round = sorted(
        (r for r in result.requests.values() if r.round == 1), key=lambda r: r.ttft_s
    )
    assert len(first_round) == 3
    assert first_round[0].ttft_s < first_round[-1].ttft_s


def test_policies_differ_only_in_unit_and_retention() -> None:
    none = Policy.named("none", block_size=96, fine_unit=8)
    block = Policy.named("block", block_size=96, fine_unit=8)
    fine = Policy.named("fine", block_size=96, fine_unit=8)
    assert not (none.tail or none.junction or none.decode_tail or none.interval)
    assert (block.unit, block.block_size) == (96, 96)
    assert (fine.unit, fine.block_size) == (8, 96)
    for policy in (block, fine):
        assert (policy.tail, policy.interval, policy.junction, policy.decode_tail) == (
            True,
            None,
            True,
            True,
        )
    with pytest.raises(ValueError, match="unknown policy"):
        Policy.named("all", block_size=96, fine_unit=8)
    odd = Policy.named("fine", block_size=96, fine_unit=7)
    with pytest.raises(pc.ConfigError, match="U must divide"):
        odd.cache_config(kernels.TorchBackend(), paged_blocks=64, state_blocks=16)


def result(
    request_id: int, ids: list[int], logits: list[float], margins: list[float]
) -> RequestResult:
    return RequestResult(
        request_id=request_id,
        round=1,
        prompt_len=10,
        hit_tokens=0,
        computed_prefill_tokens=10,
        prefill_seconds=0.0,
        kda_prefill_seconds=0.0,
        ttft_s=0.1,
        output_ids=ids,
        final_logits=np.asarray(logits, dtype=np.float32),
        margins=margins,
        preemptions=0,
    )


def test_outputs_match_catches_every_kind_of_difference() -> None:
    reference = RunResult("none", {0: result(0, [1, 2, 3], [1.0, 2.0], [0.5, 1e-5, 0.5])})
    same = RunResult("fine", {0: result(0, [1, 2, 3], [1.0, 2.00001], [0.5, 0.5, 0.5])})
    assert outputs_match(same, reference, 1e-4)[0]
    other_ids = RunResult("fine", {0: result(0, [1, 2, 4], [1.0, 2.0], [0.5, 0.5, 0.5])})
    assert not outputs_match(other_ids, reference, 1e-4)[0]
    far = RunResult("fine", {0: result(0, [1, 2, 3], [1.0, 2.1], [0.5, 0.5, 0.5])})
    assert not outputs_match(far, reference, 1e-4)[0]
    poisoned = RunResult("fine", {0: result(0, [1, 2, 3], [1.0, float("nan")], [0.5] * 3)})
    assert not outputs_match(poisoned, reference, 1e-4)[0]
    missing = RunResult("fine", {})
    assert not outputs_match(missing, reference, 1e-4)[0]
    # A flip at the reference's near-tie (output 1, margin 1e-5) passes only when tie-aware;
    # a flip where the margin was clear (output 0) never does.
    at_tie = RunResult("fine", {0: result(0, [1, 7, 8], [9.0, 9.0], [0.5] * 3)})
    assert not outputs_match(at_tie, reference, 1e-4)[0]
    assert outputs_match(at_tie, reference, 1e-4, tie_aware=True)[0]
    clear = RunResult("fine", {0: result(0, [5, 2, 3], [1.0, 2.0], [0.5] * 3)})
    assert not outputs_match(clear, reference, 1e-4, tie_aware=True)[0]
    assert relative_difference(np.ones(3), np.ones(4)) == float("inf")


def test_the_warm_up_runs_every_policy_and_changes_no_measured_figure(
    model: HybridModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = PresetWorkload("growing-prefix", "test", GROWING, GEOMETRY)
    runs: list[str] = []
    original = Engine.run

    def counting(engine: Engine, *args: object, **kwargs: object) -> RunResult:
        runs.append(engine.policy.name)
        return original(engine, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "run", counting)
    cold = simulate(workload, ["block", "fine"], model, warm_up=False).to_json()
    assert runs == ["none", "block", "fine"]
    runs.clear()
    warm = simulate(workload, ["block", "fine"], model, warm_up=True).to_json()
    assert runs == ["none", "block", "fine"] * 2  # the warm-up first, then the measured runs
    assert model.kda_timer.seconds == 0.0
    for name in ("none", "block", "fine"):
        a, b = cold["policies"][name], warm["policies"][name]
        for key in ("requests", "hit_tokens", "computed_prefill_tokens", "steps"):
            assert a[key] == b[key], (name, key)
        assert b["outputs_match_no_cache"] is True
        assert [r["computed_prefill_tokens"] for r in a["rounds"]] == [
            r["computed_prefill_tokens"] for r in b["rounds"]
        ]


def test_decode_only_steps_are_not_timed_and_the_timer_is_left_enabled(
    model: HybridModel,
) -> None:
    timed: list[bool] = []
    original = model.kda_timer.measure

    def recording() -> object:
        timed.append(model.kda_timer.enabled)
        return original()

    model.kda_timer.measure = recording  # type: ignore[method-assign]
    try:
        result = run(model, GROWING, "fine")
    finally:
        del model.kda_timer.measure
    layers = model.config.num_kda_layers
    # Every step runs each KDA layer once; steps with a prefill row are timed, the rest not.
    assert len(timed) == layers * (result.steps + result.aborted_steps)
    assert any(timed) and not all(timed)
    assert model.kda_timer.enabled
