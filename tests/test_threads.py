"""One manager driven from several threads; long calls release the GIL."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import prefixcache as pc
import pytest
from conftest import hybrid_config, paged_config, run_prompt

THREADS = 8
PER_THREAD = 6


def prompt(seq: int) -> list[int]:
    """Sequences share a 64-token prefix in families of 4, then diverge."""
    family = seq % 4
    return [family * 1000 + t for t in range(64)] + [seq * 7 + t for t in range(30 + seq % 5)]


def test_threads_drive_distinct_sequences_through_steps() -> None:
    mgr = pc.CacheManager(hybrid_config(num_blocks=4096, state_blocks=1024))
    for family in range(4):  # warm the cache: every family's prefix is computed once
        run_prompt(mgr, 10_000 + family, [*prompt(family)[:64], 9])
    ids = [[t * PER_THREAD + i for i in range(PER_THREAD)] for t in range(THREADS)]

    def admit(seqs: list[int]) -> list[int]:
        hits = []
        for seq in seqs:
            mgr.add(seq, np.array(prompt(seq), dtype=np.int64))
            hits.append(mgr.lookup(seq).tokens)
            scheduled = mgr.schedule(seq, 1000)
            assert scheduled is not None and scheduled.num_computed == hits[-1]
        return hits

    def decode(seqs: list[int], step: int) -> None:
        mgr.append_batch(seqs, [step] * len(seqs))
        out = mgr.schedule_batch(np.array(seqs), 1)
        assert all(s is not None and s.num_tokens == 1 for s in out)

    with ThreadPoolExecutor(THREADS) as pool:
        hits = list(pool.map(admit, ids))
        assert all(h == 64 for thread in hits for h in thread)  # every family prefix hits
        plan = mgr.build_plan()
        assert sorted(plan.seq_ids.tolist()) == sorted(s for t in ids for s in t)
        mgr.commit(plan)
        mgr.check_invariants()
        for step in range(5):
            list(pool.map(decode, ids, [step] * THREADS))
            plan = mgr.build_plan()
            assert plan.num_tokens == THREADS * PER_THREAD
            mgr.commit(plan)
        mgr.check_invariants()
        list(pool.map(lambda seqs: [mgr.finish(s) for s in seqs], ids))
    mgr.check_invariants()
    assert mgr.num_sequences == 0

    def next_turn(seqs: list[int]) -> None:
        for seq in seqs:  # each sequence's tokens were kept for `extends`
            # A uint32 array; the new tail is hashed without the GIL, while other threads run.
            tokens = np.array([*prompt(seq), 0, 1, 2, 3, 4, 5], dtype=np.uint32)
            added = mgr.add(seq, tokens, extends=seq)
            assert added.extends_found and added.hashed_units == 0

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(next_turn, ids))
    mgr.check_invariants()
    assert mgr.num_sequences == THREADS * PER_THREAD


def test_concurrent_lookups_and_hashing_agree_with_sequential_results() -> None:
    mgr = pc.CacheManager(paged_config(num_blocks=4096))
    for seq in range(16):
        run_prompt(mgr, seq, prompt(seq))
    for seq in range(16):
        mgr.add(100 + seq, prompt(seq))
    expected = [mgr.lookup(100 + seq) for seq in range(16)]
    digests = [pc.hash_prefix(prompt(seq)) for seq in range(16)]

    def work(seq: int) -> tuple[pc.Hit, list[bytes]]:
        return mgr.lookup(100 + seq), pc.hash_prefix(prompt(seq))

    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(10):
            results = list(pool.map(work, range(16)))
            assert [r[0] for r in results] == expected
            assert [r[1] for r in results] == digests
    mgr.check_invariants()


@pytest.fixture
def long_switch_interval() -> Iterator[None]:
    """A thread holding the GIL keeps it for this long unless it releases it itself."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def ticks_during(call: Callable[[], object]) -> int:
    """Runs `call` in a thread; counts the main thread's loop iterations while it is inside.

    With a 30 s switch interval, a call that keeps the GIL lets no other thread run until it
    returns, so the count is 0, always; one that releases the GIL lets the main thread run,
    as soon as the OS schedules it (see `releases_gil`).
    """
    window: list[float] = []

    def worker() -> None:
        window.append(time.perf_counter())
        call()
        window.append(time.perf_counter())

    ticks: list[float] = []
    thread = threading.Thread(target=worker)
    thread.start()
    while thread.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0)  # hand the GIL over so the worker can start and finish
    thread.join()
    start, end = window
    return sum(start < t < end for t in ticks)


