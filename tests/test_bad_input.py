"""Bad input to every public call: the right typed exception, a helpful message, never a crash.

Argument *type* problems raise ``TypeError``; out-of-range values and bad shapes raise
``InvalidRequestError`` / ``ConfigError`` (both ``ValueError``); protocol misuse raises its own
``PrefixCacheError`` subclass. After every failure the manager passes ``check_invariants`` and
still serves a full step.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import prefixcache as pc
import pytest
import torch
from conftest import hybrid_config, paged_config, run_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

U32_MAX = 2**32 - 1

WRONG_TYPE_INTS = ["7", 1.5, None, True, [1], b"\x01"]
OUT_OF_RANGE_IDS = [-1, 2**63, 2**64, 2**200]
OUT_OF_RANGE_U32 = [-1, 2**32, 2**64, -(2**80)]


@pytest.fixture
def mgr() -> pc.CacheManager:
    """A hybrid manager with sequence 1 computed (decoding) and sequence 2 added."""
    manager = pc.CacheManager(hybrid_config())
    run_prompt(manager, 1, list(range(40)), finish=False)
    manager.append(1, [7])
    manager.add(2, list(range(100, 164)))
    return manager


def still_usable(manager: pc.CacheManager) -> None:
    manager.check_invariants()
    seq = 1000 + manager.num_sequences
    assert run_prompt(manager, seq, list(range(500, 540))) == 0
    manager.check_invariants()


# Calls that take a sequence id, as (name, call with the id in first position).
ID_CALLS: list[tuple[str, Callable[[pc.CacheManager, Any], object]]] = [
    ("add", lambda m, i: m.add(i, [1, 2, 3])),
    ("lookup", lambda m, i: m.lookup(i)),
    ("schedule", lambda m, i: m.schedule(i, 16)),
    ("request_checkpoint", lambda m, i: m.request_checkpoint(i, 16)),
    ("suggest_chunk", lambda m, i: m.suggest_chunk(i, 16)),
    ("append", lambda m, i: m.append(i, [1])),
    ("finish", lambda m, i: m.finish(i)),
    ("preempt", lambda m, i: m.preempt(i)),
    ("num_computed", lambda m, i: m.num_computed(i)),
    ("num_tokens", lambda m, i: m.num_tokens(i)),
    ("add extends", lambda m, i: m.add(77, [1, 2], extends=i)),
]


@pytest.mark.parametrize(("name", "call"), ID_CALLS, ids=[n for n, _ in ID_CALLS])
@pytest.mark.parametrize("bad", WRONG_TYPE_INTS, ids=repr)
def test_a_sequence_id_of_the_wrong_type_is_a_type_error(
    mgr: pc.CacheManager, name: str, call: Callable[[pc.CacheManager, Any], object], bad: object
) -> None:
    if name == "add extends" and bad is None:
        return  # extends=None means "no extends"
    with pytest.raises(TypeError, match="must be an int"):
        call(mgr, bad)
    still_usable(mgr)


@pytest.mark.parametrize(("name", "call"), ID_CALLS, ids=[n for n, _ in ID_CALLS])
@pytest.mark.parametrize("bad", OUT_OF_RANGE_IDS, ids=repr)
def test_a_sequence_id_out_of_range_is_an_invalid_request(
    mgr: pc.CacheManager, name: str, call: Callable[[pc.CacheManager, Any], object], bad: int
) -> None:
    with pytest.raises(
        pc.InvalidRequestError, match=r"seq_id must be in 0\.\.=9223372036854775807"
    ):
        call(mgr, bad)
    still_usable(mgr)


@pytest.mark.parametrize(
    ("name", "call"),
    [c for c in ID_CALLS if c[0] not in ("add", "add extends")],
    ids=[n for n, _ in ID_CALLS if n not in ("add", "add extends")],
)
def test_an_unknown_sequence_id(
    mgr: pc.CacheManager, name: str, call: Callable[[pc.CacheManager, Any], object]
) -> None:
    with pytest.raises(pc.UnknownSequenceError, match="unknown sequence 424242: add it first"):
        call(mgr, 424242)
    still_usable(mgr)


BAD_TOKENS: list[tuple[object, type[BaseException], str]] = [
    ("abc", TypeError, "list of ints or a 1-D integer array"),
    (b"abc", TypeError, "list of ints or a 1-D integer array"),
    (5, TypeError, "list of ints or a 1-D integer array"),
    (None, TypeError, "list of ints or a 1-D integer array"),
    ([1, "a"], TypeError, r"tokens\[1\] must be an int"),
    ([1.0], TypeError, r"tokens\[0\] must be an int"),
    ([None], TypeError, r"tokens\[0\] must be an int"),
    ([True], TypeError, r"tokens\[0\] must be an int"),
    ([1, -1], pc.InvalidRequestError, r"tokens\[1\] must be in 0\.\.=4294967295, got -1"),
    ([2**32], pc.InvalidRequestError, r"tokens\[0\] must be in 0\.\.=4294967295"),
    ([2**90], pc.InvalidRequestError, r"tokens\[0\] must be in 0\.\.=4294967295"),
    (np.array([1.0, 2.0]), TypeError, "integer array, got dtype float64"),
    (np.array([True]), TypeError, "integer array, got dtype"),
    (np.array(["a"]), TypeError, "integer array, got dtype"),
    (np.array([[1, 2]]), pc.InvalidRequestError, r"must be 1-D, got an array of shape \[1, 2\]"),
    (np.array(5), pc.InvalidRequestError, "must be 1-D"),
    (np.array([3, -2], dtype=np.int64), pc.InvalidRequestError, r"tokens\[1\] is out of range"),
    (np.array([2**33], dtype=np.int64), pc.InvalidRequestError, r"tokens\[0\] is out of range"),
    (np.array([2**64 - 1], dtype=np.uint64), pc.InvalidRequestError, "out of range"),
    (np.array([-1], dtype=np.int8), pc.InvalidRequestError, "out of range"),
    (torch.tensor([1.5]), TypeError, "integer array, got dtype float32"),
    (torch.tensor([[1, 2]]), pc.InvalidRequestError, "must be 1-D"),
    (torch.tensor([1], requires_grad=False).to(torch.bool), TypeError, "integer array"),
    (object(), TypeError, "got object"),
]


@pytest.mark.parametrize(("tokens", "error", "message"), BAD_TOKENS, ids=repr)
@pytest.mark.parametrize("call", ["add", "add extends", "append", "hash_prefix", "append_batch"])
def test_bad_tokens(
    mgr: pc.CacheManager,
    call: str,
    tokens: object,
    error: type[BaseException],
    message: str,
) -> None:
    with pytest.raises(error, match=message):
        if call == "add":
            mgr.add(3, tokens)  # type: ignore[arg-type]
        elif call == "add extends":  # NumPy uint32 arrays take another path with `extends`
            mgr.add(3, tokens, extends=1)  # type: ignore[arg-type]
        elif call == "append":
            mgr.append(1, tokens)  # type: ignore[arg-type]
        elif call == "append_batch":
            mgr.append_batch([1], tokens)  # type: ignore[arg-type]
        else:
            pc.hash_prefix(tokens)  # type: ignore[arg-type]
    assert mgr.num_tokens(1) == 41
    with pytest.raises(pc.UnknownSequenceError):
        mgr.lookup(3)
    still_usable(mgr)


def test_empty_tokens(mgr: pc.CacheManager) -> None:
    with pytest.raises(pc.InvalidRequestError, match="at least one token"):
        mgr.add(3, [])
    with pytest.raises(pc.InvalidRequestError, match="at least one token"):
        mgr.add(3, np.array([], dtype=np.int64))
    with pytest.raises(pc.InvalidRequestError, match="at least one token"):
        mgr.add(3, np.array([], dtype=np.uint32), extends=1)
    assert pc.hash_prefix([]) == []
    still_usable(mgr)


def test_oversized_token_inputs_are_refused_before_copying(mgr: pc.CacheManager) -> None:
    # 2**31 tokens (8 GiB as uint32) that occupy no memory: a broadcast view.
    huge = np.broadcast_to(np.uint32(1), (pc.MAX_SEQUENCE_TOKENS + 1,))
    for call in (
        lambda: mgr.add(3, huge),
        lambda: mgr.add(3, huge, extends=1),
        lambda: mgr.append(1, huge),
        lambda: pc.hash_prefix(huge),
    ):
        with pytest.raises(pc.InvalidRequestError, match="more than the supported 2147483647"):
            call()
    still_usable(mgr)


# What the bindings refuse before copying or reading a huge input, run in a child process
# under a 6 GiB address-space limit: a typed error there, never an abort of the process. `ids`
# is a zero-stride view of 2**33 ids and `tokens` one of MAX_SEQUENCE_TOKENS tokens (8 GiB to
# copy as uint32); neither occupies memory.
HUGE_INPUT_CHILD = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
import numpy as np
import prefixcache as pc
m = pc.CacheManager(pc.CacheConfig(pools=[pc.PoolConfig(256)], groups=[pc.FullAttention(16)]))
m.add(1, [1, 2, 3])
ids = np.broadcast_to(np.int64(1), (2**33,))
tokens = np.broadcast_to(np.uint32(1), (pc.MAX_SEQUENCE_TOKENS,))
try:
    {call}
except pc.InvalidRequestError as e:
    print("refused:", e)
print("in flight:", m.plan_in_flight)
"""
TOO_MANY_IDS = (
    r"has 8589934592 entries, more than the supported 1048576 "
    r"\(prefixcache\.MAX_BATCH_SEQUENCES\): split the batch"
)
TOO_MANY_TO_COPY = (
    r"tokens has 2147483647 entries, and copying them needs 8\.0 GiB of memory, which could "
    r"not be allocated"
)
HUGE_INPUTS = [
    ("schedule_batch", "m.schedule_batch(ids, 1)", "seq_ids " + TOO_MANY_IDS),
    ("schedule_tokens", "m.schedule_tokens(ids, 1)", "seq_ids " + TOO_MANY_IDS),
    ("schedule_batch budgets", "m.schedule_batch([1], ids)", "max_tokens " + TOO_MANY_IDS),
    ("append_batch", "m.append_batch(ids, ids)", "seq_ids " + TOO_MANY_IDS),
    ("append_batch tokens", "m.append_batch([1], ids)", "tokens " + TOO_MANY_IDS),
    ("decode_step", "m.decode_step(pc.PlanBuffers(), ids, ids)", "seq_ids " + TOO_MANY_IDS),
    ("block_table", "m.block_table(0, ids)", "seq_ids " + TOO_MANY_IDS),
    ("add", "m.add(2, tokens)", TOO_MANY_TO_COPY),
    ("add extends", "m.add(2, tokens, extends=1)", TOO_MANY_TO_COPY),
    (
        "add big-endian",
        "m.add(2, np.broadcast_to(np.array(1, dtype='>u4'), tokens.shape))",
        TOO_MANY_TO_COPY,
    ),
    ("add range", "m.add(2, range(pc.MAX_SEQUENCE_TOKENS))", TOO_MANY_TO_COPY),
    ("append", "m.append(1, tokens)", TOO_MANY_TO_COPY),
    ("hash_prefix", "pc.hash_prefix(tokens)", TOO_MANY_TO_COPY),
    (
        "PlanBuffers rows",
        "pc.PlanBuffers(rows=pc.MAX_BATCH_SEQUENCES + 1)",
        r"rows must be in 1\.\.=1048576, got 1048577",
    ),
    (
        # 100 paged groups' parts at 2**20 rows need about 9 GiB: the build that lays them out
        # is refused, and its step taken out of flight again.
        "PlanBuffers growth",
        "m = pc.CacheManager(pc.CacheConfig(pools=[pc.PoolConfig(256)], "
        "groups=[pc.FullAttention(16)] * 100)); m.add(1, [1]); m.schedule(1, 1); "
        "m.build_plan_into(pc.PlanBuffers(rows=pc.MAX_BATCH_SEQUENCES))",
        r"PagedGroupBuffers\.\w+ of \d+ values needs [\d.]+ MiB of memory, which could not be "
        r"allocated .*: ask for fewer rows",
    ),
]


