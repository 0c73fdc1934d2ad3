"""The ``prefixcache`` command line: ``prefixcache simulate`` (also ``python -m prefixcache``).

``simulate`` runs the reference engine (:mod:`prefixcache.engine`) with the tiny hybrid model
(:mod:`prefixcache.models`) over a named workload (:mod:`prefixcache.engine.workloads`) under each
caching policy, side by side, checks that caching changed no output, and prints a per-round
table and a summary table; ``--json`` and ``--plot`` write the same figures to files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main", "render_report"]

WORKLOADS = ("growing-prefix", "shared-prompts", "agentic", "trace")
BACKENDS = ("auto", "torch", "fla", "flashkda", "flashkda-op")

EPILOG = """\
policies:
  none   no prefix caching: every prompt is computed in full (the same manager with every
         checkpoint retention off, so no recurrent state is ever cached and every hit is 0).
         Always run first (unless --no-reference): it is the reference the other policies'
         outputs are checked against.
  block  block-aligned caching, as engines do today: hash unit U = attention block B,
         checkpoints only on block boundaries; a resend of an N-token prompt resumes at
         ((N-1)//B)*B.
  fine   fine prefix matching: U < B, with tail, junction and decode-tail checkpoints; a resend
         resumes at ((N-1)//U)*U.

presets:
  seed     the full sizes, those of the seed result (growing-prefix: 8 streams, 120,000 -> 164,000
           tokens in 23 rounds, 200 output tokens, chunk budget 8,192, B=1536, U=128). Hours
           on a CPU; meant for a GPU.
  default  the same ratios, about a minute on 2 CPU cores. growing-prefix: the seed geometry
           divided by 16 (B=96, U=8, +125 tokens per round, budget 512, 12 output tokens) with
           a 588-token first prompt (congruent to 120,000/16 modulo B), so every round's hit
           and recomputation are exactly the seed's divided by 16.
  When the kernel backend's checkpoint alignment A does not divide U (fla: 64, FlashKDA: 16),
  U is raised to a multiple of A and B to a multiple of U; the header says so.

output check:
  Each policy's generated ids and final logits are compared with the `none` run: ids equal,
  logits within 1e-4 relative in float32 (the CPU default); with the GPU's bf16 kernels, 3e-2
  and ids compared up to the first near-tie of the reference (see prefixcache.engine.simulate).

the model (--model):
  tiny          (the CPU default) a Kimi-Linear-shaped hybrid, scaled down: 3 KDA layers and 1
                full-attention layer, width 64, 4 KDA heads of 16, vocabulary 1000.
  kimi-k3-tp8   (the GPU default) a cost proxy of Kimi-K3 on one GPU of a TP8 deployment:
                Kimi-K3's per-GPU widths (7,168 wide, 12 KDA heads of 128, full-rank bounded
                gate, conv width 4), a dense SwiGLU of width 4,160 costing what its MoE's
                active experts cost per token per GPU, grouped-query attention whose cache
                holds about MLA's bytes per token, vocabulary 20,480; --depth G groups of
                3 KDA + 1 attention layers (default 2; Kimi-K3 has 69 + 24 layers).
  kimi-k3-tp8/N the same with every width divided by N (for the CPU).
  Seeded random weights, greedy sampling, float32 on the CPU, bf16 with the GPU kernels. Its
  KDA layers run the kernel layer and read/write recurrent states and checkpoints in the slots
  the cache manager hands out; its attention layers read/write a paged KV cache through block
  tables and slot mappings. It represents the cache traffic, the exact numerics of resuming
  from checkpoints and the prefill work each policy saves; kimi-k3-tp8 on a GPU also a real
  model's GPU time per token, layer for layer. It does not represent output quality (random
  weights), the latency of a whole real model (a few layer groups deep; attention runs one
  sequence at a time in plain torch), MoE routing or MLA latent attention. TTFT is wall-clock
  time on this machine from a request's arrival in the engine loop to its first token (an
  idle engine jumps to the next arrival instead of waiting for it).

