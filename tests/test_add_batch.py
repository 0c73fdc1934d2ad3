"""`CacheManager.add_batch`: a step's arrivals in one call, as `add` of each in order.

The reference is a second manager given the same requests one `add` at a time: the results
must be equal, and so must everything a caller sees afterwards (lookups, the keys each
sequence publishes once computed, compared with `hash_prefix` of its tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import prefixcache as pc
import pytest
from test_threads import long_switch_interval, releases_gil

__all__ = ["long_switch_interval"]  # the fixture, used by name

U = 16


def manager(live: bool = True) -> pc.CacheManager:
    return pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=8192)],
            groups=[pc.FullAttention(block_size=U)],
            hash=pc.HashConfig(algorithm="sha256", unit=U),
            reuse_live_prefixes=live,
        )
    )


def requests(n: int, seed: int = 0) -> tuple[list[int], list[np.ndarray], list[int | None]]:
    """`n` prompts, most sharing one of three heads, each extending the previous request with
    the same head (inside the batch)."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, 50_000, size=1024, dtype=np.uint32) for _ in range(3)]
    ids, prompts, extends = [], [], []
    last: dict[int, int] = {}
    for i in range(n):
        h = int(rng.integers(0, 4))
        tail = rng.integers(0, 50_000, size=int(rng.integers(1, 2000)), dtype=np.uint32)
        head = heads[h][: int(rng.integers(0, 1024))] if h < 3 else tail[:0]
        prompts.append(np.concatenate([head, tail]))
        ids.append(100 + i)
        extends.append(last.get(h))
        last[h] = 100 + i
    return ids, prompts, extends


def published(mgr: pc.CacheManager, seq_id: int) -> list[bytes]:
    """The keys `seq_id` publishes when its whole prompt is computed in one step."""
    mgr.drain_events()
    mgr.schedule(seq_id, 1 << 20)
    mgr.commit(mgr.build_plan())
    return [h for e in mgr.drain_events() if isinstance(e, pc.BlockStored) for h in e.keys]


@pytest.mark.parametrize("live", [False, True])
@pytest.mark.parametrize("threads", [None, 1, 2, 4])
def test_add_batch_is_add_of_each_in_order(live: bool, threads: int | None) -> None:
    ids, prompts, extends = requests(24)
    one, batch = manager(live), manager(live)
    expected = [one.add(i, p, extends=e) for i, p, e in zip(ids, prompts, extends, strict=True)]
    got = batch.add_batch(ids, prompts, extends=extends, threads=threads)
    assert [(a.reused_tokens, a.hashed_units, a.extends_found) for a in got] == [
        (a.reused_tokens, a.hashed_units, a.extends_found) for a in expected
    ]
    assert any(a.reused_tokens for a in got)  # the batch reused its own requests' digests
    batch.check_invariants()
    for seq_id, prompt in zip(ids, prompts, strict=True):
        assert batch.lookup(seq_id).tokens == one.lookup(seq_id).tokens
        keys = published(batch, seq_id)
        assert keys == published(one, seq_id)
        digests = pc.hash_prefix(prompt, U, "sha256")
        assert set(keys) <= set(digests)


def test_refused_requests_admit_nothing() -> None:
    mgr = manager()
    mgr.add(1, list(range(64)))
    good = list(range(100))
    with pytest.raises(pc.DuplicateSequenceError):
        mgr.add_batch([2, 1], [good, good])
    with pytest.raises(pc.DuplicateSequenceError):
        mgr.add_batch([2, 3, 2], [good, good, good])
    with pytest.raises(pc.InvalidRequestError):
        mgr.add_batch([2, 3], [good, []])
    with pytest.raises(pc.InvalidRequestError):
        mgr.add_batch([2, 3], [good])  # one prompt per id
    with pytest.raises(pc.InvalidRequestError):
        mgr.add_batch([2], [good], extends=[None, None])
    with pytest.raises(pc.InvalidRequestError):
        mgr.add_batch([2], [good], threads=pc.MAX_HASH_THREADS + 1)
    with pytest.raises(TypeError):
        mgr.add_batch([2], [good], threads=1.5)  # type: ignore[arg-type]
    assert mgr.num_sequences == 1
    assert mgr.add_batch([], []) == []
    # Sequence 1's first 64 tokens are live: their digests are reused, as `add` reuses them.
    (added,) = mgr.add_batch([2], [good], extra_keys=[None])
    assert (added.reused_tokens, added.hashed_units) == (64, 2)


def test_add_batch_hashes_without_the_gil(long_switch_interval: None) -> None:
    """The main thread keeps running while another thread's batch is hashed."""
    mgr = manager(live=False)
    prompts = [np.arange(i, i + (1 << 16), dtype=np.uint32) for i in range(16)]

    def attempt(i: int) -> Callable[[], object]:
        ids = [1000 * (i + 1) + j for j in range(16)]
        return lambda: mgr.add_batch(ids, prompts)

    assert releases_gil(attempt)
    assert mgr.num_sequences % 16 == 0 and mgr.num_sequences > 0
