"""`hash_prefix`: the encoding in docs/HASHING.md, its vectors, and the cache keys."""

from __future__ import annotations

import numpy as np
import prefixcache as pc
import pytest
from conftest import paged_config, run_prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_encoding import reference

# (tokens, keyword arguments, algorithm, h[0] hex, h[1] hex) from docs/HASHING.md.
VECTORS = [
    (
        range(32),
        {},
        "xxh3_128",
        "1d72a9d44c7c6f7dfd48830cad65b5bf",
        "da62b31b55051d8b772a25c1fe37ba0f",
    ),
    (
        range(32),
        {},
        "sha256",
        "3dce0ce6d7e67aef61ac809fc95f88f81b8cf7c51ed45f2fdbd7bb32109b48c6",
        "8eb122ce37268a8df79b885710164c11479bf2b6b478ff0ac95a2ea5b61dc61f",
    ),
    (
        range(32),
        {"seed": 42},
        "xxh3_128",
        "ea1e99faf7ded141ced44932437454c3",
        "65569577c865c92f7b9f5b93f9590985",
    ),
    (
        range(32),
        {"extra_keys": pc.ExtraKeys(cache_salt=b"tenant-a", lora_id=7)},
        "sha256",
        "46e0d8973eb9f19a4b5af019c8fb206d16c56e1c9d6a2c47e467ad05d2a14622",
        "30b4780a1e5af48bf7cb3d6be5cb05f6fee5fb2a59ff787164c8dccc7974b093",
    ),
    (
        range(32),
        {"extra_keys": pc.ExtraKeys(multimodal=[pc.MultimodalInput(10, 20, b"img0")])},
        "xxh3_128",
        "fec780fa09a66a1f4d6218cca8b9f2d2",
        "07252b11a9b64f010e52d53599b7a367",
    ),
    (
        range(150_000, 150_256),
        {"unit": 128},
        "xxh3_128",
        "3dd372b00db59c857256cf99964d7fc7",
        "12a5e547ce957fe441b806df0fa6c9e8",
    ),
]


@pytest.mark.parametrize(("tokens", "kwargs", "algorithm", "h0", "h1"), VECTORS)
def test_documented_vectors(
    tokens: range, kwargs: dict[str, object], algorithm: str, h0: str, h1: str
) -> None:
    digests = pc.hash_prefix(list(tokens), algorithm=algorithm, **kwargs)  # type: ignore[arg-type]
    assert [d.hex() for d in digests] == [h0, h1]


def test_only_full_units_are_hashed_and_lengths_follow_the_algorithm() -> None:
    assert len(pc.hash_prefix(list(range(47)), unit=16)) == 2
    assert pc.hash_prefix(list(range(15)), unit=16) == []
    assert {len(d) for d in pc.hash_prefix(list(range(64)))} == {16}
    assert {len(d) for d in pc.hash_prefix(list(range(64)), algorithm="sha256")} == {32}
    assert pc.hash_prefix(list(range(64))) == pc.hash_prefix(list(range(64)), 16, "xxh3_128", 0)


def test_a_prefix_digest_never_depends_on_later_tokens() -> None:
    base = list(range(100))
    assert pc.hash_prefix(base + [1, 2, 3] * 20)[:6] == pc.hash_prefix(base)
    changed = pc.hash_prefix([*base[:40], 999, *base[41:]])
    original = pc.hash_prefix(base)
    assert changed[:2] == original[:2] and all(
        a != b for a, b in zip(changed[2:], original[2:], strict=True)
    )


@settings(max_examples=50, deadline=None, database=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=70),
    unit=st.integers(min_value=1, max_value=9),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    salt=st.none() | st.binary(max_size=5),
    lora=st.none() | st.integers(min_value=0, max_value=2**64 - 1),
    mm=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 30), st.binary(min_size=1, max_size=4)),
        max_size=3,
    ),
)
def test_matches_the_reference_encoding(
    tokens: list[int],
    unit: int,
    seed: int,
    salt: bytes | None,
    lora: int | None,
    mm: list[tuple[int, int, bytes]],
) -> None:
    # Inputs the cache accepts: in order of start (ties by end), within the tokens.
    multimodal = sorted(
        ((s, s + n, h) for s, n, h in mm if s + n <= len(tokens)), key=lambda m: (m[0], m[1])
    )
    extra = pc.ExtraKeys(
        cache_salt=salt,
        lora_id=lora,
        multimodal=[pc.MultimodalInput(s, e, h) for s, e, h in multimodal],
    )
    got = pc.hash_prefix(tokens, unit=unit, algorithm="sha256", seed=seed, extra_keys=extra)
    assert got == reference(tokens, unit, "sha256", seed, salt, lora, multimodal)


def test_xxh3_matches_the_reference_encoding() -> None:
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 2**32, 1000)]
    for unit in (1, 7, 16, 128):
        assert pc.hash_prefix(tokens, unit=unit, seed=5) == reference(
            tokens, unit, "xxh3_128", seed=5
        )


def test_salt_as_str_is_its_utf8_bytes() -> None:
    tokens = list(range(32))
    as_str = pc.hash_prefix(tokens, extra_keys=pc.ExtraKeys(cache_salt="tenant-é"))
    as_bytes = pc.hash_prefix(tokens, extra_keys=pc.ExtraKeys(cache_salt="tenant-é".encode()))
    assert as_str == as_bytes != pc.hash_prefix(tokens)
    assert pc.hash_prefix(tokens, extra_keys=pc.ExtraKeys(cache_salt=b"")) != pc.hash_prefix(tokens)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_the_cache_keys_are_hash_prefix_digests(algorithm: str) -> None:
    cfg = pc.CacheConfig(
        pools=[pc.PoolConfig(64)],
        groups=[pc.FullAttention(32)],
        hash=pc.HashConfig(algorithm=algorithm, seed=9, unit=16),  # type: ignore[arg-type]
    )
    mgr = pc.CacheManager(cfg)
    tokens = list(range(100, 196))
    run_prompt(mgr, 1, tokens)
    keys = [k for event in mgr.drain_events() for k in event.keys]  # type: ignore[union-attr]
    assert keys == pc.hash_prefix(tokens, unit=16, algorithm=algorithm, seed=9)  # type: ignore[arg-type]


def test_hashing_is_the_same_for_the_manager_and_for_routers() -> None:
    mgr = pc.CacheManager(paged_config(unit=16))
    salt = pc.ExtraKeys(cache_salt=b"t")
    mgr.add(1, list(range(64)), extra_keys=salt)
    mgr.schedule(1, 64)
    mgr.commit(mgr.build_plan())
    (run,) = mgr.drain_events()  # one run: both blocks of the commit
    assert run.keys == pc.hash_prefix(list(range(64)), extra_keys=salt)  # type: ignore[union-attr]
