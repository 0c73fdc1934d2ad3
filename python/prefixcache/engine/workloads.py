"""Named workloads for ``prefixcache simulate`` (``docs/BENCHMARKS.md``) and their presets.

A workload is a stream of :class:`Request` objects. Some are known up front (with an arrival
time in seconds, or "now"); others exist only once an earlier request has finished (the next
round of a growing conversation, whose prompt may contain the model's own output). So a
:class:`Workload` hands out its first requests, then follow-ups from :meth:`Workload.on_finished`.
Every token id is drawn from a seeded NumPy generator: two runs (two caching policies) see the
same prompts, as long as the model produced the same outputs.

Workloads (names as in the CLI):

- ``growing-prefix`` (:class:`GrowingPrefix`): concurrent streams; each round's prompt is the
  previous round's prompt plus ``growth`` new random tokens; outputs are not fed back. A stream
  sends its next round when the previous one has finished (closed loop).
- ``shared-prompts`` (:class:`SharedPrompts`): every request starts with one of a few system
  prompts, followed by a random suffix; all arrive at once.
- ``agentic`` (:class:`Agentic`): conversations whose next prompt is the previous prompt, the
  model's output and a new user turn (this is where decode-tail checkpoints pay).
- ``trace FILE`` (:class:`Trace`): JSONL, one request per line (see :func:`load_trace`).

Presets (:func:`workload_preset`): ``seed`` is the full size (the seed result's); ``default`` keeps
the ratios at a size that runs in about a minute on a 2-core CPU. For ``growing-prefix`` the
default is the seed geometry divided by 16 (block 96, unit 8, +125 tokens per round, chunk budget
512, 12 output tokens), except that the first prompt is 588 tokens instead of 7500: both are
congruent modulo the block (588 = 7500 - 72 * 96), so every round's hit and recomputation are
exactly the seed's divided by 16 (fine recomputes 24.2% fewer prefill tokens than block over
rounds 2-23, as at full size), only the never-reused prefix is shorter.
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

import prefixcache as pc

__all__ = [
    "PRESETS",
    "WORKLOAD_NAMES",
    "Agentic",
    "AgenticSpec",
    "Geometry",
    "GrowingPrefix",
    "GrowingPrefixSpec",
    "PresetWorkload",
    "Request",
    "SharedPrompts",
    "SharedPromptsSpec",
    "Trace",
    "TraceError",
    "TraceSpec",
    "Workload",
    "WorkloadSpec",
    "load_trace",
    "workload_preset",
]

WORKLOAD_NAMES = ("growing-prefix", "shared-prompts", "agentic", "trace")
PRESETS = ("default", "seed")
Preset = Literal["default", "seed"]


@dataclass(frozen=True, eq=False)
class Request:
    """One request: a prompt to prefill, then ``output_len`` greedy tokens to decode.

    Attributes:
        request_id: unique, non-negative; also the cache manager's sequence id.
        prompt: token ids, ``int64`` ``[N]``, ``N >= 1``, read-only: a read-only contiguous
            ``int64`` array is kept as it is (the engine shares it, so nothing may write it
            through another view), anything else is copied into one.
        output_len: tokens to generate (``>= 1``).
        round: the round (or turn, or wave) it belongs to, for per-round reports (from 1).
        arrival_s: arrival time in seconds from the start of the run; ``None`` = when it is
            handed to the engine (a follow-up arrives when its predecessor finishes).
        extends: id of an earlier request whose prompt this one continues (a hashing hint for
            the cache manager: the hashes of the common prefix are reused, not recomputed).
    """

    request_id: int
    prompt: np.ndarray
    output_len: int
    round: int = 1
    arrival_s: float | None = None
    extends: int | None = None

    def __post_init__(self) -> None:
        if self.request_id < 0:
            raise ValueError(f"request_id must be >= 0, got {self.request_id}")
        object.__setattr__(self, "prompt", read_only_ids(self.prompt))
        if self.prompt.ndim != 1 or self.prompt.shape[0] < 1:
            raise ValueError(
                f"request {self.request_id}: the prompt must be a non-empty 1-D array of ids"
            )
        if self.output_len < 1:
            raise ValueError(
                f"request {self.request_id}: output_len must be >= 1, got {self.output_len}"
            )

    @property
    def prompt_len(self) -> int:
        """N, the prompt's length in tokens."""
        return int(self.prompt.shape[0])


