"""`build_plan_into`: the plan written into persistent `PlanBuffers` equals `build_plan`'s."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import numpy as np
import prefixcache as pc
import pytest
from conftest import hybrid_config, paged_config, run_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def members(protocol: type) -> set[str]:
    """The public attributes and methods a protocol declares."""
    return {n for n in vars(protocol) if not n.startswith("_")}


def step_values(step: pc.StepPlanLike) -> dict[str, object]:
    """Everything a kernel layer reads of a step, read through `StepPlanLike` alone (the
    leading rows its docstring names), as plain lists."""
    rows, tokens, copies = step.num_rows, step.num_tokens, step.num_copies
    out: dict[str, object] = {
        "step_id": step.step_id,
        "counts": step.counts,
        "seq_ids": step.seq_ids[:rows].tolist(),
        "query_start_loc": step.query_start_loc[: rows + 1].tolist(),
        "num_computed": step.num_computed[:rows].tolist(),
        "num_scheduled": step.num_scheduled[:rows].tolist(),
        "copies": step.copies[:copies].tolist(),
    }
    for part in step.paged:
        assert isinstance(part, pc.PagedGroupPlanLike)
        assert step.paged_group(part.group) is part
        out[f"paged{part.group}"] = (
            part.appended[: part.num_appended].tolist(),
            part.replaced[: part.num_replaced].tolist(),
            part.slot_mapping[:tokens].tolist(),
        )
    for part in step.state:
        assert isinstance(part, pc.StateGroupPlanLike)
        assert step.state_group(part.group) is part
        c = part.max_checkpoints
        out[f"state{part.group}"] = (
            part.running_slot[:rows].tolist(),
            part.initial_slot[:rows].tolist(),
            part.checkpoint_offsets[:rows, :c].tolist(),
            part.checkpoint_slots[:rows, :c].tolist(),
            part.snapshots[: part.num_snapshots].tolist(),
        )
    return out


def assert_same_plan(plan: pc.StepPlan, buffers: pc.PlanBuffers) -> None:
    """Every value of `plan` is in the leading rows of `buffers`."""
    # Read through the one protocol both satisfy, the same values.
    assert isinstance(plan, pc.StepPlanLike) and isinstance(buffers, pc.StepPlanLike)
    assert step_values(plan) == step_values(buffers)
    rows = plan.num_rows
    assert (buffers.step_id, buffers.num_rows, buffers.num_tokens) == (
        plan.step_id,
        rows,
        plan.num_tokens,
    )
    assert buffers.seq_ids[:rows].tolist() == plan.seq_ids.tolist()
    assert buffers.query_start_loc[: rows + 1].tolist() == plan.query_start_loc.tolist()
    assert buffers.num_computed[:rows].tolist() == plan.num_computed.tolist()
    assert buffers.num_scheduled[:rows].tolist() == plan.num_scheduled.tolist()
    assert buffers.num_copies == len(plan.copies)
    assert buffers.copies[: buffers.num_copies].tolist() == plan.copies.tolist()
    assert [b.group for b in buffers.paged] == [p.group for p in plan.paged]
    for b, p in zip(buffers.paged, plan.paged, strict=True):
        assert (b.num_appended, b.num_replaced) == (len(p.appended), len(p.replaced))
        assert b.appended[: b.num_appended].tolist() == p.appended.tolist()
        assert b.replaced[: b.num_replaced].tolist() == p.replaced.tolist()
        assert b.slot_mapping[: plan.num_tokens].tolist() == p.slot_mapping.tolist()
    assert [b.group for b in buffers.state] == [s.group for s in plan.state]
    counts = [rows, plan.num_tokens, len(plan.copies)]
    counts += [n for p in plan.paged for n in (len(p.appended), len(p.replaced))]
    counts += [n for s in plan.state for n in (s.checkpoint_offsets.shape[1], len(s.snapshots))]
    assert buffers.counts == tuple(counts)
    for b, s in zip(buffers.state, plan.state, strict=True):
        assert b.running_slot[:rows].tolist() == s.running_slot.tolist()
        assert b.initial_slot[:rows].tolist() == s.initial_slot.tolist()
        c = b.max_checkpoints
        assert (rows, c) == s.checkpoint_offsets.shape
        if c:
            assert b.checkpoint_offsets[:rows, :c].tolist() == s.checkpoint_offsets.tolist()
            assert b.checkpoint_slots[:rows, :c].tolist() == s.checkpoint_slots.tolist()
        assert b.num_snapshots == len(s.snapshots)
        assert b.snapshots[: b.num_snapshots].tolist() == s.snapshots.tolist()


STEP = st.tuples(
    st.lists(st.integers(min_value=1, max_value=300), min_size=0, max_size=3),  # new prompts
    st.integers(min_value=1, max_value=200),  # prefill budget per sequence
    st.booleans(),  # finish the oldest sequence after the step
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STEP, min_size=1, max_size=12), st.integers(min_value=1, max_value=4))
def test_buffers_hold_what_build_plan_returns(steps: list, rows: int) -> None:
    """Twin managers take the same steps; one builds plans, the other writes into one
    `PlanBuffers` that starts small (so it grows) and is reused every step. Prompts share all
    but their last token, so later ones hit earlier ones (with copy-on-write copies when a hit
    ends inside a block), and the state group takes interior checkpoints and snapshots."""
    twins = [
        pc.CacheManager(hybrid_config(num_blocks=400, state_blocks=200, alignment=8))
        for _ in range(2)
    ]
    buffers = pc.PlanBuffers(rows=rows)
    live: list[int] = []
    next_id = 0
    for prompts, budget, finish in steps:
        for length in prompts:
            for mgr in twins:
                mgr.add(next_id, [t % 50 for t in range(length - 1)] + [next_id % 50])
            live.append(next_id)
            next_id += 1
        if not live:
            continue
        results = []
        for mgr in twins:
            counts = mgr.schedule_tokens(live, budget)
            results.append(counts.tolist())
        assert results[0] == results[1]
        if all(c <= 0 for c in results[0]):
            continue
        plan = twins[0].build_plan()
        step_id = twins[1].build_plan_into(buffers)
        assert step_id == plan.step_id
        assert_same_plan(plan, buffers)
        twins[0].commit(plan)
        twins[1].commit(buffers)
        for mgr in twins:
            for seq in live:
                if mgr.num_computed(seq) == mgr.num_tokens(seq):
                    mgr.append(seq, [seq % 50])
        if finish:
            for mgr in twins:
                mgr.finish(live[0])
            live.pop(0)
    for mgr in twins:
        mgr.check_invariants()
    assert [twins[0].num_computed(s) for s in live] == [twins[1].num_computed(s) for s in live]


def test_arrays_persist_across_steps_and_grow_when_needed() -> None:
    mgr = pc.CacheManager(hybrid_config(num_blocks=256, state_blocks=64))
    buffers = pc.PlanBuffers(rows=2)
    assert buffers.step_id is None and buffers.paged == () and buffers.num_rows == 0
    assert buffers.counts == (0, 0, 0)
    for seq in range(2):
        mgr.add(seq, list(range(seq, seq + 40)))
    mgr.schedule_tokens([0, 1], 40)
    mgr.build_plan_into(buffers)
    generation = buffers.generation
    assert generation > 0  # the first plan laid out the groups' parts
    seq_ids, paged = buffers.seq_ids, buffers.paged
    slots = buffers.state[0].running_slot
    mgr.commit(buffers)
    mgr.append_batch([0, 1], [5, 6])
    mgr.schedule_tokens([0, 1], 1)
    mgr.build_plan_into(buffers)
    # Same objects, new values: nothing is made for a step that fits.
    assert buffers.seq_ids is seq_ids and buffers.paged is paged
    assert buffers.state[0].running_slot is slots and buffers.generation == generation
    assert buffers.num_rows == 2 and buffers.num_tokens == 2
    assert buffers.num_scheduled[:2].tolist() == [1, 1]
    mgr.commit(buffers)
    for seq in range(2, 5):
        mgr.add(seq, list(range(seq, seq + 40)))
    mgr.append_batch([0, 1], [7, 8])
    mgr.schedule_tokens(list(range(5)), 40)
    mgr.build_plan_into(buffers)
    # Five rows do not fit two: the row arrays were replaced by larger ones.
    assert buffers.num_rows == 5 and len(buffers.seq_ids) >= 5
    assert buffers.seq_ids is not seq_ids and buffers.generation > generation
    assert buffers.seq_ids[:5].tolist() == [0, 1, 2, 3, 4]
    mgr.abort(buffers)
    assert [mgr.num_computed(s) for s in range(5)] == [41, 41, 0, 0, 0]
    mgr.check_invariants()


def test_bad_uses_of_buffers_are_refused() -> None:
    mgr = pc.CacheManager(paged_config())
    other = pc.CacheManager(paged_config())
    buffers = pc.PlanBuffers()
    with pytest.raises(pc.StepError, match="no plan was built into them"):
        mgr.commit(buffers)
    with pytest.raises(pc.InvalidRequestError, match="rows"):
        pc.PlanBuffers(rows=0)
    with pytest.raises(TypeError, match="StepPlan or PlanBuffers"):
        mgr.commit(np.zeros(3))  # type: ignore[arg-type]
    mgr.add(1, list(range(40)))
    mgr.schedule(1, 40)
    mgr.build_plan_into(buffers)
    with pytest.raises(pc.StalePlanError, match="built by another manager"):
        other.commit(buffers)
    with pytest.raises(pc.StepError, match="in flight"):
        mgr.build_plan_into(pc.PlanBuffers())
    mgr.commit(buffers)
    with pytest.raises(pc.StalePlanError, match="already committed"):
        mgr.commit(buffers)
    assert "rows=1, tokens=40" in repr(buffers)
    assert "num_appended=2" in repr(buffers.paged[0])
    mgr.check_invariants()


def test_decode_step_equals_the_four_calls() -> None:
    """`decode_step` against commit + append_batch + schedule_tokens + build_plan on a twin,
    through a pool that runs out (a -1) and sequences finishing between steps."""
    explicit, fused = (
        pc.CacheManager(hybrid_config(num_blocks=10, state_blocks=64, alignment=8))
        for _ in range(2)
    )
    buffers = pc.PlanBuffers(rows=1)
    for mgr in (explicit, fused):
        for seq in range(4):
            mgr.add(seq, [seq % 3] * 60 + [seq])
        mgr.schedule_tokens([0, 1, 2, 3], 100)
    plan = explicit.build_plan()
    fused.build_plan_into(buffers)
    assert_same_plan(plan, buffers)
    live = [0, 1, 2, 3]
    saw_refusal = False
    in_flight: pc.StepPlan | None = plan
    for step in range(40):
        tokens = [(seq + step) % 50 for seq in live]
        if in_flight is not None:
            explicit.commit(in_flight)
        explicit.append_batch(live, tokens)
        expected = explicit.schedule_tokens(live, 1)
        plan = in_flight = explicit.build_plan()
        got = fused.decode_step(buffers, np.array(live, dtype=np.int64), tokens)
        assert got.dtype == np.int32 and got.tolist() == expected.tolist()
        assert_same_plan(plan, buffers)
        saw_refusal |= -1 in got.tolist()
        if step % 10 == 9:
            # The oldest finishes: commit first, finish it; the next `decode_step` then finds
            # no step in flight and commits nothing.
            explicit.commit(plan)
            fused.commit(buffers)
            in_flight = None
            for mgr in (explicit, fused):
                mgr.finish(live[0])
            live.pop(0)
    assert saw_refusal  # 9 usable blocks of 32 tokens cannot hold four growing sequences
    for mgr in (explicit, fused):
        mgr.check_invariants()
    assert [explicit.num_tokens(s) for s in live] == [fused.num_tokens(s) for s in live]


def test_decode_step_checks_before_changing_anything() -> None:
    mgr = pc.CacheManager(hybrid_config())
    buffers = pc.PlanBuffers()
    for seq in range(2):
        mgr.add(seq, list(range(seq, seq + 40)))
    mgr.schedule_tokens([0, 1], 100)
    mgr.build_plan_into(buffers)
    with pytest.raises(pc.InvalidRequestError, match="2 sequence ids but 1 tokens"):
        mgr.decode_step(buffers, [0, 1], [5])
    # The commit of the step in flight happened and stands; nothing was appended.
    assert mgr.plan_in_flight is None and [mgr.num_tokens(s) for s in (0, 1)] == [40, 40]
    with pytest.raises(pc.StepError, match="appears twice"):
        mgr.decode_step(buffers, [0, 0], [5, 6])
    with pytest.raises(pc.UnknownSequenceError):
        mgr.decode_step(buffers, [0, 9], [5, 6])
    assert [mgr.num_tokens(s) for s in (0, 1)] == [40, 40]
    assert mgr.decode_step(buffers, [1, 0], [5, 6]).tolist() == [1, 1]
    assert buffers.seq_ids[:2].tolist() == [1, 0] and buffers.num_tokens == 2
    with pytest.raises(pc.StepError, match="in flight"):
        mgr.decode_step(pc.PlanBuffers(), [0], [1])  # the step in flight is not in these
    mgr.check_invariants()


def test_decode_step_commits_the_held_step_after_a_refused_build() -> None:
    """Buffers hold step 1 in flight; a second build into them is refused (a plan is in
    flight). `decode_step` with the same buffers still commits step 1, the step they hold
    (found by the API fuzzer: the refused build had dropped the plan the buffers refill,
    and with it the identity the core decides the commit from)."""
    mgr = pc.CacheManager(paged_config(num_blocks=16, unit=4, block_size=4))
    buffers = pc.PlanBuffers(rows=1)
    mgr.add(1, list(range(10)))
    mgr.schedule(1, 10)
    step = mgr.build_plan_into(buffers)
    with pytest.raises(pc.StepError, match=f"plan of step {step} is in flight"):
        mgr.build_plan_into(buffers)
    assert buffers.step_id == step and mgr.plan_in_flight == step
    assert mgr.decode_step(buffers, [], []).tolist() == []
    assert mgr.plan_in_flight == buffers.step_id == step + 1 and mgr.num_computed(1) == 10
    assert mgr.decode_step(buffers, [1], [7]).tolist() == [1]
    assert mgr.num_tokens(1) == 11 and buffers.seq_ids[:1].tolist() == [1]
    mgr.commit(buffers)
    mgr.check_invariants()


def test_buffers_follow_a_manager_with_other_groups() -> None:
    """One `PlanBuffers` used by managers whose groups differ (kinds, not just ids): the parts
    are laid out again, and every value is still the plan's."""
    two_paged = pc.CacheConfig(
        pools=[pc.PoolConfig(num_blocks=128)],
        groups=[
            pc.FullAttention(block_size=16, pool=0),
            pc.SlidingWindow(block_size=16, window=32, pool=0),
        ],
        hash=pc.HashConfig(unit=16),
    )
    buffers = pc.PlanBuffers(rows=2)
    for config in (hybrid_config(), two_paged, hybrid_config()):
        twins = [pc.CacheManager(config) for _ in range(2)]
        for mgr in twins:
            mgr.add(1, list(range(70)))
            mgr.schedule(1, 70)
        plan = twins[0].build_plan()
        generation = buffers.generation
        twins[1].build_plan_into(buffers)
        assert buffers.generation > generation  # other parts: the engine must refresh
        assert_same_plan(plan, buffers)
        assert len(buffers.paged) == len(plan.paged) and len(buffers.state) == len(plan.state)
        twins[1].commit(buffers)