timing:
  prefill s is each step's wall time (the step ends when its logits reach the host), shared
  among its prefill rows by tokens; KDA prefill s is the KDA kernels' time (--kda-timing).
  On a GPU each policy first runs the whole workload once, unmeasured (--warm-up full), so
  that no measured run pays first-call costs and the policies' order does not matter.
  --repeats N then measures the policies N times, counterbalanced (block, fine, fine, block,
  ...: every second pass reversed, so a drift over the process charges every policy alike),
  each on fresh caches: every pass is kept in the JSON, with each policy's median and spread
  (max/min - 1) over the passes, and the tables show each policy's median pass (by TTFT p50).
"""


def _parse_policies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    valid = ("none", "block", "fine")
    unknown = [name for name in names if name not in valid]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--policies takes a comma-separated subset of {','.join(valid)}, got {text!r}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``prefixcache`` command."""
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="prefixcache: prefix caching for hybrid attention / recurrent-state models.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    simulate = commands.add_parser(
        "simulate",
        help="run the reference engine over a workload under each caching policy",
        description=(
            "Run a reference continuous-batching engine (chunked prefill, preemption, decode)\n"
            "with a tiny hybrid KDA + attention model over a named workload, once per caching\n"
            "policy, and compare hits, recomputed prefill tokens, prefill time and time to\n"
            "first token side by side, checking that caching changed no output."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    simulate.add_argument(
        "--workload",
        nargs="+",
        metavar=("NAME", "FILE"),
        default=["growing-prefix"],
        help=(
            "growing-prefix (default), shared-prompts, agentic, or 'trace FILE' (JSONL, one "
            'request per line: {"id", "arrival_s", "prompt": [ids] | "prompt_len" with an '
            'optional "prefix_of": id, "output_len"}, optional "round")'
        ),
    )
    simulate.add_argument(
        "--preset",
        choices=("default", "seed"),
        default="default",
        help="workload size: default (about a minute on 2 CPU cores) or seed (full size)",
    )
    simulate.add_argument(
        "--policies",
        type=_parse_policies,
        default=["none", "block", "fine"],
        metavar="LIST",
        help="comma-separated caching policies among none,block,fine (default: all three; "
        "none is always run, as the reference, unless --no-reference)",
    )
    simulate.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model runs (default cpu; cuda uses the KDA shape of Kimi-K3 per GPU)",
    )
    simulate.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="KDA kernel backend: auto (the fastest available: flashkda-op, flashkda, fla, "
        "then torch), torch (reference, CPU or GPU), fla (fla-core Triton, GPU), flashkda "
        "(flash_kda package, SM90+), flashkda-op (vLLM's FlashKDA op; library path in "
        "$PREFIXCACHE_FLASHKDA_LIB)",
    )
    simulate.add_argument(
        "--output-len",
        type=int,
        metavar="N",
        help="tokens each request decodes, instead of the preset's (growing-prefix: the "
        "prompts do not include the outputs, so the prefill work is unchanged; fewer decode "
        "steps make a GPU run of the seed preset shorter)",
    )
    simulate.add_argument(
        "--model",
        metavar="NAME",
        default="auto",
        help="the model: tiny, kimi-k3-tp8 or kimi-k3-tp8/N (see 'the model' below; default "
        "auto: tiny on the CPU, kimi-k3-tp8 on CUDA)",
    )
    simulate.add_argument(
        "--depth",
        type=int,
        metavar="G",
        help="layer groups (3 KDA + 1 attention each) of the kimi-k3-tp8 model (default 2)",
    )
    simulate.add_argument(
        "--kda-timing",
        # prefixcache.models.timing.TIMING_MODES (imported lazily)
        choices=("auto", "wall", "gpu", "events"),
        default="auto",
        help="how KDA prefill time is measured: auto (default: events on CUDA, wall on the "
        "CPU), wall (synchronised wall clock around each layer: the GPU's work plus the "
        "host's time to launch it), gpu (CUDA events after a GPU-side backlog: execution time "
        "alone, but every layer waits for the backlog) or events (CUDA events, no "
        "synchronisation: execution time when the GPU is the bottleneck; CUDA only)",
    )
    simulate.add_argument(
        "--layers-backlog",
        type=int,
        default=0,
        metavar="CYCLES",
        help="a diagnosis: a GPU-side spin of CYCLES clock cycles before each eager step's "
        "layers (HybridModel.set_layers_backlog; CUDA only), so that the step clock's layers "
        "part is the GPU's execution without waits for the host's launches; every step pays "
        "the spin, so TTFT and prefill time are not meaningful then (default 0: none)",
    )
    simulate.add_argument(
        "--conv",
        # "auto" + prefixcache.kernels.backend.CONV_IMPLS (imported lazily)
        choices=("auto", "torch", "triton"),
        default="auto",
        help="the KDA short convolution: auto (default: triton on CUDA, torch on the CPU), "
        "torch (several passes in torch) or triton (two fused Triton kernels, "
        "prefixcache.kernels.conv_triton; needs --device cuda)",
    )
    simulate.add_argument(
        "--decode-attention",
        # "auto" + prefixcache.models.DECODE_ATTENTIONS (imported lazily)
        choices=("auto", "torch", "triton"),
        default="auto",
        help="the attention of decode rows (one query token): auto (default: triton on CUDA, "
        "torch on the CPU), torch (each row's context gathered, then attended to, row by row) "
        "or triton (every decode row in one launch, read through the block table: "
        "prefixcache.kernels.decode_attention; needs --device cuda)",
    )
    simulate.add_argument(
        "--no-prefill-split",
        action="store_true",
        help="attend to a prefill chunk's cached prefix in one flash call (default on CUDA: "
        "cut into pieces that fill the GPU, merged by their log-sum-exps; "
        "prefixcache.kernels.prefill_attention)",
    )
    simulate.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode-only steps from CUDA graphs, one per row count and context bucket "
        "(default: on where they can run: CUDA, a FlashKDA backend, the Triton convolution and "
        "decode attention; prefixcache.models.graphs). --no-cuda-graphs runs every step eagerly",
    )
    simulate.add_argument(
        "--warm-up",
        # "auto" + prefixcache.engine.simulate.WARM_UPS (imported lazily)
        choices=("auto", "none", "shapes", "full"),
        default="auto",
        help="what each policy runs unmeasured first: auto (default: full on CUDA, none on "
        "the CPU), full (the whole workload: the second pass is measured), shapes (two "
        "streams reaching the workload's longest context and filling its chunk budget; on "
        "the H200 not enough to make runs independent of the policies' order) or none",
    )
    simulate.add_argument(
        "--warm-order",
        type=_parse_policies,
        default=None,
        metavar="POLICIES",
        help="the warm pass's policies in this order instead of --policies' (each measured "
        "policy once, none optional): e.g. --warm-order block,fine --policies fine,block "
        "tells an effect of the first warm policy from one of the first measured policy",
    )
    simulate.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="measure the policies N times (1 to 16, default 1), counterbalanced (the "
        "order given, then reversed: block,fine,fine,block,...), each on fresh caches; the "
        "none reference runs once, first. The JSON keeps every pass and gives each policy's "
        "median and spread over them",
    )
    simulate.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan step k+1 while the forward of step k runs (default; on a worker thread, "
        "two plans in flight, sampled tokens reaching the next step as placeholders, a "
        "request waiting a step for a prefix a plan in flight computes) or, with "
        "--no-overlap, one step at a time",
    )
    simulate.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the none run unless --policies names it: for timing runs of block and fine "
        "whose outputs were checked in another run (outputs_match_no_cache is then null and "
        "the table says unchecked)",
    )
    simulate.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="write every figure (per policy and per round) to FILE as JSON",
    )
    simulate.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="write a PNG: per round, recomputed prefill tokens and TTFT p50 of each policy",
    )
    simulate.add_argument(
        "--events",
        metavar="ENDPOINT",
        help="publish every run's KV events on a ZMQ PUB socket bound at ENDPOINT (e.g. "
        "tcp://127.0.0.1:5557), in vLLM 0.33's format, for KV-aware routers such as Dynamo's "
        "indexer (the wire block is the hash unit U); each run starts with AllBlocksCleared",
    )
    simulate.add_argument(
        "--events-replay",
        metavar="ENDPOINT",
        help="with --events: the ROUTER socket that replays buffered batches",
    )
    simulate.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics of the running manager at http://127.0.0.1:PORT/metrics",
    )
    simulate.add_argument(
        "--serve-for",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --events or --metrics-port: keep publishing and serving this long after the "
        "last run, so that a router or a scrape can query the final state",
    )
    simulate.set_defaults(command_parser=simulate)
    return parser


