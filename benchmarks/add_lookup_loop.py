"""A fixed loop of ``add`` + ``lookup`` through the bindings, for instruction counts.

``python benchmarks/add_lookup_loop.py N MODE`` builds N managers (B = 1536, U = 128, a state
group with A = 64) and gives each 64 prompts: ``long`` of 12,000 to 19,875 tokens, ``short`` of
1,000. Under ``valgrind --tool=callgrind``, the instructions of N = 5 minus those of N = 1, over
4 x 64, are one prompt's ``add`` + ``lookup`` through Python, a figure machine load does not move.
"""

from __future__ import annotations

import sys

import numpy as np
import prefixcache as pc


def main() -> None:
    managers, mode = int(sys.argv[1]), sys.argv[2]
    config = pc.CacheConfig(
        hash=pc.HashConfig(unit=128),
        pools=[pc.PoolConfig(num_blocks=4096), pc.PoolConfig(num_blocks=4096)],
        groups=[pc.FullAttention(block_size=1536, pool=0), pc.StateGroup(alignment=64, pool=1)],
    )
    rng = np.random.default_rng(0)
    if mode == "long":
        prompts = [rng.integers(0, 50000, 12000 + 125 * i, dtype=np.uint32) for i in range(64)]
    else:
        prompts = [rng.integers(0, 50000, 1000, dtype=np.uint32) for _ in range(64)]
    for _ in range(managers):
        manager = pc.CacheManager(config)
        for seq_id, prompt in enumerate(prompts):
            manager.add(seq_id, prompt)
            manager.lookup(seq_id)


if __name__ == "__main__":
    main()
