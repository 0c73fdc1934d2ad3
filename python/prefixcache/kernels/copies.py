"""The step plan's block copies: copy-on-write copies of paged KV blocks and state snapshots.

- ``copies`` ``[K, 4]`` int64 rows ``(group, src_block, dst_block, num_tokens)`` run *before* the
  forward: the first ``num_tokens`` token slots of ``src_block`` are copied into ``dst_block`` in
  every attention layer of paged group ``group``.
- ``snapshots`` ``[S, 2]`` int32 rows ``(src_running_block, dst_checkpoint_block)`` run *after*
  the forward: the running state (conv window and recurrent state) is copied into a checkpoint
  block, in every recurrent layer of the state group. This is how a position at the end of a
  step is kept, on any backend.

Both are validated first (``validate``) and raise ``KernelPlanError`` without copying anything.
``copy_checked_blocks`` / ``copy_checked_states`` run lists already validated, for a caller that
checks a whole step (copies, state plan, snapshots) before it writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ._convert import ArrayLike, to_device
from .paged_kv import PagedKVCache, copy_prefix_all
from .state_cache import StateCache
from .validate import check_copies, check_snapshots

__all__ = [
    "apply_copies",
    "apply_snapshots",
    "copy_checked_blocks",
    "copy_checked_states",
    "copy_shapes",
]


def apply_snapshots(caches: StateCache | Sequence[StateCache], snapshots: ArrayLike) -> None:
    """Copy running states into checkpoint blocks in every cache of one state group."""
    layers = [caches] if isinstance(caches, StateCache) else list(caches)
    if not layers:
        return
    num_slots = min(cache.num_blocks for cache in layers)
    copy_checked_states(layers, check_snapshots(snapshots, num_slots))


def copy_checked_states(layers: Sequence[StateCache], pairs: Sequence[tuple[int, int]]) -> None:
    """Copy slot ``src`` into slot ``dst`` for each pair already checked by
    ``check_snapshots``, in every cache of ``layers``."""
    if not pairs:
        return
    src_host = torch.tensor([src for src, _ in pairs], dtype=torch.int64)
    dst_host = torch.tensor([dst for _, dst in pairs], dtype=torch.int64)
    for cache in layers:
        cache.copy_slots(to_device(src_host, cache.device), to_device(dst_host, cache.device))


def _layers_by_group(
    kv_caches: Mapping[int, PagedKVCache | Sequence[PagedKVCache]],
) -> dict[int, list[PagedKVCache]]:
    return {
        group: [caches] if isinstance(caches, PagedKVCache) else list(caches)
        for group, caches in kv_caches.items()
    }


def copy_shapes(
    kv_caches: Mapping[int, PagedKVCache | Sequence[PagedKVCache]],
) -> dict[int, tuple[int, int]]:
    """``(num_blocks, block_size)`` of each paged group's caches, as ``check_copies`` takes."""
    return {
        group: (min(c.num_blocks for c in caches), min(c.block_size for c in caches))
        for group, caches in _layers_by_group(kv_caches).items()
        if caches
    }


def apply_copies(
    copies: ArrayLike,
    kv_caches: Mapping[int, PagedKVCache | Sequence[PagedKVCache]],
) -> None:
    """Run copy-on-write copies in the attention layers of each paged group.

    ``kv_caches`` maps a paged group id to its layers' caches (one cache or a list).
    """
    copy_checked_blocks(check_copies(copies, copy_shapes(kv_caches)), kv_caches)


def copy_checked_blocks(
    rows: Sequence[tuple[int, int, int, int]],
    kv_caches: Mapping[int, PagedKVCache | Sequence[PagedKVCache]],
) -> None:
    """Run copies already checked by ``check_copies`` (rows ``(group, src, dst, num_tokens)``;
    rows of different groups touch different caches, so each group's run together)."""
    if not rows:
        return
    layers = _layers_by_group(kv_caches)
    for group in dict.fromkeys(row[0] for row in rows):
        copy_prefix_all(layers[group], [(s, d, n) for g, s, d, n in rows if g == group])