def test_buffers_holding_another_managers_step_in_flight_are_refused() -> None:
    """Manager B's build into buffers that hold manager A's step, still in flight, would leave
    A no plan to commit or abort it by: B refuses them, and A goes on."""
    a, b = pc.CacheManager(paged_config()), pc.CacheManager(paged_config())
    for mgr in (a, b):
        mgr.add(1, list(range(40)))
        mgr.schedule(1, 32)
    buffers = pc.PlanBuffers()
    step = a.build_plan_into(buffers)
    held = rf"hold step {step} of another CacheManager \(the one with id\(\) {id(a)}\)"
    for call in (
        lambda: b.build_plan_into(buffers),
        lambda: b.decode_step(buffers, [1], [7]),
    ):
        with pytest.raises(pc.StepError, match=rf"{held}.*abort_step\({step}\)"):
            call()
    assert buffers.step_id == step and b.plan_in_flight is None and b.num_tokens(1) == 40
    a.commit(buffers)  # A's step is still there to commit
    assert a.num_computed(1) == 32
    run_prompt(a, 2, list(range(100, 140)))  # and A serves further steps
    # A committed: B may take the buffers over, and A in turn refuses them.
    b_step = b.build_plan_into(buffers)
    assert buffers.step_id == b_step and buffers.seq_ids[:1].tolist() == [1]
    a.append(1, [5])
    a.schedule(1, 100)
    with pytest.raises(pc.StepError, match=rf"step {b_step} of another CacheManager"):
        a.build_plan_into(buffers)
    b.commit(buffers)
    a.build_plan_into(buffers)
    a.commit(buffers)
    # Buffers whose manager is gone hold no step anyone can end: any manager takes them.
    c = pc.CacheManager(paged_config())
    c.add(1, list(range(40)))
    c.schedule(1, 40)
    c.build_plan_into(buffers)
    del c
    gc.collect()
    b.append(1, [6])
    b.schedule(1, 100)
    b.build_plan_into(buffers)
    b.commit(buffers)
    for mgr in (a, b):
        mgr.check_invariants()


