"""Caching policies compared by ``prefixcache simulate``: ``none``, ``block`` and ``fine``.

Every policy runs the same cache manager with the same two groups (one full-attention group of
block size B for the attention layers, one state group for the KDA layers, each in its own pool)
and the same kernel backend; they differ only in the hash unit U and the checkpoint retention:

- ``none``: no prefix caching. U = B and every retention is off, so no state checkpoint ever
  exists; by the hit rule (a state group resumes only at a published checkpoint or at 0) every
  hit is 0 and every prompt is computed in full. Attention blocks are still published, but they
  can never be used without a state to resume from. The engine asserts that no hit happens.
- ``block``: block-aligned caching, what engines do today: U = B, so every checkpoint (tail,
  junction, decode tail) and every hit sits on a block boundary. A resend of an N-token prompt
  resumes at ``((N-1) // B) * B``.
- ``fine``: U < B with tail, junction and decode-tail checkpoints: a resend resumes at
  ``((N-1) // U) * U``; attention blocks are reused up to the last full block and the partial
  one is copied on write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import prefixcache as pc

from ..kernels import KDABackend

__all__ = ["POLICY_NAMES", "Policy", "PolicyName"]

PolicyName = Literal["none", "block", "fine"]
POLICY_NAMES: tuple[PolicyName, ...] = ("none", "block", "fine")

PAGED_GROUP = 0
STATE_GROUP = 1


@dataclass(frozen=True)
class Policy:
    """A caching policy: its name, its hash unit U and its checkpoint retention."""

    name: PolicyName
    block_size: int
    unit: int
    tail: bool
    interval: int | None
    junction: bool
    decode_tail: bool

    @classmethod
    def named(cls, name: str, *, block_size: int, fine_unit: int) -> Policy:
        """The policy called ``name`` for attention blocks of ``block_size`` tokens.

        ``fine_unit`` is the ``fine`` policy's U. That it divides ``block_size`` is the core's
        rule: :meth:`cache_config` raises ``ConfigError`` otherwise.
        """
        if name == "none":
            return cls("none", block_size, block_size, False, None, False, False)
        if name == "block":
            return cls("block", block_size, block_size, True, None, True, True)
        if name == "fine":
            return cls("fine", block_size, fine_unit, True, None, True, True)
        raise ValueError(f"unknown policy {name!r}; choose among {', '.join(POLICY_NAMES)}")

    @property
    def caches_prefixes(self) -> bool:
        """Whether any hit can happen under this policy."""
        return self.name != "none"

    def retention(self) -> pc.Retention:
        """The state group's retention."""
        return pc.Retention(
            tail=self.tail,
            interval=self.interval,
            junction=self.junction,
            decode_tail=self.decode_tail,
        )

    def cache_config(
        self,
        backend: KDABackend,
        *,
        paged_blocks: int,
        state_blocks: int,
        checkpoint_cap: int | None = None,
    ) -> pc.CacheConfig:
        """The manager's configuration: pool 0 = attention blocks, pool 1 = KDA state slots.

        The state group's alignment A and checkpoints per step C come from ``backend`` itself
        (``StateGroup.from_backend``), so the planner and the kernels share one rule.
        """
        return pc.CacheConfig(
            pools=[pc.PoolConfig(num_blocks=paged_blocks), pc.PoolConfig(num_blocks=state_blocks)],
            groups=[
                pc.FullAttention(block_size=self.block_size, pool=0),
                pc.StateGroup.from_backend(
                    backend, pool=1, retention=self.retention(), checkpoint_cap=checkpoint_cap
                ),
            ],
            hash=pc.HashConfig(unit=self.unit),
            enable_events=False,
        )

    def describe(self) -> str:
        """One line: U, B and the retained positions."""
        if self.name == "none":
            return f"no prefix caching (B={self.block_size}, no checkpoints)"
        kept = [
            label
            for label, on in (
                ("tail", self.tail),
                (f"every {self.interval}", self.interval is not None),
                ("junction", self.junction),
                ("decode tail", self.decode_tail),
            )
            if on
        ]
        return f"U={self.unit}, B={self.block_size}, checkpoints: {', '.join(kept)}"