@pytest.mark.skipif(sys.platform != "linux", reason="address-space limits are Linux's")
@pytest.mark.parametrize(
    ("call", "message"), [(c, m) for _, c, m in HUGE_INPUTS], ids=[n for n, _, _ in HUGE_INPUTS]
)
def test_huge_inputs_are_refused_with_a_typed_error_not_an_abort(call: str, message: str) -> None:
    start = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", HUGE_INPUT_CHILD.format(call=call)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RUST_BACKTRACE": "0"},
    )
    elapsed = time.perf_counter() - start
    assert child.returncode == 0, child.stderr
    refused = child.stdout.splitlines()[0]
    assert refused.startswith("refused: invalid request: "), child.stdout
    assert re.search(message, refused), refused
    assert child.stdout.splitlines()[-1] == "in flight: None"
    assert elapsed < 10, f"{elapsed:.1f} s: the input was read before it was refused"


def test_batches_beyond_the_bound_are_refused_by_length(mgr: pc.CacheManager) -> None:
    bound = pc.MAX_BATCH_SEQUENCES
    too_many = np.broadcast_to(np.int64(2), (bound + 1,))
    message = (
        rf"has {bound + 1} entries, more than the supported {bound} "
        r"\(prefixcache\.MAX_BATCH_SEQUENCES\)"
    )
    for call in (
        lambda: mgr.schedule_batch(too_many, 16),
        lambda: mgr.schedule_tokens(list(range(bound + 1)), 16),
        lambda: mgr.append_batch(too_many, too_many),
        lambda: mgr.decode_step(pc.PlanBuffers(), too_many, too_many),
        lambda: mgr.block_table(0, too_many),
        lambda: mgr.schedule_batch(torch.zeros(bound + 1, dtype=torch.int64), 16),
    ):
        with pytest.raises(pc.InvalidRequestError, match=message):
            call()
    # At the bound itself the ids are read, and the core answers for them.
    with pytest.raises(pc.UnknownSequenceError, match="unknown sequence 99"):
        mgr.schedule_batch(np.broadcast_to(np.int64(99), (bound,)), 16)
    still_usable(mgr)


