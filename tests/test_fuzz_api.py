"""A short, deterministic run of the stateful API fuzzer (``tests/fuzz_api.py``).

Random programs over the whole public API (random configurations, every call with good and
hostile arguments) must keep every invariant: only typed errors, exactly the documented ones,
``check_invariants`` after every call, no hit beyond a prefix computed with the same extra keys,
well-formed plans, published keys equal to ``hash_prefix``, and a manager still usable at the
end. The second test draws no hostile values, so its programs go deeper into the protocol
(hits, evictions, junctions, checkpoints). The long run is
``python3 tests/fuzz_api.py --examples N --seed S``.
"""

from __future__ import annotations

import fuzz_api
from hypothesis.stateful import run_state_machine_as_test


def run_short(examples: int, gentle: bool) -> None:
    fuzz_api.GENTLE = gentle
    try:
        run_state_machine_as_test(
            fuzz_api.FuzzMachine,
            settings=fuzz_api.short_settings(examples, 50, derandomize=True, database=None),
        )
    finally:
        fuzz_api.GENTLE = False


def test_random_programs_with_hostile_arguments_keep_every_api_rule() -> None:
    run_short(examples=150, gentle=False)


def test_random_valid_traffic_never_hits_beyond_what_was_computed() -> None:
    run_short(examples=100, gentle=True)


def test_random_overlapped_programs_keep_the_in_flight_rules() -> None:
    # Overlapped steps (D = 2..3): placeholders, resolve, plans at depth, ends of the oldest,
    # a later and a stale plan, cascading aborts, finish and preempt in flight, and first
    # schedules resuming from checkpoints while plans are in flight (which the run must reach),
    # sequences with extra keys among them, and checkpoints requested for the next plan.
    before = fuzz_api.CHECKPOINT_RESUMES_IN_FLIGHT
    extra = fuzz_api.CHECKPOINT_RESUMES_WITH_EXTRA_KEYS
    requests = fuzz_api.CHECKPOINT_REQUESTS
    run_state_machine_as_test(
        fuzz_api.OverlapMachine,
        settings=fuzz_api.short_settings(150, 50, derandomize=True, database=None),
    )
    resumed = fuzz_api.CHECKPOINT_RESUMES_IN_FLIGHT - before
    assert resumed > 0, "no row resumed from a checkpoint while plans were in flight"
    extra = fuzz_api.CHECKPOINT_RESUMES_WITH_EXTRA_KEYS - extra
    requests = fuzz_api.CHECKPOINT_REQUESTS - requests
    assert extra > 0, "no row of a sequence with extra keys resumed from a checkpoint"
    assert requests > 0, "no checkpoint requested for a known chunk"