def _workload_arguments(
    parser: argparse.ArgumentParser, values: list[str]
) -> tuple[str, str | None]:
    name = values[0]
    if name not in WORKLOADS:
        parser.error(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if name == "trace":
        if len(values) != 2:
            parser.error("--workload trace needs a FILE: --workload trace FILE")
        return name, values[1]
    if len(values) != 1:
        parser.error(f"--workload {name} takes no FILE (only trace does)")
    return name, None


def _progress_factory() -> Callable[[str, int], Callable[[Any], None]]:
    from tqdm import tqdm

    bars: list[Any] = []

    def factory(policy: str, total: int) -> Callable[[Any], None]:
        for bar in bars:
            bar.close()
        bar = tqdm(total=total, desc=f"{policy:>5}", unit="req", file=sys.stderr, leave=True)
        bars.append(bar)

        def done(_: Any) -> None:
            bar.update(1)
            if bar.n >= total:
                bar.close()

        return done

    return factory


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def render_report(document: dict[str, Any]) -> str:
    """The per-round and summary tables of a ``--json`` document, as text."""
    policies: dict[str, Any] = document["policies"]
    names = list(policies)
    lines: list[str] = []
    rounds = sorted({r["round"] for p in policies.values() for r in p["rounds"]})
    if 1 < len(rounds) <= 64:
        by_round = {name: {r["round"]: r for r in policies[name]["rounds"]} for name in names}
        headers = ["round"]
        for name in names:
            headers += [f"{name} computed", f"{name} TTFT ms"]
        rows = []
        for number in rounds:
            row = [str(number)]
            for name in names:
                entry = by_round[name].get(number)
                row += (
                    [f"{entry['computed_prefill_tokens']:,}", f"{entry['ttft_p50_ms']:.1f}"]
                    if entry
                    else ["-", "-"]
                )
            rows.append(row)
        lines += ["Per round: prefill tokens computed and TTFT p50", _table(headers, rows), ""]
    reference = policies.get("none", {}).get("computed_prefill_tokens", 0)
    rows = []
    for name in names:
        p = policies[name]
        saved = (
            f"{100.0 * (1 - p['computed_prefill_tokens'] / reference):.1f}%" if reference else "-"
        )
        rows.append(
            [
                name,
                f"U={p['unit']}",
                str(p["requests"]),
                f"{p['prompt_tokens']:,}",
                f"{p['hit_tokens']:,}",
                f"{p['computed_prefill_tokens']:,}",
                saved,
                f"{p['prefill_seconds']:.2f}",
                f"{p['ttft_p50_ms']:.1f}",
                str(p["preemptions"]),
                {True: "yes", False: "NO", None: "unchecked"}[p["outputs_match_no_cache"]],
            ]
        )
    headers = [
        "policy",
        "unit",
        "requests",
        "prompt tokens",
        "hit tokens",
        "computed prefill",
        "saved",
        "prefill s",
        "TTFT p50 ms",
        "preempted",
        "outputs = none",
    ]
    lines += ["Summary", _table(headers, rows)]
    if "block" in policies and "fine" in policies and len(rounds) > 1:
        later = [r for r in rounds if r > 1]

        def total(name: str, key: str) -> float:
            return float(sum(r[key] for r in policies[name]["rounds"] if r["round"] > 1))

        block, fine = (
            total("block", "computed_prefill_tokens"),
            total("fine", "computed_prefill_tokens"),
        )
        if block:
            lines.append(
                f"fine vs block over rounds {later[0]}-{later[-1]}: {int(fine):,} vs "
                f"{int(block):,} prefill tokens computed ({100.0 * (fine / block - 1):+.1f}%); "
                f"prefill time {total('fine', 'prefill_seconds'):.2f} s vs "
                f"{total('block', 'prefill_seconds'):.2f} s; KDA prefill time "
                f"{total('fine', 'kda_prefill_seconds'):.2f} s vs "
                f"{total('block', 'kda_prefill_seconds'):.2f} s"
            )
    if document.get("repeats", 1) > 1:
        lines += ["", f"Passes ({document['repeats']}, in the order they ran; * the median pass)"]
        rows = []
        for name in names:
            p = policies[name]
            for entry in p.get("passes", []):
                rows.append(
                    [
                        name + ("*" if entry["pass"] == p["median_pass"] else ""),
                        str(entry["pass"]),
                        str(entry["position"] + 1),
                        f"{entry['ttft_p50_ms']:.2f}",
                        f"{entry['prefill_seconds']:.3f}",
                        f"{entry['kda_prefill_seconds']:.3f}",
                        f"{entry['host_seconds']:.3f}",
                    ]
                )
            if len(p.get("passes", [])) > 1:
                spread = [
                    "-" if p["spread"][key] is None else f"{100.0 * p['spread'][key]:.1f}%"
                    for key in (
                        "ttft_p50_ms",
                        "prefill_seconds",
                        "kda_prefill_seconds",
                        "host_seconds",
                    )
                ]
                rows.append([f"{name} spread", "", "", *spread])
        headers = ["policy", "pass", "ran", "TTFT p50 ms", "prefill s", "KDA s", "host s"]
        lines.append(_table(headers, rows))
    for name in names:
        if policies[name]["outputs_match_no_cache"] is False:
            lines.append(f"MISMATCH {name}: {policies[name]['outputs_match_detail']}")
    return "\n".join(lines)


def _plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (tokens_axis, ttft_axis) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, policy in document["policies"].items():
        rounds = [r["round"] for r in policy["rounds"]]
        tokens_axis.plot(
            rounds, [r["computed_prefill_tokens"] for r in policy["rounds"]], marker="o",
            label=name,
        )  # fmt: skip
        ttft_axis.plot(rounds, [r["ttft_p50_ms"] for r in policy["rounds"]], marker="o", label=name)
    tokens_axis.set_ylabel("prefill tokens computed (log)")
    tokens_axis.set_title(
        f"{document['workload']} ({document['preset']}), {document['device']}, "
        f"backend {document['backend']}"
    )
    ttft_axis.set_ylabel("TTFT p50, ms (log)")
    ttft_axis.set_xlabel("round")
    for axis in (tokens_axis, ttft_axis):
        axis.set_yscale("log")  # `none` is an order of magnitude above the caching policies
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


class _Observer:
    """``--events`` and ``--metrics-port``: one publisher and one metrics endpoint that follow
    each run's manager in turn."""

    def __init__(self, events: str | None, replay: str | None, metrics_port: int | None) -> None:
        self.active = events is not None or metrics_port is not None
        self.manager: Any = None
        self.publisher: Any = None
        self.server: Any = None
        if events is not None:
            from ..events import KVEventsConfig, ZmqEventPublisher

            config = KVEventsConfig(endpoint=events, replay_endpoint=replay)
            self.publisher = ZmqEventPublisher(None, config, bind=True)
            print(f"publishing KV events on {self.publisher.endpoint}")
        if metrics_port is not None:
            from ..metrics import serve

            self.server, _ = serve(lambda: self.manager, metrics_port, publisher=self.publisher)
            print(f"serving metrics at http://127.0.0.1:{self.server.server_port}/metrics")

    def observe(self, manager: Any) -> Callable[[], object]:
        self.manager = manager
        if self.publisher is None:
            return lambda: None
        self.publisher.attach(manager)
        publish: Callable[[], object] = self.publisher.publish
        return publish

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.server is not None:
            self.server.shutdown()


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from ..kernels import KernelError
    from .simulate import (
        SimulationReport,
        build_model,
        check_repeats,
        check_warm_order,
        measured_names,
        resolve_warm_up,
        simulate,
    )
    from .workloads import TraceError, workload_preset

    name, trace_path = _workload_arguments(parser, args.workload)
    if args.device == "cpu":
        # The tiny model's tensors are far too small to gain from intra-op threads, and on a
        # busy machine OpenMP's spinning threads slow every op down by an order of magnitude.
        torch.set_num_threads(1)
    try:
        check_repeats(args.repeats)
        warm_up = None if args.warm_up == "auto" else args.warm_up
        check_warm_order(
            measured_names(args.policies, reference=not args.no_reference),
            args.warm_order,
            resolve_warm_up(warm_up, torch.device(args.device)),
        )
        from ..models import ModelConfig

        config = None
        if args.model != "auto" or args.depth is not None:
            model_name = args.model
            if model_name == "auto":
                model_name = "tiny" if args.device == "cpu" else "kimi-k3-tp8"
            config = ModelConfig.named(model_name, args.depth)
        model = build_model(
            args.device,
            args.backend,
            config=config,
            kda_timing=args.kda_timing,
            conv=args.conv,
            decode_attention=args.decode_attention,
            split_prefill=not args.no_prefill_split,
            cuda_graphs="auto" if args.cuda_graphs is None else args.cuda_graphs,
        )
        model.set_layers_backlog(args.layers_backlog)
        workload = workload_preset(
            name, args.preset, trace_path=trace_path, vocab_size=model.config.vocab_size
        )
        if args.output_len is not None:
            if name == "trace" or args.output_len < 1:
                raise ValueError(
                    "--output-len takes a positive count and a named workload (a trace gives "
                    "each request's own)"
                )
            workload = dataclasses.replace(
                workload, spec=dataclasses.replace(workload.spec, output_len=args.output_len)
            )
    except (KernelError, TraceError, OSError, RuntimeError, ValueError) as error:
        print(f"prefixcache simulate: error: {error}", file=sys.stderr)
        return 2
    backend = model.backend
    geometry = workload.geometry.aligned(backend.checkpoint_alignment)
    config = model.config
    print(
        f"prefixcache simulate: {name} ({args.preset} preset, {workload.spec.num_requests} "
        f"requests) on {args.device}, KDA backend {backend.name} (alignment "
        f"{backend.checkpoint_alignment}, checkpoints per step "
        f"{backend.max_checkpoints_per_step or 'unbounded'})"
    )
    print(
        f"model: {config.name}, {config.num_kda_layers} KDA + {config.num_attention_layers} "
        f"attention layers, width {config.hidden_size}, KDA {config.kda_heads}x"
        f"{config.kda_head_dim}, attention {config.attention_heads}/{config.attention_kv_heads}"
        f"x{config.attention_head_dim}, MLP {config.mlp_hidden_size}, vocabulary "
        f"{config.vocab_size}, {str(model.dtype).removeprefix('torch.')}, random weights; "
        f"conv {backend.conv_impl}, decode attention {model.decode_attention}, prefill split "
        f"{'on' if model.split_prefill else 'off'}, KDA timing {model.kda_timer.mode}, CUDA "
        f"graphs {'on' if model.graphs is not None else 'off'}"
    )
    adjusted = geometry != workload.geometry
    print(
        f"geometry: attention block B={geometry.block_size}, fine unit U={geometry.unit}, "
        f"chunk budget {geometry.token_budget} tokens, up to {geometry.max_running} running"
        + (" (raised to the backend's alignment)" if adjusted else "")
    )
    print(
        "engine: overlapped (the host plans step k+1 while the forward of step k runs; "
        "requests wait a step for a prefix in flight)"
        if args.overlap
        else "engine: one step at a time (--no-overlap)"
    )
    started = time.perf_counter()

    def save_partial(partial: SimulationReport) -> None:
        # A seed-size run takes many minutes per policy: keep what is finished on disk.
        if args.json is not None:
            document = partial.to_json()
            document["seconds"] = time.perf_counter() - started
            document["complete"] = False
            args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")

    observer = _Observer(args.events, args.events_replay, args.metrics_port)
    try:
        report = simulate(
            workload,
            args.policies,
            model,
            device_name=args.device,
            backend_name=args.backend,
            progress=_progress_factory(),
            on_policy=save_partial,
            reference=not args.no_reference,
            warm_up=warm_up,
            observe=observer.observe if observer.active else None,
            overlap=args.overlap,
            repeats=args.repeats,
            warm_order=args.warm_order,
        )
        if observer.active and args.serve_for > 0:
            print(f"\nserving the final state for {args.serve_for:g} s")
            time.sleep(args.serve_for)
    finally:
        observer.close()
    document = report.to_json()
    document["seconds"] = time.perf_counter() - started
    document["complete"] = True
    print()
    print(render_report(document))
    print(f"\n{document['seconds']:.1f} s in total")
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot is not None:
        _plot(document, args.plot)
        print(f"wrote {args.plot}")
    # A policy's entry fails its check when any of its passes does.
    mismatched = [
        n for n, p in document["policies"].items() if p["outputs_match_no_cache"] is False
    ]
    return 1 if mismatched else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``prefixcache`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return _simulate(args, args.command_parser)
    parser.error(f"unknown command {args.command!r}")
    return 2