@pytest.mark.parametrize("bad", OUT_OF_RANGE_U32, ids=repr)
def test_counts_out_of_range(mgr: pc.CacheManager, bad: int) -> None:
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: mgr.schedule(2, bad), "max_tokens"),
        (lambda: mgr.schedule(2, 16, lookahead=bad), "lookahead"),
        (lambda: mgr.schedule_batch([2], bad), "max_tokens"),
        (lambda: mgr.schedule_batch([2], [bad]), r"max_tokens\[0\]"),
        (lambda: mgr.request_checkpoint(1, bad), "position"),
        (lambda: mgr.suggest_chunk(2, bad), "token_budget"),
        (lambda: mgr.block_table(bad, [1]), "group"),
    ]
    for call, what in calls:
        with pytest.raises(pc.InvalidRequestError, match=rf"{what} must be in 0\.\.=4294967295"):
            call()
    still_usable(mgr)


@pytest.mark.parametrize("bad", WRONG_TYPE_INTS, ids=repr)
def test_counts_of_the_wrong_type(mgr: pc.CacheManager, bad: object) -> None:
    calls: list[Callable[[], object]] = [
        lambda: mgr.schedule(2, bad),  # type: ignore[arg-type]
        lambda: mgr.request_checkpoint(1, bad),  # type: ignore[arg-type]
        lambda: mgr.suggest_chunk(2, bad),  # type: ignore[arg-type]
        lambda: mgr.block_table(bad, [1]),  # type: ignore[arg-type]
    ]
    if bad is not None:  # lookahead=None means the default
        calls.append(lambda: mgr.schedule(2, 16, lookahead=bad))  # type: ignore[arg-type]
    for call in calls:
        with pytest.raises(TypeError, match="must be an int"):
            call()
    if not isinstance(bad, bool):
        with pytest.raises(TypeError):
            mgr.schedule(2, 16, exact=bad)  # type: ignore[arg-type]
    still_usable(mgr)


