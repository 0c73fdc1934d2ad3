"""The seed report's fits and what -20% needs (``benchmarks/gpu_seed_report.py``).

The rule, stated here independently: over rounds 2 and later, block's figure of a request (its
KDA seconds shared over the round's requests; its TTFT p50) is a straight line in the round's
computed tokens a request, fitted by least squares; the fixed amount to take off both policies
for fine to land 20% under block is the x of ``fine - x = 0.8 (block - x)``, none where fine is
there already. Rounds built here lie on known lines, so the report must print those lines and
the amount solved by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_seed_report

REQUESTS = 4


def _policy(
    tokens_a_request: list[int],
    kda_fixed_ms: float,
    ttft_fixed_ms: float,
    before_ms: float = 0.7,
) -> dict[str, Any]:
    """Rounds 1 to N (round 1 far off every line, so including it would show) whose KDA time a
    request is ``kda_fixed_ms`` + 0.5 us a token and whose TTFT p50 is ``ttft_fixed_ms`` + 10 us a
    token, ``before_ms`` of it before the request's forward; every request of a round at its
    round's TTFT."""
    rounds, ttfts = [], []
    for number, tokens in enumerate(tokens_a_request, start=1):
        kda_ms = kda_fixed_ms + 0.0005 * tokens
        ttft = ttft_fixed_ms + 0.010 * tokens
        if number == 1:
            kda_ms, ttft = 1000.0, 5000.0
        rounds.append({
            "round": number,
            "requests": REQUESTS,
            "computed_prefill_tokens": REQUESTS * tokens,
            "kda_prefill_seconds": REQUESTS * kda_ms / 1e3,
            "prefill_seconds": REQUESTS * (ttft - before_ms) / 1e3,
            "ttft_p50_ms": ttft,
        })  # fmt: skip
        ttfts += [[number, ttft]] * REQUESTS
    return {"rounds": rounds, "request_ttft_ms": ttfts}


def test_fits_recover_the_lines_and_the_fixed_part_minus_20_needs() -> None:
    block = _policy([9000, 2000, 3000, 4000, 2500], kda_fixed_ms=0.3, ttft_fixed_ms=6.0)
    fine = _policy([9000, 1600, 1600, 1700, 1600], 0.3, ttft_fixed_ms=6.0, before_ms=0.4)
    lines = gpu_seed_report.fits({"policies": {"block": block, "fine": fine}})
    assert lines[4].endswith("median round): block 0.70 ms, fine 0.40 ms")
    assert lines[0].startswith("block's KDA time fits 0.300 ms a request + 0.500 us a token")
    # KDA a request over rounds 2 to 5: block 0.3 + 0.0005 * 2875 = 1.7375 ms, fine 0.3 +
    # 0.0005 * 1625 = 1.1125 ms: already 36% under, nothing needed.
    assert "KDA at -20% needs 0 us less fixed work a request" in lines[1]
    assert "(1.113 against 1.738 ms a request now)" in lines[1]
    assert lines[2].startswith("block's TTFT p50 fits 6.00 ms + 10.00 us a token")
    # TTFT p50 over rounds 2 to 5: block's requests at 26, 31, 36 and 46 ms -> 33.5; fine's at
    # 22, 22, 22 and 23 -> 22. 22 is already under 0.8 * 33.5 = 26.8.
    assert "needs 0.00 ms less fixed time a request" in lines[3]
    # With 30 ms more fixed time in both (52 against 63.5): x = (52 - 50.8) / 0.2 = 6 ms.
    block = _policy([9000, 2000, 3000, 4000, 2500], kda_fixed_ms=0.3, ttft_fixed_ms=36.0)
    fine = _policy([9000, 1600, 1600, 1700, 1600], kda_fixed_ms=0.3, ttft_fixed_ms=36.0)
    lines = gpu_seed_report.fits({"policies": {"block": block, "fine": fine}})
    assert "TTFT p50 at -20% needs 6.00 ms less fixed time a request" in lines[3]
    assert "(52.0 against 63.5 ms now)" in lines[3]


def test_the_needed_amounts_do_not_need_a_fit() -> None:
    # Fine's tokens only 10% under block's with a large fixed part: KDA a request block 2.0 +
    # 0.0005 * 2000 = 3.0 ms, fine 2.0 + 0.0005 * 1800 = 2.9 ms; x = (2.9 - 2.4) / 0.2 = 2.5 ms.
    # TTFT: block 26, fine 24 ms; x = (24 - 20.8) / 0.2 = 16 ms.
    block = _policy([9000, 2000, 2000, 2000], kda_fixed_ms=2.0, ttft_fixed_ms=6.0)
    fine = _policy([9000, 1800, 1800, 1800], kda_fixed_ms=2.0, ttft_fixed_ms=6.0)
    # Block's tokens are all alike, so its lines are undefined: the report says so, no figures.
    lines = gpu_seed_report.fits({"policies": {"block": block, "fine": fine}})
    assert lines[0] == "block's rounds compute too alike tokens a request for a fit"
    assert "KDA at -20% needs 2500 us less fixed work a request" in lines[1]
    assert "TTFT p50 at -20% needs 16.00 ms less fixed time a request" in lines[2]
    assert len(lines) == 4
    block["rounds"][1]["computed_prefill_tokens"] = REQUESTS * 2200
    block["rounds"][1]["kda_prefill_seconds"] = REQUESTS * (2.0 + 0.0005 * 2200) / 1e3
    lines = gpu_seed_report.fits({"policies": {"block": block, "fine": fine}})
    assert lines[0].startswith("block's KDA time fits 2.000 ms a request + 0.500 us a token")
    # Block now 2 + 0.0005 * 6200 / 3 ms a request on average; x = (2.9 - 0.8 * that) / 0.2.
    expected = (2.9 - 0.8 * (2.0 + 0.0005 * 6200 / 3)) / 0.2
    assert f"needs {1e3 * expected:.0f} us less fixed work a request" in lines[1]


def test_the_report_refuses_what_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A missing file, a file that is not JSON, and more than the two orders are usage errors
    # (exit status 2, the path named), not tracebacks.
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    for arguments, said in (
        ([str(tmp_path / "missing.json")], "missing.json"),
        ([str(broken)], "broken.json"),
        (["a.json", "b.json", "c.json"], "at most two documents"),
        ([], "FILE"),
    ):
        with pytest.raises(SystemExit) as exited:
            gpu_seed_report.main(arguments)
        assert exited.value.code == 2
        assert said in capsys.readouterr().err
