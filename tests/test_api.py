"""The public Python API: configuration, the step protocol, hits, plans, events and statistics."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import numpy as np
import prefixcache as pc
import pytest
import torch
from conftest import hybrid_config, paged_config, run_prompt


def test_every_public_name_is_exported_and_documented() -> None:
    for name in pc.__all__:
        obj = getattr(pc, name)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue  # constants and type aliases (documented where they are defined)
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
    for cls in (pc.CacheManager, pc.StepPlan, pc.Hit, pc.Stats, pc.GroupStats):
        for attr, member in inspect.getmembers(cls):
            if not attr.startswith("_"):
                assert (member.__doc__ or "").strip(), f"{cls.__name__}.{attr} has no docstring"
    assert set(pc.__all__) >= {
        "CacheManager",
        "CacheConfig",
        "PoolConfig",
        "FullAttention",
        "SlidingWindow",
        "StateGroup",
        "Retention",
        "HashConfig",
        "ExtraKeys",
        "hash_prefix",
        "PrefixCacheError",
    }


def test_the_limits_are_exported_as_the_bindings_enforce_them() -> None:
    limits = [name for name in pc.__all__ if name.startswith("MAX_")]
    assert set(limits) >= {
        "MAX_BATCH_SEQUENCES",
        "MAX_BLOCKS_PER_POOL",
        "MAX_BLOCK_SIZE",
        "MAX_GROUPS",
        "MAX_HASH_UNIT",
        "MAX_LOOKAHEAD_TOKENS",
        "MAX_POOLS",
        "MAX_SEQUENCE_TOKENS",
        "MAX_STEPS_IN_FLIGHT",
    }
    for name in limits:
        value = getattr(pc, name)
        assert type(value) is int and value > 0 and value == getattr(pc._core, name), name
    # Positions and ids are int32 / int64 in plans: the bounds fit them.
    assert pc.MAX_SEQUENCE_TOKENS <= 2**31 - 1 and pc.MAX_BLOCKS_PER_POOL <= 2**31 - 1
    with pytest.raises(
        pc.InvalidRequestError, match=rf"rows must be in 1\.\.={pc.MAX_BATCH_SEQUENCES}"
    ):
        pc.PlanBuffers(rows=pc.MAX_BATCH_SEQUENCES + 1)


def test_config_is_frozen_and_stores_tuples() -> None:
    cfg = paged_config()
    assert isinstance(cfg.pools, tuple) and isinstance(cfg.groups, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hash = pc.HashConfig()  # type: ignore[misc]
    assert dataclasses.replace(cfg, enable_events=False).enable_events is False


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    assert field.default_factory is not dataclasses.MISSING, field.name
    made = field.default_factory()
    return dataclasses.asdict(made) if dataclasses.is_dataclass(made) else made


def test_every_dataclass_default_is_the_cores() -> None:
    """Each configuration default is the core's (`CacheConfig::default()`, ...): a literal
    default written in Python that differs, a default the core has and the dataclass lacks
    (or the reverse) fails here."""
    core = pc._core.defaults()
    expected: dict[type, dict[str, Any]] = {
        pc.CacheConfig: {**core["cache"], "hash": core["hash"]},
        pc.HashConfig: dict(core["hash"]),
        pc.StateGroup: dict(core["state_group"]),
        pc.Retention: dict(core["retention"]),
        # No defaults in the core either: the pool's size and a paged group's geometry are
        # always given.
        pc.PoolConfig: {},
        pc.FullAttention: {},
        pc.SlidingWindow: {},
    }
    # `pool` is the one default of Python's alone: the core's `GroupConfig` has no default
    # (a group always names its pool there); 0 is the first pool.
    python_only = {"pool": 0}
    for cls, table in expected.items():
        defaults = {
            f.name: _default_of(f)
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        }
        for name, value in python_only.items():
            if name in defaults:
                assert defaults.pop(name) == value, (cls.__name__, name)
        assert defaults == table, cls.__name__
    # The ways a default reaches a caller besides the dataclasses' fields.
    assert pc.StateGroup().retention == pc.Retention(**core["state_group"]["retention"])
    backend = inspect.signature(pc.StateGroup.from_backend).parameters
    for name in ("checkpoint_cap", "reserve_per_sequence"):
        assert backend[name].default == core["state_group"][name], name
    hashing = inspect.signature(pc.hash_prefix).parameters
    for name in ("unit", "algorithm", "seed"):
        assert hashing[name].default == core["hash"][name], name
    assert pc.hash_prefix(list(range(64))) == pc.hash_prefix(
        list(range(64)), **{k: core["hash"][k] for k in ("unit", "algorithm", "seed")}
    )
    # A fresh dict each call: changing one changes no later default.
    core["cache"]["enable_events"] = not core["cache"]["enable_events"]
    assert pc._core.defaults() != core


def test_state_group_from_backend_reads_alignment_and_capacity() -> None:
    class Backend:
        checkpoint_alignment = 64
        max_checkpoints_per_step = 3

    group = pc.StateGroup.from_backend(Backend(), pool=1, checkpoint_cap=10)
    assert (group.alignment, group.max_checkpoints_per_step, group.pool) == (64, 3, 1)
    assert group.checkpoint_cap == 10 and group.retention == pc.Retention()
    cfg = pc.CacheConfig(
        pools=[pc.PoolConfig(64), pc.PoolConfig(64)],
        groups=[pc.FullAttention(64), group],
        hash=pc.HashConfig(unit=64),
    )
    assert pc.CacheManager(cfg).chunk_alignment == 64


def test_state_group_from_a_kernel_backend() -> None:
    kernels = pytest.importorskip("prefixcache.kernels")
    backend = kernels.TorchBackend(checkpoint_alignment=16)
    group = pc.StateGroup.from_backend(backend, pool=1)
    assert group.alignment == 16
    assert group.max_checkpoints_per_step == backend.max_checkpoints_per_step


def test_manager_keeps_its_config() -> None:
    cfg = hybrid_config()
    mgr = pc.CacheManager(cfg)
    assert mgr.config is cfg
    assert mgr.chunk_alignment == 16
    assert "CacheManager" in repr(mgr)


def test_resend_hits_the_last_unit_boundary() -> None:
    mgr = pc.CacheManager(paged_config())
    prompt = list(range(100))
    assert run_prompt(mgr, 1, prompt) == 0
    assert run_prompt(mgr, 2, prompt) == 96
    assert mgr.num_sequences == 0
    mgr.add(3, prompt[:50])
    hit = mgr.lookup(3)
    assert (hit.tokens, hit.max_tokens, hit.junction) == (48, 48, None)
    assert hit.groups == [hit.groups[0]] and hit.groups[0].stop is None


def test_hybrid_hit_reports_each_group_and_why_it_stops() -> None:
    mgr = pc.CacheManager(hybrid_config())
    prompt = list(range(100))
    run_prompt(mgr, 1, prompt)
    mgr.add(2, [*prompt, 7, 7, 7, 7])  # longer: the tail checkpoint at 96 is a hit
    hit = mgr.lookup(2)
    assert hit.tokens == 96
    mgr.add(3, prompt[:70])  # shorter: attention reaches 64, no state was saved there
    hit = mgr.lookup(3)
    assert hit.tokens == 0 and hit.max_tokens == 64
    attention, state = hit.groups
    assert (attention.group, attention.tokens, attention.stop) == (0, 64, None)
    assert (state.group, state.tokens, state.stop) == (1, 0, "no_state_at_position")
    assert hit.junction == 64


def test_schedule_caps_at_what_is_left_and_trims_to_the_chunk_grid() -> None:
    mgr = pc.CacheManager(hybrid_config())
    mgr.add(1, list(range(100)))
    first = mgr.schedule(1, 40)
    assert first is not None and (first.num_computed, first.num_tokens) == (0, 32)
    assert first.hit is not None and first.hit.tokens == 0
    mgr.commit(mgr.build_plan())
    rest = mgr.schedule(1, 1000)
    assert rest is not None and (rest.num_computed, rest.num_tokens, rest.hit) == (32, 68, None)
    mgr.commit(mgr.build_plan())
    assert mgr.num_computed(1) == mgr.num_tokens(1) == 100


def test_budget_below_the_grid_schedules_zero_tokens_not_none() -> None:
    mgr = pc.CacheManager(hybrid_config())
    mgr.add(1, list(range(100)))
    scheduled = mgr.schedule(1, 8)
    assert scheduled is not None and scheduled.num_tokens == 0
    exact = mgr.schedule(1, 8, exact=True)
    assert exact is not None and exact.num_tokens == 8


def test_running_out_of_blocks_is_none_and_changes_nothing() -> None:
    mgr = pc.CacheManager(paged_config(num_blocks=4))  # 3 usable blocks of 32 tokens
    mgr.add(1, list(range(200)))
    before = mgr.pool_usage()
    assert mgr.schedule(1, 200) is None
    assert mgr.pool_usage() == before
    assert mgr.stats().refused_schedules == 1
    assert mgr.schedule(1, 96) is not None
    mgr.check_invariants()


def test_schedule_batch_takes_arrays_or_a_scalar_budget() -> None:
    mgr = pc.CacheManager(paged_config())
    for seq in range(4):
        mgr.add(seq, [seq] * 40)
    out = mgr.schedule_batch(np.array([0, 1], dtype=np.int64), 16)
    assert [s.num_tokens if s else None for s in out] == [16, 16]
    out = mgr.schedule_batch([2, 3], np.array([8, 40], dtype=np.uint32))
    assert [(s.seq_id, s.num_tokens) if s else None for s in out] == [(2, 8), (3, 40)]
    mgr.add(4, [4] * 40)
    (last,) = mgr.schedule_batch(torch.tensor([4]), np.int32(24))
    assert last is not None and last.num_tokens == 24
    plan = mgr.build_plan()
    assert plan.seq_ids.tolist() == [0, 1, 2, 3, 4]
    assert plan.num_scheduled.tolist() == [16, 16, 8, 40, 24]
    assert plan.query_start_loc.tolist() == [0, 16, 32, 40, 80, 104]
    mgr.commit(plan)


def test_schedule_tokens_is_schedule_batch_without_objects() -> None:
    twins = [pc.CacheManager(paged_config(num_blocks=12, block_size=16)) for _ in range(2)]
    for mgr in twins:
        for seq in range(3):
            mgr.add(seq, [seq] * 40)
        mgr.add(3, [3] * 200)
    batch, tokens = twins
    budgets = np.array([16, 40, 3], dtype=np.uint32)
    objects = batch.schedule_batch([0, 1, 2], budgets)
    counts = tokens.schedule_tokens([0, 1, 2], budgets)
    assert counts.dtype == np.int32 and counts.shape == (3,)
    assert counts.tolist() == [s.num_tokens if s else -1 for s in objects] == [16, 40, 3]
    plan = tokens.build_plan()
    assert plan.num_scheduled.tolist() == [16, 40, 3]
    tokens.commit(plan)
    # 11 usable blocks, 5 held: sequence 3 needs 8 for 128 tokens and gets nothing (nothing
    # changes for it); sequence 0 gets its last 24 tokens in 2 more blocks.
    free = tokens.pool_usage()[0].free
    assert tokens.schedule_tokens([3, 0], 128).tolist() == [-1, 24]
    assert tokens.pool_usage()[0].free == free - 2
    assert tokens.stats().refused_schedules == 1
    tokens.commit(tokens.build_plan())
    assert tokens.schedule_tokens([], 16).shape == (0,)
    tokens.check_invariants()


def test_decode_loop_with_batch_entry_points() -> None:
    mgr = pc.CacheManager(hybrid_config())
    ids = np.arange(8, dtype=np.int64)
    for seq in ids.tolist():
        mgr.add(seq, list(range(seq, seq + 20)))
    mgr.schedule_batch(ids, 1000)
    mgr.commit(mgr.build_plan())
    for step in range(20):
        mgr.append_batch(ids, np.full(8, step, dtype=np.int32))
        out = mgr.schedule_batch(ids, 1)
        assert all(s is not None and s.num_tokens == 1 for s in out)
        plan = mgr.build_plan()
        assert plan.num_tokens == 8 and plan.num_rows == 8
        assert plan.num_computed.tolist() == [20 + step] * 8
        mgr.commit(plan)
    assert [mgr.num_tokens(s) for s in ids.tolist()] == [40] * 8
    mgr.check_invariants()
    for seq in ids.tolist():
        mgr.finish(seq)
    assert mgr.num_sequences == 0 and mgr.num_finished_cached == 8


def test_plan_arrays_have_the_documented_shapes_and_dtypes() -> None:
    mgr = pc.CacheManager(hybrid_config(max_checkpoints_per_step=2))
    mgr.add(1, list(range(100)))
    mgr.add(2, list(range(50)))
    mgr.schedule(1, 1000)
    mgr.schedule(2, 1000)
    plan = mgr.build_plan()
    assert plan.step_id >= 1 and mgr.plan_in_flight == plan.step_id
    assert plan.seq_ids.dtype == np.int64 and plan.seq_ids.shape == (2,)
    assert plan.query_start_loc.dtype == np.int32 and plan.query_start_loc.shape == (3,)
    assert plan.num_computed.dtype == np.int32 and plan.num_scheduled.dtype == np.int32
    assert plan.copies.dtype == np.int64 and plan.copies.shape == (0, 4)
    (paged,) = plan.paged
    assert paged is not None and paged.group == 0
    assert plan.paged_group(0).group == 0
    assert paged.appended.dtype == np.int32 and paged.appended.shape == (4 + 2, 3)
    assert paged.replaced.shape == (0, 3)
    assert paged.slot_mapping.dtype == np.int64 and paged.slot_mapping.shape == (150,)
    state = plan.state_group(1)
    assert state.running_slot.shape == (2,) and state.initial_slot.tolist() == [-1, -1]
    assert (state.running_slot != state.initial_slot).all()
    assert state.checkpoint_offsets.dtype == np.int32
    assert state.checkpoint_offsets.shape == state.checkpoint_slots.shape
    assert state.checkpoint_offsets.shape[0] == 2
    assert state.snapshots.shape[1] == 2
    # Tail checkpoints at 96 (interior of [0, 100)) and 48 (interior of [0, 50)).
    assert sorted(state.checkpoint_offsets[:, 0].tolist()) == [48, 96]
    with pytest.raises(ValueError, match="not a paged group"):
        plan.paged_group(1)
    with pytest.raises(ValueError, match="not a state group"):
        plan.state_group(0)
    mgr.commit(plan)
    assert mgr.plan_in_flight is None


def test_slot_mapping_and_block_table_agree() -> None:
    mgr = pc.CacheManager(paged_config(block_size=32))
    mgr.add(5, list(range(70)))
    mgr.schedule(5, 70)
    plan = mgr.build_plan()
    table = mgr.block_table(0, [5])
    assert table.dtype == np.int32 and table.shape == (1, 3)
    appended = plan.paged[0].appended
    assert appended[:, 2].tolist() == table[0].tolist()
    slots = plan.paged[0].slot_mapping
    expected = [int(table[0, t // 32]) * 32 + t % 32 for t in range(70)]
    assert slots.tolist() == expected
    mgr.commit(plan)


def test_copy_on_write_copy_for_a_partial_block_hit() -> None:
    mgr = pc.CacheManager(paged_config(block_size=32, unit=16))
    run_prompt(mgr, 1, list(range(100)))
    mgr.add(2, [*range(48), 999, 999, 999])  # hits 48 = one full block + 16 tokens
    scheduled = mgr.schedule(2, 100)
    assert scheduled is not None and scheduled.num_computed == 48
    plan = mgr.build_plan()
    assert plan.copies.shape == (1, 4)
    group, src, dst, tokens = plan.copies[0].tolist()
    assert (group, tokens) == (0, 16) and src != dst
    mgr.abort(plan)
    assert mgr.num_computed(2) == 0 and mgr.stats().aborts == 1
    mgr.check_invariants()


def test_abort_returns_sequences_to_their_pre_step_position() -> None:
    mgr = pc.CacheManager(hybrid_config())
    mgr.add(1, list(range(64)))
    mgr.schedule(1, 32)
    mgr.commit(mgr.build_plan())
    usage = mgr.pool_usage()
    mgr.schedule(1, 32)
    mgr.abort(mgr.build_plan())
    assert mgr.num_computed(1) == 32
    assert mgr.pool_usage() == usage
    mgr.check_invariants()


def test_preempt_then_reschedule_restarts_from_a_lookup() -> None:
    mgr = pc.CacheManager(paged_config())
    run_prompt(mgr, 1, list(range(64)))
    mgr.add(2, list(range(80)))
    mgr.schedule(2, 80)
    mgr.commit(mgr.build_plan())
    mgr.preempt(2)
    assert mgr.num_computed(2) == 0
    again = mgr.schedule(2, 80)
    assert again is not None and again.num_computed == 64  # its own keys from before
    mgr.commit(mgr.build_plan())
    mgr.check_invariants()


def test_extends_reuses_the_hashes_of_the_common_prefix() -> None:
    mgr = pc.CacheManager(paged_config(unit=16))
    turn1 = list(range(100))
    assert mgr.add(1, turn1).hashed_units == 6
    run_prompt(mgr, 2, turn1)
    mgr.finish(1)
    turn2 = [*turn1, 5, 6, 7, 8, 9]
    added = mgr.add(3, turn2, extends=1)
    assert added.extends_found and added.reused_tokens == 96 and added.hashed_units == 0
    missing = mgr.add(5, turn2, extends=12345)
    assert not missing.extends_found and missing.reused_tokens == 0


@pytest.mark.parametrize("reuse", [True, False])
def test_an_add_without_extends_reuses_the_prefix_of_a_live_sequence(reuse: bool) -> None:
    config = dataclasses.replace(paged_config(unit=16), reuse_live_prefixes=reuse)
    mgr = pc.CacheManager(config)
    system = list(range(64))
    mgr.add(1, [*system, *range(1000, 1040)])
    second = [*system, *range(2000, 2050)]
    added = mgr.add(2, np.asarray(second, dtype=np.uint32))
    # The 64 system tokens (4 units) come from sequence 1 when reuse is on.
    assert (added.reused_tokens, added.hashed_units, added.extends_found) == (
        (64, 3, False) if reuse else (0, 7, False)
    )
    # What sequence 2 publishes is keyed by the real digests of its tokens.
    mgr.drain_events()
    mgr.schedule(2, len(second))
    mgr.commit(mgr.build_plan())
    published = [key for e in mgr.drain_events() if isinstance(e, pc.BlockStored) for key in e.keys]
    assert published == pc.hash_prefix(second, unit=16)
    mgr.finish(1)
    mgr.finish(2)
    # Finished sequences are not live: nothing is reused without `extends` any more.
    assert mgr.add(3, second).reused_tokens == 0


@pytest.mark.parametrize(
    "as_input",
    [
        list,
        lambda t: np.asarray(t, dtype=np.uint32),
        lambda t: np.repeat(np.asarray(t, dtype=np.uint32), 2)[::2],  # strided
        lambda t: np.asarray(t, dtype=np.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
    ],
    ids=["list", "uint32", "uint32-strided", "int64", "torch-int32"],
)
def test_extends_gives_the_same_result_for_every_token_input(as_input: Any) -> None:
    def turn_two(tokens: object) -> tuple[pc.Added, int]:
        mgr = pc.CacheManager(paged_config(unit=16))
        turn1 = list(range(100))
        run_prompt(mgr, 1, turn1)  # computed, published and finished
        added = mgr.add(2, tokens, extends=1)  # type: ignore[arg-type]
        hit = mgr.lookup(2).tokens
        mgr.check_invariants()
        return added, hit

    turn2 = [*range(100), 5, 6, 7, 8, 9, 1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008]
    expected, expected_hit = turn_two(turn2)
    got, hit = turn_two(as_input(turn2))
    assert (got.extends_found, got.reused_tokens, got.hashed_units) == (
        expected.extends_found,
        expected.reused_tokens,
        expected.hashed_units,
    )
    assert got.reused_tokens == 96 and got.hashed_units == 1
    assert hit == expected_hit == 96


def test_extra_keys_separate_caches() -> None:
    mgr = pc.CacheManager(paged_config())
    prompt = list(range(64))
    salted = pc.ExtraKeys(cache_salt=b"tenant-a")
    mgr.add(1, prompt, extra_keys=salted)
    mgr.schedule(1, 64)
    mgr.commit(mgr.build_plan())
    mgr.finish(1)
    mgr.add(2, prompt)
    mgr.add(3, prompt, extra_keys=pc.ExtraKeys(cache_salt="tenant-a"))
    mgr.add(4, prompt, extra_keys=pc.ExtraKeys(lora_id=3))
    image = pc.MultimodalInput(start=10, end=20, hash=b"img")
    mgr.add(5, prompt, extra_keys=pc.ExtraKeys(cache_salt=b"tenant-a", multimodal=[image]))
    assert [mgr.lookup(s).tokens for s in (2, 3, 4, 5)] == [0, 48, 0, 0]


def test_request_checkpoint_and_suggest_chunk() -> None:
    mgr = pc.CacheManager(hybrid_config(max_checkpoints_per_step=0))
    mgr.add(1, list(range(200)))
    # C = 0: the chunk should end on the tail position 192 when the budget reaches it.
    assert mgr.suggest_chunk(1, 1000) == 192
    assert mgr.suggest_chunk(1, 100) == 100
    mgr.schedule(1, 64)
    mgr.request_checkpoint(1, 64)  # the chunk end: a snapshot
    with pytest.raises(pc.AlignmentError, match="nearest valid"):
        mgr.request_checkpoint(1, 40)
    plan = mgr.build_plan()
    assert plan.state[0].snapshots.shape == (1, 2)
    mgr.commit(plan)
    assert mgr.stats().groups[1].checkpoints_published == 1


def test_events_carry_keys_that_match_hash_prefix() -> None:
    mgr = pc.CacheManager(paged_config(block_size=32, unit=16))
    prompt = list(range(64))
    run_prompt(mgr, 1, prompt, finish=False)
    events = mgr.drain_events()
    assert all(isinstance(e, pc.BlockStored) for e in events)
    assert [e.sequence for e in events] == sorted(e.sequence for e in events)
    keys = [k for e in events for k in e.keys]
    assert keys == pc.hash_prefix(prompt, unit=16)
    # One run for the commit, across both blocks: a block per key, the run's token ids.
    (run,) = events
    assert (run.token_start, run.token_end, run.parent, run.checkpoint) == (0, 64, None, False)
    table = mgr.block_table(0, [1])[0].tolist()
    assert run.blocks == [table[0], table[0], table[1], table[1]] and run.block == table[0]
    assert (run.tokens, run.tokens_start, run.lora_id, run.cache_salt) == (prompt, 0, None, None)
    mgr.finish(1)
    assert mgr.drain_events() == []
    mgr.reset()
    (cleared,) = mgr.drain_events()
    assert isinstance(cleared, pc.AllBlocksCleared) and cleared.sequence > run.sequence


def test_eviction_is_reported_as_block_removed() -> None:
    mgr = pc.CacheManager(paged_config(num_blocks=3, block_size=32))
    run_prompt(mgr, 1, list(range(64)))
    run_prompt(mgr, 2, list(range(1000, 1064)))
    removed = [e for e in mgr.drain_events() if isinstance(e, pc.BlockRemoved)]
    assert removed and all(len(e.keys) == 2 and e.group == 0 for e in removed)
    # No other block carries their keys: every key leaves the wire's view.
    assert all(e.gone == e.keys for e in removed)
    assert mgr.stats().evictions == len(removed)


def test_events_can_be_disabled() -> None:
    cfg = dataclasses.replace(paged_config(), enable_events=False)
    mgr = pc.CacheManager(cfg)
    run_prompt(mgr, 1, list(range(64)))
    assert mgr.drain_events() == []


def test_stats_and_pool_usage() -> None:
    mgr = pc.CacheManager(hybrid_config(num_blocks=64, state_blocks=16))
    run_prompt(mgr, 1, list(range(100)))
    run_prompt(mgr, 2, list(range(100)))
    stats = mgr.stats()
    assert stats.admissions == 2 and stats.commits == 2 and stats.admitted_hit_tokens == 96
    _attention, state = stats.groups
    assert state.checkpoints_published == 1 and state.checkpoint_hits == 1
    assert set(state.checkpoints_skipped) == {
        "unaligned",
        "capacity",
        "already_cached",
        "budget",
        "mid_step",
    }
    assert sum(state.checkpoints_skipped.values()) == 0
    assert stats.to_dict()["groups"][1]["checkpoint_hits"] == 1
    assert "Stats(" in repr(stats)
    usage = mgr.pool_usage()
    assert [u.num_blocks for u in usage] == [64, 16]
    for u in usage:
        assert u.free + u.cached + u.owned == u.num_blocks - 1
        assert u.to_dict()["num_blocks"] == u.num_blocks
    assert usage[1].checkpoints == 1


def test_reset_refuses_while_sequences_hold_blocks() -> None:
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, list(range(64)))
    mgr.schedule(1, 64)
    mgr.commit(mgr.build_plan())
    with pytest.raises(pc.ResetRefusedError, match="finish or preempt"):
        mgr.reset()
    mgr.finish(1)
    mgr.reset()
    mgr.add(2, list(range(64)))
    assert mgr.lookup(2).tokens == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t,
        tuple,
        range,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: np.array(t, dtype=np.int64)[::-1][::-1],
        lambda t: np.array([t, t], dtype=np.int64)[0],
        lambda t: np.array([t, t], dtype=np.int64).T[:, 1],  # strided
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
        lambda t: [np.int64(x) for x in t],
    ],
)
def test_token_inputs_of_every_supported_kind_agree(make: object) -> None:
    tokens = list(range(40))
    as_input = range(40) if make is range else make(tokens)  # type: ignore[operator]
    assert pc.hash_prefix(as_input) == pc.hash_prefix(tokens)
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, as_input)
    assert mgr.num_tokens(1) == 40
    mgr.append(1, as_input)
    assert mgr.num_tokens(1) == 80


@pytest.mark.parametrize("length", [40, 1024, 1025, 3000])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint64, np.uint16, np.int8])
@pytest.mark.parametrize("strided", [False, True])
def test_arrays_short_and_long_read_alike(length: int, dtype: type, strided: bool) -> None:
    # Arrays up to 1,024 entries are copied out, longer ones read in place: same tokens, and
    # the same check of every entry (the last one here).
    def make(values: np.ndarray) -> np.ndarray:
        return np.repeat(values, 2)[::2] if strided else values

    tokens = [i % 100 for i in range(length)]
    array = make(np.array(tokens, dtype=dtype))
    assert array.flags.c_contiguous != strided
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, array)
    assert mgr.num_tokens(1) == length
    assert pc.hash_prefix(array) == pc.hash_prefix(tokens)
    values = np.array(tokens, dtype=dtype)
    values[-1] = -1 if np.issubdtype(dtype, np.signedinteger) else np.iinfo(dtype).max
    bad = make(values)
    if dtype in (np.uint32, np.uint16):
        return  # every value of these fits a token
    with pytest.raises(pc.InvalidRequestError, match=rf"tokens\[{length - 1}\] is out of range"):
        mgr.add(2, bad)
    with pytest.raises(pc.InvalidRequestError, match=rf"seq_ids\[{length - 1}\] is out of range"):
        mgr.schedule_batch(bad.astype(np.int64) if dtype == np.uint64 else bad, 1)


def test_a_finished_id_can_be_added_again() -> None:
    mgr = pc.CacheManager(paged_config())
    run_prompt(mgr, 1, list(range(64)))
    assert run_prompt(mgr, 1, list(range(64))) == 48


def test_the_checkpoint_offset_rule_is_the_cores() -> None:
    # Values and the edges: A = 1, a query no longer than A, offset 0 and offset == query_len.
    assert pc.is_exportable_offset(16, 16, 64) and pc.is_exportable_offset(48, 16, 64)
    assert not pc.is_exportable_offset(8, 16, 64)
    assert not pc.is_exportable_offset(0, 16, 64)  # the chunk start is no checkpoint
    assert not pc.is_exportable_offset(64, 16, 64)  # the chunk end is a snapshot's job
    assert pc.is_exportable_offset(1, 1, 2) and not pc.is_exportable_offset(2, 1, 2)
    assert not pc.is_exportable_offset(1, 1, 1)
    assert not pc.is_exportable_offset(16, 16, 16)  # query_len == A: nothing inside
    assert not pc.is_exportable_offset(8, 16, 8)  # query_len < A
    assert not pc.is_exportable_offset(16, 0, 64)  # alignment 0 allows none
    assert not pc.is_exportable_offset(-16, 16, 64) and not pc.is_exportable_offset(2**40, 1, 64)
    assert pc.nearest_exportable_offsets(20, 16, 64) == [16, 32]
    assert pc.nearest_exportable_offsets(32, 16, 64) == [32, 48]
    assert pc.nearest_exportable_offsets(0, 16, 64) == [16]
    assert pc.nearest_exportable_offsets(64, 16, 64) == [48]
    assert pc.nearest_exportable_offsets(70, 16, 64) == [48]
    assert pc.nearest_exportable_offsets(-5, 16, 64) == [16]
    assert pc.nearest_exportable_offsets(2**40, 16, 64) == [48]
    assert pc.nearest_exportable_offsets(3, 1, 5) == [3, 4]
    assert pc.nearest_exportable_offsets(0, 1, 1) == []
    assert pc.nearest_exportable_offsets(5, 16, 16) == []
    assert pc.nearest_exportable_offsets(5, 16, 8) == []
    assert pc.nearest_exportable_offsets(5, 0, 64) == []
    # Against a plain statement of the rule, over every small case.
    for a in range(0, 6):
        for q in range(0, 13):
            valid = [o for o in range(1, q) if a and o % a == 0]
            for o in range(-2, q + 3):
                assert pc.is_exportable_offset(o, a, q) == (o in valid), (o, a, q)
                below = [v for v in valid if v <= o][-1:]
                above = [v for v in valid if v > o][:1]
                assert pc.nearest_exportable_offsets(o, a, q) == below + above, (o, a, q)
    with pytest.raises(pc.InvalidRequestError, match="alignment must be in"):
        pc.is_exportable_offset(1, -1, 4)
    with pytest.raises(pc.InvalidRequestError, match="query_len must be in"):
        pc.nearest_exportable_offsets(1, 1, 2**32)
    with pytest.raises(TypeError, match="offset must be an int"):
        pc.is_exportable_offset(1.0, 1, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offset must be an int"):
        pc.is_exportable_offset(True, 1, 4)
    assert pc.is_exportable_offset(np.int64(2), np.uint32(2), 4)


def test_the_request_checkpoint_rule_agrees_with_the_offset_rule() -> None:
    """A manager accepts a checkpoint inside a chunk exactly where `is_exportable_offset`
    says the kernel can write it (on the unit grid), and names the nearest such offsets."""
    unit, alignment = 16, 16
    mgr = pc.CacheManager(hybrid_config(unit=unit, alignment=alignment))
    mgr.add(1, list(range(200)))
    mgr.schedule(1, 100, exact=True)  # a chunk [0, 100)
    for position in range(unit, 100, unit):
        assert pc.is_exportable_offset(position, alignment, 100)
        mgr.request_checkpoint(1, position)
    with pytest.raises(pc.AlignmentError, match="16, 32") as error:
        mgr.request_checkpoint(1, 24)
    assert not pc.is_exportable_offset(24, alignment, 100)
    assert pc.nearest_exportable_offsets(24, alignment, 100) == [16, 32]
    assert "24" in str(error.value)
    mgr.abort(mgr.build_plan())


def test_aligned_geometry_is_the_cores() -> None:
    assert pc.aligned_geometry(16, 32, 16) == (16, 32)  # already aligned: unchanged
    assert pc.aligned_geometry(8, 96, 64) == (64, 192)
    assert pc.aligned_geometry(128, 1536, 64) == (128, 1536)
    assert pc.aligned_geometry(1, 1, 1) == (1, 1)
    assert pc.aligned_geometry(6, 10, 4) == (12, 60)
    for unit in range(1, 9):
        for block in range(1, 17):
            for a in range(1, 9):
                u, b = pc.aligned_geometry(unit, block, a)
                assert u % unit == 0 and u % a == 0 and b % block == 0 and b % u == 0
                assert u == min(x for x in range(1, unit * a + 1) if x % unit == 0 == x % a)
                assert b == min(x for x in range(u, u * block + 1, u) if x % block == 0)
                # What it returns is a geometry a manager accepts for that alignment.
                pc.CacheConfig(
                    pools=[pc.PoolConfig(4), pc.PoolConfig(8)],
                    groups=[pc.FullAttention(b), pc.StateGroup(alignment=a, pool=1)],
                    hash=pc.HashConfig(unit=u),
                )
    with pytest.raises(pc.ConfigError, match="alignment must be at least 1"):
        pc.aligned_geometry(16, 32, 0)
    with pytest.raises(pc.ConfigError, match="larger than the supported"):
        pc.aligned_geometry(pc.MAX_HASH_UNIT, pc.MAX_HASH_UNIT, 3)
    with pytest.raises(pc.ConfigError, match="unit must be in"):
        pc.aligned_geometry(-1, 32, 16)


def test_config_rules_are_the_cores() -> None:
    paged = paged_config()
    assert paged.chunk_alignment == 1 and paged.min_token_budget == 1
    cfg = pc.CacheConfig(
        pools=[pc.PoolConfig(256), pc.PoolConfig(64)],
        groups=[
            pc.FullAttention(128),
            pc.StateGroup(alignment=16, pool=1),
            pc.StateGroup(alignment=64, pool=1),
            pc.SlidingWindow(64, window=128),
        ],
        hash=pc.HashConfig(unit=64),
    )
    assert cfg.chunk_alignment == pc.CacheManager(cfg).chunk_alignment == 64
    assert cfg.min_token_budget == 64
    # A budget below it schedules nothing of a non-final chunk; at it, one grid step.
    mgr = pc.CacheManager(cfg)
    mgr.add(1, list(range(1000)))
    assert mgr.schedule_tokens([1], cfg.min_token_budget - 1).tolist() == [0]
    assert mgr.schedule_tokens([1], cfg.min_token_budget).tolist() == [64]
    mgr.abort(mgr.build_plan())
    # Full attention: its table (1000 tokens: 8 blocks of 128) and, since a hit may end
    # inside a block (U < B), the copy-on-write source; with U == B, the table alone.
    assert cfg.blocks_for_sequence(0, 1000) == 9
    assert paged_config(unit=32, block_size=32).blocks_for_sequence(0, 1000) == 32
    assert cfg.blocks_for_sequence(0, 0) == 0
    # A sliding window needs fewer blocks when chunks are short.
    assert cfg.blocks_for_sequence(3, 1000, max_chunk=64) < cfg.blocks_for_sequence(3, 1000)
    assert cfg.blocks_for_sequence(1, 1000) >= 2  # two running buffers at least
    with pytest.raises(pc.InvalidRequestError, match="group 4 does not exist"):
        cfg.blocks_for_sequence(4, 10)
    with pytest.raises(pc.InvalidRequestError, match="tokens must be in"):
        cfg.blocks_for_sequence(0, -1)