def test_bad_batches(mgr: pc.CacheManager) -> None:
    mgr.add(3, list(range(32)))
    for schedule in (mgr.schedule_batch, mgr.schedule_tokens):
        with pytest.raises(pc.InvalidRequestError, match="2 sequence ids but 1 token budgets"):
            schedule([2, 3], [16])
        with pytest.raises(pc.StepError, match="appears twice"):
            schedule([2, 2], 16)
        with pytest.raises(pc.UnknownSequenceError, match="unknown sequence 99"):
            schedule([2, 99], 16)
        with pytest.raises(TypeError, match="integer array"):
            schedule(np.array([2.0]), 16)
    with pytest.raises(pc.StepError, match="appears twice"):
        mgr.schedule_batch([2, 2], 16)
    with pytest.raises(pc.UnknownSequenceError, match="unknown sequence 99"):
        mgr.schedule_batch([2, 99], 16)
    with pytest.raises(pc.InvalidRequestError, match="must be 1-D"):
        mgr.schedule_batch(np.array([[2, 3]]), 16)
    with pytest.raises(pc.InvalidRequestError, match=r"seq_ids\[0\] is out of range"):
        mgr.schedule_batch(np.array([-2], dtype=np.int64), 16)
    with pytest.raises(TypeError, match="integer array"):
        mgr.schedule_batch(np.array([2.0]), 16)
    with pytest.raises(TypeError, match=r"seq_ids\[0\] must be an int"):
        mgr.schedule_batch(["2"], 16)
    with pytest.raises(pc.InvalidRequestError, match="1 sequence ids but 2 tokens"):
        mgr.append_batch([1], [1, 2])
    with pytest.raises(pc.UnknownSequenceError):
        mgr.append_batch([1, 99], [1, 2])
    assert mgr.num_tokens(1) == 41  # nothing was appended
    with pytest.raises(pc.InvalidRequestError, match="not a paged group"):
        mgr.block_table(1, [1])
    with pytest.raises(pc.InvalidRequestError, match="not a paged group"):
        mgr.block_table(7, [1])
    with pytest.raises(pc.UnknownSequenceError):
        mgr.block_table(0, [1, 99])
    assert mgr.schedule_batch([], 16) == []
    assert mgr.block_table(0, []).shape == (0, 0)
    still_usable(mgr)


def test_bad_extra_keys(mgr: pc.CacheManager) -> None:
    image = pc.MultimodalInput
    cases: list[tuple[object, type[BaseException], str]] = [
        ("salt", TypeError, 'must have an attribute "cache_salt"'),
        (pc.ExtraKeys(cache_salt=5), TypeError, "cache_salt must be bytes or str"),  # type: ignore[arg-type]
        (pc.ExtraKeys(lora_id=-1), pc.InvalidRequestError, "lora_id must be in"),
        (pc.ExtraKeys(lora_id="a"), TypeError, "lora_id must be an int"),  # type: ignore[arg-type]
        (pc.ExtraKeys(multimodal=[image(5, 5, b"x")]), pc.InvalidRequestError, "which is empty"),
        (pc.ExtraKeys(multimodal=[image(1, 2, b"")]), pc.InvalidRequestError, "empty hash"),
        (pc.ExtraKeys(multimodal=[image(0, 99, b"x")]), pc.InvalidRequestError, "ends beyond"),
        (pc.ExtraKeys(multimodal=[image(-1, 2, b"x")]), pc.InvalidRequestError, "start must be"),
        (pc.ExtraKeys(multimodal=[5]), TypeError, 'must have an attribute "start"'),  # type: ignore[list-item]
    ]
    for extra, error, message in cases:
        with pytest.raises(error, match=message):
            mgr.add(3, list(range(32)), extra_keys=extra)  # type: ignore[arg-type]
        with pytest.raises(pc.UnknownSequenceError):
            mgr.lookup(3)
    with pytest.raises(TypeError, match="lora_id must be an int"):
        pc.hash_prefix([1] * 16, extra_keys=pc.ExtraKeys(lora_id=1.0))  # type: ignore[arg-type]
    still_usable(mgr)