class Workload(ABC):
    """A source of requests for one run (stateful: build a fresh one per run)."""

    name: str

    @property
    @abstractmethod
    def num_requests(self) -> int:
        """How many requests the run will see in total (follow-ups included)."""

    @abstractmethod
    def initial_requests(self) -> list[Request]:
        """The requests known before the run starts."""

    def on_finished(self, request: Request, output_ids: Sequence[int]) -> list[Request]:
        """Follow-ups released by the completion of ``request`` (none by default)."""
        del request, output_ids
        return []


def read_only_ids(ids: Any) -> np.ndarray:
    """``ids`` as a read-only contiguous ``int64`` array: itself when it is one, else a copy.

    A request's prompt is held this way so that the engine can keep it without a copy: at
    admission, between a request's arrival and its first step, a copy of a 164K-token prompt
    cost 0.05 to 0.2 ms on a 2-core VM and up to 4 ms where its pages were new.
    """
    if (
        isinstance(ids, np.ndarray)
        and ids.dtype == np.int64
        and not ids.flags.writeable
        and ids.flags.c_contiguous
    ):
        return ids
    frozen = np.array(ids, dtype=np.int64)
    frozen.flags.writeable = False
    return frozen


def _sealed(ids: np.ndarray) -> np.ndarray:
    """A freshly built id array (nothing else refers to it) made read-only, not copied."""
    ids.flags.writeable = False
    return ids


def _random_tokens(generator: np.random.Generator, vocab_size: int, count: int) -> np.ndarray:
    """Fresh random ids, read-only (nothing writes a workload's prompts)."""
    return _sealed(generator.integers(0, vocab_size, size=count, dtype=np.int64))


# --- growing-prefix -------------------------------------------------------------------------


@dataclass(frozen=True)
class GrowingPrefixSpec:
    """Sizes of a growing-prefix workload (see :class:`GrowingPrefix`)."""

    streams: int = 8
    first_prompt: int = 120_000
    growth: int = 2_000
    rounds: int = 23
    output_len: int = 200

    def prompt_len(self, round_number: int) -> int:
        """Prompt length of round ``round_number`` (from 1)."""
        return self.first_prompt + (round_number - 1) * self.growth

    @property
    def num_requests(self) -> int:
        """Requests over the whole run."""
        return self.streams * self.rounds

    def cache_tokens(self) -> int:
        """Tokens worth caching: every stream's last prompt plus the outputs of all rounds."""
        return self.streams * (self.prompt_len(self.rounds) + self.rounds * self.output_len)

    def longest_sequence(self) -> int:
        """Tokens of the longest request, prompt and outputs (the last round's)."""
        return self.prompt_len(self.rounds) + self.output_len

    def build(self, vocab_size: int, seed: int = 0) -> GrowingPrefix:
        """A fresh workload with these sizes."""
        return GrowingPrefix(self, vocab_size, seed)