def test_a_step_is_ended_by_its_id_when_its_plan_is_gone() -> None:
    """`abort_step` / `commit_step`: the step in flight (`plan_in_flight`) ended without its
    plan object, for buffers that were dropped or overwritten."""
    mgr = pc.CacheManager(hybrid_config())
    mgr.add(1, list(range(40)))
    mgr.schedule(1, 40)
    mgr.build_plan_into(pc.PlanBuffers())  # the buffers are dropped at once
    step = mgr.plan_in_flight
    assert step is not None
    with pytest.raises(pc.StepError, match=f"plan of step {step} is in flight"):
        mgr.finish(1)
    with pytest.raises(pc.StalePlanError, match=f"step {step} is in flight"):
        mgr.abort_step(step + 1)
    with pytest.raises(pc.InvalidRequestError, match="step_id must be in"):
        mgr.abort_step(-1)
    with pytest.raises(TypeError, match="step_id must be an int"):
        mgr.commit_step("1")  # type: ignore[arg-type]
    mgr.abort_step(step)
    assert mgr.plan_in_flight is None and mgr.num_computed(1) == 0
    with pytest.raises(pc.StalePlanError, match="cannot abort it again"):
        mgr.abort_step(step)
    mgr.schedule(1, 40)
    plan = mgr.build_plan()
    mgr.commit_step(plan.step_id)
    assert mgr.num_computed(1) == 40 and mgr.stats().commits == 1
    with pytest.raises(pc.StalePlanError, match="already committed"):
        mgr.commit(plan)
    mgr.finish(1)
    mgr.check_invariants()


