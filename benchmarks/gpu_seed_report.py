#!/usr/bin/env python3
"""Tables of the seed measurement (``benchmarks/gpu_seed.sh``) from its JSON documents.

For one or two ``prefixcache simulate --json`` documents of the seed preset (block and fine,
in either order) prints, as Markdown: per round, each policy's computed prefill tokens, KDA
time, whole-model prefill time and TTFT p50; the totals over rounds 2 to 23 against the targets
(KDA prefill time and TTFT p50 each >= 20% lower for fine), with block's KDA time and TTFT p50
fitted per request and per token, the fixed amount a request each target needs taken off both
policies, and each policy's time before a request's forward; and, given both orders, each
policy's figures in the two runs side by side (the order check: within 5%); and each policy's
measured step times (decode steps, prefill steps and their fit). A document of
``simulate --repeats N`` (N > 1) also gets its per-pass table (rounds 2 to 23, the median pass
starred; the per-round tables and totals are the median pass's) with each figure's spread
(max / min - 1) over the passes, the order check of pass 1 against pass 2 of each policy, and
each pass's own per-round table and totals, fine against block (pass 2 runs fine first when
pass 1 ran block first); with two such documents the order check compares their median
passes. Older documents (no passes) print as before.

    python3 benchmarks/gpu_seed_report.py seed_block_first.json [seed_fine_first.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any


def later(policy: dict[str, Any], key: str) -> float:
    """The sum of ``key`` over rounds 2 and later."""
    return float(sum(r[key] for r in policy["rounds"] if r["round"] > 1))


def ttft_p50(policy: dict[str, Any]) -> float:
    """TTFT p50 (ms) over every request of rounds 2 and later."""
    return statistics.median(ms for round_, ms in policy["request_ttft_ms"] if round_ > 1)


def change(new: float, old: float) -> str:
    return f"{100.0 * (new / old - 1):+.1f}%" if old else "-"


def per_round(document: dict[str, Any]) -> list[str]:
    block, fine = document["policies"]["block"], document["policies"]["fine"]
    lines = [
        "| round | block computed | fine computed | tokens | block KDA ms | fine KDA ms | KDA "
        "| block prefill ms | fine prefill ms | prefill | block TTFT p50 ms | fine TTFT p50 ms "
        "| TTFT |",
        "|" + "---|" * 13,
    ]
    for b, f in zip(block["rounds"], fine["rounds"], strict=True):
        cells = [
            str(b["round"]),
            f"{b['computed_prefill_tokens']:,}",
            f"{f['computed_prefill_tokens']:,}",
            change(f["computed_prefill_tokens"], b["computed_prefill_tokens"]),
            f"{1e3 * b['kda_prefill_seconds']:.1f}",
            f"{1e3 * f['kda_prefill_seconds']:.1f}",
            change(f["kda_prefill_seconds"], b["kda_prefill_seconds"]),
            f"{1e3 * b['prefill_seconds']:.1f}",
            f"{1e3 * f['prefill_seconds']:.1f}",
            change(f["prefill_seconds"], b["prefill_seconds"]),
            f"{b['ttft_p50_ms']:.1f}",
            f"{f['ttft_p50_ms']:.1f}",
            change(f["ttft_p50_ms"], b["ttft_p50_ms"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def totals(document: dict[str, Any]) -> list[str]:
    block, fine = document["policies"]["block"], document["policies"]["fine"]
    rows = [
        ("prefill tokens computed", "computed_prefill_tokens", 1.0, "{:,.0f}", "-24.2% (ceiling)"),
        ("KDA prefill time, s", "kda_prefill_seconds", 1.0, "{:.3f}", "<= -20%"),
        ("whole-model prefill time, s", "prefill_seconds", 1.0, "{:.3f}", "-"),
    ]
    lines = ["| rounds 2 to 23 | block | fine | change | target |", "|---|---|---|---|---|"]
    for label, key, scale, form, target in rows:
        b, f = scale * later(block, key), scale * later(fine, key)
        lines.append(
            f"| {label} | {form.format(b)} | {form.format(f)} | {change(f, b)} | {target} |"
        )
    b, f = ttft_p50(block), ttft_p50(fine)
    lines.append(f"| TTFT p50, ms | {b:.1f} | {f:.1f} | {change(f, b)} | <= -20% |")
    return lines


def _block_fit(
    rounds: list[dict[str, Any]], value: Callable[[dict[str, Any]], float]
) -> tuple[float, float]:
    """``value`` of a request in each of ``rounds`` against the round's computed tokens a
    request, by least squares: (fixed part, part a token)."""
    slope, intercept = statistics.linear_regression(
        [r["computed_prefill_tokens"] / r["requests"] for r in rounds], [value(r) for r in rounds]
    )
    return intercept, slope


def _needed(block: float, fine: float) -> float:
    """The fixed amount to take off both policies' figure so that fine lands 20% under block
    (``(fine - x) = 0.8 (block - x)``); 0 where it is there already."""
    return max(0.0, (fine - 0.8 * block) / 0.2)


def fits(document: dict[str, Any]) -> list[str]:
    """Block's KDA time over rounds 2 to 23 and its TTFT p50, each fitted per round by least
    squares against its computed tokens a request (fine's rounds compute nearly the same tokens,
    so a fit of them says nothing); how much fixed work a request, taken off both policies
    alike, would bring fine to 20% under block; and each policy's time before a request's
    forward (a round's TTFT p50 less its forward wall a request, the median round)."""
    policies = document["policies"]
    rounds = [r for r in policies["block"]["rounds"] if r["round"] > 1]
    if not rounds:
        return []
    # A fit needs two token counts; the amounts -20% needs do not.
    fits = len({r["computed_prefill_tokens"] / r["requests"] for r in rounds}) > 1
    lines = []
    if fits:
        fixed, per_token = _block_fit(
            rounds, lambda r: 1e3 * r["kda_prefill_seconds"] / r["requests"]
        )
        lines.append(
            f"block's KDA time fits {fixed:.3f} ms a request + {1e3 * per_token:.3f} us a token "
            "(per round, rounds 2 to 23)"
        )
    else:
        lines.append("block's rounds compute too alike tokens a request for a fit")
    b, f = (
        later(policies["block"], "kda_prefill_seconds"),
        later(policies["fine"], "kda_prefill_seconds"),
    )
    requests = later(policies["block"], "requests")
    if requests:
        lines.append(
            f"KDA at -20% needs {1e6 * _needed(b, f) / requests:.0f} us less fixed work a request "
            f"in both policies ({1e3 * f / requests:.3f} against {1e3 * b / requests:.3f} ms a "
            "request now)"
        )
    if fits:
        fixed, per_token = _block_fit(rounds, lambda r: float(r["ttft_p50_ms"]))
        lines.append(
            f"block's TTFT p50 fits {fixed:.2f} ms + {1e3 * per_token:.2f} us a token of a "
            "request (per round, rounds 2 to 23)"
        )
    b, f = ttft_p50(policies["block"]), ttft_p50(policies["fine"])
    lines.append(
        f"TTFT p50 at -20% needs {_needed(b, f):.2f} ms less fixed time a request in both "
        f"policies ({f:.1f} against {b:.1f} ms now)"
    )
    before = {
        name: statistics.median(
            r["ttft_p50_ms"] - 1e3 * r["prefill_seconds"] / r["requests"]
            for r in policies[name]["rounds"]
            if r["round"] > 1
        )
        for name in ("block", "fine")
    }
    lines.append(
        "before the forward (TTFT p50 less the forward's wall a request, median round): "
        + ", ".join(f"{name} {ms:.2f} ms" for name, ms in before.items())
    )
    return lines


def spread(values: list[float]) -> str:
    return f"{100.0 * (max(values) / min(values) - 1):.1f}%" if min(values) > 0 else "-"


def passes(document: dict[str, Any]) -> list[str]:
    """Each repeated policy's passes (rounds 2 to 23) and the spread of each figure; the decode
    graphs each pass captured and its garbage collections (all rounds; "-" where a document
    predates them)."""
    lines = [
        "| policy | pass | ran | TTFT p50 ms | prefill s | KDA s | host s (all rounds) "
        "| graphs captured | gc s (collections) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, policy in document["policies"].items():
        entries = policy.get("passes", [])
        if len(entries) < 2:
            continue
        figures: list[list[float]] = [[], [], [], []]
        for entry in entries:
            row = [
                ttft_p50(entry),
                later(entry, "prefill_seconds"),
                later(entry, "kda_prefill_seconds"),
                float(entry["host_seconds"]),
            ]
            for column, value in zip(figures, row, strict=True):
                column.append(value)
            star = "*" if entry["pass"] == policy.get("median_pass") else ""
            times = entry.get("step_times") or {}
            captures = times.get("graph_captures", "-")
            collections = (
                f"{times['gc_seconds']:.3f} ({times['gc_collections']})"
                if "gc_seconds" in times
                else "-"
            )
            lines.append(
                f"| {name}{star} | {entry['pass']} | {entry['position'] + 1} | {row[0]:.1f} | "
                f"{row[1]:.3f} | {row[2]:.3f} | {row[3]:.2f} | {captures} | {collections} |"
            )
        lines.append(f"| {name} spread | | | " + " | ".join(map(spread, figures)) + " | | |")
    return lines


def pass_states(document: dict[str, Any]) -> list[str]:
    """What each measured pass changed in the process and the CUDA allocator (``pass_state``
    of its step times; none where a document predates them): CPU seconds, involuntary context
    switches, minor page faults, Python's allocated blocks at its start and their change, and on
    CUDA the reserved MiB at its start, the allocated peak, cudaMalloc / cudaFree calls and the
    allocator's retries."""
    rows = []
    for name, policy in document["policies"].items():
        for entry in policy.get("passes") or [policy]:
            state = (entry.get("step_times") or {}).get("pass_state")
            if state is None:
                continue
            start, delta = state["start"], state["change"]
            row = (
                f"| {name} | {entry.get('pass', 1)} | {entry.get('position', 0) + 1} | "
                f"{delta['cpu_seconds']:.2f} | {delta['involuntary_switches']} | "
                f"{delta['minor_faults']} | {start['python_blocks']:,} "
                f"({delta['python_blocks']:+,}) |"
            )
            if "cuda_reserved_bytes" in start:
                row += (
                    f" {start['cuda_reserved_bytes'] / 2**20:,.0f} | "
                    f"{state['end']['cuda_allocated_peak_bytes'] / 2**20:,.0f} | "
                    f"{delta['cuda_device_allocs']} / {delta['cuda_device_frees']} | "
                    f"{delta['cuda_alloc_retries']} |"
                )
            else:
                row += " - | - | - | - |"
            rows.append(row)
    if not rows:
        return []
    return [
        "| policy | pass | ran | CPU s | involuntary switches | minor faults "
        "| Python blocks at start (change) | reserved MiB at start | allocated peak MiB "
        "| cudaMalloc / cudaFree | allocator retries |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def pass_policies(document: dict[str, Any], number: int) -> dict[str, Any]:
    """The policies' entries of pass ``number`` (those repeated that often)."""
    out = {}
    for name, policy in document["policies"].items():
        for entry in policy.get("passes", []):
            if entry["pass"] == number:
                out[name] = entry
    return out


def order_check(
    first: dict[str, Any],
    second: dict[str, Any],
    labels: tuple[str, str] = ("block first", "fine first"),
) -> list[str]:
    """Each policy's figures in two runs (two ``policies`` mappings) side by side."""
    lines = [
        f"| policy | figure (rounds 2 to 23) | {labels[0]} | {labels[1]} | difference |",
        "|---|---|---|---|---|",
    ]
    for name in ("block", "fine"):
        a, b = first.get(name), second.get(name)
        if a is None or b is None:
            continue
        for label, key in (("KDA s", "kda_prefill_seconds"), ("prefill s", "prefill_seconds")):
            x, y = later(a, key), later(b, key)
            lines.append(f"| {name} | {label} | {x:.3f} | {y:.3f} | {change(y, x)} |")
        x, y = ttft_p50(a), ttft_p50(b)
        lines.append(f"| {name} | TTFT p50 ms | {x:.1f} | {y:.1f} | {change(y, x)} |")
    return lines


def step_parts(policies: dict[str, Any]) -> list[str]:
    """The prefill steps' parts (``step_times.prefill_parts``: host prep before the layers,
    host launch of the layers, GPU time of the layers), per policy: median, fit."""
    rows = []
    limit = 0
    for name, policy in policies.items():
        parts = (policy.get("step_times") or {}).get("prefill_parts")
        if not parts:
            continue
        limit = parts["max_tokens"]
        for part in ("prep", "launch", "layers"):
            figure = parts[part]
            fit = (
                f"{figure['fixed_ms']:.2f} ms + {figure['per_token_us']:.2f} us a token"
                if "fixed_ms" in figure
                else "-"
            )
            rows.append(
                f"| {name} | {part} | {parts['steps']} | {parts['tokens_p50']:,.0f} | "
                f"{figure['ms_p50']:.2f} | {fit} |"
            )
    if not rows:
        return []
    head = [
        f"### prefill steps of at most {limit:,} tokens: where the time goes",
        "| policy | part | steps | tokens p50 | ms p50 | fit |",
        "|---|---|---|---|---|---|",
    ]
    return head + rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description="Tables of the seed measurement from `prefixcache simulate --json` documents."
    )
    parser.add_argument(
        "documents",
        nargs="+",
        metavar="FILE",
        help="one or two documents of the seed preset (two: the order check between them)",
    )
    paths = parser.parse_args(argv).documents
    if len(paths) > 2:
        parser.error(f"at most two documents (the two orders), got {len(paths)}")
    documents = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                documents.append(json.load(handle))
        except (OSError, json.JSONDecodeError) as error:
            parser.error(f"{path}: {error}")
    for path, document in zip(paths, documents, strict=True):
        policies = document["policies"]
        print(f"## {path}: {list(policies)} complete={document.get('complete')}")
        print(
            f"model {document['model'].get('name')} {document['model']['layers']}, "
            f"conv {document.get('conv')}, KDA timing {document.get('kda_timing')}, "
            f"warm-up {document.get('warm_up')} (order {document.get('warm_order', '-')}), "
            f"{document.get('seconds', 0):.0f} s"
        )
        for name, policy in policies.items():
            times = policy.get("step_times") or {}
            if times:
                print(
                    f"{name} steps: {times['decode_steps']} decode steps, p50 "
                    f"{times.get('decode_ms_p50', 0):.2f} ms; {times['prefill_steps']} prefill "
                    f"steps, p50 {times.get('prefill_ms_p50', 0):.1f} ms at "
                    f"{times.get('prefill_tokens_p50', 0):,.0f} tokens, fit "
                    f"{times.get('prefill_fixed_ms', 0):.2f} ms + "
                    f"{times.get('prefill_per_token_us', 0):.2f} us a token"
                    + (
                        f"; {times['graph_captures']} graphs captured"
                        if "graph_captures" in times
                        else ""
                    )
                )
        parts = step_parts(policies)
        if parts:
            print("\n".join(parts))
            print()
        if "block" in policies and "fine" in policies:
            print("\n".join(per_round(document)))
            print()
            print("\n".join(totals(document)))
            print()
            print("\n".join(fits(document)))
            print()
        if document.get("repeats", 1) > 1:
            print(f"### {document['repeats']} passes, in the order {document.get('pass_order')}")
            print("\n".join(passes(document)))
            print()
            print("### order check: pass 1 against pass 2")
            checked = (pass_policies(document, 1), pass_policies(document, 2))
            print("\n".join(order_check(*checked, labels=("pass 1", "pass 2"))))
            print()
            for number in range(1, document["repeats"] + 1):
                both = pass_policies(document, number)
                if "block" in both and "fine" in both:
                    print(f"### pass {number}: fine against block")
                    print("\n".join(per_round({"policies": both})))
                    print()
                    print("\n".join(totals({"policies": both})))
                    print()
        states = pass_states(document)
        if states:
            print("### what each pass changed (pass_state)")
            print("\n".join(states))
            print()
    if len(documents) == 2:
        print("## order check" + (" (median passes)" if documents[0].get("repeats", 1) > 1 else ""))
        print("\n".join(order_check(documents[0]["policies"], documents[1]["policies"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
