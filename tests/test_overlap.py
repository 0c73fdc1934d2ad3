"""Overlapped steps through the bindings (`max_steps_in_flight` > 1): the configuration field,
placeholders and `resolve`, the order plans end in, cascading aborts, the pending answer of
`lookup` and the one-call overlapped decode step with a ring of `PlanBuffers`.

The rules, in this file's words: with D plans in flight the next `build_plan` is refused; plans
end oldest first; a key over a token not yet sampled is published once its step committed and
the token is resolved, whichever comes last; aborting the oldest plan ends all of them and
returns their ids; a plan's buffers may not be rewritten while that plan is in flight.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import prefixcache as pc
import pytest
from conftest import hybrid_config, paged_config


def overlapped(config: pc.CacheConfig, depth: int = 2) -> pc.CacheManager:
    return pc.CacheManager(dataclasses.replace(config, max_steps_in_flight=depth))


def test_the_field_is_validated_and_defaults_to_one() -> None:
    assert paged_config().max_steps_in_flight == 1
    assert pc.MAX_STEPS_IN_FLIGHT >= 2
    for bad in (0, pc.MAX_STEPS_IN_FLIGHT + 1):
        with pytest.raises(pc.ConfigError, match="max_steps_in_flight"):
            dataclasses.replace(paged_config(), max_steps_in_flight=bad)


def test_plans_end_in_build_order_and_abort_returns_every_plan_it_ended() -> None:
    mgr = overlapped(paged_config(unit=4, block_size=8))
    for i in (1, 2, 3):
        mgr.add(i, list(range(i * 100, i * 100 + 20)))
    mgr.schedule(1, 20)
    first = mgr.build_plan()
    mgr.schedule(2, 20)
    second = mgr.build_plan()
    mgr.schedule(3, 20)
    with pytest.raises(pc.StepError, match=f"step {first.step_id}"):
        mgr.build_plan()
    assert mgr.plans_in_flight == [first.step_id, second.step_id]
    with pytest.raises(pc.StepError, match=f"step {first.step_id}"):
        mgr.commit(second)
    assert mgr.abort(first) == [first.step_id, second.step_id]
    assert mgr.plans_in_flight == []
    with pytest.raises(pc.StalePlanError):
        mgr.commit(second)
    mgr.check_invariants()


def test_a_key_over_a_placeholder_waits_for_resolve() -> None:
    mgr = overlapped(paged_config(unit=4, block_size=8))
    prompt = list(range(7))
    mgr.add(1, prompt)
    mgr.schedule(1, 7)
    prefill = mgr.build_plan()
    mgr.append(1, [], placeholders=1)
    assert (mgr.num_tokens(1), mgr.num_placeholders(1)) == (8, 1)
    assert mgr.schedule(1, 1).num_tokens == 1
    decode = mgr.build_plan()
    mgr.commit(prefill)
    mgr.commit(decode)
    mgr.drain_events()
    probe = [*prompt, 70, 71]
    mgr.add(9, probe)
    assert mgr.lookup(9).tokens == 4
    with pytest.raises(pc.InvalidRequestError):
        mgr.resolve(1, [70, 71])
    with pytest.raises(pc.StepError):
        mgr.append(1, [5])
    mgr.resolve(1, [70])
    stored = [e for e in mgr.drain_events() if isinstance(e, pc.BlockStored)]
    assert [(e.token_start, e.token_end) for e in stored] == [(4, 8)]
    assert mgr.lookup(9).tokens == 8
    mgr.check_invariants()


def test_lookup_reports_the_pending_hit_and_its_plan() -> None:
    mgr = overlapped(hybrid_config(unit=4, block_size=8, alignment=4))
    prompt = list(range(40))
    mgr.add(1, prompt)
    mgr.schedule(1, 40)
    plan = mgr.build_plan()
    mgr.add(2, prompt)
    hit = mgr.lookup(2)
    assert (hit.tokens, hit.pending_tokens, hit.pending_plan) == (0, 36, plan.step_id)
    assert "pending_tokens=36" in repr(hit)
    mgr.commit(plan)
    hit = mgr.lookup(2)
    assert (hit.tokens, hit.pending_tokens, hit.pending_plan) == (36, 36, None)


def test_the_overlapped_decode_step_runs_one_call_a_step_over_a_ring_of_buffers() -> None:
    mgr = overlapped(hybrid_config(unit=4, block_size=8, alignment=4))
    ids = [1, 2, 3]
    for i in ids:
        mgr.add(i, list(range(i * 100, i * 100 + 9)))
    mgr.schedule_batch(ids, 9)
    mgr.commit(mgr.build_plan())
    ring = [pc.PlanBuffers(), pc.PlanBuffers()]
    sampled: dict[int, list[int]] = {i: [] for i in ids}
    for step in range(12):
        in_flight = mgr.plans_in_flight
        full = len(in_flight) == 2
        tokens = np.array([1000 + step * 10 + i for i in ids], dtype=np.uint32)
        out = mgr.decode_step_overlapped(
            ring[step % 2],
            ids,
            resolve_ids=ids if full else None,
            tokens=tokens if full else None,
            commit=in_flight[0] if full else None,
        )
        assert out.tolist() == [1, 1, 1]
        if full:
            for i, t in zip(ids, tokens.tolist(), strict=True):
                sampled[i].append(t)
        mgr.check_invariants()
    # The buffers still hold plans in flight: writing into them is refused.
    with pytest.raises(pc.StepError, match="still in flight"):
        mgr.decode_step_overlapped(ring[0], ids)
    for step_id in mgr.plans_in_flight:
        mgr.commit_step(step_id)
    for i in ids:
        assert mgr.num_computed(i) == 9 + 12
        assert mgr.num_placeholders(i) == 12 - len(sampled[i])
        mgr.resolve(i, list(range(mgr.num_placeholders(i))))
        mgr.finish(i)
    assert all(u.owned == 0 for u in mgr.pool_usage())
    mgr.check_invariants()


def test_with_d_1_an_in_flight_plan_still_refuses_every_other_step_call() -> None:
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, list(range(40)))
    mgr.schedule(1, 32)
    plan = mgr.build_plan()
    for call in (
        lambda: mgr.schedule(1, 8),
        lambda: mgr.append(1, [], placeholders=1),
        lambda: mgr.finish(1),
        lambda: mgr.build_plan(),
    ):
        with pytest.raises(pc.StepError):
            call()
    assert mgr.abort(plan) == [plan.step_id]