def _strided(array: np.ndarray) -> None:
    with warnings.catch_warnings():  # setting strides is deprecated (NumPy 2.4), not gone
        warnings.simplefilter("ignore", DeprecationWarning)
        array.strides = (0,)


# An array of the buffers changed in place from Python, and what the next build says.
IN_PLACE_CHANGES: list[tuple[str, Callable[[pc.PlanBuffers], object], str]] = [
    (
        "resized",
        lambda b: b.seq_ids.resize(2, refcheck=False),
        r"PlanBuffers\.seq_ids was resized or reshaped to shape \(2,\) \(it is \(4,\)\)",
    ),
    (
        "reshaped",
        lambda b: setattr(b.paged[0].appended, "shape", (6, 2)),
        r"PagedGroupBuffers\.appended was resized or reshaped to shape \(6, 2\) "
        r"\(it is \(4, 3\)\)",
    ),
    (
        "retyped",
        lambda b: setattr(b.num_computed, "dtype", np.int16),
        r"PlanBuffers\.num_computed had its dtype changed to int16 \(it is int32\)",
    ),
    (
        "strided",
        lambda b: _strided(b.query_start_loc),
        r"PlanBuffers\.query_start_loc is no longer C-contiguous",
    ),
    (
        "read-only",
        lambda b: setattr(b.num_scheduled.flags, "writeable", False),
        r"PlanBuffers\.num_scheduled was made read-only",
    ),
]