class GrowingPrefix(Workload):
    """Streams whose prompt grows by ``growth`` new tokens per round (closed loop per stream).

    Round r of stream s is request ``s * rounds + r - 1``; its prompt is the first
    ``first_prompt + (r-1) * growth`` tokens of the stream's random token sequence, so it starts
    with the previous round's prompt exactly (the output is not fed back).
    """

    name = "growing-prefix"

    def __init__(self, spec: GrowingPrefixSpec, vocab_size: int, seed: int = 0) -> None:
        if min(spec.streams, spec.first_prompt, spec.rounds, spec.output_len) < 1:
            raise ValueError(f"every size of {spec} must be >= 1")
        if spec.growth < 0:
            raise ValueError(f"growth must be >= 0, got {spec.growth}")
        self.spec = spec
        generator = np.random.default_rng(seed)
        total = spec.prompt_len(spec.rounds)
        self._tokens = [_random_tokens(generator, vocab_size, total) for _ in range(spec.streams)]

    @property
    def num_requests(self) -> int:
        """See :meth:`Workload.num_requests`."""
        return self.spec.num_requests

    def _request(self, stream: int, round_number: int, arrival: float | None) -> Request:
        spec = self.spec
        request_id = stream * spec.rounds + round_number - 1
        return Request(
            request_id=request_id,
            prompt=self._tokens[stream][: spec.prompt_len(round_number)],
            output_len=spec.output_len,
            round=round_number,
            arrival_s=arrival,
            extends=request_id - 1 if round_number > 1 else None,
        )

    def initial_requests(self) -> list[Request]:
        """Round 1 of every stream, all at time 0."""
        return [self._request(stream, 1, 0.0) for stream in range(self.spec.streams)]

    def on_finished(self, request: Request, output_ids: Sequence[int]) -> list[Request]:
        """The stream's next round, if any."""
        del output_ids
        if request.round >= self.spec.rounds:
            return []
        stream = request.request_id // self.spec.rounds
        return [self._request(stream, request.round + 1, None)]


# --- shared-prompts -------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedPromptsSpec:
    """Sizes of a shared-prompts workload (see :class:`SharedPrompts`)."""

    requests: int = 2_000
    prompt_len: int = 4_096
    system_len: int = 2_048
    system_prompts: int = 20
    output_len: int = 64
    round_size: int = 256

    @property
    def num_requests(self) -> int:
        """Requests over the whole run."""
        return self.requests

    def cache_tokens(self) -> int:
        """Tokens worth caching: the system prompts plus one round of requests in flight."""
        return self.system_prompts * self.system_len + self.round_size * (
            self.prompt_len + self.output_len
        )

    def longest_sequence(self) -> int:
        """Tokens of the longest request, prompt and outputs."""
        return self.prompt_len + self.output_len

    def build(self, vocab_size: int, seed: int = 0) -> SharedPrompts:
        """A fresh workload with these sizes."""
        return SharedPrompts(self, vocab_size, seed)


class SharedPrompts(Workload):
    """Requests that start with one of ``system_prompts`` shared prefixes, all at time 0.

    Request i uses system prompt ``i % system_prompts``; its round is ``1 + i // round_size``
    (waves of as many requests as may run at once).
    """

    name = "shared-prompts"

    def __init__(self, spec: SharedPromptsSpec, vocab_size: int, seed: int = 0) -> None:
        if not 0 <= spec.system_len < spec.prompt_len:
            raise ValueError(
                f"system_len {spec.system_len} must be below prompt_len {spec.prompt_len}"
            )
        if min(spec.requests, spec.system_prompts, spec.output_len, spec.round_size) < 1:
            raise ValueError(f"every count of {spec} must be >= 1")
        self.spec = spec
        generator = np.random.default_rng(seed)
        systems = [
            _random_tokens(generator, vocab_size, spec.system_len)
            for _ in range(spec.system_prompts)
        ]
        suffix_len = spec.prompt_len - spec.system_len
        self._requests = [
            Request(
                request_id=i,
                prompt=_sealed(
                    np.concatenate(
                        [
                            systems[i % spec.system_prompts],
                            _random_tokens(generator, vocab_size, suffix_len),
                        ]
                    )
                ),
                output_len=spec.output_len,
                round=1 + i // spec.round_size,
                arrival_s=0.0,
            )
            for i in range(spec.requests)
        ]

    @property
    def num_requests(self) -> int:
        """See :meth:`Workload.num_requests`."""
        return self.spec.requests

    def initial_requests(self) -> list[Request]:
        """Every request, at time 0."""
        return list(self._requests)