ATTEMPTS = 5


def releases_gil(attempt: Callable[[int], Callable[[], object]]) -> bool:
    """Whether the main thread made progress (a tick) while a call was inside, in any of
    `ATTEMPTS` runs; `attempt(i)` sets run `i` up and returns its call.

    A call that keeps the GIL gives 0 ticks in every run (see `ticks_during`), so repeating
    cannot make it pass; the repeats are for a loaded machine, whose OS may leave the main
    thread unscheduled through one call's window, but hardly through five.
    """
    return any(ticks_during(attempt(i)) > 0 for i in range(ATTEMPTS))


def test_long_calls_release_the_gil(long_switch_interval: None) -> None:
    reversed_list = list(range(1_000_000, 0, -1))
    for _ in range(ATTEMPTS):  # the harness sees a GIL holder, every time
        assert ticks_during(lambda: sorted(reversed_list)) == 0
    tokens = np.arange(1 << 20, dtype=np.uint32) % 50_000  # 1M tokens, 65536 units
    assert releases_gil(lambda _: lambda: pc.hash_prefix(tokens, unit=1 << 16, algorithm="sha256"))
    mgr = pc.CacheManager(paged_config(num_blocks=(1 << 16) + 1, block_size=16, unit=16))
    added: list[int] = []
    assert releases_gil(lambda i: lambda: (mgr.add(100 + i, tokens), added.append(100 + i)))
    for seq in added:
        mgr.finish(seq)
    mgr.add(1, tokens)
    plans: list[pc.StepPlan] = []

    def build(_: int) -> Callable[[], object]:
        if plans:
            mgr.abort(plans.pop())
        mgr.schedule(1, 1 << 20)
        return lambda: plans.append(mgr.build_plan())

    assert releases_gil(build)
    mgr.commit(plans.pop())
    assert releases_gil(lambda _: lambda: mgr.check_invariants())
    mgr.finish(1)
    mgr.add(2, tokens)
    assert mgr.lookup(2).tokens == (1 << 20) - 16
    # A lookup probes every one of the 65536 cached blocks: repeat it to widen the window.
    assert releases_gil(lambda _: lambda: [mgr.lookup(2) for _ in range(20)])
    mgr.check_invariants()


def test_short_calls_keep_the_gil_unless_they_must_wait(long_switch_interval: None) -> None:
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=64)],
            groups=[pc.FullAttention(block_size=16, pool=0)],
            hash=pc.HashConfig(algorithm="sha256", unit=16),
        )
    )
    mgr.add(1, list(range(40)))
    # Releasing the GIL would cost more than these calls: they keep it (no tick).
    assert ticks_during(lambda: [mgr.num_computed(1) for _ in range(20_000)]) == 0
    short_prompt = np.arange(64, dtype=np.uint32)
    assert ticks_during(lambda: [pc.hash_prefix(short_prompt) for _ in range(2_000)]) == 0
    ids = np.array([1], dtype=np.int64)
    assert ticks_during(lambda: mgr.schedule_tokens(ids, 1)) == 0
    plan = mgr.build_plan()
    assert ticks_during(lambda: mgr.commit(plan)) == 0
    # While another thread hashes 8M tokens (about 60 ms) inside the lock, a short call waits
    # for the lock without the GIL, so the main thread keeps running meanwhile.
    tokens = np.arange(1 << 23, dtype=np.uint32) % 50_000
    adders: list[threading.Thread] = []

    def while_another_thread_hashes(i: int) -> Callable[[], object]:
        adders.append(threading.Thread(target=lambda: mgr.add(2 + i, tokens)))
        adders[-1].start()
        time.sleep(0.01)  # the adding thread converts the tokens, then hashes without the GIL
        return lambda: mgr.num_computed(1)

    assert releases_gil(while_another_thread_hashes)
    for adder in adders:
        adder.join()
    assert mgr.num_tokens(2) == 1 << 23 and mgr.num_computed(1) == 1
    mgr.check_invariants()


def test_threads_reading_a_plan_get_the_same_arrays() -> None:
    mgr = pc.CacheManager(hybrid_config(num_blocks=512, state_blocks=256))
    for seq in range(32):
        mgr.add(seq, prompt(seq))
    mgr.schedule_batch(list(range(32)), 1000)
    plan = mgr.build_plan()
    barrier = threading.Barrier(THREADS)

    def read(_: int) -> list[int]:
        barrier.wait()
        arrays = [plan.seq_ids, plan.query_start_loc, plan.paged[0].slot_mapping]
        arrays += [plan.state[0].running_slot, plan.state[0].checkpoint_slots]
        return [id(a) for a in arrays]

    with ThreadPoolExecutor(THREADS) as pool:
        seen = list(pool.map(read, range(THREADS)))
    assert all(ids == seen[0] for ids in seen)  # one array per attribute, whoever made it
    assert plan.num_rows == 32 and plan.seq_ids.tolist() == list(range(32))
    mgr.commit(plan)


