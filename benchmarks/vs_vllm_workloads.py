"""Token streams of the vLLM comparison (``benchmarks/vs_vllm.py``), at the seed result's sizes.

Both managers are fed the very same requests: prompts and sampled tokens come from a seeded
NumPy generator and are built once, before any timed run.

- ``growing-prefix``: 8 streams; a stream's first prompt is 120,000 random tokens, each of its
  23 rounds appends 2,000 new tokens to the previous prompt (up to 164,000); 200 decoded tokens
  per request, not fed back. A stream sends its next round when the previous one has finished
  (closed loop), so the next round may name the previous one in ``extends``.
- ``shared-prompts``: 2,000 requests of 4,096 tokens, the first 2,048 being one of 20 system
  prompts, the rest random; 64 decoded tokens each; all arrive at once, up to 256 run together.
  A request's ``extends`` hint is the latest earlier request with the same system prompt.

``scale`` shrinks a workload while keeping its block geometry: growing-prefix lengths (first
prompt, growth, outputs) are multiplied by it and rounded to whole 16-token blocks;
shared-prompts keeps its lengths and multiplies the number of requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

VOCAB_SIZE = 150_000
WORKLOAD_NAMES = ("growing-prefix", "shared-prompts")

Tokens = npt.NDArray[np.uint32]


@dataclass(frozen=True, eq=False)
class Request:
    """One request: a prompt to prefill, then ``len(output)`` tokens to decode.

    Attributes:
        request_id: unique, non-negative; also the sequence id given to prefixcache.
        prompt: token ids, ``uint32``.
        output: the tokens the "model" samples, in order (the last one is never computed).
        extends: an earlier request whose prompt this one shares a prefix with (hash reuse).
        prefix_key: requests with the same key share the first ``prefix_len`` tokens.
        prefix_len: length of that shared prefix (0: nothing shared by construction).
    """

    request_id: int
    prompt: Tokens
    output: Tokens
    extends: int | None
    prefix_key: int
    prefix_len: int


@dataclass(frozen=True)
class WorkloadShape:
    """Scheduler limits of a workload (identical for both managers)."""

    token_budget: int
    max_running: int


class Workload(ABC):
    """A closed-loop request source: initial requests, then follow-ups of finished ones."""

    name: str
    shape: WorkloadShape

    @abstractmethod
    def initial(self) -> list[Request]: ...

    def on_finished(self, request: Request) -> list[Request]:
        del request
        return []

    @abstractmethod
    def prompt_tokens(self) -> int:
        """Largest number of tokens a running sequence may hold (prompt plus output)."""
        ...


def _round_block(value: float, block: int = 16) -> int:
    return max(block, round(value / block) * block)


class GrowingPrefix(Workload):
    """8 streams of 23 rounds, each round's prompt the previous one plus 2,000 tokens."""

    name = "growing-prefix"

    def __init__(self, scale: float = 1.0, seed: int = 0) -> None:
        self.shape = WorkloadShape(token_budget=8192, max_running=8)
        self.streams = 8
        self.rounds = 23
        self.first = _round_block(120_000 * scale)
        self.growth = _round_block(2_000 * scale)
        self.output_len = max(2, round(200 * scale))
        generator = np.random.default_rng(seed)
        longest = self.first + self.growth * (self.rounds - 1)
        self.base = [
            generator.integers(0, VOCAB_SIZE, size=longest, dtype=np.uint32)
            for _ in range(self.streams)
        ]
        self.outputs = generator.integers(
            0, VOCAB_SIZE, size=(self.streams, self.rounds, self.output_len), dtype=np.uint32
        )

    def prompt_len(self, round_index: int) -> int:
        return self.first + self.growth * round_index

    def _request(self, stream: int, round_index: int) -> Request:
        previous = None if round_index == 0 else (round_index - 1) * self.streams + stream
        return Request(
            request_id=round_index * self.streams + stream,
            prompt=self.base[stream][: self.prompt_len(round_index)],
            output=self.outputs[stream, round_index],
            extends=previous,
            prefix_key=stream,
            prefix_len=0 if round_index == 0 else self.prompt_len(round_index - 1),
        )

    def initial(self) -> list[Request]:
        return [self._request(stream, 0) for stream in range(self.streams)]

    def on_finished(self, request: Request) -> list[Request]:
        round_index, stream = divmod(request.request_id, self.streams)
        if round_index + 1 >= self.rounds:
            return []
        return [self._request(stream, round_index + 1)]

    def prompt_tokens(self) -> int:
        return self.prompt_len(self.rounds - 1) + self.output_len


class SharedPrompts(Workload):
    """2,000 requests of 4,096 tokens; the first 2,048 are one of 20 system prompts."""

    name = "shared-prompts"

    def __init__(self, scale: float = 1.0, seed: int = 0) -> None:
        self.shape = WorkloadShape(token_budget=8192, max_running=256)
        self.num_requests = max(20, round(2_000 * scale))
        self.prompt_len = 4096
        self.system_len = 2048
        self.output_len = 64
        generator = np.random.default_rng(seed + 1)
        systems = generator.integers(0, VOCAB_SIZE, size=(20, self.system_len), dtype=np.uint32)
        choice = generator.integers(0, 20, size=self.num_requests)
        suffixes = generator.integers(
            0,
            VOCAB_SIZE,
            size=(self.num_requests, self.prompt_len - self.system_len),
            dtype=np.uint32,
        )
        outputs = generator.integers(
            0, VOCAB_SIZE, size=(self.num_requests, self.output_len), dtype=np.uint32
        )
        latest: dict[int, int] = {}
        self.requests: list[Request] = []
        for i in range(self.num_requests):
            system = int(choice[i])
            self.requests.append(
                Request(
                    request_id=i,
                    prompt=np.concatenate([systems[system], suffixes[i]]),
                    output=outputs[i],
                    extends=latest.get(system),
                    prefix_key=system,
                    prefix_len=self.system_len,
                )
            )
            latest[system] = i

    def initial(self) -> list[Request]:
        return list(self.requests)

    def prompt_tokens(self) -> int:
        return self.prompt_len + self.output_len


def make_workload(name: str, scale: float) -> Workload:
    """The named workload at ``scale`` (1.0 = the seed result's sizes)."""
    if name == "growing-prefix":
        return GrowingPrefix(scale)
    if name == "shared-prompts":
        return SharedPrompts(scale)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
