#!/usr/bin/env python3
"""Host time of one host-to-device upload of a step's index array, the way each step makes them.

Every step uploads its plan's index arrays (token ids, KV slots, block tables, state slots, the
convolution's positions) with ``prefixcache.kernels._convert.to_device``: a non-blocking copy from
the pageable array itself, which the driver stages before it returns. This measures, per call
and per size, the host time of that path against a copy through pinned memory
(``Tensor.pin_memory``, the caching host allocator, then a non-blocking copy: what ``to_device``
did until 2026-12-02), with the GPU idle and with it busy behind a backlog
(``torch.cuda._sleep``, as a step's launches run behind its kernels): a path whose host time
grows behind a backlog waits for the GPU, which a step's launches must not. Each upload's values
are checked on the device.

    PYTHONPATH=<site with the wheel> python3 benchmarks/gpu_uploads.py --json "$OUT/uploads.json"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from prefixcache.kernels._convert import to_device

#: Sizes (int64 elements): a decode step's rows, a prefill chunk's tokens, a block table of a
#: 164K-token context in 16-token pages.
SIZES = (8, 64, 512, 4096, 32768)
#: GPU clock cycles of the backlog (about 10 ms at 1.98 GHz): longer than the timed calls.
BACKLOG_CYCLES = 20_000_000


def _pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.pin_memory().to(device, non_blocking=True)


PATHS: dict[str, Callable[[torch.Tensor, torch.device], torch.Tensor]] = {
    "pinned, non-blocking": _pinned,
    "pageable, non-blocking (to_device)": to_device,
}


def time_path(
    upload: Callable[[torch.Tensor, torch.device], torch.Tensor],
    size: int,
    device: torch.device,
    busy: bool,
    calls: int,
) -> list[float]:
    """Host microseconds of each of ``calls`` uploads of a fresh ``size``-element array."""
    times = []
    for k in range(calls):
        host = torch.arange(k, k + size, dtype=torch.int64)
        if busy:
            torch.cuda._sleep(BACKLOG_CYCLES)  # type: ignore[no-untyped-call]
        started = time.perf_counter()
        on_device = upload(host, device)
        times.append(1e6 * (time.perf_counter() - started))
        torch.cuda.synchronize(device)
        if int(on_device[0]) != k or int(on_device[-1]) != k + size - 1:
            raise AssertionError(f"upload of {size} elements arrived wrong")
    return times


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    for upload in PATHS.values():  # first calls: the allocator's growth, the driver's
        for size in SIZES:
            time_path(upload, size, device, False, 5)
    rows = []
    print("| path | elements | GPU | host us p50 | p90 | max |")
    print("|---|---|---|---|---|---|")
    for name, upload in PATHS.items():
        for size in SIZES:
            for busy in (False, True):
                times = time_path(upload, size, device, busy, args.calls)
                cuts = statistics.quantiles(times, n=10)
                row = {
                    "path": name,
                    "elements": size,
                    "gpu_busy": busy,
                    "p50_us": statistics.median(times),
                    "p90_us": cuts[-1],
                    "max_us": max(times),
                }
                rows.append(row)
                print(
                    f"| {name} | {size:,} | {'busy' if busy else 'idle'} | {row['p50_us']:.1f} "
                    f"| {row['p90_us']:.1f} | {row['max_us']:.1f} |"
                )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