@pytest.mark.parametrize(
    ("change", "message"),
    [(c, m) for _, c, m in IN_PLACE_CHANGES],
    ids=[n for n, _, _ in IN_PLACE_CHANGES],
)
def test_an_array_changed_in_place_is_refused_with_what_happened(
    change: Callable[[pc.PlanBuffers], object], message: str
) -> None:
    mgr = pc.CacheManager(paged_config())
    buffers = pc.PlanBuffers(rows=4)
    mgr.add(1, list(range(40)))
    mgr.schedule(1, 40)
    mgr.build_plan_into(buffers)
    mgr.commit(buffers)
    change(buffers)
    mgr.add(2, list(range(100, 140)))
    mgr.schedule(2, 40)
    with pytest.raises(pc.InvalidRequestError, match=message) as error:
        mgr.build_plan_into(buffers)
    assert "do not resize, reshape, retype" in str(error.value)
    assert "create a new PlanBuffers" in str(error.value)
    # The engine never got the plan: it was taken out of flight again, and new buffers serve.
    assert mgr.plan_in_flight is None and mgr.num_computed(2) == 0
    fresh = pc.PlanBuffers(rows=4)
    mgr.schedule(2, 40)
    mgr.build_plan_into(fresh)
    assert fresh.seq_ids[:1].tolist() == [2]
    mgr.commit(fresh)
    assert mgr.num_computed(2) == 40
    mgr.check_invariants()


