"""Error mapping: one Python class per core error variant, under one base, with useful messages."""

from __future__ import annotations

import pickle

import prefixcache as pc
import pytest
from conftest import hybrid_config, paged_config, run_prompt
from prefixcache import _core

# The class each core variant must raise, by `CacheError::kind`. The tests below take the list
# of variants from the core (`_core.ERROR_KINDS`, generated with `kind` from one list in
# rust/core/src/error.rs), so a variant added there without a class here fails them.
EXPECTED = {
    "Config": pc.ConfigError,
    "InvalidRequest": pc.InvalidRequestError,
    "UnknownSequence": pc.UnknownSequenceError,
    "DuplicateSequence": pc.DuplicateSequenceError,
    "NothingToSchedule": pc.NothingToScheduleError,
    "Step": pc.StepError,
    "StalePlan": pc.StalePlanError,
    "Alignment": pc.AlignmentError,
    "ResetRefused": pc.ResetRefusedError,
    "Invariant": pc.InvariantError,
}


def test_every_core_variant_has_its_own_class_in_prefixcache() -> None:
    kinds = _core.ERROR_KINDS
    assert len(kinds) == len(set(kinds)) >= 10
    assert set(kinds) == set(EXPECTED), "map every core variant to a class (errors.rs)"
    public = [getattr(pc, name) for name in pc.__all__]
    classes = [c for c in public if isinstance(c, type) and issubclass(c, pc.PrefixCacheError)]
    for kind in kinds:
        (cls,) = (c for c in classes if c.__dict__.get("kind") == kind)
        assert cls is EXPECTED[kind], kind
    assert len({EXPECTED[kind] for kind in kinds}) == len(kinds)


def test_every_core_variant_maps_to_its_own_class() -> None:
    samples = _core._error_samples()
    assert sorted(kind for kind, _ in samples) == sorted(_core.ERROR_KINDS)
    for kind, error in samples:
        assert type(error) is EXPECTED[kind], kind
        assert error.kind == kind
        assert isinstance(error, pc.PrefixCacheError)
        assert str(error)
    assert len({type(e) for _, e in samples}) == len(_core.ERROR_KINDS)


def test_every_class_the_module_registers_has_a_sample() -> None:
    """A class added for a new core variant without a sample in `_error_samples` (so without
    the mapping test above) fails here."""
    registered = {
        cls.kind: cls
        for cls in vars(_core).values()
        if isinstance(cls, type) and issubclass(cls, pc.PrefixCacheError) and cls.kind
    }
    assert registered == {kind: type(error) for kind, error in _core._error_samples()}


def test_hierarchy() -> None:
    assert issubclass(pc.PrefixCacheError, Exception)
    assert issubclass(pc.InvalidRequestError, ValueError)
    assert issubclass(pc.ConfigError, ValueError)
    assert issubclass(pc.StalePlanError, pc.StepError)
    for cls in EXPECTED.values():
        assert issubclass(cls, pc.PrefixCacheError)
        assert cls.__module__ == "prefixcache"
        assert cls.__doc__
    assert pc.PrefixCacheError.kind is None


def test_errors_pickle_round_trip() -> None:
    error = pc.UnknownSequenceError("unknown sequence 3")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is pc.UnknownSequenceError and str(again) == str(error)


def test_config_error_names_the_field() -> None:
    with pytest.raises(pc.ConfigError, match="U must divide every paged block size"):
        pc.CacheConfig(
            pools=[pc.PoolConfig(8)],
            groups=[pc.FullAttention(block_size=24)],
            hash=pc.HashConfig(unit=16),
        )


def test_every_variant_is_raised_by_the_call_that_causes_it() -> None:
    mgr = pc.CacheManager(hybrid_config())
    with pytest.raises(pc.InvalidRequestError, match="at least one token"):
        mgr.add(1, [])
    with pytest.raises(pc.UnknownSequenceError, match="unknown sequence 9"):
        mgr.lookup(9)
    mgr.add(1, list(range(64)))
    with pytest.raises(pc.DuplicateSequenceError, match="already live"):
        mgr.add(1, [1])
    mgr.schedule(1, 64)
    with pytest.raises(pc.StepError, match="already scheduled"):
        mgr.schedule(1, 64)
    with pytest.raises(pc.AlignmentError, match="alignment 16"):
        mgr.request_checkpoint(1, 8)
    plan = mgr.build_plan()
    with pytest.raises(pc.StepError, match="in flight"):
        mgr.append(1, [1])
    mgr.commit(plan)
    with pytest.raises(pc.StalePlanError, match="already committed"):
        mgr.commit(plan)
    with pytest.raises(pc.NothingToScheduleError, match="append the sampled token"):
        mgr.schedule(1, 1)
    with pytest.raises(pc.ResetRefusedError, match="1 sequence"):
        mgr.reset()
    mgr.check_invariants()


def test_a_plan_of_another_manager_is_stale() -> None:
    first, second = pc.CacheManager(paged_config()), pc.CacheManager(paged_config())
    for mgr in (first, second):
        mgr.add(1, list(range(32)))
        mgr.schedule(1, 32)
    plan = first.build_plan()
    second.build_plan()
    with pytest.raises(pc.StalePlanError, match="built by another manager"):
        second.commit(plan)
    first.commit(plan)
    first.check_invariants()
    second.check_invariants()


def test_stale_plan_after_a_newer_one() -> None:
    mgr = pc.CacheManager(paged_config())
    run_prompt(mgr, 1, list(range(32)), finish=False)
    mgr.append(1, [5])
    mgr.schedule(1, 1)
    old = mgr.build_plan()
    mgr.abort(old)
    with pytest.raises(pc.StalePlanError, match="cannot abort it again"):
        mgr.abort(old)
    mgr.schedule(1, 1)
    new = mgr.build_plan()
    with pytest.raises(pc.StalePlanError, match=f"step {new.step_id} is in flight"):
        mgr.commit(old)
    mgr.commit(new)
    mgr.check_invariants()


@pytest.mark.parametrize("short", [False, True], ids=["without-gil", "with-gil"])
def test_a_core_panic_is_an_invariant_error_and_disables_the_manager(short: bool) -> None:
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, list(range(32)))
    with pytest.raises(pc.InvariantError, match="deliberate panic for testing"):
        mgr._panic_for_testing(short=short)  # type: ignore[attr-defined]
    short_calls = (mgr.build_plan, lambda: mgr.num_computed(1), lambda: mgr.schedule_tokens([1], 1))
    for call in (mgr.check_invariants, lambda: mgr.lookup(1), *short_calls):
        with pytest.raises(pc.InvariantError, match="create a new CacheManager"):
            call()
    assert "unusable" in repr(mgr)
    other = pc.CacheManager(paged_config())  # other managers are unaffected
    assert run_prompt(other, 1, list(range(32))) == 0
