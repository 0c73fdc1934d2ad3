"""A paged KV cache for the attention layers of a reference model.

Blocks of ``block_size`` token slots; block ids come from the Rust core's paged group. A token's
*slot* is ``block * block_size + offset`` (the step plan's ``slot_mapping``, int64, ``-1`` =
padding, skipped, as in vLLM). A sequence's *block table row* lists its blocks in order, so its
token ``i`` lives in ``block_table_row[i // block_size]`` at offset ``i % block_size``.

Layout: ``key`` and ``value`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``. This is a
reference (correctness, CPU tests, the tiny model), not a fast attention kernel.

:meth:`PagedKVCache.stacked` makes the caches of several layers of one shape as views of one
tensor ``[layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (each layer's key and
value contiguous, as a cache of its own): a copy-on-write copy then moves a block's tokens in
every layer in one launch (:func:`copy_prefix_all`) instead of one a layer, which a resumed
request pays before its forward starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._convert import index_where_it_is, to_device

__all__ = ["PagedKVCache", "copy_prefix_all"]


def _checked_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    if num_blocks < 1 or block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(
            "num_blocks, block_size, num_kv_heads and head_dim must all be >= 1, got "
            f"{num_blocks}, {block_size}, {num_kv_heads}, {head_dim}"
        )
    return (num_blocks, block_size, num_kv_heads, head_dim)


class PagedKVCache:
    """Key and value blocks of one attention layer."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = _checked_shape(num_blocks, block_size, num_kv_heads, head_dim)
        self._attach(torch.zeros((1, 2, *shape), dtype=dtype, device=device), 0)

    def _attach(self, storage: torch.Tensor, layer: int) -> None:
        #: ``(storage, layer)``: the cache is layer ``layer`` of ``storage`` (one of its own, or
        #: of :meth:`stacked`).
        self.stack = (storage, layer)
        self.key, self.value = storage[layer, 0], storage[layer, 1]

    @classmethod
    def stacked(
        cls,
        layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> list[PagedKVCache]:
        """``layers`` caches of one shape whose keys and values are views of one zeroed tensor
        ``[layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (see the module
        docstring); each behaves as a cache of its own."""
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        shape = _checked_shape(num_blocks, block_size, num_kv_heads, head_dim)
        storage = torch.zeros((layers, 2, *shape), dtype=dtype, device=device)
        caches = []
        for layer in range(layers):
            cache = cls.__new__(cls)
            cache._attach(storage, layer)
            caches.append(cache)
        return caches

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return int(self.key.shape[0])

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return int(self.key.shape[1])

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads."""
        return int(self.key.shape[2])

    @property
    def head_dim(self) -> int:
        """Head dimension."""
        return int(self.key.shape[3])

    @property
    def device(self) -> torch.device:
        """Device of the blocks."""
        return self.key.device

    def write(
        self,
        slot_mapping: torch.Tensor | np.ndarray,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        checked: bool = False,
    ) -> None:
        """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at token slots ``slot_mapping``.

        Slots ``-1`` are skipped. Raises ``IndexError`` on a slot beyond the cache and
        ``ValueError`` on mismatched shapes. ``checked``: the caller has checked (with
        :meth:`slots_in_range`, on the host) that every slot is in the cache, none ``-1``, so a
        device ``slot_mapping`` is used as it is, without reading it back (which would wait
        for the GPU).
        """
        # Host indices (the plan's NumPy arrays) are checked on the host, then uploaded: no
        # device synchronisation per layer and step.
        slots, on_device = index_where_it_is(slot_mapping, "slot_mapping", self.device)
        if checked and on_device:
            if key.shape != value.shape or key.dim() != 3 or key.shape[0] != slots.shape[0]:
                raise ValueError(
                    f"key and value must both be [T={slots.shape[0]}, num_kv_heads, head_dim], "
                    f"got {tuple(key.shape)} and {tuple(value.shape)}"
                )
            self._store(slots, key, value)
            return
        if key.shape != value.shape or key.dim() != 3 or key.shape[0] != slots.shape[0]:
            raise ValueError(
                f"key and value must both be [T={slots.shape[0]}, num_kv_heads, head_dim], got "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        if tuple(key.shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"key heads/dim {tuple(key.shape[1:])} do not match the cache's "
                f"({self.num_kv_heads}, {self.head_dim})"
            )
        keep = slots >= 0
        if not bool(keep.all()):
            slots = slots[keep]
            if not on_device:
                keep = to_device(keep, key.device)
            key, value = key[keep], value[keep]
        capacity = self.num_blocks * self.block_size
        if slots.numel() and int(slots.max()) >= capacity:
            raise IndexError(f"slot {int(slots.max())} is beyond the cache's {capacity} slots")
        if not on_device:
            slots = to_device(slots, self.device)
        self._store(slots, key, value)

    def slots_in_range(self, slot_mapping: np.ndarray) -> bool:
        """Whether every slot of a host ``slot_mapping`` is in this cache and none is ``-1``
        (what ``write(..., checked=True)`` relies on)."""
        slots = np.asarray(slot_mapping)
        capacity = self.num_blocks * self.block_size
        return slots.size == 0 or bool(slots.min() >= 0 and slots.max() < capacity)

    def _store(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if tuple(key.shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"key heads/dim {tuple(key.shape[1:])} do not match the cache's "
                f"({self.num_kv_heads}, {self.head_dim})"
            )
        capacity = self.num_blocks * self.block_size
        self.key.view(capacity, self.num_kv_heads, self.head_dim).index_copy_(
            0, slots, key.to(self.key.dtype)
        )
        self.value.view(capacity, self.num_kv_heads, self.head_dim).index_copy_(
            0, slots, value.to(self.value.dtype)
        )

    def gather(
        self, block_table_row: torch.Tensor | np.ndarray | list[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of a sequence: ``(key, value)`` ``[length, heads, dim]``.

        ``block_table_row`` lists the sequence's blocks in order; entries past the last block
        the sequence needs are ignored (padding may hold any value).
        """
        row, on_device = index_where_it_is(block_table_row, "block_table_row", self.device)
        needed = -(-length // self.block_size)
        if length < 0 or needed > row.shape[0]:
            raise ValueError(
                f"length {length} needs {needed} blocks but the block table row has {row.shape[0]}"
            )
        blocks = row[:needed]
        if needed and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks):
            raise IndexError(
                f"block table row {blocks.tolist()} has a block outside [0, {self.num_blocks})"
            )
        if not on_device:
            blocks = to_device(blocks, self.device)
        shape = (needed * self.block_size, self.num_kv_heads, self.head_dim)
        key = self.key.index_select(0, blocks).reshape(shape)[:length]
        value = self.value.index_select(0, blocks).reshape(shape)[:length]
        return key, value

    def copy_prefix(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` token slots of block ``src_block`` into ``dst_block``
        (keys and values in one copy)."""
        storage, layer = self.stack
        storage[layer, :, dst_block, :num_tokens] = storage[layer, :, src_block, :num_tokens]


def copy_prefix_all(caches: Sequence[PagedKVCache], rows: Sequence[tuple[int, int, int]]) -> None:
    """:meth:`PagedKVCache.copy_prefix` of each ``(src_block, dst_block, num_tokens)`` row
    (already checked by ``check_copies``) in every cache of ``caches``: one copy a row when the
    caches are exactly the layers of one :meth:`PagedKVCache.stacked` storage, one a cache
    otherwise."""
    if not caches or not rows:
        return
    storage = caches[0].stack[0]
    whole = all(cache.stack[0] is storage for cache in caches) and sorted(
        cache.stack[1] for cache in caches
    ) == list(range(storage.shape[0]))
    for src_block, dst_block, num_tokens in rows:
        if whole:
            storage[:, :, dst_block, :num_tokens] = storage[:, :, src_block, :num_tokens]
        else:
            for cache in caches:
                cache.copy_prefix(src_block, dst_block, num_tokens)