def test_extra_keys_beyond_the_bounds_are_refused_before_they_are_copied(
    mgr: pc.CacheManager,
) -> None:
    limit = pc.MAX_EXTRA_KEY_BYTES
    long = b"x" * (limit + 1)
    huge = memoryview(np.broadcast_to(np.uint8(1), (2**40,)))  # 1 TiB that occupies nothing
    prompt = list(range(32))
    too_long: list[tuple[object, int]] = [
        (long, limit + 1),
        (bytearray(long), limit + 1),
        ("é" * limit, 2 * limit),  # a str is its UTF-8 bytes
        (huge, 2**40),
    ]
    for value, length in too_long:
        message = (
            rf"is {length} bytes, more than the limit of {limit} bytes "
            r"\(prefixcache\.MAX_EXTRA_KEY_BYTES\); pass a digest of it instead"
        )
        with pytest.raises(pc.InvalidRequestError, match="extra_keys.cache_salt " + message):
            mgr.add(3, prompt, extra_keys=pc.ExtraKeys(cache_salt=value))  # type: ignore[arg-type]
        image = pc.MultimodalInput(0, 16, value)  # type: ignore[arg-type]
        with pytest.raises(pc.InvalidRequestError, match=r"multimodal\[0\]\.hash " + message):
            pc.hash_prefix(prompt, extra_keys=pc.ExtraKeys(multimodal=[image]))
    assert pc.hash_prefix(prompt, extra_keys=pc.ExtraKeys(cache_salt=b"x" * limit))
    bound = pc.MAX_MULTIMODAL_INPUTS
    inputs = [pc.MultimodalInput(0, 1, b"x")] * (bound + 1)
    endless = SimpleNamespace(cache_salt=None, lora_id=None, multimodal=itertools.repeat(inputs[0]))
    for extra, count in ((pc.ExtraKeys(multimodal=inputs), bound + 1), (endless, "more")):
        with pytest.raises(
            pc.InvalidRequestError,
            match=rf"extra_keys\.multimodal has {count} inputs, more than the limit of {bound} a "
            r"sequence \(prefixcache\.MAX_MULTIMODAL_INPUTS\)",
        ):
            mgr.add(3, prompt, extra_keys=extra)  # type: ignore[arg-type]
    with pytest.raises(pc.UnknownSequenceError):
        mgr.lookup(3)
    still_usable(mgr)


def test_bad_hash_prefix_settings() -> None:
    with pytest.raises(pc.InvalidRequestError, match=r"unit must be in 1\.\.="):
        pc.hash_prefix([1] * 16, unit=0)
    with pytest.raises(pc.InvalidRequestError, match="unit must be in"):
        pc.hash_prefix([1] * 16, unit=-16)
    with pytest.raises(pc.InvalidRequestError, match='algorithm "md5" is unknown'):
        pc.hash_prefix([1] * 16, algorithm="md5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="algorithm must be a str"):
        pc.hash_prefix([1] * 16, algorithm=5)  # type: ignore[arg-type]
    with pytest.raises(pc.InvalidRequestError, match="seed must be in"):
        pc.hash_prefix([1] * 16, seed=-1)
    with pytest.raises(pc.InvalidRequestError, match="seed must be in"):
        pc.hash_prefix([1] * 16, seed=2**64)
    with pytest.raises(TypeError, match="seed must be an int"):
        pc.hash_prefix([1] * 16, seed="0")  # type: ignore[arg-type]


def test_protocol_misuse(mgr: pc.CacheManager) -> None:
    mgr.finish(1)
    with pytest.raises(pc.UnknownSequenceError, match="unknown sequence 1"):
        mgr.finish(1)  # double finish
    with pytest.raises(pc.DuplicateSequenceError, match="sequence 2 is already live"):
        mgr.add(2, [1])
    with pytest.raises(pc.StepError, match="not scheduled"):
        mgr.request_checkpoint(2, 16)
    mgr.schedule(2, 32)
    plan = mgr.build_plan()
    for call in (
        lambda: mgr.build_plan(),
        lambda: mgr.schedule(2, 1),
        lambda: mgr.schedule_batch([2], 1),
        lambda: mgr.append(2, [1]),
        lambda: mgr.append_batch([2], [1]),
        lambda: mgr.finish(2),
        lambda: mgr.preempt(2),
        lambda: mgr.reset(),
        lambda: mgr.request_checkpoint(2, 16),
    ):
        with pytest.raises(pc.StepError, match=f"plan of step {plan.step_id} is in flight"):
            call()
    mgr.lookup(2)  # allowed while a plan is in flight
    mgr.stats()
    mgr.commit(plan)
    with pytest.raises(pc.StalePlanError, match="already committed"):
        mgr.commit(plan)  # twice
    with pytest.raises(pc.StalePlanError, match="already committed"):
        mgr.abort(plan)  # abort after commit
    for bad in (None, 5, "plan", plan.paged[0]):
        with pytest.raises(TypeError, match="StepPlan"):
            mgr.commit(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="StepPlan"):
            mgr.abort(bad)  # type: ignore[arg-type]
    with pytest.raises(pc.InvalidRequestError, match="lookahead"):
        mgr.schedule(2, 16, lookahead=2)  # state groups cannot roll back drafts
    with pytest.raises(pc.InvalidRequestError, match="group must be in"):
        plan.paged_group(-1)
    with pytest.raises(TypeError, match="group must be an int"):
        plan.state_group("1")  # type: ignore[arg-type]
    still_usable(mgr)


def test_finish_or_preempt_drops_a_scheduled_sequence_from_the_next_plan() -> None:
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, list(range(32)))
    mgr.add(2, list(range(32)))
    mgr.schedule_batch([1, 2], 32)
    mgr.finish(1)
    mgr.preempt(2)
    plan = mgr.build_plan()
    assert plan.num_rows == 0
    mgr.commit(plan)
    still_usable(mgr)


