"""A stateful fuzzer of prefixcache's public Python API (a hypothesis ``RuleBasedStateMachine``).

Each program builds a random configuration (1 to 3 pools, tiny ones included; full-attention,
sliding-window and state groups, pools shared between groups, checkpoint caps, retention
variants, both hash algorithms, ``verify_tokens``, ``reuse_live_prefixes``, a small finished
cache) and then drives one manager through every public call, with good arguments and hostile
ones: ``add`` with every shape of ``ExtraKeys`` and of token container, ``extends``,
``lookup``, ``schedule`` (budgets, ``exact``, lookahead), the batch calls with NumPy arrays,
``request_checkpoint``, ``build_plan`` / ``build_plan_into``, ``commit`` / ``abort`` of the
plan in flight, of stale plans and of another manager's plans, ``PlanBuffers`` shared by two
managers, ``decode_step``, ``append``, ``finish``, ``preempt``, ``reset``, events, statistics,
pool usage, ``hash_prefix`` and a read of ``PlanBuffers`` while another thread builds into them.

What every call must satisfy, checked by a model kept here in plain Python:

* it raises only a ``PrefixCacheError`` (never ``InvariantError``), or ``TypeError`` /
  ``ValueError`` / ``OverflowError`` for a Python value of the wrong type, and exactly the
  error the documented rules predict when they predict one (``None`` where an int is needed:
  ``TypeError``; an id past ``2**63 - 1``: ``InvalidRequestError``; a step call while a plan
  is in flight: ``StepError``; ...); a refused call changes nothing;
* ``check_invariants()`` passes after it, and the manager's sequences, tokens and plan in
  flight are the model's;
* no hit exceeds what was computed with the same extra keys: the model records the identity
  of every prefix a committed step computed (its tokens, salt, LoRA id and, per hash unit,
  the ordered hashes of the multimodal inputs overlapping the unit), and every hit, reconciled
  or per group, must be the length of such a prefix of the sequence (or 0) and at most
  ``((N - 1) // U) * U``; no group's own hit and no junction lies above the full-attention
  bound; digest reuse (``Added.reused_tokens``) never crosses a unit whose extra keys differ;
* when every event was seen, each hit is exactly the one the design's rule gives for the keys
  the events say are alive (each full-attention group's longest prefix, the other groups'
  longest position up to that bound, the largest position every group resumes at, the
  junction); with paged groups only and nothing ever evicted, it is the longest prefix ever
  computed with the sequence's extra keys;
* the plan is well formed (checkpoint offsets on the kernel's grid, within C and at positions
  the retention keeps; slots in their pool; copy-on-write lengths below the block), holds
  exactly what was scheduled, and writes each token into its sequence's block-table entry, in
  a block no other live sequence holds; a block is shared by two sequences only as a full
  block of a prefix both computed with the same extra keys, and never by two groups;
* every published key is the ``hash_prefix`` digest of a prefix of a sequence that the
  publishing call committed or finished (and ``hash_prefix`` equals the reference
  encoding); a removed block loses exactly the keys it was given; statistics count what the
  model counted; an ``AlignmentError`` says nothing false about the offset;
* at the end the manager is still usable: the plan in flight ends, every sequence finishes,
  no block is still owned, ``reset`` succeeds and a fresh request is served.

``OverlapMachine`` drives overlapped steps (``max_steps_in_flight`` 2 or 3: placeholders,
``resolve``, plans ended in and out of order, cascading aborts, ``decode_step_overlapped`` over
a ring of ``PlanBuffers``, finish and preempt in flight) with its own statement of their rules;
a campaign runs both machines.

A long campaign: ``python3 tests/fuzz_api.py --examples N --seed S [--rounds R] [--gentle]``
(``--gentle``: no hostile values, deeper programs; ``--no-shrink``: report failures as found;
``--ignore SIGNATURE``: skip a failure already known). It prints the seed, the operations
run and each failure with its minimal program (``from prefixcache import *`` runs it). The
test suite runs a short deterministic one (``tests/test_fuzz_api.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import prefixcache as pc
import reference_encoding
from hypothesis import HealthCheck, Phase, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    precondition,
    rule,
)

OPERATIONS = 0
"""Calls into prefixcache made by the fuzzer so far (all programs, shrinking included)."""
CHECKPOINT_RESUMES = 0
"""Plan rows of ``OverlapMachine`` that resumed from a published checkpoint (its short run in
``make test`` must reach some), and those of them built while other plans were in flight."""
CHECKPOINT_RESUMES_IN_FLIGHT = 0
CHECKPOINT_RESUMES_WITH_EXTRA_KEYS = 0
"""Of those, rows of sequences with extra keys; and ``request_checkpoint`` calls of
``OverlapMachine`` accepted for a known chunk."""
CHECKPOINT_REQUESTS = 0
HUGE_POOL_CHECKED = False

SEQ_ID_MAX = 2**63 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
LOOKAHEAD_SURELY_TOO_LARGE = 1 << 20
"""Lookahead beyond any sensible bound: must be refused (InvalidRequestError), whatever the
exact limit the core chooses."""

# The errors a call may raise at all (the documented ones for wrong Python types included).
TYPED = (pc.PrefixCacheError, TypeError, ValueError, OverflowError)
BYTE_ORDER_WORDS = ("byte order", "byteorder", "endian", "native")
STOPS = {"not_cached", "recently_evicted", "no_state_at_position", "window_gap", None}


class FuzzFailure(AssertionError):
    """A call broke a rule of the API (the message says which)."""


_FAILURE_KINDS: dict[str, type[FuzzFailure]] = {}
IGNORED: set[str] = set()
"""Signatures of failures already reported by this campaign: a program that meets one again
is discarded (``reject``), so that a long run goes on to find other failures."""


def shape(text: str) -> str:
    """``text`` without its values (numbers and quoted reprs): what stays for every instance
    of one failure."""
    return re.sub(r"\d+|b?'[^']*'|\"[^\"]*\"|\([^()]*\)|\[[^\[\]]*\]", "#", text)[:160]


def failure_class(message: str, signature: str) -> type[FuzzFailure]:
    """A FuzzFailure subclass per signature, named after the call the message starts with:
    hypothesis groups failures by exception type, so different failures stay apart."""
    if signature not in _FAILURE_KINDS:
        match = re.match(r"[A-Za-z_.]+", message)
        words = re.split(r"[._]", match.group() if match else "")
        name = "".join(w.title() for w in words if w) or "Api"
        cls = type(f"{name}Failure", (FuzzFailure,), {"__module__": __name__})
        cls.signature = signature  # type: ignore[attr-defined]
        _FAILURE_KINDS[signature] = cls
    return _FAILURE_KINDS[signature]


def int_kind(value: object, top: int) -> str:
    """``"ok"`` for an int in ``0..=top``, ``"range"`` for another int, ``"type"`` otherwise
    (``bool`` is not an int here, as in the bindings)."""
    if isinstance(value, (bool, np.bool_)):
        return "type"
    if isinstance(value, (int, np.integer)):
        return "ok" if 0 <= int(value) <= top else "range"
    return "type"


@dataclass
class Expect:
    """What a call may do: raise one of ``errors`` (when any, it must raise), or raise one of
    ``maybe`` / succeed."""

    errors: set[type[BaseException]] = field(default_factory=set)
    maybe: set[type[BaseException]] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    message_check: Callable[[BaseException], str | None] | None = None

    def must(self, error: type[BaseException], why: str) -> Expect:
        self.errors.add(error)
        self.reasons.append(f"must raise {error.__name__}: {why}")
        return self

    def may(self, error: type[BaseException], why: str) -> Expect:
        self.maybe.add(error)
        self.reasons.append(f"may raise {error.__name__}: {why}")
        return self

    def int_arg(self, value: object, top: int, what: str) -> bool:
        """Adds the errors for a bad int argument; whether the value is a good one."""
        kind = int_kind(value, top)
        if kind == "type":
            self.must(TypeError, f"{what}={value!r} is not an int")
        elif kind == "range":
            self.must(pc.InvalidRequestError, f"{what}={value!r} is out of 0..={top}")
        return kind == "ok"

    def merge(self, other: Expect) -> Expect:
        self.errors |= other.errors
        self.maybe |= other.maybe
        self.reasons += other.reasons
        self.message_check = self.message_check or other.message_check
        return self


# ---------------------------------------------------------------------------------------------
# Independent helpers: the digest encoding of docs/HASHING.md, token containers, extra keys.


def reference_digests(
    tokens: list[int],
    unit: int,
    algorithm: str,
    seed: int,
    salt: bytes | None,
    lora: int | None,
    multimodal: Iterable[tuple[int, int, bytes]],
) -> list[bytes]:
    """The reference encoding of docs/HASHING.md."""
    return reference_encoding.reference(tokens, unit, algorithm, seed, salt, lora, multimodal)


GENTLE = False
"""No hostile values at all (``--gentle``): every program goes deep into the protocol."""


def mostly(good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], odds: int = 12) -> Any:
    """``good`` but one time in ``odds + 1`` ``odd`` (hostile values stay rare, so that most
    programs get far; shrinking goes towards ``good``)."""
    return st.integers(0, odds).flatmap(lambda i: odd if i == odds and not GENTLE else good)


TOKEN_FORMS_GOOD = ["list", "list", "list", "uint32", "uint32", "int64", "tuple", "int32"]
TOKEN_FORMS_ODD = ["uint8", "strided", "numpy_scalars", "big_endian", "masked"]
TOKEN_FORMS_BAD = [
    "bytes",
    "bytearray",
    "memoryview",
    "negative",
    "too_big",
    "float",
    "bool",
    "2d",
    "string",
    "float_array",
]
TOKEN_FORMS = mostly(
    st.sampled_from(TOKEN_FORMS_GOOD),
    st.sampled_from(TOKEN_FORMS_ODD + TOKEN_FORMS_BAD),
    odds=8,
)


def byte_order_message(error: BaseException) -> str | None:
    """A big-endian integer array may be refused, but the message must say why (byte order),
    not that it is no integer array."""
    text = str(error).lower()
    if "dtype" not in text or any(word in text for word in BYTE_ORDER_WORDS):
        return None  # refused for another reason, or naming the byte order
    return f"a big-endian integer array was refused without naming the byte order: {error}"


def token_input(tokens: list[int], form: str) -> tuple[object, Expect]:
    """``tokens`` in the container ``form`` and what passing it must do."""
    expect = Expect()
    small = [t % 256 for t in tokens]
    if form == "list":
        return list(tokens), expect
    if form == "tuple":
        return tuple(tokens), expect
    if form in ("uint32", "int64", "int32", "uint8"):
        if form == "uint8" and any(t > 255 for t in tokens):
            return np.array(tokens, dtype=np.uint32), expect
        if form == "int32" and any(t > 2**31 - 1 for t in tokens):
            return np.array(tokens, dtype=np.int64), expect
        return np.array(tokens, dtype=form), expect
    if form == "strided":
        return np.repeat(np.array(tokens, dtype=np.int64), 2)[::2], expect
    if form == "numpy_scalars":
        return [np.int64(t) for t in tokens], expect.may(TypeError, "numpy scalars in a list")
    if form == "big_endian":
        expect.may(TypeError, "a big-endian array").may(ValueError, "a big-endian array")
        expect.message_check = byte_order_message
        return np.array(tokens, dtype=">i8"), expect
    if form == "masked":
        if tokens:
            mask = [True] + [False] * (len(tokens) - 1)
            expect.must(TypeError, "a masked array with a masked element").must(
                ValueError, "a masked array with a masked element"
            )
            return np.ma.array(tokens, mask=mask, dtype=np.int64), expect
        return np.ma.array(tokens, dtype=np.int64), expect.may(TypeError, "masked").may(
            ValueError, "masked"
        )
    if form == "bytes":
        return bytes(small), expect.must(TypeError, "bytes are not a list of token ids")
    if form == "bytearray":
        return bytearray(small), expect.must(TypeError, "a bytearray is refused as bytes are")
    if form == "memoryview":
        return memoryview(bytes(small)), expect.must(TypeError, "a memoryview is refused as bytes")
    if form == "negative":
        return [*tokens, -1], expect.must(pc.InvalidRequestError, "token -1")
    if form == "too_big":
        return [*tokens, 2**32], expect.must(pc.InvalidRequestError, "token 2**32")
    if form == "float":
        return [*tokens, 1.5], expect.must(TypeError, "token 1.5")
    if form == "bool":
        return [True, *tokens], expect.must(TypeError, "token True")
    if form == "2d":
        return np.array([tokens], dtype=np.int64), expect.must(pc.InvalidRequestError, "2-D array")
    if form == "string":
        return "abc", expect.must(TypeError, "a str")
    if form == "float_array":
        return np.array(tokens, dtype=np.float64), expect.must(TypeError, "a float array")
    raise AssertionError(form)


def id_array(ids: list[Any], form: str) -> tuple[object, Expect]:
    """Sequence ids in container ``form`` (ids are already hostile or not)."""
    expect = Expect()
    plain = all(int_kind(i, SEQ_ID_MAX) == "ok" for i in ids)
    if form == "list" or not plain:
        return list(ids), expect
    if form == "int64":
        return np.array(ids, dtype=np.int64), expect
    if form == "uint64":
        return np.array(ids, dtype=np.uint64), expect
    if form == "int32" and all(int(i) < 2**31 for i in ids):
        return np.array(ids, dtype=np.int32), expect
    if form == "big_endian":
        expect.may(TypeError, "a big-endian array").may(ValueError, "a big-endian array")
        expect.message_check = byte_order_message
        return np.array(ids, dtype=">i8"), expect
    if form == "masked" and ids:
        mask = [True] + [False] * (len(ids) - 1)
        expect.must(TypeError, "a masked array with a masked element").must(
            ValueError, "a masked array with a masked element"
        )
        return np.ma.array(ids, mask=mask, dtype=np.int64), expect
    return list(ids), expect


ID_FORMS = mostly(
    st.sampled_from(["list", "int64"]),
    st.sampled_from(["uint64", "int32", "big_endian", "masked"]),
    odds=6,
)
SALTS = mostly(
    st.sampled_from([None, None, None, b"", b"t1", "t1", "\u00e9", b"\xc3\xa9"]),
    st.sampled_from([bytearray(b"t1"), 5]),
)
LORAS = mostly(
    st.sampled_from([None, None, None, 0, 7, U64_MAX]), st.sampled_from([2**64, -1, True, 1.5])
)
MM_INPUT = st.tuples(
    st.integers(0, 100),  # start, in percent of the prompt
    mostly(st.integers(1, 8), st.just(0), odds=20),  # length (clipped to the prompt)
    st.sampled_from([b"A", b"A", b"B", b"AB"]),
    mostly(
        st.just("ok"),
        st.sampled_from(["empty_range", "past_end", "empty_hash", "negative", "huge", "bytearray"]),
        odds=10,
    ),
)
EXTRA_SPEC = st.one_of(
    st.just("none"),
    st.just("none"),
    st.just("inherit"),
    st.just("inherit"),
    st.just("inherit_fit"),
    st.tuples(
        SALTS,
        LORAS,
        st.lists(MM_INPUT, max_size=3),
        mostly(st.just("sorted"), st.sampled_from(["as_drawn", "reversed"]), odds=5),
    ),
)


@dataclass
class Seq:
    """The model of one sequence: what the manager was given."""

    seq_id: int
    tokens: list[int]
    salt: bytes | None
    lora: int | None
    multimodal: tuple[tuple[int, int, bytes], ...]
    own: int | None = None
    """Tokens committed when the sequence has started; ``None`` when its next schedule starts
    from a fresh lookup (after ``add`` or ``preempt``)."""
    digests: list[bytes] | None = None
    prefill: int | None = None
    """Tokens known when its prefill was first scheduled (the tail is retained from it)."""
    retained: set[int] = field(default_factory=set)
    """Positions a checkpoint may be taken at besides the policy's rules: the tails, the
    junctions of its lookups (``-1``: any, a junction unknown)."""
    requested: set[int] = field(default_factory=set)

    def unit_key(self, j: int, unit: int) -> tuple[Any, ...]:
        lo, hi = j * unit, (j + 1) * unit
        images = tuple(h for s, e, h in self.multimodal if s < hi and e > lo)
        return (tuple(self.tokens[lo:hi]), images)

    def identity(self, length: int, unit: int) -> tuple[Any, ...]:
        """What a prefix of ``length`` tokens (a multiple of the unit) is computed from."""
        return (self.salt, self.lora, tuple(self.unit_key(j, unit) for j in range(length // unit)))

    def extra_keys(self) -> pc.ExtraKeys:
        return pc.ExtraKeys(
            cache_salt=self.salt,
            lora_id=self.lora,
            multimodal=[pc.MultimodalInput(s, e, h) for s, e, h in self.multimodal],
        )


def hit_summary(hit: pc.Hit) -> tuple[Any, ...]:
    return (hit.tokens, hit.max_tokens, hit.junction, [(g.tokens, g.stop) for g in hit.groups])


def common_prefix(a: Seq, b: Seq, unit: int) -> int:
    """Tokens of the longest unit-aligned prefix whose every unit has the same tokens and the
    same extra keys in both sequences."""
    if (a.salt, a.lora) != (b.salt, b.lora):
        return 0
    k = 0
    while (k + 1) * unit <= min(len(a.tokens), len(b.tokens)) and a.unit_key(k, unit) == b.unit_key(
        k, unit
    ):
        k += 1
    return k * unit


@dataclass
class Flight:
    """The plan in flight: how it is held, its step and its rows (seq, computed, scheduled)."""

    obj: Any
    step_id: int
    rows: list[tuple[int, int, int]]


@st.composite
def configs(draw: st.DrawFn, depths: st.SearchStrategy[int] | None = None) -> pc.CacheConfig:
    unit = draw(st.integers(1, 8))
    n_pools = draw(st.integers(1, 3))
    pools = [
        pc.PoolConfig(
            num_blocks=draw(st.one_of(st.integers(2, 6), st.integers(7, 40), st.integers(41, 100)))
        )
        for _ in range(n_pools)
    ]
    divisors = [d for d in range(1, unit + 1) if unit % d == 0]
    groups: list[pc.Group] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["full", "full", "window", "state", "state"]))
        pool = draw(st.integers(0, n_pools - 1))
        block = unit * draw(st.integers(1, 4))
        if kind == "full":
            groups.append(pc.FullAttention(block_size=block, pool=pool))
        elif kind == "window":
            window = draw(st.integers(block, 3 * block))
            groups.append(pc.SlidingWindow(block_size=block, window=window, pool=pool))
        else:
            retention = pc.Retention(
                tail=draw(st.booleans()),
                interval=draw(st.one_of(st.none(), st.integers(1, 4).map(lambda k: k * unit))),
                junction=draw(st.booleans()),
                decode_tail=draw(st.booleans()),
            )
            groups.append(
                pc.StateGroup(
                    alignment=draw(st.sampled_from(divisors)),
                    max_checkpoints_per_step=draw(st.sampled_from([None, None, 0, 1, 2])),
                    pool=pool,
                    retention=retention,
                    checkpoint_cap=draw(st.sampled_from([None, None, 1, 2, 5])),
                    reserve_per_sequence=draw(st.integers(0, 3)),
                )
            )
    hash_config = pc.HashConfig(
        algorithm=draw(st.sampled_from(["xxh3_128", "sha256"])),
        seed=draw(st.sampled_from([0, 0, 1, U64_MAX])),
        unit=unit,
        verify_tokens=draw(st.booleans()),
    )
    return pc.CacheConfig(
        pools=pools,
        groups=groups,
        hash=hash_config,
        finished_cache_bytes=draw(st.sampled_from([0, 64, 1024, 64 << 20])),
        reuse_live_prefixes=draw(st.booleans()),
        recently_evicted_capacity=draw(st.sampled_from([0, 2, 4096])),
        enable_events=draw(st.sampled_from([True] * 6 + [False])),
        max_pending_events=draw(st.sampled_from([1, 8] + [1 << 20] * 6)),
        max_steps_in_flight=1 if depths is None else draw(depths),
    )


def _print_as_repr(obj: object, printer: Any, cycle: bool) -> None:
    printer.text(repr(obj))


try:  # failing programs print the group configurations as their (runnable) dataclass repr
    from hypothesis.vendor import pretty as _pretty

    for _cls in (pc.FullAttention, pc.SlidingWindow, pc.StateGroup):
        _pretty._type_pprinters[_cls] = _print_as_repr
except (ImportError, AttributeError):  # pragma: no cover - hypothesis internals moved
    pass


# Hostile values where an int is expected (ids, counts, positions).
HOSTILE_VALUES: list[object] = [-1, -(2**63), 2**63, U64_MAX, 2**64, 2**200, True, False]
HOSTILE_VALUES += [1.0, 2.5, "1", None, b"1", np.float64(3.0), np.int64(-5)]
HOSTILE = st.sampled_from(HOSTILE_VALUES)
WHO = mostly(st.integers(0, 47), st.one_of(st.integers(48, 63), HOSTILE), odds=10)
"""A sequence: 0..47 name a live one (if any), 48..63 an id never added, others are hostile."""
ADD_ID = mostly(st.integers(0, 19), HOSTILE, odds=16)
BUDGET = mostly(
    st.one_of(st.integers(1, 48), st.integers(0, 8)),
    st.sampled_from([U32_MAX, 2**31, 2**32, -1, True, 1.5, None, np.int64(8), np.uint32(5)]),
)
LOOKAHEAD = mostly(
    st.just(0),
    st.one_of(
        st.integers(1, 8),
        st.sampled_from([None, 1 << 16, (1 << 16) + 1, LOOKAHEAD_SURELY_TOO_LARGE + 1]),
        st.sampled_from([U32_MAX - 1, U32_MAX, 2**32, -1, True, 1.0]),
    ),
    odds=6,
)
EXACT = mostly(st.booleans(), st.sampled_from([1, 0, None, "yes"]), odds=10)
POSITION = mostly(
    st.tuples(
        st.sampled_from(["grid", "grid", "unit", "offset", "aligned", "raw"]), st.integers(0, 48)
    ),
    st.tuples(st.just("hostile"), st.one_of(HOSTILE, st.just(U32_MAX))),
    odds=10,
)
SMALL_TOKENS = st.lists(
    mostly(st.integers(0, 3), st.just(U32_MAX), odds=10), min_size=0, max_size=3
)
EXTENDS = mostly(
    st.sampled_from([None, None, "base", "base", "live"]),
    st.one_of(st.just("unknown"), HOSTILE),
    odds=8,
)


# A prompt long enough that building its plan releases the GIL (the bindings keep the GIL for
# small work), for the thread rule.
_LONG_PROMPT = list(range(4200))
_HOG_TOKENS = (np.arange(1 << 20, dtype=np.uint32) % 7).astype(np.uint32)


class FuzzMachine(RuleBasedStateMachine):
    """The state machine: one manager under test, a second one with the same configuration
    (for plans and buffers of another manager), and the model."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr: pc.CacheManager | None = None
        self.broken = False

    # -- set-up ---------------------------------------------------------------------------------

    @initialize(config=configs(), rows=st.integers(1, 4))
    def init(self, config: pc.CacheConfig, rows: int) -> None:
        self.cfg = config
        self.unit = config.hash.unit
        self.state_groups = [
            (i, g) for i, g in enumerate(config.groups) if isinstance(g, pc.StateGroup)
        ]
        self.full_groups = [
            i for i, g in enumerate(config.groups) if isinstance(g, pc.FullAttention)
        ]
        self.paged = {
            i: g
            for i, g in enumerate(config.groups)
            if isinstance(g, (pc.FullAttention, pc.SlidingWindow))
        }
        self.grid = 1
        for _, g in self.state_groups:
            self.grid = self.grid * g.alignment // math.gcd(self.grid, g.alignment)
        self.mgr = self.call(Expect(), "CacheManager(config)", lambda: pc.CacheManager(config))
        self.other = pc.CacheManager(config)
        self.other_next = 0
        self.buffers = pc.PlanBuffers(rows=rows)
        self.live: dict[int, Seq] = {}
        self.finished: dict[int, Seq] = {}
        self.computed: set[tuple[Any, ...]] = set()
        self.since_reset: set[tuple[Any, ...]] = set()  # the same, since the last reset
        self.pending: dict[int, tuple[int | None, int]] = {}
        self.flight: Flight | None = None
        self.ended: list[Any] = []  # plans committed or aborted (stale now)
        self.commits = 0
        self.aborts = 0
        self.refused = 0
        self.scheduled_tokens = 0
        self.finishes = 0
        self.cleared = True  # nothing published since the start or the last reset
        self.last_event = -1
        self.keys_on: dict[tuple[int, int], set[bytes]] = {}
        self.events_exact = config.enable_events and config.max_pending_events >= 4096
        self.side: pc.CacheManager | None = None
        self.check(self.mgr.chunk_alignment == self.grid, "chunk_alignment is not the lcm of A")

    # -- plumbing -------------------------------------------------------------------------------

    def fail(self, message: str, signature: str | None = None) -> None:
        """Raises the failure; ``signature`` (default: the line of the failed check) names
        it across instances."""
        if signature is None:
            caller = sys._getframe(2)
            signature = f"{caller.f_code.co_name}:{caller.f_lineno}"
        self.broken = True  # the teardown's checks would only hide this failure
        if signature in IGNORED:
            reject()
        raise failure_class(message, signature)(message)

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)

    def call(self, expect: Expect, label: str, fn: Callable[[], Any]) -> Any:
        """Runs one API call; returns its value, or the typed exception it raised as allowed
        by ``expect``. Anything else is a failure."""
        global OPERATIONS
        OPERATIONS += 1
        try:
            value = fn()
        except KeyboardInterrupt:
            raise
        except FuzzFailure:
            raise
        except BaseException as error:
            self.judge_error(expect, label, error)
            return error
        if expect.errors:
            reasons = "; ".join(expect.reasons)
            name = re.match(r"[A-Za-z_.]*", label).group()  # type: ignore[union-attr]
            errors = ",".join(sorted(e.__name__ for e in expect.errors))
            self.fail(f"{label} succeeded ({value!r}) but {reasons}", f"succeeded:{name}:{errors}")
        return value

    def judge_error(self, expect: Expect, label: str, error: BaseException) -> None:
        what = f"{label} raised {type(error).__name__}: {error}"
        if isinstance(error, pc.InvariantError):
            self.fail(
                f"{what} (InvariantError: a bug of prefixcache)", f"invariant:{shape(str(error))}"
            )
        if not isinstance(error, TYPED):
            self.fail(
                f"{what} (not a PrefixCacheError nor a TypeError/ValueError/OverflowError)",
                f"untyped:{type(error).__name__}:{shape(str(error))}",
            )
        allowed = expect.errors | expect.maybe
        if not any(isinstance(error, cls) for cls in allowed):
            reasons = "; ".join(expect.reasons) or "the call should have succeeded"
            self.fail(
                f"{what}, but {reasons}", f"unexpected:{type(error).__name__}:{shape(str(error))}"
            )
        if expect.message_check is not None:
            problem = expect.message_check(error)
            if problem:
                self.fail(f"{label}: {problem}", "message")

    def seq_of(self, who: object, prefer: Iterable[int] = ()) -> tuple[object, Seq | None]:
        """The id a rule acts on: a small int names a live sequence (one of ``prefer`` when
        there are such) or, from 48, an id never added; any other value is passed as is."""
        if isinstance(who, int) and not isinstance(who, bool) and 0 <= who < 64:
            ids = sorted(set(prefer) & set(self.live)) or sorted(self.live)
            if ids and who < 48:
                seq_id = ids[who % len(ids)]
                return seq_id, self.live[seq_id]
            return 1000 + who, None
        seq = self.live.get(int(who)) if int_kind(who, SEQ_ID_MAX) == "ok" else None  # type: ignore[call-overload]
        return who, seq

    def decoding(self) -> list[int]:
        """Live sequences whose every token is computed (the next token is a decode)."""
        return [s for s, q in self.live.items() if q.own == len(q.tokens)]

    def id_expect(self, seq_id: object, expect: Expect, what: str = "seq_id") -> bool:
        """Errors for an id that is not a live sequence; whether it is one."""
        if not expect.int_arg(seq_id, SEQ_ID_MAX, what):
            return False
        if int(seq_id) not in self.live:  # type: ignore[call-overload]
            expect.must(pc.UnknownSequenceError, f"{what} {seq_id} is not live")
            return False
        return True

    def in_flight_expect(self, expect: Expect, call: str) -> None:
        if self.flight is not None:
            expect.must(pc.StepError, f"{call} while step {self.flight.step_id} is in flight")

    def digests(self, seq: Seq) -> list[bytes]:
        if seq.digests is None or len(seq.digests) != len(seq.tokens) // self.unit:
            h = self.cfg.hash
            seq.digests = self.call(
                Expect(),
                "hash_prefix",
                lambda: pc.hash_prefix(
                    seq.tokens, self.unit, h.algorithm, h.seed, seq.extra_keys()
                ),
            )
        return seq.digests  # type: ignore[return-value]

    def holders(self) -> list[int]:
        """Live sequences that hold blocks (started or scheduled for the next plan)."""
        return [s for s, seq in self.live.items() if seq.own is not None or s in self.pending]

    # -- the oracle -----------------------------------------------------------------------------

    def was_computed(self, seq: Seq, length: int) -> bool:
        return length == 0 or seq.identity(length, self.unit) in self.computed

    def check_hit(self, seq: Seq, hit: pc.Hit, label: str, reference: bool = True) -> None:
        unit = self.unit
        n = len(seq.tokens)
        top = ((n - 1) // unit) * unit
        where = f"{label} of sequence {seq.seq_id} ({n} tokens, U={unit}): {hit!r}"
        self.check(hit.max_tokens == top, f"{where}: max_tokens is not ((N-1)//U)*U = {top}")
        own = [g.tokens for g in hit.groups]
        self.check(len(own) == len(self.cfg.groups), f"{where}: not one GroupHit per group")
        for lengths, name in (
            (hit.tokens, "hit"),
            *((g.tokens, f"group {g.group}") for g in hit.groups),
        ):
            self.check(
                lengths % unit == 0 and 0 <= lengths <= top,
                f"{where}: {name} {lengths} out of [0, {top}] or off the unit",
            )
            self.check(
                self.was_computed(seq, lengths),
                f"{where}: {name} {lengths} tokens, but no committed step ever computed this "
                f"prefix with these extra keys",
            )
        for i, g in enumerate(hit.groups):
            self.check(g.group == i, f"{where}: groups out of order")
            self.check(g.stop in STOPS, f"{where}: unknown stop {g.stop!r}")
            kind = self.cfg.groups[i]
            self.check(
                (g.stop != "no_state_at_position" or isinstance(kind, pc.StateGroup))
                and (g.stop != "window_gap" or isinstance(kind, pc.SlidingWindow))
                and (g.stop != "recently_evicted" or self.cfg.recently_evicted_capacity > 0),
                f"{where}: group {i} ({type(kind).__name__}) stops with {g.stop!r}",
            )
            self.check(
                (g.stop is None) == (g.tokens == top),
                f"{where}: group {i} stop {g.stop!r} with {g.tokens} of {top}",
            )
        self.check(hit.tokens <= min(own), f"{where}: the reconciled hit exceeds a group's own hit")
        if self.full_groups:
            bound = min(own[i] for i in self.full_groups)
            for i, g in enumerate(hit.groups):
                if i not in self.full_groups:
                    self.check(
                        g.tokens <= bound,
                        f"{where}: group {i}'s own hit is above the full-attention bound {bound}",
                    )
        # The junction: the largest own hit, never above the full-attention bound.
        bound = min((own[i] for i in self.full_groups), default=top)
        largest = min(max(own), bound)
        if hit.junction is None:
            self.check(
                largest < hit.tokens + 2 * unit,
                f"{where}: no junction although a group's own hit reaches {largest}",
            )
        else:
            self.check(
                hit.junction == largest and hit.junction >= hit.tokens + 2 * unit,
                f"{where}: junction is not the largest own hit up to the bound {bound} "
                "(and >= L + 2U)",
            )
        self.check_exact_paged_hit(seq, hit, where, top)
        if reference:
            self.check_hit_against_events(seq, hit, where, top)
        if self.cleared:
            self.check(
                hit.tokens == 0 and largest == 0,
                f"{where}: a hit with nothing published since reset",
            )

    def check_exact_paged_hit(self, seq: Seq, hit: pc.Hit, where: str, top: int) -> None:
        """With paged groups only and no block ever evicted since the last reset, every key
        a commit published is still there: the hit is the longest prefix ever computed with
        the sequence's extra keys (below the bound), for every group, and nothing stops for
        having been evicted."""
        if self.state_groups:
            return
        stats = self.call(Expect(), "stats()", self.mgr.stats)
        if stats.evictions:
            return
        unit = self.unit
        expected = max(
            (p for p in range(0, top + 1, unit) if seq.identity(p, unit) in self.since_reset),
            default=0,
        )
        own = [g.tokens for g in hit.groups]
        self.check(
            hit.tokens == expected and all(t == expected for t in own),
            f"{where}: nothing was ever evicted, so every group should hit {expected} tokens "
            "(the longest prefix computed with these extra keys)",
        )
        self.check(
            all(g.stop != "recently_evicted" for g in hit.groups),
            f"{where}: recently_evicted although nothing was evicted",
        )

    def alive_keys(self) -> dict[int, set[bytes]]:
        """Per group, the keys some block holds now, as the events told (stored, not removed
        since)."""
        alive: dict[int, set[bytes]] = {}
        for (group, _block), keys in self.keys_on.items():
            alive.setdefault(group, set()).update(keys)
        return alive

    def resumable(self, group: int, seq: Seq, length: int, alive: set[bytes]) -> bool:
        """Whether ``group`` can resume ``seq`` at ``length`` with the keys ``alive`` (the
        hit rule of the design, group by group)."""
        if length == 0:
            return True
        digests, unit = self.digests(seq), self.unit

        def key(position: int) -> bool:
            return digests[position // unit - 1] in alive

        g = self.cfg.groups[group]
        if isinstance(g, pc.StateGroup):
            return key(length)
        first = 0
        if isinstance(g, pc.SlidingWindow):
            first = max(0, length - g.window) // g.block_size
        full = length // g.block_size
        boundaries = [(j + 1) * g.block_size for j in range(first, full)]
        return all(key(q) for q in boundaries) and (length % g.block_size == 0 or key(length))

    def check_hit_against_events(self, seq: Seq, hit: pc.Hit, where: str, top: int) -> None:
        """When every event was seen, the hit is the one the design's rule gives for the keys
        the events say are alive: each full-attention group's longest prefix, the others'
        longest position at or below their bound, the largest position every group can
        resume at, and the junction."""
        if not self.events_exact:
            return
        stats = self.call(Expect(), "stats()", self.mgr.stats)
        if stats.events_dropped:
            return
        alive = self.alive_keys()
        unit, groups = self.unit, range(len(self.cfg.groups))
        positions = range(unit, top + 1, unit)

        def longest(group: int, bound: int) -> int:
            keys = alive.get(group, set())
            ok = [p for p in positions if p <= bound and self.resumable(group, seq, p, keys)]
            return max(ok, default=0)

        own = {g: longest(g, top) for g in self.full_groups}
        bound = min(own.values(), default=top)
        own |= {g: longest(g, bound) for g in groups if g not in own}
        every = [
            p
            for p in positions
            if p <= bound and all(self.resumable(g, seq, p, alive.get(g, set())) for g in groups)
        ]
        expected = max(every, default=0)
        largest = min(max(own.values()), bound)
        junction = largest if largest >= expected + 2 * unit else None
        got = (hit.tokens, [g.tokens for g in hit.groups], hit.junction)
        want = (expected, [own[g] for g in groups], junction)
        self.check(
            got == want,
            f"{where}: the keys alive (from the events) give hit {want[0]}, own hits {want[1]}, "
            f"junction {want[2]}",
        )

    def check_rows(self, rows: list[tuple[int, int, int]], label: str) -> None:
        """The rows of a plan just built are what was scheduled, from where each sequence is."""
        expected = {s: p for s, p in self.pending.items() if p[1] > 0}
        got = {s: (nc, ns) for s, nc, ns in rows}
        self.check(len(got) == len(rows), f"{label}: a sequence appears twice in the plan: {rows}")
        self.check(
            set(got) == set(expected),
            f"{label}: plan rows {sorted(got)} but scheduled {sorted(expected)}",
        )
        for s, (nc, ns) in got.items():
            pnc, pns = expected[s]
            seq = self.live[s]
            self.check(
                ns == pns and (pnc is None or pnc == nc),
                f"{label}: row of {s} is ({nc}, {ns}), scheduled ({pnc}, {pns})",
            )
            if seq.own is not None:
                self.check(
                    nc == seq.own, f"{label}: row of {s} starts at {nc}, committed {seq.own}"
                )
            else:
                self.check(
                    nc % self.unit == 0 and self.was_computed(seq, nc),
                    f"{label}: sequence {s} starts from {nc} tokens never computed with its keys",
                )
            self.check(nc + ns <= len(seq.tokens), f"{label}: row of {s} past its tokens")

    def check_plan_arrays(self, view: dict[str, Any], label: str) -> None:
        rows, unit = view["rows"], self.unit
        ns = [r[2] for r in rows]
        self.check(
            list(view["qsl"]) == [0, *np.cumsum(ns).tolist()],
            f"{label}: query_start_loc {view['qsl']} for {ns}",
        )
        total = sum(ns)
        pools = self.cfg.pools
        for group, slots, appended, replaced in view["paged"]:
            g = self.paged[group]
            blocks = pools[g.pool].num_blocks
            self.check(
                len(slots) == total,
                f"{label}: group {group} slot_mapping has {len(slots)} of {total}",
            )
            positions = [nc + i for _, nc, n in rows for i in range(n)]
            for slot, pos in zip(slots, positions, strict=True):
                block, offset = divmod(int(slot), g.block_size)
                self.check(
                    0 < block < blocks and offset == pos % g.block_size,
                    f"{label}: group {group} slot {slot} for position {pos}",
                )
            window = isinstance(g, pc.SlidingWindow)  # columns left of the window: null block
            for row, _column, block in appended:
                self.check(
                    0 <= row < len(rows) and (0 < block < blocks or (window and block == 0)),
                    f"{label}: appended ({row}, {block})",
                )
            for row, _column, block in replaced:
                self.check(
                    0 <= row < len(rows) and 0 <= block < blocks,
                    f"{label}: replaced ({row}, {block})",
                )
        for group, running, initial, offsets, cslots, snapshots in view["state"]:
            g = self.cfg.groups[group]
            blocks = pools[g.pool].num_blocks
            self.check(
                len(running) == len(rows) == len(initial), f"{label}: state group {group} row count"
            )
            for r, (_, nc, n) in enumerate(rows):
                self.check(
                    0 < running[r] < blocks and running[r] != initial[r],
                    f"{label}: running slot {running[r]} / initial {initial[r]}",
                )
                self.check(
                    initial[r] == -1 or 0 < initial[r] < blocks,
                    f"{label}: initial slot {initial[r]}",
                )
                taken = [int(o) for o in offsets[r] if o]
                for o in taken:
                    self.check(
                        0 < o < n and o % g.alignment == 0 and (nc + o) % unit == 0,
                        f"{label}: state group {group} checkpoint offset {o} in chunk "
                        f"[{nc}, {nc + n}) (A={g.alignment}, U={unit})",
                    )
                    self.check(
                        self.is_retained(rows[r][0], g, nc + o, decode_tail=False),
                        f"{label}: state group {group} checkpoints position {nc + o} of sequence "
                        f"{rows[r][0]}, not a position its retention keeps",
                    )
                C = g.max_checkpoints_per_step
                self.check(
                    C is None or len(taken) <= C,
                    f"{label}: {len(taken)} interior checkpoints > C={C}",
                )
                for o, slot in zip(offsets[r], cslots[r], strict=True):
                    self.check(
                        (slot == -1) == (o == 0) and (slot == -1 or 0 < slot < blocks),
                        f"{label}: checkpoint slot {slot} for offset {o}",
                    )
            for run, slot in snapshots:
                self.check(
                    run in list(running) and 0 < slot < blocks, f"{label}: snapshot ({run}, {slot})"
                )
                s, nc, n = rows[list(running).index(run)]
                self.check(
                    self.is_retained(s, g, nc + n, decode_tail=n > 0 and nc >= self.prefill_of(s)),
                    f"{label}: state group {group} snapshots position {nc + n} of sequence {s} "
                    f"(chunk [{nc}, {nc + n})), not a position its retention keeps",
                )
        for group, src, dst, n in view["copies"]:
            g = self.paged.get(int(group))
            self.check(g is not None, f"{label}: copy in group {group}, not a paged group")
            blocks = pools[g.pool].num_blocks  # type: ignore[union-attr]
            self.check(
                0 < n < g.block_size and 0 < src < blocks and 0 < dst < blocks and src != dst,
                f"{label}: copy {(group, src, dst, n)}",
            )  # type: ignore[union-attr]

    def prefill_of(self, seq_id: int) -> int:
        prefill = self.live[seq_id].prefill
        return len(self.live[seq_id].tokens) if prefill is None else prefill

    def is_retained(self, seq_id: int, g: pc.StateGroup, p: int, decode_tail: bool) -> bool:
        """Whether state group ``g`` may checkpoint ``seq_id`` at ``p``: its tail, a multiple
        of the interval, its junction, a requested position, or a decode tail."""
        seq, ret = self.live[seq_id], g.retention
        if p % self.unit:
            return False
        tails = {((len(seq.tokens) - 1) // self.unit) * self.unit}
        return (
            (ret.tail and p in seq.retained | tails)
            or (ret.interval is not None and p % ret.interval == 0)
            or (ret.junction and (p in seq.retained or -1 in seq.retained))
            or p in seq.requested
            or (ret.decode_tail and decode_tail)
        )

    def view_of_plan(self, plan: pc.StepPlan) -> dict[str, Any]:
        self.check(
            plan.seq_ids is plan.seq_ids and plan.copies is plan.copies,
            "build_plan: a StepPlan array is not the same object on a second read",
        )
        self.check(
            [p.group for p in plan.paged] == sorted(self.paged)
            and [q.group for q in plan.state] == [i for i, _ in self.state_groups],
            "build_plan: the plan's groups are not the configuration's",
        )
        rows = list(
            zip(
                plan.seq_ids.tolist(),
                plan.num_computed.tolist(),
                plan.num_scheduled.tolist(),
                strict=True,
            )
        )
        return {
            "rows": rows,
            "qsl": plan.query_start_loc.tolist(),
            "paged": [
                (p.group, p.slot_mapping.tolist(), p.appended.tolist(), p.replaced.tolist())
                for p in plan.paged
            ],
            "state": [
                (
                    s.group,
                    s.running_slot.tolist(),
                    s.initial_slot.tolist(),
                    s.checkpoint_offsets.tolist(),
                    s.checkpoint_slots.tolist(),
                    s.snapshots.tolist(),
                )
                for s in plan.state
            ],
            "copies": plan.copies.tolist(),
        }

    def view_of_buffers(self, b: pc.PlanBuffers) -> dict[str, Any]:
        r, t = b.num_rows, b.num_tokens
        counts = [r, t, b.num_copies]
        counts += [n for p in b.paged for n in (p.num_appended, p.num_replaced)]
        counts += [n for q in b.state for n in (q.max_checkpoints, q.num_snapshots)]
        self.check(
            b.counts == tuple(counts),
            f"build_plan_into: counts {b.counts} are not the buffers' counts {tuple(counts)}",
        )
        rows = list(
            zip(
                b.seq_ids[:r].tolist(),
                b.num_computed[:r].tolist(),
                b.num_scheduled[:r].tolist(),
                strict=True,
            )
        )
        return {
            "rows": rows,
            "qsl": b.query_start_loc[: r + 1].tolist(),
            "paged": [
                (
                    p.group,
                    p.slot_mapping[:t].tolist(),
                    p.appended[: p.num_appended].tolist(),
                    p.replaced[: p.num_replaced].tolist(),
                )
                for p in b.paged
            ],
            "state": [
                (
                    s.group,
                    s.running_slot[:r].tolist(),
                    s.initial_slot[:r].tolist(),
                    s.checkpoint_offsets[:r, : s.max_checkpoints].tolist()
                    if s.max_checkpoints
                    else [[] for _ in range(r)],
                    s.checkpoint_slots[:r, : s.max_checkpoints].tolist()
                    if s.max_checkpoints
                    else [[] for _ in range(r)],
                    s.snapshots[: s.num_snapshots].tolist(),
                )
                for s in b.state
            ],
            "copies": b.copies[: b.num_copies].tolist(),
        }

    def took_flight(self, obj: Any, step_id: int, view: dict[str, Any], label: str) -> None:
        self.check(
            self.mgr.plan_in_flight == step_id, f"{label}: plan_in_flight is not the step built"
        )
        self.check_rows(view["rows"], label)
        self.check_plan_arrays(view, label)
        self.flight = Flight(obj, step_id, view["rows"])
        self.pending.clear()
        self.check_plan_against_tables(view, label)

    def committed(self, label: str) -> None:
        """The model of a commit of the plan in flight (it succeeded)."""
        flight = self.flight
        assert flight is not None
        storers = []
        for s, nc, n in flight.rows:
            seq = self.live[s]
            for p in range((nc // self.unit + 1) * self.unit, nc + n + 1, self.unit):
                self.computed.add(seq.identity(p, self.unit))
                self.since_reset.add(seq.identity(p, self.unit))
            seq.own = nc + n
            storers.append(seq)
        self.ended.append(flight.obj)
        self.flight = None
        self.commits += 1
        if flight.rows:
            self.cleared = False
        for s, nc, n in flight.rows:
            got = self.call(Expect(), "num_computed", lambda s=s: self.mgr.num_computed(s))
            self.check(got == nc + n, f"{label}: num_computed({s}) = {got}, committed {nc + n}")
        self.absorb_events(storers, label)

    def aborted(self, label: str) -> None:
        flight = self.flight
        assert flight is not None
        self.ended.append(flight.obj)
        self.flight = None
        self.aborts += 1
        self.absorb_events([], label)

    def absorb_events(self, storers: list[Seq] | None, label: str, cleared: bool = False) -> None:
        """Drains the events one call made: keys stored only by a commit or finish, each the
        digest of a prefix of one of the sequences it involved."""
        if not self.cfg.enable_events:
            return
        events = self.call(Expect(), "drain_events", self.mgr.drain_events)
        unit = self.unit
        for ev in events:
            self.check(
                ev.sequence > self.last_event,
                f"{label}: event sequence {ev.sequence} after {self.last_event}",
            )
            self.last_event = ev.sequence
            if isinstance(ev, pc.BlockStored):
                self.check(
                    storers is not None, f"{label}: published {ev!r} outside a commit or finish"
                )
                is_state = isinstance(self.cfg.groups[ev.group], pc.StateGroup)
                self.check(ev.checkpoint == is_state, f"{label}: {ev!r} checkpoint flag")
                self.check(
                    ev.token_start % unit == 0
                    and ev.token_end - ev.token_start == unit * len(ev.keys),
                    f"{label}: {ev!r} token range",
                )
                first = ev.token_start // unit
                owners = [
                    s
                    for s in storers or []
                    if len(d := self.digests(s)) >= first + len(ev.keys)
                    and d[first : first + len(ev.keys)] == list(ev.keys)
                    and (ev.parent == (d[first - 1] if first else None))
                ]
                self.check(
                    bool(owners),
                    f"{label}: {ev!r} stores keys that are not the hash_prefix digests (and "
                    f"parent) of units {first}.. of any sequence it committed "
                    f"({[s.seq_id for s in storers or []]})",
                )
                # One run: a block per key, and the token ids, adapter and salt the keys were
                # computed from (the wire block is the unit here, so exactly the run's tokens).
                self.check(
                    len(ev.blocks) == len(ev.keys) and ev.blocks[0] == ev.block,
                    f"{label}: {ev!r} blocks {ev.blocks}",
                )
                self.check(
                    any(
                        ev.tokens_start == ev.token_start
                        and ev.tokens == s.tokens[ev.token_start : ev.token_end]
                        and ev.lora_id == s.lora
                        and ev.cache_salt == (s.salt if ev.token_start == 0 else None)
                        for s in owners
                    ),
                    f"{label}: {ev!r} token ids, lora_id or cache_salt are not those of the "
                    "sequence its keys come from",
                )
                for block, key in zip(ev.blocks, ev.keys, strict=True):
                    self.keys_on.setdefault((ev.group, block), set()).add(key)
            elif isinstance(ev, pc.BlockRemoved):
                lost = self.keys_on.pop((ev.group, ev.block), set())
                if self.events_exact:
                    self.check(
                        set(ev.keys) == lost, f"{label}: {ev!r} removed keys it was not given"
                    )
                    # The wire removes exactly the keys no other block of the group carries.
                    still = {
                        k for (g, _), keys in self.keys_on.items() if g == ev.group for k in keys
                    }
                    self.check(
                        set(ev.gone) == lost - still,
                        f"{label}: {ev!r} gone {len(ev.gone)} keys, expected those of its "
                        "keys no other block carries",
                    )
            else:
                self.check(cleared, f"{label}: AllBlocksCleared outside reset")
                self.keys_on.clear()

    def computed_of(self, seq: Seq) -> int:
        """Tokens of ``seq`` whose KV its block table may already hold: committed, or the
        hit it starts from when scheduled (or in flight) for its first step."""
        if seq.own is not None:
            return seq.own
        if self.flight is not None:
            for s, nc, _ in self.flight.rows:
                if s == seq.seq_id:
                    return nc
        nc = self.pending.get(seq.seq_id, (None, 0))[0]
        return nc or 0

    def tables(self) -> dict[int, dict[int, list[int]]]:
        """Per paged group, each live sequence's block-table row."""
        ids = sorted(self.live)
        out: dict[int, dict[int, list[int]]] = {}
        for g in self.paged:
            table = self.call(
                Expect(), f"block_table({g})", lambda g=g: self.mgr.block_table(g, ids)
            )
            out[g] = {s: row.tolist() for s, row in zip(ids, table, strict=True)}
        return out

    def check_block_tables(self) -> None:
        """No block is in two groups' tables, twice in one row, or in two sequences' rows
        unless it is a full block of a prefix both computed with the same extra keys."""
        if not self.live or not self.paged:
            return
        tables = self.tables()
        owner: dict[tuple[int, int], int] = {}  # (pool, block) -> group
        for g, rows in tables.items():
            pool, size = self.paged[g].pool, self.paged[g].block_size
            holders: dict[int, list[tuple[int, int]]] = {}
            for s, row in rows.items():
                blocks = [b for b in row if b]
                self.check(
                    len(set(blocks)) == len(blocks),
                    f"block_table({g}, [{s}]) repeats a block: {row}",
                )
                for column, block in enumerate(row):
                    if block:
                        holders.setdefault(block, []).append((s, column))
            for block, users in holders.items():
                other = owner.setdefault((pool, block), g)
                self.check(other == g, f"block {block} of pool {pool} is in groups {other} and {g}")
                if len(users) < 2:
                    continue
                columns = {c for _, c in users}
                self.check(
                    len(columns) == 1,
                    f"block {block} of group {g} is at different columns of sequences {users}",
                )
                end = (users[0][1] + 1) * size
                seqs = [self.live[s] for s, _ in users]
                for seq in seqs:
                    self.check(
                        self.computed_of(seq) >= end,
                        f"block {block} of group {g} is shared by sequences {[s for s, _ in users]}"
                        f" but sequence {seq.seq_id} has computed only {self.computed_of(seq)} of "
                        f"its {end} tokens",
                    )
                first = seqs[0].identity(end - end % self.unit, self.unit)
                tokens_equal = len({tuple(q.tokens[:end]) for q in seqs}) == 1
                self.check(
                    tokens_equal
                    and all(q.identity(end - end % self.unit, self.unit) == first for q in seqs),
                    f"block {block} of group {g} (tokens up to {end}) is shared by sequences "
                    f"{[s for s, _ in users]} whose prefixes differ in tokens or extra keys",
                )

    def check_plan_against_tables(self, view: dict[str, Any], label: str) -> None:
        """Each scheduled token's KV slot is in its sequence's block table at its position,
        in a block no other live sequence holds (published content never changes)."""
        if not self.paged or not view["rows"]:
            return
        tables = self.tables()
        for group, slots, appended, _replaced in view["paged"]:
            size = self.paged[group].block_size
            rows = tables[group]
            users: dict[int, set[int]] = {}
            for s, row in rows.items():
                for b in row:
                    if b:
                        users.setdefault(b, set()).add(s)
            i = 0
            for s, nc, n in view["rows"]:
                row = rows[s]
                for pos in range(nc, nc + n):
                    block = int(slots[i]) // size
                    i += 1
                    column = pos // size
                    self.check(
                        column < len(row) and row[column] == block,
                        f"{label}: group {group} writes position {pos} of sequence {s} into "
                        f"block {block}, but its table holds "
                        f"{row[column] if column < len(row) else None}",
                    )
                    self.check(
                        users.get(block, set()) == {s},
                        f"{label}: group {group} writes position {pos} of sequence {s} into "
                        f"block {block}, which sequences {sorted(users.get(block, set()) - {s})} "
                        "hold too",
                    )
            for r, column, block in appended:
                s = view["rows"][r][0]
                row = rows[s]
                self.check(
                    column < len(row) and row[column] == block,
                    f"{label}: appended ({r}, {column}, {block}) is not in sequence {s}'s "
                    f"table {row}",
                )

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def manager_agrees_with_the_model(self) -> None:
        if self.mgr is None:
            return
        self.call(Expect(), "check_invariants", self.mgr.check_invariants)
        mgr = self.mgr
        self.check(
            mgr.num_sequences == len(self.live),
            f"num_sequences {mgr.num_sequences}, model {len(self.live)}",
        )
        flight = self.flight.step_id if self.flight else None
        self.check(
            mgr.plan_in_flight == flight, f"plan_in_flight {mgr.plan_in_flight}, model {flight}"
        )
        for s, seq in self.live.items():
            n = self.call(Expect(), "num_tokens", lambda s=s: mgr.num_tokens(s))
            self.check(n == len(seq.tokens), f"num_tokens({s}) = {n}, model {len(seq.tokens)}")
            if seq.own is not None:
                c = self.call(Expect(), "num_computed", lambda s=s: mgr.num_computed(s))
                self.check(c == seq.own, f"num_computed({s}) = {c}, model {seq.own}")
        self.check_block_tables()
        cached = mgr.num_finished_cached
        self.check(
            cached <= self.finishes and (cached == 0 or self.cfg.finished_cache_bytes > 0),
            f"num_finished_cached {cached} after {self.finishes} finishes "
            f"(finished_cache_bytes={self.cfg.finished_cache_bytes})",
        )

    # -- add --------------------------------------------------------------------------------------

    def extra_from_spec(
        self, spec: Any, base: Seq | None, n: int
    ) -> tuple[object, Expect, tuple[bytes | None, int | None, tuple[tuple[int, int, bytes], ...]]]:
        """The ``extra_keys`` argument, what passing it must do, and the (salt, lora,
        multimodal) the sequence then has."""
        expect = Expect()
        if spec == "none" or (base is None and spec in ("inherit", "inherit_fit")):
            return None, expect, (None, None, ())
        if spec in ("inherit", "inherit_fit"):
            assert base is not None
            mm = base.multimodal
            if spec == "inherit_fit":
                mm = tuple(m for m in mm if m[1] <= n)
            salt, lora, inputs = base.salt, base.lora, [(s, e, h) for s, e, h in mm]
        else:
            salt, lora, drawn, order = spec
            inputs = [self.multimodal_input(n, *m) for m in drawn]
            if order == "sorted":
                inputs.sort(key=lambda m: (m[0], m[1]))
            elif order == "reversed":
                inputs.sort(key=lambda m: (m[0], m[1]), reverse=True)
        obj = pc.ExtraKeys(
            cache_salt=salt,
            lora_id=lora,
            multimodal=[pc.MultimodalInput(s, e, h) for s, e, h in inputs],
        )
        if isinstance(salt, str):
            salt_bytes: bytes | None = salt.encode()
        elif isinstance(salt, bytearray):
            expect.may(TypeError, "a bytearray salt")
            salt_bytes = bytes(salt)
        elif salt is None or isinstance(salt, bytes):
            salt_bytes = salt
        else:
            expect.must(TypeError, f"cache_salt {salt!r}")
            salt_bytes = None
        if lora is not None:
            expect.int_arg(lora, U64_MAX, "lora_id")
        ok_inputs = []
        for i, (s, e, h) in enumerate(inputs):
            good = expect.int_arg(s, U32_MAX, f"multimodal[{i}].start")
            good &= expect.int_arg(e, U32_MAX, f"multimodal[{i}].end")
            if isinstance(h, bytearray):
                expect.may(TypeError, "a bytearray multimodal hash")
                h = bytes(h)
            if h == b"":
                expect.must(pc.InvalidRequestError, f"multimodal[{i}] has an empty hash")
            if good and s >= e:
                expect.must(pc.InvalidRequestError, f"multimodal[{i}] [{s}, {e}) is empty")
            if good and e > n:
                expect.must(pc.InvalidRequestError, f"multimodal[{i}] ends at {e}, past {n} tokens")
            ok_inputs.append((s, e, h))
        ranges = [(s, e) for s, e, _ in inputs]
        if all(int_kind(v, U32_MAX) == "ok" for r in ranges for v in r) and ranges != sorted(
            ranges
        ):
            expect.must(
                pc.InvalidRequestError, f"multimodal inputs {ranges} are not in order of start"
            )
        lora_value = lora if int_kind(lora, U64_MAX) == "ok" else None
        return obj, expect, (salt_bytes, lora_value, tuple(ok_inputs))

    @staticmethod
    def multimodal_input(
        n: int, percent: int, length: int, digest: bytes, defect: str
    ) -> tuple[Any, Any, Any]:
        """(start, end, hash) of an input at ``percent`` of an ``n``-token prompt, with one
        defect or none."""
        start = min(percent * n // 100, max(n - 1, 0))
        end = max(min(start + length, n), start + 1)
        if defect == "empty_range":
            end = start
        elif defect == "past_end":
            end = n + 1 + length
        elif defect == "empty_hash":
            digest = b""
        elif defect == "negative":
            start = -1
        elif defect == "huge":
            start, end = 2**32, 2**32 + 1
        elif defect == "bytearray":
            return (start, end, bytearray(digest))
        return (start, end, digest)

    def known(self) -> list[Seq]:
        return [self.live[s] for s in sorted(self.live)] + [
            self.finished[s] for s in sorted(self.finished)
        ]

    @rule(
        who=ADD_ID,
        base=st.integers(0, 40),
        keep=st.integers(0, 64),
        suffix=st.lists(mostly(st.integers(0, 3), st.just(U32_MAX), odds=20), max_size=24),
        extra=EXTRA_SPEC,
        extends=EXTENDS,
        form=TOKEN_FORMS,
    )
    def add(
        self,
        who: object,
        base: int,
        keep: int,
        suffix: list[int],
        extra: Any,
        extends: object,
        form: str,
    ) -> None:
        known = self.known()
        source = known[base % len(known)] if known and base < 32 else None
        tokens = (source.tokens[:keep] if source else []) + suffix
        seq_id = who
        expect = Expect()
        if expect.int_arg(seq_id, SEQ_ID_MAX, "seq_id") and int(seq_id) in self.live:  # type: ignore[call-overload]
            expect.must(pc.DuplicateSequenceError, f"sequence {seq_id} is live")
        obj, token_expect = token_input(tokens, form)
        expect.merge(token_expect)
        if not tokens:
            expect.must(pc.InvalidRequestError, "no tokens")
        extra_obj, extra_expect, (salt, lora, mm) = self.extra_from_spec(extra, source, len(tokens))
        expect.merge(extra_expect)
        if extends == "base":
            ext: object = source.seq_id if source else 4242
        elif extends == "live":
            ext = min(self.live) if self.live else 4242
        elif extends == "unknown":
            ext = 4242
        else:
            ext = extends
        if ext is not None:
            expect.int_arg(ext, SEQ_ID_MAX, "extends")
        added = self.call(
            expect,
            f"add({seq_id!r}, {form} of {len(tokens)} tokens, {extra_obj!r}, extends={ext!r})",
            lambda: self.mgr.add(seq_id, obj, extra_keys=extra_obj, extends=ext),
        )
        # hash_prefix refuses what the manager refuses about the extra keys (same validation).
        if form == "list" or isinstance(added, BaseException):
            hp_expect = Expect().merge(extra_expect)
            h = self.cfg.hash
            got = self.call(
                hp_expect,
                f"hash_prefix(..., extra_keys={extra_obj!r})",
                lambda: pc.hash_prefix(tokens, self.unit, h.algorithm, h.seed, extra_obj),
            )
            if not isinstance(got, BaseException) and not extra_expect.maybe:
                ref = reference_digests(tokens, self.unit, h.algorithm, h.seed, salt, lora, mm)
                self.check(
                    got == ref,
                    f"hash_prefix({tokens}, {extra_obj!r}) is not the reference encoding",
                )
        if isinstance(added, BaseException):
            self.absorb_events(None, "add (refused)")
            return
        seq = Seq(int(seq_id), list(tokens), salt, lora, mm)  # type: ignore[call-overload]
        self.check_added(seq, added, ext)
        self.live[seq.seq_id] = seq
        self.absorb_events(None, "add")

    def check_added(self, seq: Seq, added: pc.Added, ext: object) -> None:
        unit, n = self.unit, len(seq.tokens)
        where = f"add({seq.seq_id}) -> {added!r}"
        ext_id = int(ext) if ext is not None else None  # type: ignore[call-overload]
        if ext_id is not None and ext_id in self.live:
            self.check(added.extends_found, f"{where}: extends={ext_id} is live but not found")
        elif ext_id is not None and ext_id not in self.finished:
            self.check(
                not added.extends_found, f"{where}: extends={ext_id} was never added, yet found"
            )
        elif ext_id is not None:
            tokens_bytes = 4 * len(self.finished[ext_id].tokens)
            self.check(
                not added.extends_found or tokens_bytes <= self.cfg.finished_cache_bytes,
                f"{where}: finished sequence {ext_id} found, but its tokens alone take "
                f"{tokens_bytes} bytes, more than finished_cache_bytes="
                f"{self.cfg.finished_cache_bytes}",
            )
        if ext_id is None:
            self.check(not added.extends_found, f"{where}: extends_found without extends")
        self.check(
            added.reused_tokens % unit == 0
            and added.reused_tokens + added.hashed_units * unit == (n // unit) * unit,
            f"{where}: reused + hashed is not the {n // unit} full units",
        )
        candidates: list[Seq] = []
        if added.extends_found:
            source = self.live.get(ext_id) or self.finished.get(ext_id)  # type: ignore[arg-type]
            candidates = [source] if source else []
        if (not added.extends_found) and self.cfg.reuse_live_prefixes:
            candidates = list(self.live.values())
        bound = max((common_prefix(seq, c, unit) for c in candidates), default=0)
        self.check(
            added.reused_tokens <= bound,
            f"{where}: reused the digests of {added.reused_tokens} tokens, but at most {bound} "
            "tokens of a sequence it may reuse from have the same tokens and extra keys",
        )

    @rule(
        ids=st.lists(mostly(st.integers(0, 19), st.just(-1), odds=30), max_size=6),
        bases=st.lists(st.integers(0, 40), min_size=6, max_size=6),
        keeps=st.lists(st.integers(0, 64), min_size=6, max_size=6),
        suffixes=st.lists(st.lists(st.integers(0, 3), max_size=24), min_size=6, max_size=6),
        chain=st.lists(st.booleans(), min_size=6, max_size=6),
        threads=st.sampled_from([None, 0, 1, 2, 3]),
    )
    def add_batch(
        self,
        ids: list[int],
        bases: list[int],
        keeps: list[int],
        suffixes: list[list[int]],
        chain: list[bool],
        threads: int | None,
    ) -> None:
        """`add_batch`: all or nothing, and each request's result as its own `add` in order
        would give it (a request may extend, and share tokens with, an earlier one of the
        same batch)."""
        known = self.known()
        prompts: list[list[int]] = []
        extends: list[int | None] = []
        expect = Expect()
        seen: set[int] = set()
        for i, seq_id in enumerate(ids):
            earlier = prompts[i - 1] if i and chain[i] else None
            source = known[bases[i] % len(known)] if known and bases[i] < 32 else None
            head = earlier if earlier is not None else (source.tokens if source else [])
            prompts.append(head[: keeps[i]] + suffixes[i])
            extends.append(ids[i - 1] if earlier is not None else None)
            # The ids are read first; then the first request `add` would refuse decides.
            if expect.errors or min(ids) < 0:
                continue
            if seq_id in self.live or seq_id in seen:
                expect.must(pc.DuplicateSequenceError, f"sequence {seq_id} is live")
            elif not prompts[-1]:
                expect.must(pc.InvalidRequestError, f"request {i} has no tokens")
            seen.add(seq_id)
        if ids and min(ids) < 0:
            expect.must(pc.InvalidRequestError, f"a negative seq_id in {ids}")
        live_before = self.mgr.num_sequences
        added = self.call(
            expect,
            f"add_batch({ids}, {[len(p) for p in prompts]} tokens, extends={extends}, "
            f"threads={threads})",
            lambda: self.mgr.add_batch(ids, prompts, extends=extends, threads=threads),
        )
        if isinstance(added, BaseException):
            self.check(
                self.mgr.num_sequences == live_before, "a refused add_batch admitted requests"
            )
            self.absorb_events(None, "add_batch (refused)")
            return
        self.check(len(added) == len(ids), f"add_batch returned {len(added)} results")
        for seq_id, tokens, ext, result in zip(ids, prompts, extends, added, strict=True):
            seq = Seq(seq_id, list(tokens), None, None, ())
            self.check_added(seq, result, ext)
            self.live[seq_id] = seq
        self.absorb_events(None, "add_batch")

    # -- lookup and schedule ----------------------------------------------------------------------

    @precondition(lambda self: bool(self.live))
    @rule(who=WHO)
    def lookup(self, who: object) -> None:
        seq_id, seq = self.seq_of(who)
        expect = Expect()
        self.id_expect(seq_id, expect)
        hit = self.call(expect, f"lookup({seq_id!r})", lambda: self.mgr.lookup(seq_id))
        if seq is not None and not isinstance(hit, BaseException):
            self.check_hit(seq, hit, "lookup")
            again = self.call(expect, f"lookup({seq_id!r}) again", lambda: self.mgr.lookup(seq_id))
            self.check(
                hit_summary(again) == hit_summary(hit),
                f"lookup({seq_id}) changed between two calls: {hit!r}, then {again!r}",
            )

    def schedule_expect(self, seq_id: object, seq: Seq | None, expect: Expect) -> None:
        self.in_flight_expect(expect, "schedule")
        if self.id_expect(seq_id, expect) and seq is not None:
            if seq.seq_id in self.pending:
                expect.must(pc.StepError, f"{seq.seq_id} is already scheduled for the next plan")
            if seq.own is not None and seq.own == len(seq.tokens):
                expect.must(pc.NothingToScheduleError, f"{seq.seq_id} is computed")

    def scheduled(
        self,
        seq: Seq,
        result: pc.Scheduled | None,
        budget: int,
        exact: bool,
        label: str,
        reference: bool = True,
    ) -> None:
        """Checks a schedule's result (``reference``: its hit was looked up in the state the
        events describe, not after an earlier schedule of the same batch allocated)."""
        if result is None:
            self.refused += 1
            return
        where = f"{label} -> {result!r}"
        self.check(result.seq_id == seq.seq_id, f"{where}: seq_id")
        nc, ns, n = result.num_computed, result.num_tokens, len(seq.tokens)
        if seq.own is None:
            self.check(result.hit is not None, f"{where}: a first schedule without its hit")
            self.check_hit(seq, result.hit, label, reference)
            self.check(nc == result.hit.tokens, f"{where}: starts at {nc}, not at its hit")
            self.first_scheduled(seq, result.hit.junction)
        else:
            self.check(
                result.hit is None and nc == seq.own,
                f"{where}: resumes at {nc}, committed {seq.own}",
            )
        end = nc + min(budget, n - nc)
        if not exact and end < n:
            end = (end // self.grid) * self.grid
        self.check(
            ns == max(0, end - nc),
            f"{where}: scheduled {ns} tokens, expected {max(0, end - nc)} "
            f"(budget {budget}, grid {self.grid}, exact={exact})",
        )
        if result.num_tokens > 0:
            self.pending[seq.seq_id] = (nc, ns)
        self.scheduled_tokens += ns
        self.retain_tail(seq)

    def first_scheduled(self, seq: Seq, junction: int | str | None) -> None:
        """A first schedule (after add or preempt): the prefill's length, its junction."""
        seq.prefill = len(seq.tokens)
        if junction == "unknown":
            seq.retained.add(-1)
        elif junction is not None:
            seq.retained.add(int(junction))

    def retain_tail(self, seq: Seq) -> None:
        seq.retained.add(((len(seq.tokens) - 1) // self.unit) * self.unit)

    @precondition(lambda self: bool(self.live))
    @rule(who=WHO, budget=BUDGET, lookahead=LOOKAHEAD, exact=EXACT)
    def schedule(self, who: object, budget: object, lookahead: object, exact: object) -> None:
        seq_id, seq = self.seq_of(who)
        expect = Expect()
        self.schedule_expect(seq_id, seq, expect)
        expect.int_arg(budget, U32_MAX, "max_tokens")
        if lookahead is not None and expect.int_arg(lookahead, U32_MAX, "lookahead"):
            la = int(lookahead)  # type: ignore[call-overload]
            if la > 0 and self.state_groups:
                expect.must(pc.InvalidRequestError, "lookahead with state groups")
            if la > LOOKAHEAD_SURELY_TOO_LARGE:
                expect.must(pc.InvalidRequestError, f"lookahead {la} is huge")
            elif la > 0:
                expect.may(pc.InvalidRequestError, f"lookahead {la} may exceed the bound")
        if not isinstance(exact, bool):
            expect.must(TypeError, f"exact={exact!r} is not a bool")
        label = f"schedule({seq_id!r}, {budget!r}, lookahead={lookahead!r}, exact={exact!r})"
        kwargs = {} if lookahead is None else {"lookahead": lookahead}
        before = None
        if seq is not None and seq.own is None and not expect.errors:
            before = self.call(Expect(), f"lookup({seq_id})", lambda: self.mgr.lookup(seq_id))
        result = self.call(
            expect, label, lambda: self.mgr.schedule(seq_id, budget, exact=exact, **kwargs)
        )
        if not isinstance(result, BaseException):
            assert seq is not None
            self.scheduled(seq, result, int(budget), bool(exact), label)  # type: ignore[call-overload]
            if before is not None and result is not None and result.hit is not None:
                self.check(
                    hit_summary(result.hit) == hit_summary(before),
                    f"{label}: the hit it started from {result.hit!r} is not the lookup's just "
                    f"before {before!r}",
                )
        self.absorb_events(None, label)

    @precondition(lambda self: bool(self.live))
    @rule(
        picks=st.lists(WHO, max_size=4),
        budgets=st.one_of(BUDGET, st.lists(st.integers(0, 40), max_size=5)),
        exact=st.booleans(),
        dup=st.booleans(),
        form=ID_FORMS,
        tokens_form=st.booleans(),
    )
    def schedule_batch(
        self,
        picks: list[object],
        budgets: object,
        exact: bool,
        dup: bool,
        form: str,
        tokens_form: bool,
    ) -> None:
        ids = [self.seq_of(p)[0] for p in picks]
        if dup and ids:
            ids.append(ids[0])
        self.schedule_ids(ids, budgets, exact, form, tokens_form)

    def schedule_ids(
        self, ids: list[Any], budgets: object, exact: bool, form: str, tokens_form: bool
    ) -> None:
        """``schedule_batch`` / ``schedule_tokens`` of ``ids`` (hostile or not)."""
        obj, expect = id_array(ids, form)
        self.in_flight_expect(expect, "schedule_batch")
        good = self.batch_ids_expect(ids, expect)
        for s in good:
            seq = self.live[s]
            if s in self.pending:
                expect.must(pc.StepError, f"{s} is already scheduled")
            if seq.own is not None and seq.own == len(seq.tokens):
                expect.must(pc.NothingToScheduleError, f"{s} is computed")
        if isinstance(budgets, list):
            per = budgets
            if len(per) != len(ids):
                expect.must(pc.InvalidRequestError, f"{len(ids)} ids but {len(per)} budgets")
            budget_arg: object = np.array(per, dtype=np.int64) if form == "int64" else per
        else:
            expect.int_arg(budgets, U32_MAX, "max_tokens")
            per = [budgets] * len(ids)
            budget_arg = budgets
        call = self.mgr.schedule_tokens if tokens_form else self.mgr.schedule_batch
        name = "schedule_tokens" if tokens_form else "schedule_batch"
        label = f"{name}({ids!r} as {form}, {budgets!r}, exact={exact})"
        results = self.call(expect, label, lambda: call(obj, budget_arg, exact=exact))
        if isinstance(results, BaseException):
            self.absorb_events(None, label)
            return
        self.check(len(results) == len(ids), f"{label}: {len(results)} results")
        for s, r, b in zip(ids, results, per, strict=True):
            seq = self.live[int(s)]  # type: ignore[call-overload]
            if tokens_form:
                r = int(r)
                self.check(-1 <= r <= int(b), f"{label}: {r} tokens for budget {b}")  # type: ignore[call-overload]
                self.refused += r == -1
                self.scheduled_tokens += max(r, 0)
                if r > 0:
                    start = seq.own
                    if start is None:  # a first schedule: it starts from its hit, pinned now
                        start = self.call(
                            Expect(), "num_computed", lambda s=s: self.mgr.num_computed(s)
                        )
                        self.first_scheduled(seq, "unknown")
                    self.pending[seq.seq_id] = (start, r)
                    self.retain_tail(seq)
            else:
                first = s == ids[0]
                self.scheduled(seq, r, int(b), exact, label, first)  # type: ignore[call-overload]
        self.absorb_events(None, label)

    def chunk_of(self, seq: Seq | None) -> tuple[int, int] | None:
        """The chunk ``[start, end)`` a sequence is scheduled for in the next plan, if known."""
        if seq is None or seq.seq_id not in self.pending or self.flight is not None:
            return None
        nc, ns = self.pending[seq.seq_id]
        nc = nc if nc is not None else seq.own
        return None if nc is None else (nc, nc + ns)

    def grid_positions(self, start: int, end: int) -> list[int]:
        """Positions every state group can checkpoint in chunk [start, end): unit boundaries
        on every kernel grid, and the chunk's end (a snapshot)."""
        unit = self.unit
        return [
            p
            for p in range(start + 1, end + 1)
            if p % unit == 0
            and (p == end or all((p - start) % g.alignment == 0 for _, g in self.state_groups))
        ]

    @precondition(lambda self: bool(self.pending))
    @rule(who=WHO, position=POSITION)
    def request_checkpoint(self, who: object, position: tuple[str, Any]) -> None:
        seq_id, seq = self.seq_of(who, prefer=self.pending)
        kind, k = position
        chunk = self.chunk_of(seq)
        p: Any = k
        if chunk is not None and kind == "grid":
            valid = self.grid_positions(*chunk)
            p = valid[k % len(valid)] if valid else chunk[1]
        elif chunk is not None and kind == "unit":
            p = (chunk[0] // self.unit + 1 + k % 4) * self.unit
        elif chunk is not None and kind == "offset":  # a unit-sized offset from the start
            p = chunk[0] + (k % 4 + 1) * self.unit
        elif chunk is not None and kind == "aligned":  # on the kernel's grid, maybe off the unit
            p = chunk[0] + (k % 6 + 1) * min((g.alignment for _, g in self.state_groups), default=1)
        expect = Expect()
        self.in_flight_expect(expect, "request_checkpoint")
        live = self.id_expect(seq_id, expect)
        pos_ok = expect.int_arg(p, U32_MAX, "position")
        if not self.state_groups:
            expect.may(pc.InvalidRequestError, "no state group")
            if live and pos_ok:
                expect.must(pc.InvalidRequestError, "no state group")
        if live and seq is not None and seq.seq_id not in self.pending:
            expect.must(pc.StepError, "not scheduled for the next plan")
        elif live and pos_ok and self.state_groups and self.flight is None:
            if chunk is None:
                expect.may(pc.AlignmentError, "start unknown")
            else:
                start, end = chunk
                inside = start < p <= end and p % self.unit == 0
                aligned = [p == end or (p - start) % g.alignment == 0 for _, g in self.state_groups]
                if not inside or not any(aligned):
                    expect.must(
                        pc.AlignmentError, f"position {p} is off the grid of [{start}, {end})"
                    )
                elif not all(aligned):
                    expect.may(pc.AlignmentError, f"position {p} is on some groups' grid only")
                if any(g.max_checkpoints_per_step == 0 for _, g in self.state_groups) and p < end:
                    expect.may(pc.AlignmentError, "a group takes no interior checkpoints")
        label = f"request_checkpoint({seq_id!r}, {p!r})"
        if chunk is not None:
            expect.message_check = lambda error: self.alignment_message(error, p, chunk)
        got = self.call(expect, label, lambda: self.mgr.request_checkpoint(seq_id, p))
        if seq is not None and not isinstance(got, BaseException):
            seq.requested.add(int(p))

    def batch_ids_expect(self, ids: Iterable[object], expect: Expect) -> list[int]:
        """The ids of a batch call that name a sequence, in order, with what the others (and a
        repeated one) must raise added to ``expect``."""
        good = []
        for i, s in enumerate(ids):
            if self.id_expect(s, expect, f"seq_ids[{i}]"):
                good.append(int(s))  # type: ignore[call-overload]
        if len(set(good)) < len(good):
            expect.must(pc.StepError, "a sequence appears twice")
        return good

    def alignment_message(self, error: BaseException, p: int, chunk: tuple[int, int]) -> str | None:
        """An AlignmentError names the offset and A truthfully, and the nearest valid
        positions it lists are valid ones of the chunk."""
        if not isinstance(error, pc.AlignmentError):
            return None
        text = str(error)
        false = f"AlignmentError for position {p} in chunk {chunk} says something false: {text}"
        said = re.search(r"offset (\d+) from the chunk start (\d+)", text)
        if said and (int(said.group(1)), int(said.group(2))) != (p - chunk[0], chunk[0]):
            return false
        offset = p - chunk[0]
        claims: list[tuple[str, Callable[[int], bool]]] = [  # what it may say, and when true
            (r"\d+, not a multiple of the backend's alignment (\d+)", lambda a: offset % a != 0),
            (r"\d+, not a multiple of the hash unit (\d+)", lambda u: offset % u != 0),
            (r"the position is not a multiple of the hash unit (\d+)", lambda u: p % u != 0),
        ]
        for pattern, holds in claims:
            found = re.search(pattern, text)
            if found and not holds(int(found.group(1))):
                return false
        outside = re.search(r"outside the chunk \[(\d+), (\d+)\)", text)
        if outside and (
            (int(outside.group(1)), int(outside.group(2))) != chunk or chunk[0] < p <= chunk[1]
        ):
            return false
        listed = re.search(r"nearest valid positions in chunk \[(\d+), (\d+)\): ([\d, ]+)", text)
        if listed:
            start, end = int(listed.group(1)), int(listed.group(2))
            valid = self.grid_positions(start, end)
            named = [int(x) for x in re.findall(r"\d+", listed.group(3))]
            if (start, end) != chunk or not set(named) <= set(valid):
                return (
                    f"AlignmentError for position {p} names positions {named}, but the valid ones "
                    f"of chunk {chunk} are {valid}: {text}"
                )
        return None

    def suggest_chunk(self, who: object, budget: object) -> None:
        seq_id, _ = self.seq_of(who)
        expect = Expect()
        self.id_expect(seq_id, expect)
        expect.int_arg(budget, U32_MAX, "token_budget")
        expect.may(pc.StepError, "while a plan is in flight").may(
            pc.NothingToScheduleError, "computed"
        )
        got = self.call(
            expect,
            f"suggest_chunk({seq_id!r}, {budget!r})",
            lambda: self.mgr.suggest_chunk(seq_id, budget),
        )
        if not isinstance(got, BaseException):
            self.check(0 <= got <= int(budget), f"suggest_chunk({seq_id}, {budget}) = {got}")  # type: ignore[call-overload]

    # -- plans ------------------------------------------------------------------------------------

    @rule(kind=st.sampled_from(["plan", "plan", "buffers", "buffers", "fresh_buffers"]))
    def build(self, kind: str) -> None:
        expect = Expect()
        self.in_flight_expect(expect, "build_plan")
        if kind == "plan":
            plan = self.call(expect, "build_plan()", self.mgr.build_plan)
            if not isinstance(plan, BaseException):
                self.took_flight(plan, plan.step_id, self.view_of_plan(plan), "build_plan")
        else:
            buffers = self.buffers if kind == "buffers" else pc.PlanBuffers(rows=1)
            step = self.call(
                expect, "build_plan_into(buffers)", lambda: self.mgr.build_plan_into(buffers)
            )
            if not isinstance(step, BaseException):
                self.check(buffers.step_id == step, "build_plan_into: buffers.step_id")
                self.took_flight(buffers, step, self.view_of_buffers(buffers), "build_plan_into")
        self.absorb_events(None, f"build ({kind})")

    @rule(verb=st.sampled_from(["commit", "commit", "commit", "abort"]))
    def end_step(self, verb: str) -> None:
        """Commits or aborts the plan in flight (with none in flight: the buffers or the plan
        that ended last, which are stale)."""
        if self.flight is None:
            target = self.ended[-1] if self.ended else self.buffers
            expect = Expect()
            if isinstance(target, pc.PlanBuffers) and target.step_id is None:
                expect.must(pc.StepError, "no plan was built into the buffers")
            else:
                expect.must(pc.StalePlanError, "the plan already ended")
            self.call(expect, f"{verb}(stale plan)", lambda: getattr(self.mgr, verb)(target))
            return
        obj = self.flight.obj
        label = f"{verb}(plan of step {self.flight.step_id})"
        self.call(Expect(), label, lambda: getattr(self.mgr, verb)(obj))
        if verb == "commit":
            self.committed(label)
        else:
            self.aborted(label)

    def end_stale_plan(self, pick: int, verb: str, junk: bool) -> None:
        """A plan that already ended, the buffers holding one, or no plan at all."""
        if junk:
            bad = [None, 5, "plan", self.buffers.paged[0] if self.buffers.paged else 1.5][pick % 4]
            expect = Expect().must(TypeError, "not a plan")
            self.call(expect, f"{verb}({bad!r})", lambda: getattr(self.mgr, verb)(bad))
            return
        held = self.flight is not None and self.flight.obj is self.buffers
        if pick % 3 == 0 and self.buffers.step_id is not None and not held:
            target: Any = self.buffers
        else:
            plans = [p for p in self.ended if isinstance(p, pc.StepPlan)]
            if not plans:
                return
            target = plans[pick % len(plans)]
        expect = Expect().must(pc.StalePlanError, "the plan already ended")
        self.call(
            expect, f"{verb}(stale step {target.step_id})", lambda: getattr(self.mgr, verb)(target)
        )

    def other_request(self) -> int:
        """Adds and schedules a request on the other manager (same configuration); its id."""
        self.other_next += 1
        sid = self.other_next
        self.other.add(sid, [1, 2, 3] * 3)
        self.other.schedule(sid, 9)
        return sid

    def other_finish(self, sid: int) -> None:
        """Ends whatever the other manager has in flight and finishes its request; a manager
        left with a step nobody can end is replaced."""
        other = self.other
        if other.plan_in_flight is not None:
            self.other = pc.CacheManager(self.cfg)
            return
        other.finish(sid)

    def end_foreign_plan(self, verb: str, via_buffers: bool) -> None:
        """A plan of another manager is not this manager's to end."""
        other = self.other
        sid = self.other_request()
        foreign = pc.PlanBuffers(rows=2) if via_buffers else None
        plan: Any = other.build_plan() if foreign is None else foreign
        if foreign is not None:
            other.build_plan_into(foreign)
        expect = Expect().must(pc.StalePlanError, "built by another manager")
        self.call(expect, f"{verb}(another manager's plan)", lambda: getattr(self.mgr, verb)(plan))
        other.commit(plan)
        self.other_finish(sid)

    def another_manager_takes_the_buffers(self, how: str) -> None:
        """Another manager writing into buffers that hold this manager's plan in flight must be
        refused: this manager could never end its step otherwise."""
        if self.flight is None or self.flight.obj is not self.buffers:
            return
        other = self.other
        sid = self.other_request()
        expect = Expect().must(pc.PrefixCacheError, "the buffers hold another manager's plan")
        if how == "build_plan_into":
            self.call(
                expect,
                "other.build_plan_into(buffers)",
                lambda: other.build_plan_into(self.buffers),
            )
            if other.plan_in_flight is None:
                other.commit(other.build_plan())
        else:
            other.commit(other.build_plan())
            self.call(
                expect,
                "other.decode_step(buffers)",
                lambda: other.decode_step(self.buffers, [sid], [1]),
            )
            if other.plan_in_flight is None and other.num_computed(sid) < other.num_tokens(sid):
                other.schedule(sid, 1)
                other.commit(other.build_plan())
        self.check(
            self.buffers.step_id == self.flight.step_id,
            f"other.{how} overwrote the buffers holding this manager's step in flight",
        )
        self.other_finish(sid)

    @precondition(lambda self: bool(self.live))
    @rule(
        picks=st.lists(WHO, min_size=0, max_size=4),
        token=SMALL_TOKENS,
        dup=mostly(st.just(False), st.just(True), odds=6),
        mismatch=mostly(st.just(False), st.just(True), odds=8),
        fresh=mostly(st.just(False), st.just(True), odds=4),
        form=ID_FORMS,
    )
    def decode_step(
        self,
        picks: list[object],
        token: list[int],
        dup: bool,
        mismatch: bool,
        fresh: bool,
        form: str,
    ) -> None:
        ids = []
        for p in picks:
            s, _ = self.seq_of(p, prefer=self.decoding())
            if s not in ids or dup:
                ids.append(s)
        tokens = [(token[i] if i < len(token) else 1) for i in range(len(ids))]
        if dup and ids:
            ids.append(ids[0])
            tokens.append(0)
        if mismatch:
            tokens.append(2)
        buffers = pc.PlanBuffers(rows=1) if fresh else self.buffers
        obj, expect = id_array(ids, form)
        held = self.flight is not None and self.flight.obj is buffers
        conversion = Expect()
        for i, s in enumerate(ids):
            conversion.int_arg(s, SEQ_ID_MAX, f"seq_ids[{i}]")
        expect.merge(conversion)
        if not conversion.errors and self.flight is not None and not held:
            expect.must(pc.StepError, "a plan not held by these buffers is in flight")
        if not conversion.errors:
            good = self.batch_ids_expect(ids, expect)
            if len(ids) != len(tokens):
                expect.must(pc.InvalidRequestError, f"{len(ids)} ids but {len(tokens)} tokens")
            for s in good:
                if s in self.pending:
                    expect.must(pc.StepError, f"{s} is scheduled for the next plan")
        label = f"decode_step({ids!r} as {form}, {tokens!r})"
        before = self.flight.step_id if held else None
        result = self.call(expect, label, lambda: self.mgr.decode_step(buffers, obj, tokens))
        if before is not None and self.mgr.plan_in_flight != before:
            self.committed(label)  # the commit stands even if the rest was refused
        if isinstance(result, BaseException):
            self.absorb_events([], label)
            return
        self.check(len(result) == len(ids), f"{label}: {len(result)} results")
        for s, t, r in zip(ids, tokens, result.tolist(), strict=True):
            seq = self.live[int(s)]  # type: ignore[call-overload]
            seq.tokens.append(t)
            self.check(r in (-1, 0, 1), f"{label}: scheduled {r}")
            self.refused += r == -1
            self.scheduled_tokens += max(r, 0)
            if r == 1:
                self.pending[seq.seq_id] = (seq.own, 1)
                if seq.own is None:
                    self.first_scheduled(seq, "unknown")
                self.retain_tail(seq)
        self.took_flight(buffers, buffers.step_id, self.view_of_buffers(buffers), label)
        self.absorb_events([], label)

    # -- decode, finish, preempt, reset -----------------------------------------------------------

    @precondition(lambda self: bool(self.live))
    @rule(who=WHO, tokens=st.lists(st.integers(0, 3), max_size=5), form=TOKEN_FORMS)
    def append(self, who: object, tokens: list[int], form: str) -> None:
        seq_id, seq = self.seq_of(who)
        obj, expect = token_input(tokens, form)
        self.in_flight_expect(expect, "append")
        if self.id_expect(seq_id, expect) and seq is not None and seq.seq_id in self.pending:
            expect.may(pc.StepError, "scheduled for the next plan")
        if not tokens:
            expect.may(pc.InvalidRequestError, "no tokens")
        got = self.call(
            expect, f"append({seq_id!r}, {form} {tokens})", lambda: self.mgr.append(seq_id, obj)
        )
        if not isinstance(got, BaseException) and seq is not None:
            seq.tokens += tokens
        self.absorb_events(None, "append")

    @precondition(lambda self: bool(self.live))
    @rule(
        picks=st.lists(WHO, max_size=4),
        token=st.integers(0, 3),
        dup=mostly(st.just(False), st.just(True), odds=4),
        mismatch=mostly(st.just(False), st.just(True), odds=8),
        form=ID_FORMS,
    )
    def append_batch(
        self, picks: list[object], token: int, dup: bool, mismatch: bool, form: str
    ) -> None:
        ids = []
        for p in picks:
            s, _ = self.seq_of(p, prefer=self.decoding())
            if s not in ids:
                ids.append(s)
        if dup and ids:
            ids.append(ids[0])
        self.append_batch_ids(ids, token, mismatch, form)

    def append_batch_ids(self, ids: list[Any], token: int, mismatch: bool, form: str) -> None:
        tokens = [token] * (len(ids) + (1 if mismatch else 0))
        obj, expect = id_array(ids, form)
        self.in_flight_expect(expect, "append_batch")
        good = [int(s) for i, s in enumerate(ids) if self.id_expect(s, expect, f"seq_ids[{i}]")]  # type: ignore[call-overload]
        if len(set(good)) < len(good):
            expect.must(pc.StepError, "a sequence appears twice in append_batch")
        if mismatch:
            expect.must(pc.InvalidRequestError, "one more token than ids")
        for s in good:
            if s in self.pending:
                expect.may(pc.StepError, f"{s} is scheduled for the next plan")
        label = f"append_batch({ids!r} as {form}, {tokens})"
        got = self.call(
            expect, label, lambda: self.mgr.append_batch(obj, np.array(tokens, dtype=np.uint32))
        )
        if not isinstance(got, BaseException):
            for s in good:
                self.live[s].tokens.append(token)
        self.absorb_events(None, label)

    @precondition(lambda self: bool(self.live))
    @rule(who=WHO, verb=st.sampled_from(["finish", "finish", "preempt"]))
    def release(self, who: object, verb: str) -> None:
        seq_id, seq = self.seq_of(who)
        expect = Expect()
        self.in_flight_expect(expect, verb)
        self.id_expect(seq_id, expect)
        got = self.call(expect, f"{verb}({seq_id!r})", lambda: getattr(self.mgr, verb)(seq_id))
        if isinstance(got, BaseException) or seq is None:
            self.absorb_events(None, verb)
            return
        self.pending.pop(seq.seq_id, None)
        if verb == "finish":
            self.finishes += 1
            del self.live[seq.seq_id]
            self.finished[seq.seq_id] = seq
            self.absorb_events([seq], verb)
            if seq.own:
                self.cleared = False
        else:
            seq.own = None
            self.absorb_events(None, verb)
            got = self.call(Expect(), "num_computed", lambda: self.mgr.num_computed(seq.seq_id))
            self.check(got == 0, f"num_computed({seq.seq_id}) = {got} after preempt")

    def reset(self) -> None:
        expect = Expect()
        self.in_flight_expect(expect, "reset")
        if self.flight is None and self.holders():
            expect.must(pc.ResetRefusedError, f"sequences {self.holders()} hold blocks")
        got = self.call(expect, "reset()", self.mgr.reset)
        if isinstance(got, BaseException):
            return
        self.cleared = True
        self.since_reset.clear()
        self.absorb_events(None, "reset", cleared=True)
        for usage in self.mgr.pool_usage():
            self.check(usage.cached == 0 and usage.checkpoints == 0, f"after reset: {usage!r}")

    # -- observations -----------------------------------------------------------------------------

    def stats_and_pool_usage(self) -> None:
        stats = self.call(Expect(), "stats()", self.mgr.stats)
        self.check(
            stats.commits == self.commits and stats.aborts == self.aborts,
            f"stats: {stats.commits} commits / {stats.aborts} aborts, "
            f"model {self.commits} / {self.aborts}",
        )
        self.check(len(stats.groups) == len(self.cfg.groups), "stats: one entry per group")
        self.check(
            stats.refused_schedules == self.refused
            and stats.scheduled_tokens == self.scheduled_tokens,
            f"stats: {stats.refused_schedules} refused schedules, {stats.scheduled_tokens} tokens "
            f"scheduled; model {self.refused}, {self.scheduled_tokens}",
        )
        # The dict holds the counters the attributes do (a counter can never be negative, so
        # that is no check; a dict that disagrees with its object is one).
        d = stats.to_dict()
        names = {n for n in dir(stats) if not n.startswith("_") and n not in ("groups", "to_dict")}
        self.check(
            set(d) == names | {"groups"} and all(d[n] == getattr(stats, n) for n in names),
            f"stats.to_dict() {d} disagrees with the attributes",
        )
        self.check(d["groups"] == [g.to_dict() for g in stats.groups], "stats.to_dict()['groups']")
        if self.events_exact:
            self.check(
                stats.events_dropped == 0, "events dropped although drained after every call"
            )
        usage = self.call(Expect(), "pool_usage()", self.mgr.pool_usage)
        self.check(len(usage) == len(self.cfg.pools), "pool_usage: one entry per pool")
        for i, (u, p) in enumerate(zip(usage, self.cfg.pools, strict=True)):
            self.check(
                u.num_blocks == p.num_blocks and u.free + u.cached + u.owned == p.num_blocks - 1,
                f"pool {i}: {u!r}",
            )
            self.check(u.checkpoints <= u.cached + u.owned, f"pool {i}: {u!r}")
            states = [g for _, g in self.state_groups if g.pool == i]
            if not states:
                self.check(
                    u.checkpoints == 0,
                    f"pool {i} has no state group but {u.checkpoints} checkpoints",
                )
            elif all(g.checkpoint_cap is not None for g in states):
                cap = sum(g.checkpoint_cap for g in states)  # type: ignore[misc]
                self.check(
                    u.checkpoints <= cap,
                    f"pool {i}: {u.checkpoints} checkpoints above the caps {cap}",
                )
            if not self.live and self.flight is None:
                self.check(u.owned == 0, f"pool {i}: {u.owned} blocks owned with no sequence live")

    def block_table(self, group: object, picks: list[object], form: str) -> None:
        ids = [self.seq_of(p)[0] for p in picks]
        obj, expect = id_array(ids, form)
        if expect.int_arg(group, U32_MAX, "group") and int(group) not in self.paged:  # type: ignore[call-overload]
            expect.must(pc.InvalidRequestError, f"group {group} is not a paged group")
        for i, s in enumerate(ids):
            self.id_expect(s, expect, f"seq_ids[{i}]")
        table = self.call(
            expect, f"block_table({group!r}, {ids!r})", lambda: self.mgr.block_table(group, obj)
        )
        if not isinstance(table, BaseException):
            blocks = self.cfg.pools[self.paged[int(group)].pool].num_blocks  # type: ignore[call-overload]
            self.check(
                table.dtype == np.int32 and table.shape[0] == len(ids),
                f"block_table shape {table.shape}",
            )
            self.check(
                bool(((table >= 0) & (table < blocks)).all()),
                f"block_table entries out of the pool: {table}",
            )

    def hash_prefix_matches(self, who: object, form: str) -> None:
        """hash_prefix of a live sequence in any container equals its digests, and the
        reference encoding."""
        _, seq = self.seq_of(who)
        if seq is None:
            return
        h = self.cfg.hash
        obj, _ = token_input(seq.tokens, form)
        got = self.call(
            Expect(),
            "hash_prefix",
            lambda: pc.hash_prefix(
                obj, unit=self.unit, algorithm=h.algorithm, seed=h.seed, extra_keys=seq.extra_keys()
            ),
        )
        self.check(
            got == self.digests(seq), f"hash_prefix of sequence {seq.seq_id} as {form} differs"
        )
        ref = reference_digests(
            seq.tokens, self.unit, h.algorithm, h.seed, seq.salt, seq.lora, seq.multimodal
        )
        self.check(
            got == ref,
            f"hash_prefix of sequence {seq.seq_id} differs from the reference encoding",
        )

    def read_buffers_while_another_thread_builds(self) -> None:
        """PlanBuffers read while another thread builds into them: a typed error or a value,
        never a bare RuntimeError. (A side manager with a long prompt; a third thread holds
        its lock meanwhile, so the build waits without the GIL while it holds the buffers.)"""
        if any(s.startswith("threads:") for s in IGNORED):
            return  # once reported, not again: the race would make programs irreproducible
        if self.side is None:
            config = pc.CacheConfig(
                pools=[pc.PoolConfig(600)], groups=[pc.FullAttention(16)], enable_events=False
            )
            self.side = pc.CacheManager(config)
        for _attempt in range(2):
            problem = self.race_once(self.side, pc.PlanBuffers(rows=1))
            if problem:
                self.fail(problem, f"threads:{shape(problem)}")

    @staticmethod
    def race_once(side: pc.CacheManager, buffers: pc.PlanBuffers) -> str | None:
        """One build of a long step into ``buffers`` while this thread reads them."""
        global OPERATIONS
        OPERATIONS += 4  # the build, the lock holder's add, the reads, the commit
        side.add(1, _LONG_PROMPT)
        side.schedule(1, len(_LONG_PROMPT))
        start = threading.Barrier(3)
        done = threading.Event()
        problems: list[str] = []

        def build() -> None:
            start.wait()
            time.sleep(0.0002)
            try:
                side.build_plan_into(buffers)
            except BaseException as error:
                if not isinstance(error, pc.PrefixCacheError):
                    problems.append(f"build_plan_into raised {type(error).__name__}: {error}")
            finally:
                done.set()

        def hold_the_lock() -> None:
            start.wait()
            side.add(2, _HOG_TOKENS)

        threads = [threading.Thread(target=build), threading.Thread(target=hold_the_lock)]
        for t in threads:
            t.start()
        start.wait()
        while not done.is_set() and not problems:
            try:
                _ = (buffers.num_rows, buffers.counts, buffers.step_id, buffers.seq_ids)
            except BaseException as error:
                if not isinstance(error, pc.PrefixCacheError):
                    kind = type(error).__name__
                    problems.append(
                        f"PlanBuffers read during another thread's build: {kind}: {error}"
                    )
        for t in threads:
            t.join()
        if side.plan_in_flight is not None:
            side.commit(buffers)
        for s in (1, 2):
            with contextlib.suppress(pc.PrefixCacheError):
                side.finish(s)
        side.reset()
        return problems[0] if problems else None

    def lookups_from_other_threads(self, budget: int) -> None:
        """Two threads look up every live sequence (and hash them) while this one runs an
        engine step: no error, and every hit they saw is within what was computed."""
        if self.flight is not None or not self.live:
            return
        seqs = [self.live[s] for s in sorted(self.live)]
        seen: list[tuple[Seq, Any]] = []
        stop = threading.Event()
        h = self.cfg.hash

        def look() -> None:
            while not stop.is_set():
                for seq in seqs:
                    try:
                        seen.append((seq, self.mgr.lookup(seq.seq_id)))
                        pc.hash_prefix(seq.tokens, self.unit, h.algorithm, h.seed)
                    except BaseException as error:
                        seen.append((seq, error))
                time.sleep(0)

        threads = [threading.Thread(target=look) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            self.engine_step(budget, "commit", "buffers", False, False, None)
        finally:
            stop.set()
            for t in threads:
                t.join()
        global OPERATIONS
        OPERATIONS += len(seen)
        for seq, hit in seen:
            if isinstance(hit, BaseException):
                self.fail(
                    f"lookup({seq.seq_id}) from another thread raised {type(hit).__name__}: {hit}",
                    f"threaded-lookup:{type(hit).__name__}",
                )
            top = ((len(seq.tokens) - 1) // self.unit) * self.unit
            for length in (hit.tokens, *(g.tokens for g in hit.groups)):
                self.check(
                    length <= top and self.was_computed(seq, length),
                    f"lookup({seq.seq_id}) from another thread: {hit!r} exceeds what was computed",
                )

    def oversized(self, which: int) -> None:
        """Inputs past the documented bounds that cost no memory (broadcast views): refused
        with a typed error before anything is copied, the manager unchanged."""
        tokens = np.broadcast_to(np.uint32(1), (pc.MAX_SEQUENCE_TOKENS + 1,))
        seq_id = min(self.live) if self.live else 1000
        ids = np.broadcast_to(np.int64(seq_id), (1 << 21,))
        small = np.broadcast_to(np.uint32(1), (1 << 21,))
        expect = Expect().must(pc.PrefixCacheError, "more than the supported count")
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("add", lambda: self.mgr.add(2000, tokens)),
            ("append", lambda: self.mgr.append(seq_id, tokens)),
            ("hash_prefix", lambda: pc.hash_prefix(tokens, unit=self.unit)),
            ("schedule_batch", lambda: self.mgr.schedule_batch(ids, 1)),
            ("append_batch", lambda: self.mgr.append_batch(ids, small)),
            ("block_table", lambda: self.mgr.block_table(min(self.paged, default=0), ids)),
        ]
        if self.flight is None:
            calls.append(("decode_step", lambda: self.mgr.decode_step(self.buffers, ids, small)))
        name, fn = calls[which % len(calls)]
        if name in ("add", "append", "hash_prefix"):
            expect.must(pc.InvalidRequestError, f"{pc.MAX_SEQUENCE_TOKENS + 1} tokens")
        self.call(expect, f"{name}(a broadcast input past the bounds)", fn)
        self.absorb_events(None, name)

    def huge_pool(self) -> None:
        """A pool of 2**31 - 1 blocks (the largest id) in a child process under a 6 GiB
        address-space limit: refused with a typed error (or MemoryError), never an abort."""
        global HUGE_POOL_CHECKED
        if HUGE_POOL_CHECKED:
            return  # once per process: a child costs half a second
        HUGE_POOL_CHECKED = True
        code = (
            "import resource\n"
            "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "import prefixcache as pc\n"
            "try:\n"
            "    pc.CacheManager(pc.CacheConfig(pools=[pc.PoolConfig(2**31 - 1)],\n"
            "                                   groups=[pc.FullAttention(16)]))\n"
            "    print('built')\n"
            "except (pc.PrefixCacheError, MemoryError) as e:\n"
            "    print('refused', type(e).__name__)\n"
        )
        global OPERATIONS
        OPERATIONS += 1
        env = dict(os.environ, RUST_BACKTRACE="0", PYTHONPATH=os.pathsep.join(sys.path))
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
        self.check(
            child.returncode == 0,
            f"CacheManager with a pool of 2**31 - 1 blocks killed the process (rc "
            f"{child.returncode}): {child.stderr.strip()[-300:]}",
        )

    def invalid_configuration(self, which: int) -> None:
        """A configuration breaking one documented rule is refused with ConfigError."""
        cfg, unit = self.cfg, self.unit
        pools, groups, hashing = list(cfg.pools), list(cfg.groups), cfg.hash
        bad_group = [
            pc.FullAttention(block_size=unit * 2 + 1 if unit > 1 else 0),
            pc.FullAttention(block_size=unit, pool=len(pools)),
            pc.SlidingWindow(block_size=2 * unit, window=unit),
            pc.StateGroup(alignment=unit + 1),
            pc.StateGroup(
                alignment=1, retention=pc.Retention(interval=unit + 1 if unit > 1 else 0)
            ),
            pc.StateGroup(alignment=1, checkpoint_cap=0),
        ]
        cases: list[dict[str, Any]] = [{"groups": [groups[0], g]} for g in bad_group]
        cases += [
            {"pools": [pc.PoolConfig(1)], "groups": [pc.FullAttention(unit)]},
            {"hash": pc.HashConfig(unit=0)},
            {"hash": pc.HashConfig(unit=unit, seed=2**64)},
            {"groups": []},
            {"pools": [pc.PoolConfig(2**31)], "groups": [pc.FullAttention(unit)]},
            {"hash": pc.HashConfig(algorithm="md5", unit=unit)},  # type: ignore[arg-type]
            {"max_steps_in_flight": 0},
            {"max_steps_in_flight": pc.MAX_STEPS_IN_FLIGHT + 1},
        ]
        fields = {"pools": pools, "groups": groups, "hash": hashing} | cases[which % len(cases)]
        self.call(
            Expect().must(pc.ConfigError, f"invalid configuration #{which}"),
            f"invalid configuration #{which}",
            lambda: pc.CacheConfig(**fields),
        )

    @rule(
        op=st.one_of(
            st.tuples(st.just("reset")),
            st.tuples(st.just("reset")),
            st.tuples(st.just("suggest_chunk"), WHO, BUDGET),
            st.tuples(st.just("stats_and_pool_usage")),
            st.tuples(
                st.just("block_table"),
                mostly(st.integers(0, 5), HOSTILE, odds=6),
                st.lists(WHO, max_size=3),
                ID_FORMS,
            ),
            st.tuples(
                st.just("hash_prefix_matches"),
                WHO,
                st.sampled_from(["list", "uint32", "int64", "strided"]),
            ),
            st.tuples(st.just("read_buffers_while_another_thread_builds")),
            st.tuples(st.just("invalid_configuration"), st.integers(0, 11)),
            st.tuples(st.just("oversized"), st.integers(0, 6)),
            st.tuples(st.just("lookups_from_other_threads"), st.integers(1, 48)),
            st.tuples(st.just("huge_pool")),
            st.tuples(
                st.just("end_stale_plan"),
                st.integers(0, 20),
                st.sampled_from(["commit", "abort"]),
                st.booleans(),
            ),
            st.tuples(
                st.just("end_foreign_plan"), st.sampled_from(["commit", "abort"]), st.booleans()
            ),
            st.tuples(
                st.just("another_manager_takes_the_buffers"),
                st.sampled_from(["build_plan_into", "decode_step"]),
            ),
        )
    )
    def misc(self, op: tuple[Any, ...]) -> None:
        """The calls an engine makes less often, one rule for all (so that they stay rarer
        than the step calls): ``op`` names the method of this class and its arguments."""
        getattr(self, op[0])(*op[1:])

    @rule(
        budget=st.integers(1, 48),
        verb=mostly(st.just("commit"), st.just("abort"), odds=6),
        kind=st.sampled_from(["plan", "buffers"]),
        exact=mostly(st.just(False), st.just(True), odds=4),
        decode=st.booleans(),
        checkpoint=st.one_of(st.none(), st.tuples(st.integers(0, 47), POSITION)),
    )
    def engine_step(
        self,
        budget: int,
        verb: str,
        kind: str,
        exact: bool,
        decode: bool,
        checkpoint: tuple[int, tuple[str, Any]] | None,
    ) -> None:
        """One step of an engine: every live sequence with tokens left is scheduled (and with
        ``checkpoint``, one of them asks for a checkpoint on its grid), the plan built and
        committed (or aborted); with ``decode``, computed sequences then get a token."""
        if self.flight is not None:
            self.end_step("commit")
        todo = [
            s
            for s, q in sorted(self.live.items())
            if s not in self.pending and (q.own is None or q.own < len(q.tokens))
        ]
        if todo:
            self.schedule_ids(todo, budget, exact, "int64", tokens_form=False)
        if checkpoint is not None and self.pending and self.state_groups:
            self.request_checkpoint(*checkpoint)
        self.build(kind)
        self.end_step(verb)
        done = [s for s, q in sorted(self.live.items()) if q.own == len(q.tokens)]
        if decode and done:
            self.append_batch_ids(done, 1, mismatch=False, form="list")

    @rule(
        base=st.integers(0, 40),
        keep=st.integers(0, 64),
        suffix=st.lists(st.integers(0, 3), max_size=16),
        extra=EXTRA_SPEC,
        extends=st.sampled_from([None, None, "base"]),
        budget=st.integers(1, 64),
        finish=st.booleans(),
    )
    def serve_request(
        self,
        base: int,
        keep: int,
        suffix: list[int],
        extra: Any,
        extends: Any,
        budget: int,
        finish: bool,
    ) -> None:
        """A whole request, as an engine serves it: a prompt (often a resend, a next turn or a
        divergence of a known one) is added, prefilled in chunks of ``budget`` until computed
        (or out of blocks) and finished; the traffic that makes hits, evictions and
        junctions."""
        if self.flight is not None:
            self.end_step("commit")
        seq_id = self.fresh_id()
        self.add(seq_id, base, keep, suffix or [1], extra, extends, "list")
        self.serve(seq_id, budget, 0, finish)

    @rule(
        base=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 3), max_size=12),
        extends=st.booleans(),
        budget=st.integers(1, 64),
        decode=st.integers(0, 3),
        finish=mostly(st.just(True), st.just(False), odds=3),
    )
    def next_turn(
        self, base: int, suffix: list[int], extends: bool, budget: int, decode: int, finish: bool
    ) -> None:
        """A known request sent again (no ``suffix``) or continued (the next turn of a
        conversation: its tokens, outputs included, and more), with its extra keys; served,
        decoded for ``decode`` tokens and finished."""
        if self.flight is not None:
            self.end_step("commit")
        seq_id = self.fresh_id()
        keep = 10**6
        self.add(seq_id, base, keep, suffix, "inherit", "base" if extends else None, "list")
        self.serve(seq_id, budget, decode, finish)

    def fresh_id(self) -> int:
        return next(i for i in range(100, 10**6) if i not in self.live)

    def serve(self, seq_id: int, budget: int, decode: int, finish: bool) -> None:
        """Prefills a live sequence in chunks of ``budget`` (until computed or out of blocks),
        decodes ``decode`` tokens, then finishes it if asked to."""
        seq = self.live.get(seq_id)
        if seq is None:
            return
        for _ in range(4 + decode):
            if seq.seq_id in self.pending or seq.seq_id not in self.live:
                break
            if seq.own == len(seq.tokens):
                if decode == 0:
                    break
                decode -= 1
                self.append(seq_id, [decode % 4], "list")
            self.schedule_ids([seq_id], budget, False, "list", tokens_form=False)
            if seq_id not in self.pending:
                break  # out of blocks (or nothing on the grid)
            self.build("buffers")
            self.end_step("commit")
        if finish and self.flight is None and seq_id in self.live:
            self.release(seq_id, "finish")

    # -- the end: the manager is still usable -----------------------------------------------------

    def teardown(self) -> None:
        if self.mgr is None or self.broken:
            return
        mgr = self.mgr
        if self.flight is not None:
            self.call(
                Expect(), "abort(plan in flight) at the end", lambda: mgr.abort(self.flight.obj)
            )
            self.aborted("teardown abort")
        for s in sorted(self.live):
            self.call(Expect(), f"finish({s}) at the end", lambda s=s: mgr.finish(s))
        self.live.clear()
        self.pending.clear()
        for i, u in enumerate(mgr.pool_usage()):
            self.check(
                u.owned == 0,
                f"pool {i}: {u.owned} blocks still owned after every sequence finished",
            )
        self.call(Expect(), "reset() with nothing running", mgr.reset)
        mgr.check_invariants()
        # A fresh one-token request is served if the pools can hold one sequence at all.
        need = [0] * len(self.cfg.pools)
        for g in self.cfg.groups:
            need[g.pool] += 2 if isinstance(g, pc.StateGroup) else 1
        fits = all(n <= p.num_blocks - 1 for n, p in zip(need, self.cfg.pools, strict=True))
        fresh = 10**9
        self.call(Expect(), "add(fresh request)", lambda: mgr.add(fresh, [1]))
        scheduled = self.call(Expect(), "schedule(fresh request)", lambda: mgr.schedule(fresh, 1))
        if fits:
            self.check(
                scheduled is not None and scheduled.num_tokens == 1,
                f"a fresh request after the program is not served: {scheduled!r} "
                f"(pools {self.cfg.pools})",
            )
            plan = self.call(Expect(), "build_plan(fresh)", mgr.build_plan)
            self.call(Expect(), "commit(fresh)", lambda: mgr.commit(plan))
        self.call(Expect(), "finish(fresh)", lambda: mgr.finish(fresh))
        mgr.check_invariants()


OVERLAP_IDS = [0, 1, 2, 3, 4, SEQ_ID_MAX]


@st.composite
def hybrid_configs(draw: st.DrawFn, depths: st.SearchStrategy[int]) -> pc.CacheConfig:
    """One full-attention group and one state group keeping checkpoints, each with its own
    pool, exact events: a shape where checkpoints are hit while plans are in flight."""
    unit = draw(st.sampled_from([2, 4]))
    retention = pc.Retention(
        tail=True,
        interval=draw(st.sampled_from([None, unit, 2 * unit])),
        junction=draw(st.booleans()),
        decode_tail=draw(st.booleans()),
    )
    state = pc.StateGroup(
        alignment=1,
        max_checkpoints_per_step=draw(st.sampled_from([None, 1])),
        pool=1,
        retention=retention,
        checkpoint_cap=draw(st.sampled_from([None, 3, 8])),
        reserve_per_sequence=2,
    )
    blocks = draw(st.sampled_from([48, 400]))
    return pc.CacheConfig(
        pools=[pc.PoolConfig(num_blocks=blocks), pc.PoolConfig(num_blocks=blocks)],
        groups=[pc.FullAttention(block_size=unit * draw(st.integers(1, 3)), pool=0), state],
        hash=pc.HashConfig(unit=unit),
        enable_events=True,
        max_pending_events=1 << 20,
        max_steps_in_flight=draw(depths),
    )


class OverlapMachine(RuleBasedStateMachine):
    """Overlapped steps from Python (``max_steps_in_flight`` = D in 2..3), a machine of its own:
    ``FuzzMachine``'s model predicts one plan in flight at a time.

    Its rules, stated here: every call raises only a ``PrefixCacheError`` (never
    ``InvariantError``), and a refused call changes nothing observable (statistics, pools,
    plans in flight, each sequence's length, committed position and placeholders), but for
    the commit a one-call decode step makes first; ``check_invariants`` holds after every
    call; the plans in flight are those built and not ended, oldest first, at most D; only the
    oldest ends: a later one is a ``StepError``, one not in flight a ``StalePlanError``;
    aborting the oldest ends every plan in flight and returns their ids, oldest first;
    building at depth D is a ``StepError``; resolving more tokens than a sequence's
    placeholders is an ``InvalidRequestError``; a lookup's pending hit is at least its hit and
    names a plan in flight exactly when it is longer; at the end, once everything in flight
    is committed and every sequence finished, no block is owned.

    Checkpoint hits with plans in flight (exact events only): the published checkpoint blocks
    are those a ``BlockStored`` event of a state group named and no ``BlockRemoved`` took
    since. A plan row that reads one resumes at exactly its position: the block carries the
    digest of the sequence's first ``num_computed`` tokens with its own extra keys (prompts
    carry salts, adapters and multimodal inputs, and a next turn may change them or name the
    earlier sequence in ``extends``: a checkpoint of another tenant, adapter or image is never
    read). A first schedule that started at a hit L > 0 reads such a block in every state
    group (a hit rests on committed content, never on what plans in flight will publish).

    ``request_checkpoint`` for a sequence scheduled for the next plan (its chunk ``(s, e]``
    known from the schedule, no plan built or ended since): a unit boundary p of the chunk
    with ``p == e`` or ``(p - s)`` a multiple of the state groups' alignment is accepted;
    any other position is an ``AlignmentError``; without a state group, an
    ``InvalidRequestError``. Pools are small (2 to 100 blocks), so every rule above also
    holds while blocks are evicted with plans in flight.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mgr: pc.CacheManager | None = None
        self.depth = 1
        self.flights: list[tuple[int, Any]] = []  # (step id, plan object), oldest first
        self.ended: list[tuple[int, Any]] = []
        self.ring: list[pc.PlanBuffers] = []
        self.token = 1
        self.cfg: pc.CacheConfig | None = None
        self.exact = False
        self.prompts: dict[int, list[int]] = {}
        self.admitted: dict[int, int] = {}  # sequence -> the hit its first schedule used
        self.checkpoints: dict[tuple[int, int], bytes] = {}  # (group, block) -> digest
        self.extras: dict[int, pc.ExtraKeys | None] = {}  # sequence -> its extra keys
        self.chunks: dict[int, tuple[int, int]] = {}  # sequence -> chunk for the next plan

    @initialize(config=st.one_of(configs(st.integers(2, 3)), hybrid_configs(st.integers(2, 3))))
    def init(self, config: pc.CacheConfig) -> None:
        try:
            self.mgr = pc.CacheManager(config)
        except pc.PrefixCacheError:
            reject()
        self.cfg = config
        self.exact = config.enable_events and config.max_pending_events >= 4096
        self.depth = config.max_steps_in_flight
        self.ring = [pc.PlanBuffers(rows=8) for _ in range(self.depth + 1)]

    def drain(self) -> None:
        """Follows the published checkpoint blocks through the events."""
        if self.mgr is None or self.cfg is None or not self.cfg.enable_events:
            return
        for ev in self.mgr.drain_events():
            if isinstance(ev, pc.BlockStored) and ev.checkpoint:
                for block, key in zip(ev.blocks, ev.keys, strict=True):
                    self.checkpoints[(ev.group, block)] = key
            elif isinstance(ev, pc.BlockRemoved):
                self.checkpoints.pop((ev.group, ev.block), None)

    def admit(self, results: list[Any]) -> None:
        """Records the hit of each first schedule that scheduled tokens, and every chunk
        scheduled for the next plan."""
        for r in results:
            if r is not None and r.hit is not None and r.num_tokens > 0:
                self.admitted[r.seq_id] = r.num_computed
            if r is not None and r.num_tokens > 0:
                self.chunks[r.seq_id] = (r.num_computed, r.num_computed + r.num_tokens)

    def extra_keys(self, pick: int, n: int) -> pc.ExtraKeys | None:
        """Extra keys from ``pick`` for a prompt of ``n`` tokens: none half the time, else a
        salt, an adapter or a multimodal input (a few values, so that some are shared)."""
        kind, v = pick % 8, pick // 8
        if kind == 4:
            return pc.ExtraKeys(cache_salt=f"tenant{v % 2}")
        if kind == 5:
            return pc.ExtraKeys(lora_id=v % 2)
        if kind >= 6:
            start = v % n
            end = start + 1 + (v // 3) % (n - start)
            image = pc.MultimodalInput(start=start, end=end, hash=bytes([1 + v % 2]))
            return pc.ExtraKeys(multimodal=[image])
        return None

    def check_resumes(self, plan: Any) -> None:
        """The checkpoint rule of the class docstring, for the rows of a plan just built."""
        global CHECKPOINT_RESUMES, CHECKPOINT_RESUMES_IN_FLIGHT, CHECKPOINT_RESUMES_WITH_EXTRA_KEYS
        cfg = self.cfg
        if cfg is None or not self.exact:
            return
        self.drain()
        h = cfg.hash
        rows = plan.num_rows
        ids = [int(x) for x in plan.seq_ids[:rows]]
        computed = [int(x) for x in plan.num_computed[:rows]]
        for sp in plan.state:
            initial = [int(x) for x in sp.initial_slot[:rows]]
            for seq_id, start, slot in zip(ids, computed, initial, strict=True):
                key = self.checkpoints.get((sp.group, slot))
                first_at = self.admitted.get(seq_id)
                if first_at is not None and first_at == start > 0 and key is None:
                    raise FuzzFailure(
                        f"sequence {seq_id} was admitted at a hit of {start} but its row reads "
                        f"slot {slot} of state group {sp.group}, which holds no checkpoint"
                    )
                prompt = self.prompts.get(seq_id)
                if key is None or prompt is None or start > len(prompt):
                    continue
                digests = pc.hash_prefix(
                    prompt,
                    unit=h.unit,
                    algorithm=h.algorithm,
                    seed=h.seed,
                    extra_keys=self.extras.get(seq_id),
                )
                if start == 0 or start % h.unit or digests[start // h.unit - 1] != key:
                    raise FuzzFailure(
                        f"sequence {seq_id} resumes at {start} from block {slot} of state group "
                        f"{sp.group}, a checkpoint of another prefix"
                    )
                CHECKPOINT_RESUMES += 1
                if self.flights:
                    CHECKPOINT_RESUMES_IN_FLIGHT += 1
                if self.extras.get(seq_id) is not None:
                    CHECKPOINT_RESUMES_WITH_EXTRA_KEYS += 1
        for seq_id in ids:
            self.admitted.pop(seq_id, None)

    def tokens(self, n: int) -> list[int]:
        self.token += n
        return [(self.token - i) % 50_000 for i in range(n)]

    def live(self) -> list[int]:
        assert self.mgr is not None
        out = []
        for i in OVERLAP_IDS:
            with contextlib.suppress(pc.UnknownSequenceError):
                self.mgr.num_tokens(i)
                out.append(i)
        return out

    def observe(self) -> tuple[Any, ...]:
        mgr = self.mgr
        assert mgr is not None
        lengths = [
            (mgr.num_tokens(i), mgr.num_computed(i), mgr.num_placeholders(i)) for i in self.live()
        ]
        pools = [(u.free, u.cached, u.owned) for u in mgr.pool_usage()]
        return (repr(mgr.stats()), pools, mgr.plans_in_flight, mgr.num_sequences, lengths)

    def call(self, label: str, fn: Callable[[], Any], atomic: bool = True) -> tuple[bool, Any]:
        """Runs ``fn``: ``(True, result)``, or ``(False, error)`` for a typed refusal."""
        global OPERATIONS
        OPERATIONS += 1
        before = self.observe()
        try:
            return True, fn()
        except pc.InvariantError as error:
            raise FuzzFailure(f"{label}: {error}") from error
        except pc.PrefixCacheError as error:
            if atomic and self.observe() != before:
                raise FuzzFailure(
                    f"{label} was refused ({error}) but changed the manager"
                ) from error
            return False, error

    def expect(self, label: str, outcome: tuple[bool, Any], error: type[BaseException]) -> None:
        ok, value = outcome
        if ok or not isinstance(value, error):
            raise FuzzFailure(f"{label}: expected {error.__name__}, got {value!r}")

    def end_oldest(self) -> None:
        self.ended = [*self.ended, self.flights.pop(0)][-4:]

    @invariant()
    def agrees(self) -> None:
        if self.mgr is None:
            return
        self.mgr.check_invariants()
        self.drain()
        in_flight = self.mgr.plans_in_flight
        ours = [s for s, _ in self.flights]
        if in_flight != ours or len(in_flight) > self.depth:
            raise FuzzFailure(f"plans in flight {in_flight}, built and not ended {ours}")

    @rule(i=st.integers(0, 5), stream=st.integers(0, 2), n=st.integers(1, 40), x=st.integers(0, 63))
    def add(self, i: int, stream: int, n: int, x: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        tokens = [stream * 100_000 + t for t in range(n)] + self.tokens(n % 3)
        extra = self.extra_keys(x, len(tokens))
        if self.call("add", lambda: mgr.add(OVERLAP_IDS[i], tokens, extra))[0]:
            self.prompts[OVERLAP_IDS[i]] = tokens
            self.extras[OVERLAP_IDS[i]] = extra
            self.admitted.pop(OVERLAP_IDS[i], None)

    @rule(
        i=st.integers(0, 5),
        j=st.integers(0, 5),
        n=st.integers(1, 9),
        x=st.one_of(st.none(), st.integers(0, 63)),
        extends=st.booleans(),
    )
    def resend(self, i: int, j: int, n: int, x: int | None, extends: bool) -> None:
        """A conversation's next turn: the prompt sequence ``j`` was added with, and more,
        with its extra keys (or others, from ``x``; a quarter of those only another adapter),
        naming ``j`` in ``extends`` or not."""
        mgr = self.mgr
        assert mgr is not None
        prompt = self.prompts.get(OVERLAP_IDS[j])
        if prompt is None:
            return
        tokens = prompt + self.tokens(n)
        extra = self.extras.get(OVERLAP_IDS[j]) if x is None else self.extra_keys(x, len(tokens))
        if x is not None and x % 4 == 0:
            # (the same conversation under another adapter: nothing of j's may be reused)
            was = self.extras.get(OVERLAP_IDS[j]) or pc.ExtraKeys()
            lora = 1 if was.lora_id is None else None
            extra = pc.ExtraKeys(cache_salt=was.cache_salt, lora_id=lora, multimodal=was.multimodal)
        source = OVERLAP_IDS[j] if extends else None
        if not self.call("add", lambda: mgr.add(OVERLAP_IDS[i], tokens, extra, extends=source))[0]:
            return
        self.prompts[OVERLAP_IDS[i]] = tokens
        self.extras[OVERLAP_IDS[i]] = extra
        self.admitted.pop(OVERLAP_IDS[i], None)
        if x is not None and x % 4 == 0:
            # (admitted at once: its first row is checked against its own keys)
            ok, r = self.call("schedule", lambda: mgr.schedule(OVERLAP_IDS[i], 64))
            if ok and r is not None:
                self.admit([r])
                self.build_checked()

    @rule(i=st.integers(0, 5), pick=st.integers(0, 40))
    def request(self, i: int, pick: int) -> None:
        """``request_checkpoint``, its rule in the class docstring, for a sequence with a
        chunk for the next plan (one scheduled first when none has): mostly a position the
        chunk accepts, else any near it."""
        mgr = self.mgr
        cfg = self.cfg
        assert mgr is not None and cfg is not None
        if not self.chunks:
            # (scheduled first: a request needs a chunk waiting for the next plan)
            ok, r = self.call("schedule", lambda: mgr.schedule(OVERLAP_IDS[i], 1 + pick % 9))
            if ok:
                self.admit([r])
        waiting = sorted(self.chunks)
        seq_id = waiting[i % len(waiting)] if waiting else OVERLAP_IDS[i]
        chunk = self.chunks.get(seq_id)
        unit = cfg.hash.unit
        aligns = [g.alignment for g in cfg.groups if isinstance(g, pc.StateGroup)]
        grid = math.lcm(*aligns) if aligns else 1

        def accepts(p: int, s: int, e: int) -> bool:
            return s < p <= e and p % unit == 0 and (p == e or (p - s) % grid == 0)

        if chunk is None:
            position = pick
        else:
            s, e = chunk
            valid = [p for p in range(s + 1, e + 1) if accepts(p, s, e)]
            if valid and pick % 3:
                position = valid[pick % len(valid)]
            else:
                position = s + pick % (e - s + 2 * unit)
        outcome = self.call("request_checkpoint", lambda: mgr.request_checkpoint(seq_id, position))
        if chunk is None:
            return
        s, e = chunk
        if not aligns:
            self.expect("request_checkpoint without a state group", outcome, pc.InvalidRequestError)
        elif not accepts(position, s, e):
            self.expect(f"request_checkpoint({position}) in ({s}, {e}]", outcome, pc.AlignmentError)
        elif not outcome[0]:
            raise FuzzFailure(
                f"request_checkpoint({position}) in ({s}, {e}] refused: {outcome[1]!r}"
            )
        else:
            global CHECKPOINT_REQUESTS
            CHECKPOINT_REQUESTS += 1

    @rule(i=st.integers(0, 5))
    def lookup(self, i: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        ok, hit = self.call("lookup", lambda: mgr.lookup(OVERLAP_IDS[i]), atomic=False)
        if not ok:
            return
        longer = hit.pending_tokens > hit.tokens
        if hit.pending_tokens < hit.tokens or (hit.pending_plan is not None) != longer:
            raise FuzzFailure(f"pending answer {hit.pending_tokens} / {hit.pending_plan} for {hit}")
        if hit.pending_plan is not None and hit.pending_plan not in mgr.plans_in_flight:
            raise FuzzFailure(f"pending plan {hit.pending_plan} is not in flight")

    @rule(budget=st.sampled_from([1, 2, 3, 7, 64, U32_MAX]))
    def schedule_all(self, budget: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        ids = self.live()
        ok, results = self.call("schedule_batch", lambda: mgr.schedule_batch(ids, budget))
        if ok:
            self.admit(results)

    @rule(i=st.integers(0, 5), budget=st.integers(1, 9))
    def schedule(self, i: int, budget: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        ok, result = self.call("schedule", lambda: mgr.schedule(OVERLAP_IDS[i], budget))
        if ok:
            self.admit([result])

    @rule(into=st.booleans())
    def build(self, into: bool) -> None:
        mgr = self.mgr
        assert mgr is not None
        full = len(self.flights) >= self.depth
        buffers = self.ring[len(self.flights) % len(self.ring)]
        holds = any(obj is buffers for _, obj in self.flights)
        if into and not holds:
            outcome = self.call("build_plan_into", lambda: mgr.build_plan_into(buffers))
            obj: Any = buffers
        else:
            outcome = self.call("build_plan", mgr.build_plan)
            obj = outcome[1]
        if full:
            self.expect("build_plan at depth", outcome, pc.StepError)
            return
        if not outcome[0]:
            raise FuzzFailure(f"build_plan below depth refused: {outcome[1]!r}")
        step = outcome[1] if into and not holds else obj.step_id
        self.chunks.clear()
        self.check_resumes(obj)
        self.flights.append((step, obj))

    @rule(
        which=st.sampled_from(["oldest", "oldest", "oldest", "newest", "stale", "unbuilt"]),
        commit=st.booleans(),
        by_id=st.booleans(),
    )
    def end(self, which: str, commit: bool, by_id: bool) -> None:
        mgr = self.mgr
        assert mgr is not None
        target: tuple[int, Any] | None = None
        if which == "oldest" and self.flights:
            target = self.flights[0]
        elif which == "newest" and self.flights:
            target = self.flights[-1]
        elif which == "stale" and self.ended:
            target = self.ended[0]
        step, obj = target if target is not None else (2**62, None)
        if obj is None or (obj in self.ring and (step, obj) not in self.flights):
            by_id = True  # (buffers reused since then hold another step)
        verb = mgr.commit_step if commit else mgr.abort_step
        if not commit:
            self.chunks.clear()  # (an abort drops the next-plan steps of what it touched)
        outcome = self.call(
            "commit/abort",
            (lambda: verb(step)) if by_id else (lambda: (mgr.commit if commit else mgr.abort)(obj)),
        )
        oldest = bool(self.flights) and step == self.flights[0][0]
        if oldest:
            if not outcome[0]:
                raise FuzzFailure(f"ending the oldest plan {step} refused: {outcome[1]!r}")
            if commit:
                self.end_oldest()
            else:
                ids = [s for s, _ in self.flights]
                if outcome[1] != ids:
                    raise FuzzFailure(f"abort of the oldest returned {outcome[1]}, not {ids}")
                while self.flights:
                    self.end_oldest()
        elif any(s == step for s, _ in self.flights):
            self.expect("ending a later plan", outcome, pc.StepError)
        else:
            self.expect("ending a plan not in flight", outcome, pc.StalePlanError)

    @rule(ids=st.lists(st.integers(0, 5), max_size=4))
    def placeholders(self, ids: list[int]) -> None:
        mgr = self.mgr
        assert mgr is not None
        seq_ids = [OVERLAP_IDS[i] for i in ids]
        self.call("append_placeholders", lambda: mgr.append_placeholders(seq_ids))

    @rule(i=st.integers(0, 5), n=st.sampled_from([0, 1, 1, 2, 5]))
    def resolve(self, i: int, n: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        seq_id = OVERLAP_IDS[i]
        pending = mgr.num_placeholders(seq_id) if seq_id in self.live() else None
        outcome = self.call("resolve", lambda: mgr.resolve(seq_id, self.tokens(n)))
        if pending is not None and n > pending:
            self.expect("resolve beyond the placeholders", outcome, pc.InvalidRequestError)
        elif pending is not None and not outcome[0]:
            raise FuzzFailure(f"resolve of {n} over {pending} placeholders: {outcome[1]!r}")

    @rule(i=st.integers(0, 5), n=st.integers(0, 3), count=st.integers(0, 3))
    def append(self, i: int, n: int, count: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        tokens = self.tokens(n)
        self.call("append", lambda: mgr.append(OVERLAP_IDS[i], tokens, placeholders=count))

    @rule(commit=st.booleans(), resolve=st.booleans(), everyone=st.booleans())
    def overlapped(self, commit: bool, resolve: bool, everyone: bool) -> None:
        """``decode_step_overlapped`` into a ring buffer that holds no plan in flight."""
        mgr = self.mgr
        assert mgr is not None
        held = [obj for _, obj in self.flights]
        free = [b for b in self.ring if not any(b is h for h in held)]
        if not free:
            return
        buffers = free[0]
        ids = self.live() if everyone else self.live()[:2]
        oldest = self.flights[0][0] if commit and self.flights else None
        rids = [i for i in ids if mgr.num_placeholders(i) > 0] if resolve else []
        tokens = self.tokens(len(rids))
        global OPERATIONS
        OPERATIONS += 1
        before = self.observe()
        self.chunks.clear()
        try:
            mgr.decode_step_overlapped(buffers, ids, rids, tokens, commit=oldest)
            ok = True
        except pc.InvariantError as error:
            raise FuzzFailure(f"decode_step_overlapped: {error}") from error
        except pc.PrefixCacheError:
            ok = False
        committed = oldest is not None and mgr.plan_in_flight != oldest
        if committed:
            self.end_oldest()
        if ok:
            self.check_resumes(buffers)
            self.flights.append((buffers.step_id, buffers))
        elif not committed and self.observe() != before:
            raise FuzzFailure("a refused decode_step_overlapped changed the manager")

    @rule(budget=st.sampled_from([4, 16, 64]))
    def engine_round(self, budget: int) -> None:
        """An engine's overlapped iteration: the oldest plan commits when D are in flight,
        every live sequence is scheduled, and the next plan is built."""
        mgr = self.mgr
        assert mgr is not None
        if len(self.flights) >= self.depth:
            self.commit_oldest()
        ids = self.live()
        ok, results = self.call("schedule_batch", lambda: mgr.schedule_batch(ids, budget))
        if ok:
            self.admit(results)
        self.build_checked()

    def commit_oldest(self) -> None:
        mgr = self.mgr
        assert mgr is not None
        step = self.flights[0][0]
        if not self.call("commit_step", lambda: mgr.commit_step(step))[0]:
            raise FuzzFailure(f"committing the oldest plan {step} was refused")
        self.end_oldest()

    def build_checked(self) -> None:
        """``build_plan`` below depth D (which must succeed), its rows checked."""
        mgr = self.mgr
        assert mgr is not None
        if len(self.flights) >= self.depth:
            self.commit_oldest()
        ok, plan = self.call("build_plan", mgr.build_plan)
        if not ok:
            raise FuzzFailure(f"build_plan below depth refused: {plan!r}")
        self.chunks.clear()
        self.check_resumes(plan)
        self.flights.append((plan.step_id, plan))

    @rule(i=st.integers(0, 5), n=st.integers(2, 30), more=st.integers(1, 9), x=st.integers(0, 63))
    def next_turn(self, i: int, n: int, more: int, x: int) -> None:
        """A conversation: a fresh prompt computed to its end in overlapped chunks and
        finished, then its next turn (the prompt and more) admitted under the same id while a
        plan of everyone else is in flight: with a state group it resumes from a checkpoint of
        the first turn (the rows are checked as every plan's). Both turns carry the same extra
        keys (from ``x``)."""
        mgr = self.mgr
        assert mgr is not None
        seq_id = OVERLAP_IDS[i]
        prompt = self.tokens(n)
        extra = self.extra_keys(x, n)
        if seq_id in self.live() or not self.call("add", lambda: mgr.add(seq_id, prompt, extra))[0]:
            return
        self.prompts[seq_id] = prompt
        self.extras[seq_id] = extra
        self.admitted.pop(seq_id, None)
        for _ in range(2 * n):
            if mgr.num_computed(seq_id) >= n:
                break
            ok, r = self.call("schedule", lambda: mgr.schedule(seq_id, 8))
            if ok:
                self.admit([r])
            if ok and r is None:
                return  # out of blocks: a turn another time
            self.build_checked()
        if mgr.num_computed(seq_id) < n or not self.call("finish", lambda: mgr.finish(seq_id))[0]:
            return
        others = self.live()
        ok, results = self.call("schedule_batch", lambda: mgr.schedule_batch(others, 4))
        if ok:
            self.admit(results)
        self.build_checked()
        turn = prompt + self.tokens(more)
        if not self.call("add", lambda: mgr.add(seq_id, turn, extra))[0]:
            return
        self.prompts[seq_id] = turn
        ok, r = self.call("schedule", lambda: mgr.schedule(seq_id, 64))
        if ok:
            self.admit([r])
        self.build_checked()

    @rule(i=st.integers(0, 5), preempt=st.booleans())
    def release(self, i: int, preempt: bool) -> None:
        mgr = self.mgr
        assert mgr is not None
        seq_id = OVERLAP_IDS[i]
        if self.call("finish/preempt", lambda: (mgr.preempt if preempt else mgr.finish)(seq_id))[0]:
            self.admitted.pop(seq_id, None)
            self.chunks.pop(seq_id, None)

    def teardown(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        while self.flights:
            mgr.commit_step(self.flights[0][0])
            self.end_oldest()
            mgr.check_invariants()
        for seq_id in self.live():
            mgr.finish(seq_id)
        mgr.check_invariants()
        owned = [u.owned for u in mgr.pool_usage()]
        if any(owned):
            raise FuzzFailure(f"blocks still owned with nothing live: {owned}")


def short_settings(examples: int, steps: int, **kwargs: Any) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        **kwargs,
    )


def run_campaign(examples: int, seed: int, steps: int, rounds: int, shrink: bool = True) -> int:
    """Runs ``rounds`` campaigns of ``examples`` programs each (seeds ``seed``, ``seed + 1``,
    ...); prints each failure's minimal program. Returns the number of failing rounds."""
    failures: list[str] = []
    started = time.perf_counter()
    for r in range(rounds):
        s = seed + r
        print(
            f"round {r + 1}/{rounds}: seed {s}, {examples} programs of up to {steps} steps",
            flush=True,
        )
        phases = list(Phase) if shrink else [p for p in Phase if p is not Phase.shrink]
        config = short_settings(examples, steps, database=None, phases=phases)
        try:
            for machine in (FuzzMachine, OverlapMachine):
                test = get_state_machine_test(machine, settings=config)
                hypothesis_seed(s)(test)()
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            for one in getattr(error, "exceptions", None) or [error]:
                IGNORED.add(getattr(one, "signature", f"{type(one).__name__}:{shape(str(one))}"))
                first = str(one).splitlines()[0] if str(one) else type(one).__name__
                failures.append(f"seed {s}: {type(one).__name__}: {first}")
                signature = getattr(one, "signature", "?")
                print(f"\nFAILURE (seed {s}, signature {signature!r}): {type(one).__name__}: {one}")
                for note in getattr(one, "__notes__", []):
                    print(note)
    elapsed = time.perf_counter() - started
    print(f"\n{OPERATIONS} operations in {elapsed:.1f} s ({OPERATIONS / elapsed:.0f} per second)")
    print(
        f"overlapped: {CHECKPOINT_RESUMES} rows resumed from a checkpoint, "
        f"{CHECKPOINT_RESUMES_IN_FLIGHT} of them with plans in flight, "
        f"{CHECKPOINT_RESUMES_WITH_EXTRA_KEYS} with extra keys; "
        f"{CHECKPOINT_REQUESTS} checkpoints requested"
    )
    print(f"{len(failures)} failing round(s)" + ("" if not failures else ":"))
    for f in failures:
        print("  " + f)
    return len(failures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="programs per round")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000, help="first seed")
    parser.add_argument("--steps", type=int, default=60, help="most calls per program")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (seed, seed + 1, ...)")
    parser.add_argument(
        "--no-shrink", action="store_true", help="report failures as found (faster, longer)"
    )
    parser.add_argument(
        "--gentle", action="store_true", help="no hostile values: valid calls only, deeper"
    )
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="SIGNATURE",
        help="skip programs that meet a failure already known (its signature, as printed)",
    )
    args = parser.parse_args(argv)
    global GENTLE
    GENTLE = args.gentle
    IGNORED.update(args.ignore)
    print(f"prefixcache {pc.__version__} from {pc.__file__}; seed {args.seed}")
    failing = run_campaign(args.examples, args.seed, args.steps, args.rounds, not args.no_shrink)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
