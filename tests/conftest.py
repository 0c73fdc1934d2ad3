"""Shared helpers of the binding tests (`test_api`, `test_errors`, `test_bad_input`, ...).

`prefixcache` is imported lazily, so the kernel tests (which run without the Rust extension)
still collect when it is not built.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import prefixcache as pc


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module's tests (`pytestmark = pytest.mark.usefixtures(...)`),
    the thread count of before restored after them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def paged_config(num_blocks: int = 256, unit: int = 16, block_size: int = 32) -> pc.CacheConfig:
    """One pool, one full-attention group."""
    import prefixcache as pc

    return pc.CacheConfig(
        pools=[pc.PoolConfig(num_blocks=num_blocks)],
        groups=[pc.FullAttention(block_size=block_size, pool=0)],
        hash=pc.HashConfig(unit=unit),
    )


def hybrid_config(
    num_blocks: int = 256,
    state_blocks: int = 64,
    unit: int = 16,
    block_size: int = 32,
    alignment: int = 16,
    max_checkpoints_per_step: int | None = None,
    retention: pc.Retention | None = None,
) -> pc.CacheConfig:
    """A full-attention group (pool 0) and a state group (pool 1)."""
    import prefixcache as pc

    return pc.CacheConfig(
        pools=[pc.PoolConfig(num_blocks=num_blocks), pc.PoolConfig(num_blocks=state_blocks)],
        groups=[
            pc.FullAttention(block_size=block_size, pool=0),
            pc.StateGroup(
                alignment=alignment,
                max_checkpoints_per_step=max_checkpoints_per_step,
                pool=1,
                retention=retention or pc.Retention(),
            ),
        ],
        hash=pc.HashConfig(unit=unit),
    )


def run_prompt(mgr: pc.CacheManager, seq_id: int, tokens: list[int], finish: bool = True) -> int:
    """Adds, schedules all of, computes and commits a prompt; returns the hit it started from."""
    mgr.add(seq_id, tokens)
    scheduled = mgr.schedule(seq_id, len(tokens))
    assert scheduled is not None
    plan = mgr.build_plan()
    mgr.commit(plan)
    if finish:
        mgr.finish(seq_id)
    mgr.check_invariants()
    return scheduled.num_computed