def invalid_configs() -> list[tuple[Callable[[], object], type[BaseException], str]]:
    attention = pc.FullAttention(block_size=32)
    pools = [pc.PoolConfig(16)]

    def cfg(**kw: Any) -> Callable[[], object]:
        args: dict[str, Any] = {"pools": pools, "groups": [attention]} | kw
        return lambda: pc.CacheConfig(**args)

    def state(**kw: Any) -> Callable[[], object]:
        return cfg(groups=[attention, pc.StateGroup(**kw)])

    return [
        (cfg(pools=[]), pc.ConfigError, "no pools"),
        (cfg(groups=[]), pc.ConfigError, "no groups"),
        (cfg(pools=[pc.PoolConfig(1)]), pc.ConfigError, "at least 2"),
        (cfg(pools=[pc.PoolConfig(-5)]), pc.ConfigError, r"pools\[0\].num_blocks must be in"),
        (cfg(pools=[pc.PoolConfig(2**40)]), pc.ConfigError, "num_blocks must be in"),
        (cfg(pools=[pc.PoolConfig(2**31)]), pc.ConfigError, "block ids are int32"),
        (cfg(pools=[pc.PoolConfig("8")]), TypeError, "num_blocks must be an int"),  # type: ignore[arg-type]
        (cfg(pools=5), TypeError, "pools must be a list"),
        (cfg(groups="full"), TypeError, "groups must be a list, got str"),
        (lambda: pc.ExtraKeys(multimodal=3), TypeError, "multimodal must be a list"),  # type: ignore[arg-type]
        (cfg(groups=[object()]), TypeError, "FullAttention, SlidingWindow or StateGroup"),
        (cfg(groups=[pc.FullAttention(0)]), pc.ConfigError, "block size 0"),
        (cfg(groups=[pc.FullAttention(24)]), pc.ConfigError, "U must divide"),
        (cfg(groups=[pc.FullAttention(32, pool=1)]), pc.ConfigError, "uses pool 1"),
        (cfg(groups=[pc.FullAttention(32, pool=-1)]), pc.ConfigError, "pool must be in"),
        (cfg(groups=[pc.SlidingWindow(32, 16)]), pc.ConfigError, "smaller than its block"),
        (state(alignment=0), pc.ConfigError, "alignment A = 0"),
        (state(alignment=5), pc.ConfigError, "must divide the hash unit"),
        (state(retention=pc.Retention(interval=20)), pc.ConfigError, "interval K = 20"),
        (state(checkpoint_cap=0), pc.ConfigError, "checkpoint_cap = 0"),
        (state(max_checkpoints_per_step=-1), pc.ConfigError, "max_checkpoints_per_step"),
        (state(retention=pc.Retention(tail="yes")), TypeError, "tail must be a bool"),  # type: ignore[arg-type]
        (state(retention=None), TypeError, 'must have an attribute "tail"'),  # type: ignore[arg-type]
        (cfg(hash=pc.HashConfig(unit=0)), pc.ConfigError, "unit U must be at least 1"),
        (cfg(hash=pc.HashConfig(algorithm="md5")), pc.ConfigError, "unknown"),  # type: ignore[arg-type]
        (cfg(hash=pc.HashConfig(seed=-1)), pc.ConfigError, "hash.seed must be in"),
        (cfg(hash=pc.HashConfig(verify_tokens=1)), TypeError, "verify_tokens must be a bool"),  # type: ignore[arg-type]
        (cfg(hash=None), TypeError, 'must have an attribute "algorithm"'),
        (cfg(enable_events="yes"), TypeError, "enable_events must be a bool"),
        (cfg(finished_cache_bytes=-1), pc.ConfigError, "finished_cache_bytes must be in"),
        (cfg(reuse_live_prefixes=None), TypeError, "reuse_live_prefixes must be a bool"),  # type: ignore[arg-type]
        (cfg(recently_evicted_capacity=2.5), TypeError, "must be an int"),
        (lambda: pc.CacheManager(None), TypeError, "must have an attribute"),  # type: ignore[arg-type]
        (lambda: pc.CacheManager(5), TypeError, "must have an attribute"),  # type: ignore[arg-type]
    ]