def test_both_plan_representations_have_every_member_of_the_protocol() -> None:
    """`StepPlanLike` (and its group parts) is what a kernel layer may read of a step: every
    member exists on `StepPlan` and on `PlanBuffers` with the same meaning, including the
    counts a `StepPlan` could leave to `len` (`num_copies`, `num_appended`, ...)."""
    assert members(pc.StepPlanLike) >= {
        "step_id", "num_rows", "num_tokens", "num_copies", "counts", "seq_ids",
        "query_start_loc", "num_computed", "num_scheduled", "copies", "paged", "state",
        "paged_group", "state_group",
    }  # fmt: skip
    assert members(pc.PagedGroupPlanLike) == {
        "group", "num_appended", "num_replaced", "appended", "replaced", "slot_mapping",
    }  # fmt: skip
    assert members(pc.StateGroupPlanLike) == {
        "group", "max_checkpoints", "num_snapshots", "running_slot", "initial_slot",
        "checkpoint_offsets", "checkpoint_slots", "snapshots",
    }  # fmt: skip
    for protocol, classes in (
        (pc.StepPlanLike, (pc.StepPlan, pc.PlanBuffers)),
        (pc.PagedGroupPlanLike, (pc.PagedGroupPlan, pc.PagedGroupBuffers)),
        (pc.StateGroupPlanLike, (pc.StateGroupPlan, pc.StateGroupBuffers)),
    ):
        for cls in classes:
            missing = {name for name in members(protocol) if not hasattr(cls, name)}
            assert not missing, (cls.__name__, missing)
    # One step of every kind of part, with copies, checkpoints and snapshots, read both ways.
    twins = [pc.CacheManager(hybrid_config(max_checkpoints_per_step=2)) for _ in range(2)]
    buffers = pc.PlanBuffers(rows=1)
    for mgr in twins:
        run_prompt(mgr, 1, list(range(90)))  # cached: the next prompt hits inside a block
        mgr.add(2, [*range(90), 5, 6, 7])
        mgr.add(3, list(range(1000, 1100)))
        # Sequence 3's chunk ends on its tail (96, a snapshot) with a checkpoint inside (32).
        assert mgr.schedule_tokens([2, 3], [100, 96]).tolist() == [13, 96]
        mgr.request_checkpoint(3, 32)
    plan = twins[0].build_plan()
    twins[1].build_plan_into(buffers)
    values = step_values(plan)
    assert values == step_values(buffers)
    counts = plan.counts
    assert counts[:3] == (2, plan.num_tokens, 1)  # the hit inside a block is copied on write
    assert buffers.num_copies == plan.num_copies == len(plan.copies) == 1
    (paged,), (state,) = plan.paged, plan.state
    assert (paged.num_appended, paged.num_replaced) == (len(paged.appended), len(paged.replaced))
    assert state.max_checkpoints == state.checkpoint_offsets.shape[1] >= 1
    assert state.num_snapshots == len(state.snapshots) >= 1
    assert buffers.paged_group(0) is buffers.paged[0]
    assert buffers.state_group(1) is buffers.state[0]
    for step in (plan, buffers):
        with pytest.raises(ValueError, match=r"group 1 is not a paged group of this plan"):
            step.paged_group(1)
        with pytest.raises(ValueError, match=r"group 0 is not a state group of this plan"):
            step.state_group(0)
    with pytest.raises(ValueError, match=r"group 0 is not a paged group .*paged groups: \[\]"):
        pc.PlanBuffers().paged_group(0)
    twins[0].commit(plan)
    twins[1].commit(buffers)
