"""The reference engine overlapped: step k+1 is planned while the forward of step k runs.

The rule checked everywhere here: overlapping changes no output. Each overlapped run (the
tiny model, the torch backend on the CPU, ``check=True``: block tables and placeholders are
compared with the manager's after every plan, commit and abort) must generate exactly the ids
of the no-cache run made one step at a time (which every policy run one step at a time
reproduces: tests/test_engine.py), with final logits within 1e-4 relative, on every
workload, with and without caching, with pools small enough to evict and to preempt, and with
forwards that fail after poisoning what they wrote (a failure must end the later plan in
flight as well: it read what the failed one half wrote).

Beyond outputs: the host must really plan ahead (a forward that waits until the next plan is
built would wait forever in an engine that does not overlap), and a request whose prefix a
plan in flight is computing must wait for it rather than recompute it.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("prefixcache._core")

import prefixcache as pc
from prefixcache.engine import (
    FLOAT32_RTOL,
    Engine,
    EngineConfig,
    Policy,
    PoolTooSmallError,
    RunResult,
    build_model,
    engine_config_for,
    outputs_match,
    simulate,
)
from prefixcache.engine.cli import build_parser
from prefixcache.engine.workloads import (
    AgenticSpec,
    GrowingPrefixSpec,
    PresetWorkload,
    Request,
    SharedPromptsSpec,
    TraceSpec,
    WorkloadSpec,
)
from prefixcache.kernels import Step
from prefixcache.models import HybridModel, ModelCaches
from test_engine import GEOMETRY, poisoning_forward, run

_PROMPTS = np.random.default_rng(0).integers(0, 1000, size=(3, 50))
_SHARING = _PROMPTS.copy()
_SHARING[2, :40] = _SHARING[0, :40]  # the third request shares a prefix with the first
WORKLOADS: dict[str, WorkloadSpec] = {
    "growing": GrowingPrefixSpec(streams=3, first_prompt=100, growth=40, rounds=3, output_len=4),
    "agentic": AgenticSpec(conversations=2, turns=3, first_prompt=100, user_turn=20, output_len=6),
    # One system prompt: the second request is admitted while the first one's prefill flies.
    "shared": SharedPromptsSpec(
        requests=6, prompt_len=96, system_len=64, system_prompts=1, output_len=3, round_size=3
    ),
    "trace": TraceSpec(
        path=Path("inline"),
        requests=tuple(Request(i, _SHARING[i], output_len=12, arrival_s=0.0) for i in range(3)),
    ),
}
# Three unrelated 50-token prompts decoding 30 tokens each: 7 attention blocks of 32 cannot
# hold them all.
PREEMPTING = TraceSpec(
    path=Path("inline"),
    requests=tuple(Request(i, _PROMPTS[i], output_len=30, arrival_s=0.0) for i in range(3)),
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return build_model("cpu", "torch")


@pytest.fixture(scope="module")
def one_step(model: HybridModel) -> dict[str, RunResult]:
    """Every workload without caching, one step at a time: the reference outputs."""
    specs = {**WORKLOADS, "preempting": PREEMPTING}
    return {name: run(model, spec, "none", overlap=False) for name, spec in specs.items()}


def assert_matches(result: RunResult, reference: RunResult) -> None:
    ok, detail = outputs_match(result, reference, FLOAT32_RTOL)
    assert ok, detail


# (block runs overlapped here in the failure and hold tests, and in tests/test_engine.py.)
@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("policy", ["none", "fine"])
def test_overlapped_runs_generate_what_one_step_at_a_time_does(
    model: HybridModel, one_step: dict[str, RunResult], workload: str, policy: str
) -> None:
    spec = WORKLOADS[workload]
    result = run(model, spec, policy)
    assert result.overlap and not one_step[workload].overlap
    assert len(result.requests) == spec.num_requests
    assert_matches(result, one_step[workload])
    # (The trace's shared 40 tokens end off a block and off any checkpoint fine plans.)
    caches = policy == "block" or (policy == "fine" and workload != "trace")
    assert (result.hit_tokens > 0) == caches
    assert result.aborted_steps == result.preemptions == 0
    # Decode-only steps take decode_step_overlapped once two plans are in flight.
    if workload in ("agentic", "trace"):
        assert result.decode_steps > 0


def test_the_host_plans_the_next_step_while_a_forward_runs(model: HybridModel) -> None:
    # Each of the first forwards waits until the engine has built the next plan, which an
    # engine that ran the forward inline could never do (the wait would time out).
    managers: list[pc.CacheManager] = []
    overlapped: list[int] = []

    def observe(manager: pc.CacheManager) -> object:
        managers.append(manager)
        return lambda: None

    def forward(
        step: Step, token_ids: torch.Tensor, caches: ModelCaches, logits_indices: np.ndarray
    ) -> torch.Tensor:
        if len(overlapped) < 4:
            deadline = threading.Event()
            for _ in range(400):  # up to 2 s
                if len(managers[-1].plans_in_flight) == 2:
                    overlapped.append(int(step.step_id or 0))
                    break
                deadline.wait(0.005)
        return model.execute(step, token_ids, caches, logits_indices)

    result = run(model, WORKLOADS["agentic"], "fine", forward=forward, observe=observe)
    assert len(overlapped) == 4, overlapped
    assert len(result.requests) == WORKLOADS["agentic"].num_requests


@pytest.mark.parametrize(
    ("workload", "policy"), [("growing", "none"), ("growing", "block"), ("agentic", "fine")]
)
def test_a_failed_forward_aborts_the_later_plan_in_flight_too(
    model: HybridModel,
    one_step: dict[str, RunResult],
    workload: str,
    policy: str,
) -> None:
    poisoning, failures = poisoning_forward(model, fail_every=3)
    calls = 0

    def forward(
        step: Step, token_ids: torch.Tensor, caches: ModelCaches, logits_indices: np.ndarray
    ) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return poisoning(step, token_ids, caches, logits_indices)

    result = run(model, WORKLOADS[workload], policy, forward=forward)
    assert len(failures) > 2
    assert result.aborted_steps == len(failures)
    # The plan built while the failed forward ran was aborted with it, and never run: every
    # forward called either committed or failed.
    assert result.cascaded_aborts > 0
    assert calls == result.steps + len(failures)
    assert result.manager_stats["aborts"] == result.aborted_steps + result.cascaded_aborts
    assert_matches(result, one_step[workload])
    for request in result.requests.values():
        assert np.isfinite(request.final_logits).all()


@pytest.mark.parametrize("policy", ["none", "fine"])
def test_small_pools_evict_and_preempt_without_changing_outputs(
    model: HybridModel, one_step: dict[str, RunResult], policy: str
) -> None:
    # Attention pools too small for everyone: with a plan in flight a sequence the pools cannot
    # serve waits (its step is cut short), and preemption happens once nothing is in flight.
    evicting = EngineConfig(
        token_budget=96, max_running=3, paged_blocks=16, state_blocks=12, check=True
    )
    result = run(model, WORKLOADS["growing"], policy, config=evicting)
    assert result.manager_stats["evictions"] > 0
    assert_matches(result, one_step["growing"])
    preempting = dataclasses.replace(evicting, paged_blocks=7, state_blocks=16)
    result = run(model, PREEMPTING, policy, config=preempting)
    assert result.preemptions > 0
    assert result.decode_fallbacks > 0  # a decode_step_overlapped without a sequence's block
    assert any(r.preemptions for r in result.requests.values())
    assert_matches(result, one_step["preempting"])


def test_a_request_waits_for_the_prefix_a_plan_in_flight_computes(
    model: HybridModel, one_step: dict[str, RunResult]
) -> None:
    # Block checkpoints: the first request's plan writes the system prompt's boundary (64)
    # checkpoint, so lookup reports it pending to the next request while that plan flies.
    spec = WORKLOADS["shared"]
    held = run(model, spec, "block")
    config = engine_config_for(
        PresetWorkload("test", "test", spec, GEOMETRY), GEOMETRY, model.backend, check=True
    )
    eager = run(model, spec, "block", config=dataclasses.replace(config, hold_pending=False))
    assert held.holds > 0 and held.held_requests > 0 and held.held_pending_tokens > 0
    assert eager.holds == 0
    # Admitted at once, the second request recomputes the system prompt the first computes;
    # held, it hits it, as it does one step at a time.
    assert held.computed_prefill_tokens < eager.computed_prefill_tokens
    assert held.hit_tokens > eager.hit_tokens
    assert held.hit_tokens == run(model, spec, "block", overlap=False).hit_tokens
    assert_matches(held, one_step["shared"])
    assert_matches(eager, one_step["shared"])


def test_overlap_is_the_default_and_the_flag_reaches_the_engine(
    model: HybridModel, one_step: dict[str, RunResult]
) -> None:
    parser = build_parser()
    assert parser.parse_args(["simulate"]).overlap is True
    assert parser.parse_args(["simulate", "--no-overlap"]).overlap is False
    assert EngineConfig(96, 3, 100, 100).overlap is True
    spec = WORKLOADS["trace"]
    workload = PresetWorkload("trace", "test", spec, GEOMETRY)
    for overlap in (True, False):
        report = simulate(workload, ["fine"], model, overlap=overlap, reference=False)
        assert report.engine_config is not None and report.engine_config.overlap is overlap
        assert report.to_json()["policies"]["fine"]["overlap"] is overlap
        assert_matches(report.runs["fine"], one_step["trace"])
        # Overlapped, the manager lets two plans be in flight; the pools are sized for it.
        engine = Engine(
            model,
            Policy.named("fine", block_size=32, fine_unit=8),
            report.engine_config,
        )
        assert engine.manager_config().max_steps_in_flight == (2 if overlap else 1)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    lengths=st.lists(st.integers(min_value=20, max_value=70), min_size=2, max_size=4),
    shared=st.integers(min_value=0, max_value=40),
    outputs=st.lists(st.integers(min_value=1, max_value=8), min_size=4, max_size=4),
    paged_blocks=st.integers(min_value=6, max_value=40),
    fail_every=st.sampled_from([0, 2, 3, 5]),
    policy=st.sampled_from(["none", "block", "fine"]),
)
def test_random_traces_pools_and_failures_change_no_output(
    model: HybridModel,
    lengths: list[int],
    shared: int,
    outputs: list[int],
    paged_blocks: int,
    fail_every: int,
    policy: str,
) -> None:
    # Prompts sharing a prefix of `shared` tokens, small attention pools (evicting and
    # preempting), forwards failing every few calls: overlapped, the outputs are those of the
    # no-cache run one step at a time with pools that hold everything.
    rng = np.random.default_rng(len(lengths) * 1000 + shared)
    common = rng.integers(0, 1000, size=shared)
    requests = tuple(
        Request(
            i,
            np.concatenate([common, rng.integers(0, 1000, size=n)]),
            output_len=outputs[i],
            arrival_s=0.0,
        )
        for i, n in enumerate(lengths)
    )
    spec = TraceSpec(path=Path("inline"), requests=requests)
    reference = run(model, spec, "none", overlap=False)
    config = EngineConfig(
        token_budget=96, max_running=3, paged_blocks=paged_blocks, state_blocks=48, check=True
    )
    forward = poisoning_forward(model, fail_every)[0] if fail_every else None
    try:
        one_step = run(model, spec, policy, config=dataclasses.replace(config, overlap=False))
    except PoolTooSmallError:
        return  # pools too small for one of the prompts: nothing to compare
    assert_matches(one_step, reference)
    result = run(model, spec, policy, config=config, forward=forward)
    assert_matches(result, reference)


def test_a_junction_against_a_prefix_in_flight_is_checkpointed_as_one_step_at_a_time() -> None:
    # The rule wanted: overlapping steps never costs a later request its hit. A, then B, share
    # a 64-token prefix and then differ; one step at a time, B is scheduled after A committed,
    # so B's chunk checkpoints the junction (64) and C, sharing the prefix too, hits 64. With
    # A still in flight when B is scheduled, C should hit 64 all the same.
    from conftest import hybrid_config

    prefix = list(range(64))
    hits = []
    for overlapped in (False, True):
        config = hybrid_config(unit=8, block_size=16, alignment=8)
        manager = pc.CacheManager(dataclasses.replace(config, max_steps_in_flight=2))
        manager.add(1, prefix + list(range(1000, 1032)))
        manager.schedule(1, 96)
        first = manager.build_plan()
        if not overlapped:
            manager.commit(first)
        manager.add(2, prefix + list(range(2000, 2032)))
        manager.schedule(2, 96)
        second = manager.build_plan()
        if overlapped:
            manager.commit(first)
        manager.commit(second)
        manager.add(3, prefix + list(range(3000, 3032)))
        hits.append(manager.lookup(3).tokens)
    assert hits[0] == 64  # one step at a time
    assert hits[1] == hits[0]