def test_state_group_from_something_that_is_not_a_backend() -> None:
    with pytest.raises(TypeError, match="lacks checkpoint_alignment, max_checkpoints_per_step"):
        pc.StateGroup.from_backend(object())  # type: ignore[arg-type]

    class Unaligned:
        checkpoint_alignment = 0
        max_checkpoints_per_step = None

    group = pc.StateGroup.from_backend(Unaligned())
    with pytest.raises(pc.ConfigError, match="alignment A = 0"):
        pc.CacheConfig(pools=[pc.PoolConfig(8)], groups=[group])


@pytest.mark.parametrize(("make", "error", "message"), invalid_configs())
def test_invalid_configs(
    make: Callable[[], object], error: type[BaseException], message: str
) -> None:
    with pytest.raises(error, match=message):
        make()
    if issubclass(error, pc.ConfigError):
        assert issubclass(error, ValueError)


# A small random walk over the whole API with good and bad arguments: only typed exceptions,
# and the invariants hold after every call.
ARG = st.one_of(
    st.integers(min_value=-3, max_value=6),
    st.sampled_from([2**40, 2**70, None, "x", 1.5, True]),
)
TOKENS = st.one_of(
    st.lists(st.integers(min_value=0, max_value=50), max_size=70),
    st.lists(st.integers(min_value=-1, max_value=2**32), max_size=3),
    st.sampled_from(["x", None, np.zeros((2, 2), dtype=np.int64), np.array([1.5])]),
)
OPS = st.sampled_from(
    [
        "add",
        "lookup",
        "schedule",
        "schedule_batch",
        "schedule_tokens",
        "request_checkpoint",
        "suggest_chunk",
        "build_commit",
        "build_abort",
        "append",
        "append_batch",
        "finish",
        "preempt",
        "reset",
        "block_table",
    ]
)


@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.lists(st.tuples(OPS, ARG, ARG, TOKENS), min_size=1, max_size=30))
def test_random_calls_raise_only_typed_errors(
    calls: list[tuple[str, object, object, object]],
) -> None:
    mgr = pc.CacheManager(hybrid_config(num_blocks=12, state_blocks=10, alignment=8))
    for op, a, b, tokens in calls:
        try:
            if op == "add":
                mgr.add(a, tokens)  # type: ignore[arg-type]
            elif op == "lookup":
                mgr.lookup(a)  # type: ignore[arg-type]
            elif op == "schedule":
                mgr.schedule(a, b if isinstance(b, int) else 64)  # type: ignore[arg-type]
            elif op == "schedule_batch":
                mgr.schedule_batch([a, b], 32)  # type: ignore[list-item]
            elif op == "schedule_tokens":
                mgr.schedule_tokens([a, b], b)  # type: ignore[list-item, arg-type]
            elif op == "request_checkpoint":
                mgr.request_checkpoint(a, b)  # type: ignore[arg-type]
            elif op == "suggest_chunk":
                mgr.suggest_chunk(a, b)  # type: ignore[arg-type]
            elif op in ("build_commit", "build_abort"):
                plan = mgr.build_plan()
                mgr.check_invariants()
                (mgr.commit if op == "build_commit" else mgr.abort)(plan)
            elif op == "append":
                mgr.append(a, tokens)  # type: ignore[arg-type]
            elif op == "append_batch":
                mgr.append_batch([a], [b])  # type: ignore[list-item]
            elif op == "finish":
                mgr.finish(a)  # type: ignore[arg-type]
            elif op == "preempt":
                mgr.preempt(a)  # type: ignore[arg-type]
            elif op == "reset":
                mgr.reset()
            else:
                mgr.block_table(a, [b])  # type: ignore[arg-type, list-item]
        except pc.InvariantError:
            raise
        except (pc.PrefixCacheError, TypeError, ValueError):
            pass
        mgr.check_invariants()


@pytest.mark.parametrize("dtype", [">i8", ">u8", ">i4", ">u4", ">i2", ">u2"])
@pytest.mark.parametrize("length", [40, 3000])  # copied out, read in place
@pytest.mark.parametrize("strided", [False, True])
def test_integer_arrays_in_the_other_byte_order_hold_their_values(
    dtype: str, length: int, strided: bool
) -> None:
    other = np.dtype(dtype) if sys.byteorder == "little" else np.dtype(dtype).newbyteorder("<")
    assert not other.isnative

    def make(values: list[int]) -> np.ndarray:
        array = np.array(values, dtype=other.newbyteorder("=")).astype(other)
        return np.repeat(array, 2)[::2] if strided else array

    tokens = [i % 1000 for i in range(length)]
    assert pc.hash_prefix(make(tokens)) == pc.hash_prefix(tokens)
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, make(tokens))
    mgr.append(1, make([7, 8]))
    assert mgr.num_tokens(1) == length + 2
    assert mgr.schedule_tokens(make([1]), make([16])).tolist() == [16]
    assert mgr.block_table(0, make([1])).shape == (1, 1)
    # Out-of-range values are found in the other byte order too.
    if other.kind == "i" or other.itemsize == 8:
        bad = [*tokens[:-1], -1 if other.kind == "i" else 2**64 - 1]
        with pytest.raises(pc.InvalidRequestError, match=rf"tokens\[{length - 1}\] is out of"):
            mgr.add(2, make(bad))
    mgr.check_invariants()


