"""Regression tests of the defects an outside fuzzer found, through the Python API: a wrong hit
across images, the junction above the attention bound, the checkpoint cap with shared pools, a
lookahead near 2**32, the finished cache's memory with ids that never repeat, and hash_prefix
accepting multimodal inputs the manager refuses. (Huge inputs and shared PlanBuffers are in
test_bad_input.py and test_plan_buffers.py.)"""

from __future__ import annotations

import os

import numpy as np
import prefixcache as pc
import pytest


def usable(mgr: pc.CacheManager, seq_id: int = 10**6) -> None:
    """A whole request still runs on `mgr`."""
    mgr.add(seq_id, list(range(64)))
    assert mgr.schedule(seq_id, 64) is not None
    mgr.commit(mgr.build_plan())
    mgr.finish(seq_id)
    mgr.check_invariants()


def full_attention(unit: int, **kwargs: object) -> pc.CacheManager:
    return pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(64)],
            groups=[pc.FullAttention(block_size=unit)],
            hash=pc.HashConfig(unit=unit, **kwargs),  # type: ignore[arg-type]
        )
    )


TEXT = [3, 3, 1, 3, 2, 3, 2, 0, 3, 0]


def test_multimodal_inputs_out_of_order_are_refused_by_add_and_hash_prefix() -> None:
    mgr = full_attention(2)
    unsorted = pc.ExtraKeys(
        multimodal=[pc.MultimodalInput(9, 10, b"img1"), pc.MultimodalInput(4, 8, b"X")]
    )
    with pytest.raises(pc.InvalidRequestError, match="in order of their start"):
        mgr.add(1, TEXT, unsorted)
    with pytest.raises(pc.InvalidRequestError, match="in order of their start"):
        pc.hash_prefix(TEXT, unit=2, extra_keys=unsorted)
    assert mgr.num_sequences == 0
    usable(mgr)


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("through_extends", [False, True])
def test_a_request_with_an_image_hits_only_what_was_computed_with_it(
    verify: bool, through_extends: bool
) -> None:
    mgr = full_attention(2, verify_tokens=verify)
    with_image = pc.ExtraKeys(
        multimodal=[pc.MultimodalInput(4, 8, b"X"), pc.MultimodalInput(9, 10, b"img1")]
    )
    mgr.add(1, TEXT, with_image)
    other = [*TEXT[:6], 0, 0, 3, 2, 0, 2, 0, 0]  # the same text, without the image
    added = mgr.add(2, other, None, extends=1 if through_extends else None)
    assert added.reused_tokens == 4  # the image starts at token 4
    mgr.schedule(2, 100)
    mgr.commit(mgr.build_plan())
    stored = [k for ev in mgr.drain_events() if isinstance(ev, pc.BlockStored) for k in ev.keys]
    assert stored == pc.hash_prefix(other, unit=2)
    mgr.finish(2)
    mgr.add(3, TEXT, with_image)
    assert mgr.lookup(3).tokens == 4
    mgr.check_invariants()


@pytest.mark.parametrize(
    "bad",
    [
        pc.MultimodalInput(5, 5, b"x"),  # empty range
        pc.MultimodalInput(0, 5, b""),  # empty hash
        pc.MultimodalInput(0, 50, b"x"),  # past the tokens
    ],
)
def test_hash_prefix_refuses_what_the_manager_refuses(bad: pc.MultimodalInput) -> None:
    extra = pc.ExtraKeys(multimodal=[bad])
    mgr = full_attention(16)
    with pytest.raises(pc.InvalidRequestError) as refused_by_add:
        mgr.add(1, list(range(32)), extra)
    with pytest.raises(pc.InvalidRequestError) as refused_by_hash:
        pc.hash_prefix(list(range(32)), unit=16, extra_keys=extra)
    assert str(refused_by_add.value) == str(refused_by_hash.value)