# --- agentic --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgenticSpec:
    """Sizes of an agentic workload (see :class:`Agentic`)."""

    conversations: int = 32
    turns: int = 16
    first_prompt: int = 8_192
    user_turn: int = 512
    output_len: int = 256

    @property
    def num_requests(self) -> int:
        """Requests over the whole run."""
        return self.conversations * self.turns

    def last_prompt_len(self) -> int:
        """Prompt length of the last turn."""
        return self.first_prompt + (self.turns - 1) * (self.output_len + self.user_turn)

    def cache_tokens(self) -> int:
        """Tokens worth caching: every conversation's last prompt and output."""
        return self.conversations * (self.last_prompt_len() + self.output_len)

    def longest_sequence(self) -> int:
        """Tokens of the longest request, prompt and outputs (the last turn's)."""
        return self.last_prompt_len() + self.output_len

    def build(self, vocab_size: int, seed: int = 0) -> Agentic:
        """A fresh workload with these sizes."""
        return Agentic(self, vocab_size, seed)


class Agentic(Workload):
    """Conversations: turn t+1's prompt = turn t's prompt + the model's output + a user turn.

    Turn t of conversation c is request ``c * turns + t - 1`` (closed loop per conversation);
    the user turns are drawn up front, so they do not depend on the model's outputs.
    """

    name = "agentic"

    def __init__(self, spec: AgenticSpec, vocab_size: int, seed: int = 0) -> None:
        if min(spec.conversations, spec.turns, spec.first_prompt, spec.output_len) < 1:
            raise ValueError(f"every size of {spec} must be >= 1")
        if spec.user_turn < 1:
            raise ValueError(f"user_turn must be >= 1, got {spec.user_turn}")
        self.spec = spec
        generator = np.random.default_rng(seed)
        self._first = [
            _random_tokens(generator, vocab_size, spec.first_prompt)
            for _ in range(spec.conversations)
        ]
        self._user_turns = [
            [_random_tokens(generator, vocab_size, spec.user_turn) for _ in range(spec.turns)]
            for _ in range(spec.conversations)
        ]

    @property
    def num_requests(self) -> int:
        """See :meth:`Workload.num_requests`."""
        return self.spec.num_requests

    def initial_requests(self) -> list[Request]:
        """Turn 1 of every conversation, at time 0."""
        return [
            Request(
                request_id=c * self.spec.turns,
                prompt=self._first[c],
                output_len=self.spec.output_len,
                round=1,
                arrival_s=0.0,
            )
            for c in range(self.spec.conversations)
        ]

    def on_finished(self, request: Request, output_ids: Sequence[int]) -> list[Request]:
        """The conversation's next turn, if any: prompt + output + a new user turn."""
        if request.round >= self.spec.turns:
            return []
        conversation = request.request_id // self.spec.turns
        prompt = _sealed(
            np.concatenate(
                [
                    request.prompt,
                    np.asarray(output_ids, dtype=np.int64),
                    self._user_turns[conversation][request.round],
                ]
            )
        )
        return [
            Request(
                request_id=request.request_id + 1,
                prompt=prompt,
                output_len=self.spec.output_len,
                round=request.round + 1,
                extends=request.request_id,
            )
        ]


# --- trace ----------------------------------------------------------------------------------


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line and the field."""


@dataclass(frozen=True)
class TraceSpec:
    """A trace file (see :func:`load_trace`)."""

    path: Path
    requests: tuple[Request, ...]

    @property
    def num_requests(self) -> int:
        """Requests in the file."""
        return len(self.requests)

    def cache_tokens(self) -> int:
        """Every prompt and output token of the trace (an upper bound)."""
        return sum(r.prompt_len + r.output_len for r in self.requests)

    def longest_sequence(self) -> int:
        """Tokens of the longest request, prompt and outputs."""
        return max(r.prompt_len + r.output_len for r in self.requests)

    def build(self, vocab_size: int, seed: int = 0) -> Trace:
        """The trace's requests (already materialised); ids must fit ``vocab_size``."""
        del seed
        for request in self.requests:
            if int(request.prompt.max()) >= vocab_size or int(request.prompt.min()) < 0:
                raise TraceError(
                    f"{self.path}: request {request.request_id} has token ids outside "
                    f"[0, {vocab_size}) (the model's vocabulary)"
                )
        return Trace(self)


