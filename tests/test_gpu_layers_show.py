"""``benchmarks/gpu_layers.py --show``: a saved file's kernel lists, each with its total.

The figures the benchmarks page quotes from saved kernel lists (a layer call's kernels in all)
come from this command, so it must print every kernel of a case, not the first few, and their
sum: checked here on a file written with known values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_layers


def test_show_prints_every_kernel_and_their_total(tmp_path, capsys) -> None:
    times = [100.0 + index for index in range(20)]  # more than a screenful; sum 2190
    saved = {
        "kernels": [
            {
                "kind": "kda-step",
                "tokens": 3584,
                "prefix": 0,
                "kernels": [
                    {"kernel": f"kernel_{index}", "per_call": 1.0, "us_per_call": us}
                    for index, us in enumerate(times)
                ],
            }
        ],
        "fits": [
            {
                "kind": "kda-step", "prefix": 0, "fixed_ms": 0.25, "per_token_us": 0.2,
                "host_ms_at_max": 0.6, "gpu_ms_at_max": 1.1, "busy_fixed_ms": 0.1,
                "busy_per_token_us": 0.25,
            }
        ],
    }  # fmt: skip
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(saved))
    assert gpu_layers.main(["--show", str(path)]) == 0
    out = capsys.readouterr().out
    assert all(f"kernel_{index}" in out for index in range(20))
    assert "2190.0       all kernels of the call" in out
    assert "fixed 0.250 ms + 0.2000 us a token" in out and "busy: 0.100 ms" in out