MASKED_CALLS: list[tuple[str, Callable[[pc.CacheManager, np.ma.MaskedArray], object]]] = [
    ("add", lambda m, a: m.add(3, a)),
    ("add extends", lambda m, a: m.add(3, a, extends=1)),
    ("append", lambda m, a: m.append(1, a)),
    ("hash_prefix", lambda m, a: pc.hash_prefix(a)),
    ("schedule_batch", lambda m, a: m.schedule_batch(a[2:3], 16)),
    ("schedule_batch budgets", lambda m, a: m.schedule_batch([2], a[:1])),
    ("append_batch", lambda m, a: m.append_batch(a[1:2], [5])),
    ("decode_step", lambda m, a: m.decode_step(pc.PlanBuffers(), a[1:2], [5])),
]


@pytest.mark.parametrize(("name", "call"), MASKED_CALLS, ids=[n for n, _ in MASKED_CALLS])
def test_masked_arrays_are_refused_not_read_without_their_mask(
    mgr: pc.CacheManager,
    name: str,
    call: Callable[[pc.CacheManager, np.ma.MaskedArray], object],
) -> None:
    masked = np.ma.masked_array(np.arange(40), mask=np.arange(40) == 30)
    with pytest.raises(
        TypeError, match=r"is a numpy masked array, and its mask would be ignored: pass a plain "
    ) as error:
        call(mgr, masked)
    assert "arr.filled(value)" in str(error.value) and "arr.compressed()" in str(error.value)
    assert mgr.num_tokens(1) == 41 and mgr.plan_in_flight is None
    mgr.add(3, masked.filled(0))  # what the message says to pass
    assert mgr.num_tokens(3) == 40
    still_usable(mgr)


BYTES_LIKE: list[tuple[str, Callable[[bytes], object]]] = [
    ("bytes", bytes),
    ("bytearray", bytearray),
    ("memoryview", memoryview),
    ("uint8 array", lambda b: np.frombuffer(b, dtype=np.uint8)),
]


@pytest.mark.parametrize("as_bytes", [f for _, f in BYTES_LIKE], ids=[n for n, _ in BYTES_LIKE])
def test_byte_fields_take_every_bytes_like_value_alike(as_bytes: Callable[[bytes], Any]) -> None:
    """A cache salt and a multimodal hash are bytes: any bytes-like object gives the same keys
    as `bytes` with its contents."""
    prompt = list(range(64))

    def keys(convert: Callable[[bytes], Any]) -> pc.ExtraKeys:
        image = pc.MultimodalInput(start=10, end=20, hash=convert(b"img"))
        return pc.ExtraKeys(cache_salt=convert(b"tenant-a"), multimodal=[image])

    reference, given = keys(bytes), keys(as_bytes)
    assert pc.hash_prefix(prompt, extra_keys=given) == pc.hash_prefix(prompt, extra_keys=reference)
    assert pc.hash_prefix(prompt, extra_keys=given) != pc.hash_prefix(prompt)
    mgr = pc.CacheManager(paged_config())
    mgr.add(1, prompt, extra_keys=reference)
    mgr.schedule(1, 64)
    mgr.commit(mgr.build_plan())
    mgr.finish(1)
    mgr.add(2, prompt, extra_keys=given)
    assert mgr.lookup(2).tokens == 48


@pytest.mark.parametrize(
    "data", [b"\x01\x02", bytearray(b"\x01\x02"), memoryview(b"\x01\x02")], ids=repr
)
def test_byte_data_is_refused_where_integers_are_expected(
    mgr: pc.CacheManager, data: bytes | bytearray | memoryview
) -> None:
    """Byte data is not a token or id list, whatever object holds it."""
    kind = type(data).__name__
    for call in (
        lambda: mgr.add(3, data),
        lambda: mgr.add(3, data, extends=1),
        lambda: mgr.append(1, data),
        lambda: pc.hash_prefix(data),
        lambda: mgr.append_batch(data, [1, 2]),
        lambda: mgr.append_batch([1, 2], data),
        lambda: mgr.schedule_batch(data, 16),
        lambda: mgr.schedule_batch([1, 2], data),
    ):
        with pytest.raises(
            TypeError,
            match=rf"must be a list of ints or a 1-D integer array, got {kind} \(byte data.*"
            r"numpy\.frombuffer",
        ):
            call()  # type: ignore[arg-type]
    assert mgr.num_tokens(1) == 41
    still_usable(mgr)


def test_a_sequence_named_twice_is_refused_by_every_batch_call(mgr: pc.CacheManager) -> None:
    buffers = pc.PlanBuffers()
    for name, call in (
        ("append_batch", lambda: mgr.append_batch([1, 1], [5, 6])),
        ("decode_step", lambda: mgr.decode_step(buffers, [1, 1], [5, 6])),
        ("schedule_batch", lambda: mgr.schedule_batch([2, 2], 16)),
    ):
        with pytest.raises(pc.StepError, match=rf"sequence \d+ appears twice in one {name}"):
            call()
    assert mgr.num_tokens(1) == 41  # nothing was appended
    still_usable(mgr)