class Trace(Workload):
    """Replays a trace: every request at its ``arrival_s``."""

    name = "trace"

    def __init__(self, spec: TraceSpec) -> None:
        self.spec = spec

    @property
    def num_requests(self) -> int:
        """See :meth:`Workload.num_requests`."""
        return self.spec.num_requests

    def initial_requests(self) -> list[Request]:
        """Every request of the file, each at its arrival time."""
        return list(self.spec.requests)


def _field(line: int, record: dict[str, Any], name: str, kind: type) -> Any:
    if name not in record:
        raise TraceError(f"line {line}: missing field {name!r}")
    value = record[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceError(f"line {line}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def load_trace(path: str | os.PathLike[str], *, vocab_size: int = 1000, seed: int = 0) -> TraceSpec:
    """Parse a JSONL trace, one request per line.

    Each line is an object with ``"id"`` (any JSON string or number, unique), ``"arrival_s"``
    (seconds from the start, >= 0), ``"output_len"`` (>= 1), and either ``"prompt"`` (a list of
    token ids) or ``"prompt_len"`` (random ids), optionally with ``"prefix_of": ID``: the prompt
    then starts with the prompt of the earlier line ``ID``, cut or extended with random ids to
    ``prompt_len`` tokens. An optional ``"round"`` (int >= 1, default 1) groups requests in the
    per-round report. Random ids are drawn from ``seed`` in file order, so a trace always
    replays the same prompts. Blank lines are skipped. Raises :class:`TraceError`.
    """
    generator = np.random.default_rng(seed)
    by_id: dict[str, Request] = {}
    requests: list[Request] = []
    text = Path(path).read_text(encoding="utf-8")
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise TraceError(f"line {number}: not valid JSON ({error})") from error
        if not isinstance(record, dict):
            raise TraceError(f"line {number}: expected a JSON object, got {type(record).__name__}")
        if "id" not in record or isinstance(record["id"], (dict, list)):
            raise TraceError(f"line {number}: missing or non-scalar field 'id'")
        key = str(record["id"])
        if key in by_id:
            raise TraceError(f"line {number}: duplicate id {record['id']!r}")
        arrival = _field(number, record, "arrival_s", float)
        if not math.isfinite(arrival) or arrival < 0:
            raise TraceError(f"line {number}: arrival_s must be a finite number >= 0")
        output_len = _field(number, record, "output_len", int)
        if output_len < 1:
            raise TraceError(f"line {number}: output_len must be >= 1, got {output_len}")
        round_number = record.get("round", 1)
        if not isinstance(round_number, int) or isinstance(round_number, bool) or round_number < 1:
            raise TraceError(f"line {number}: round must be an int >= 1, got {round_number!r}")
        extends: int | None = None
        if "prompt" in record:
            ids = record["prompt"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise TraceError(f"line {number}: 'prompt' must be a non-empty list of ints")
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise TraceError(f"line {number}: prompt token ids must lie in [0, {vocab_size})")
            prompt = np.asarray(ids, dtype=np.int64)
        else:
            length = _field(number, record, "prompt_len", int)
            if length < 1:
                raise TraceError(f"line {number}: prompt_len must be >= 1, got {length}")
            if "prefix_of" in record:
                source = by_id.get(str(record["prefix_of"]))
                if source is None:
                    raise TraceError(
                        f"line {number}: prefix_of {record['prefix_of']!r} names no earlier line"
                    )
                shared = source.prompt[:length]
                extra = _random_tokens(generator, vocab_size, length - shared.shape[0])
                prompt = _sealed(np.concatenate([shared, extra]))
                extends = source.request_id
            else:
                prompt = _random_tokens(generator, vocab_size, length)
        request = Request(
            request_id=len(requests),
            prompt=prompt,
            output_len=output_len,
            round=round_number,
            arrival_s=arrival,
            extends=extends,
        )
        by_id[key] = request
        requests.append(request)
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return TraceSpec(path=Path(path), requests=tuple(requests))


# --- presets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """Cache and scheduler geometry of a workload preset.

    Attributes:
        block_size: B, tokens per attention block (all policies).
        unit: U of the ``fine`` policy (``block`` uses U = B).
        token_budget: tokens per engine step (chunked prefill budget).
        max_running: sequences running at once.
    """

    block_size: int
    unit: int
    token_budget: int
    max_running: int

    def __post_init__(self) -> None:
        if min(self.block_size, self.unit, self.token_budget, self.max_running) < 1:
            raise ValueError(f"every field of {self} must be >= 1")
        # The core's rule (U divides B): a geometry is valid iff aligning it to A = 1 keeps it.
        if pc.aligned_geometry(self.unit, self.block_size, 1) != (self.unit, self.block_size):
            raise ValueError(f"the unit {self.unit} must divide the block size {self.block_size}")

    def aligned(self, alignment: int) -> Geometry:
        """This geometry with the smallest U and B the core accepts for a kernel of checkpoint
        alignment A (``prefixcache.aligned_geometry``); unchanged when A already divides U."""
        unit, block = pc.aligned_geometry(self.unit, self.block_size, alignment)
        return replace(self, unit=unit, block_size=block)


WorkloadSpec = GrowingPrefixSpec | SharedPromptsSpec | AgenticSpec | TraceSpec


@dataclass(frozen=True)
class PresetWorkload:
    """A named workload at a preset size, with the geometry it is meant to run under."""

    name: str
    preset: str
    spec: WorkloadSpec
    geometry: Geometry

    def build(self, vocab_size: int, seed: int = 0) -> Workload:
        """A fresh :class:`Workload` (build one per run)."""
        return self.spec.build(vocab_size, seed)


_SPECS: dict[tuple[str, str], tuple[WorkloadSpec, Geometry]] = {
    ("growing-prefix", "seed"): (
        GrowingPrefixSpec(),
        Geometry(block_size=1536, unit=128, token_budget=8192, max_running=8),
    ),
    ("growing-prefix", "default"): (
        GrowingPrefixSpec(streams=8, first_prompt=588, growth=125, rounds=23, output_len=12),
        Geometry(block_size=96, unit=8, token_budget=512, max_running=8),
    ),
    ("shared-prompts", "seed"): (
        SharedPromptsSpec(),
        Geometry(block_size=16, unit=8, token_budget=8192, max_running=256),
    ),
    ("shared-prompts", "default"): (
        SharedPromptsSpec(
            requests=160,
            prompt_len=512,
            system_len=256,
            system_prompts=20,
            output_len=8,
            round_size=32,
        ),
        Geometry(block_size=16, unit=8, token_budget=1024, max_running=32),
    ),
    ("agentic", "seed"): (
        AgenticSpec(),
        Geometry(block_size=1536, unit=128, token_budget=8192, max_running=32),
    ),
    ("agentic", "default"): (
        AgenticSpec(conversations=8, turns=8, first_prompt=512, user_turn=40, output_len=24),
        Geometry(block_size=96, unit=8, token_budget=512, max_running=8),
    ),
}

_TRACE_GEOMETRY = {
    "seed": Geometry(block_size=1536, unit=128, token_budget=8192, max_running=64),
    "default": Geometry(block_size=96, unit=8, token_budget=512, max_running=16),
}


def workload_preset(
    name: str,
    preset: str = "default",
    *,
    trace_path: str | os.PathLike[str] | None = None,
    vocab_size: int = 1000,
) -> PresetWorkload:
    """The workload ``name`` at size ``preset`` (``"default"`` or ``"seed"``).

    ``trace`` needs ``trace_path``; its preset chooses only the geometry.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if name == "trace":
        if trace_path is None:
            raise ValueError("the trace workload needs a FILE (--workload trace FILE)")
        spec = load_trace(trace_path, vocab_size=vocab_size)
        return PresetWorkload(name, preset, spec, _TRACE_GEOMETRY[preset])
    if (name, preset) not in _SPECS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
    spec_, geometry = _SPECS[(name, preset)]
    return PresetWorkload(name, preset, spec_, geometry)