def test_add_with_extends_hashes_the_new_tail_without_the_gil(long_switch_interval: None) -> None:
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=64)],
            groups=[pc.FullAttention(block_size=16, pool=0)],
            hash=pc.HashConfig(algorithm="sha256", unit=16),
        )
    )
    run_prompt(mgr, 1, list(range(64)))  # the first turn, finished
    # The next turn: the 64 tokens of the first, then 4M new ones (about 25 ms of SHA-256).
    turn = np.concatenate([np.arange(64), np.arange(1 << 22) % 50_000]).astype(np.uint32)
    added: list[pc.Added] = []
    assert releases_gil(lambda i: lambda: added.append(mgr.add(10 + i, turn, extends=1)))
    assert added[0].extends_found and added[0].reused_tokens == 64
    assert added[0].hashed_units == (1 << 22) // 16
    mgr.check_invariants()


def test_add_with_extends_compares_a_long_prefix_without_the_gil(
    long_switch_interval: None,
) -> None:
    """A next turn that shares 8M tokens with the finished previous one and adds 16: the core
    compares the shared prefix (without hashing it) and hashes one unit, all without the GIL."""
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=64)],
            groups=[pc.FullAttention(block_size=16, pool=0)],
            finished_cache_bytes=1 << 30,
        )
    )
    prefix = np.arange(1 << 23, dtype=np.uint32) % 50_000
    mgr.add(0, prefix)
    mgr.finish(0)  # kept, tokens and hashes, for `extends`
    turn = np.concatenate([prefix, np.arange(16, dtype=np.uint32)])
    added: list[pc.Added] = []

    def next_turn(i: int) -> Callable[[], object]:
        if i:
            mgr.finish(i)  # the previous attempt's turn, for the next to extend
        return lambda: added.append(mgr.add(i + 1, turn, extends=i))

    assert releases_gil(next_turn)
    first = added[0]
    assert first.extends_found and first.reused_tokens == 1 << 23 and first.hashed_units == 1
    mgr.check_invariants()


def test_buffers_used_while_another_thread_builds_into_them_raise_step_error() -> None:
    """A build holds its buffers from before it takes the manager's lock until the plan is
    written; using them meanwhile gets a `StepError` that says so."""
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=1024)],
            groups=[pc.FullAttention(block_size=16, pool=0)],
            hash=pc.HashConfig(algorithm="sha256", unit=16),
        )
    )
    refused = 0
    for attempt in range(3):  # each attempt's prompts share nothing with the others'
        mgr.add(attempt, [attempt * 1000 + t for t in range(64)])
        mgr.schedule(attempt, 64)
        buffers = pc.PlanBuffers()
        # Another thread holds the manager's lock while it hashes 8M tokens (about 50 ms of
        # SHA-256): the build waits for the lock without the GIL, holding the buffers.
        many = np.arange(1 << 23, dtype=np.uint32) + np.uint32(attempt << 24)
        hashing = threading.Thread(target=lambda a=attempt, t=many: mgr.add(100 + a, t))
        hashing.start()
        time.sleep(0.01)
        builder = threading.Thread(target=lambda b=buffers: mgr.build_plan_into(b))
        builder.start()
        while builder.is_alive():
            for use in (
                lambda b=buffers: b.num_rows,
                lambda b=buffers: b.seq_ids,
                lambda b=buffers: b.counts,
                lambda b=buffers: repr(b),
                lambda b=buffers: mgr.commit(b),
            ):
                try:
                    use()
                except pc.StepError as e:
                    if "no plan was built into them" in str(e):
                        continue  # the build had not taken the buffers yet
                    assert "being written by a build (build_plan_into or decode_step) in " in (
                        str(e)
                    )
                    refused += 1
            time.sleep(0)
        builder.join()
        hashing.join()
        assert buffers.num_rows == 1 and buffers.num_tokens == 64
        if mgr.plan_in_flight is not None:  # unless a commit in the loop came after the build
            mgr.commit(buffers)
        assert mgr.num_computed(attempt) == 64
        if refused:
            break
    assert refused > 0
    mgr.check_invariants()