def test_a_checkpoint_above_the_attention_bound_is_not_the_junction() -> None:
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=3), pc.PoolConfig(num_blocks=64)],
            groups=[
                pc.FullAttention(block_size=1536, pool=0),
                pc.StateGroup(
                    alignment=16,
                    pool=1,
                    retention=pc.Retention(
                        tail=True, interval=None, junction=True, decode_tail=True
                    ),
                ),
            ],
            hash=pc.HashConfig(unit=128),
        )
    )
    rng = np.random.default_rng(7)
    a = [int(t) for t in rng.integers(0, 50_000, 513)]
    shares_421 = a[:421] + [int(t) for t in rng.integers(50_000, 60_000, 92)]
    prompts = [a, list(range(60_000, 60_128)), [60_500], shares_421, a, a[:385]]
    hits = []
    for seq_id, prompt in enumerate(prompts):
        mgr.add(seq_id, prompt)
        hit = mgr.lookup(seq_id)
        hits.append((hit.tokens, hit.junction))
        assert mgr.schedule(seq_id, len(prompt)) is not None
        mgr.commit(mgr.build_plan())
        mgr.finish(seq_id)
        mgr.check_invariants()
    # A's resend: the attention bound is 384; A's checkpoint at 512 lies above it, so the
    # junction is 384 and is checkpointed; a 385-token prefix of A then resumes there.
    assert hits[4] == (0, 384)
    assert hits[5] == (384, None)


def test_the_checkpoint_cap_is_per_group_when_state_groups_share_a_pool() -> None:
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=64)],
            groups=[
                pc.StateGroup(alignment=4, pool=0, retention=pc.Retention(interval=4)),
                pc.StateGroup(alignment=4, pool=0, checkpoint_cap=1),
            ],
            hash=pc.HashConfig(unit=4),
        )
    )
    mgr.add(1, list(range(40)))
    mgr.schedule(1, 100)
    mgr.commit(mgr.build_plan())
    mgr.check_invariants()
    before = mgr.stats().groups[0].evictions
    mgr.add(2, list(range(1000, 1040)))
    mgr.schedule(2, 100)
    mgr.commit(mgr.build_plan())
    mgr.check_invariants()
    assert mgr.stats().groups[0].evictions == before  # group 1 displaces only its own
    assert mgr.stats().groups[1].evictions == 1


@pytest.mark.parametrize("lookahead", [2**16 + 1, 2**31, 2**32 - 1])
def test_a_lookahead_beyond_the_bound_is_refused_and_the_manager_stays_usable(
    lookahead: int,
) -> None:
    mgr = full_attention(4)
    mgr.add(1, list(range(9)))
    with pytest.raises(pc.InvalidRequestError, match="lookahead"):
        mgr.schedule(1, 100, lookahead=lookahead)
    assert mgr.plan_in_flight is None
    usable(mgr)
    s = mgr.schedule(1, 100, lookahead=2)
    assert s is not None and s.num_computed + s.num_tokens == 9


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_the_finished_cache_stays_within_its_budget_with_ids_that_never_repeat() -> None:
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(256)],
            groups=[pc.FullAttention(block_size=16)],
            finished_cache_bytes=4096,
            enable_events=False,
        )
    )
    tokens = list(range(40))
    for seq_id in range(100_000):
        mgr.add(seq_id, tokens)
        mgr.finish(seq_id)
    start = rss_mib()
    for seq_id in range(100_000, 1_100_000):
        mgr.add(seq_id, tokens)
        mgr.finish(seq_id)
    # An id map that kept every finished id grew by about 35 MiB over these million requests.
    assert rss_mib() - start < 4
    assert mgr.num_finished_cached <= 4096 // 160
    assert mgr.add(1 << 40, tokens, extends=1_099_999).extends_found
    assert not mgr.add(1 << 41, tokens, extends=5).extends_found


def test_an_alignment_error_says_which_rule_a_position_breaks() -> None:
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(64), pc.PoolConfig(32)],
            groups=[pc.FullAttention(4), pc.StateGroup(alignment=2, pool=1)],
            hash=pc.HashConfig(unit=4),
        )
    )
    mgr.add(1, list(range(21)))
    mgr.schedule(1, 8)
    mgr.commit(mgr.build_plan())
    mgr.schedule(1, 8)  # the chunk [8, 16)
    with pytest.raises(pc.AlignmentError, match=r"offset -4 .* outside the chunk"):
        mgr.request_checkpoint(1, 4)
    with pytest.raises(pc.AlignmentError, match="position is not a multiple of the hash unit 4"):
        mgr.request_checkpoint(1, 10)
    mgr.request_checkpoint(1, 12)
