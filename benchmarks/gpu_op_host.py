#!/usr/bin/env python3
"""The host time of one FlashKDA op call, and whether the call waits for the GPU.

One call of ``torch.ops._flashkda_C.fwd`` over one sequence of ``--tokens`` (the Kimi-K3 proxy's
12 heads of 128 a GPU, bf16, fp32 states), launched behind a GPU-side spin of about 0.1 s
(``gpu_layers.host_ms`` with a backlog): a call that returns after the spin (tens of ms) waited
for the GPU; one that returns before it queued its work, and its time is the host work of the
call itself (what a prefill step's GPU waits for when the work queued before the call runs out
first). Variants: varlen (``cu_seqlens`` ``[0, T]`` on the device, as the backend calls it), the
same with a checkpoint, and batch mode (``q`` ``[1, T, H, K]``, no ``cu_seqlens``), with and
without a checkpoint. Each variant's outputs, final and checkpoint states are compared with the
varlen call's.

    PREFIXCACHE_FLASHKDA_LIB=<_flashkda_C.abi3.so> python3 benchmarks/gpu_op_host.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_layers import host_ms


class OpSetup(NamedTuple):
    """The FlashKDA op and what a call over the Kimi-K3 proxy's KDA layer needs."""

    ops: Any  # torch.ops._flashkda_C
    device: torch.device
    heads: int
    head_dim: int
    generator: torch.Generator
    a_log: torch.Tensor  # [H] float32
    dt_bias: torch.Tensor  # [H, K] float32

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A standard-normal tensor of ``shape`` on the device, drawn from ``generator``."""
        return torch.randn(*shape, generator=self.generator, device=self.device).to(dtype)


def op_setup(seed: int = 0) -> OpSetup:
    """The op (``PREFIXCACHE_FLASHKDA_LIB``), the proxy's KDA heads and head width a GPU, a seeded
    generator on the GPU and zero gate parameters."""
    from prefixcache.kernels.flashkda import load_flashkda_op
    from prefixcache.models import ModelConfig

    device = torch.device("cuda")
    config = ModelConfig.kimi_k3_tp8()  # its KDA heads and head width, per GPU
    h, d = config.kda_heads, config.kda_head_dim
    return OpSetup(
        ops=load_flashkda_op(),
        device=device,
        heads=h,
        head_dim=d,
        generator=torch.Generator(device=device).manual_seed(seed),
        a_log=torch.zeros(h, device=device),
        dt_bias=torch.zeros(h, d, device=device),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    setup = op_setup()
    ops, device, rnd = setup.ops, setup.device, setup.randn
    t, h, d = args.tokens, setup.heads, setup.head_dim
    q, k, v = rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h, d)
    g, beta = rnd(1, t, h, d), rnd(1, t, h)
    a_log, dt_bias = setup.a_log, setup.dt_bias
    initial = rnd(1, h, d, d, dtype=torch.float32) * 0.1
    cu = torch.tensor([0, t], dtype=torch.int64, device=device)
    offsets = torch.tensor([t // 2 // 16 * 16], dtype=torch.int64, device=device)
    size = int(ops.get_workspace_size(t * 1, h, 1))
    workspace = torch.empty(size, dtype=torch.uint8, device=device)

    def call(varlen: bool, checkpoint: bool) -> tuple[torch.Tensor, ...]:
        out = torch.empty_like(v)
        final = torch.empty_like(initial)
        staging = torch.zeros_like(initial) if checkpoint else None
        ops.fwd(
            q, k, v, g, beta, d**-0.5, out, workspace, a_log, dt_bias, -5.0, initial, final,
            cu if varlen else None, staging,
            offsets if checkpoint else None,
        )  # fmt: skip
        return (out, final) if staging is None else (out, final, staging)

    variants = {
        "varlen": (True, False),
        "varlen+checkpoint": (True, True),
        "batch": (False, False),
        "batch+checkpoint": (False, True),
    }
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "tokens": t}
    reference: dict[bool, tuple[torch.Tensor, ...]] = {}
    for name, (varlen, checkpoint) in variants.items():
        try:
            first = call(varlen, checkpoint)
        except Exception as error:
            results[name] = {"error": str(error).split("\n")[0][:200]}
            print(f"{name:<20} refused: {results[name]['error']}")
            continue
        torch.cuda.synchronize()
        reference.setdefault(checkpoint, first)
        same = all(torch.equal(a, b) for a, b in zip(first, reference[checkpoint], strict=True))
        host = host_ms(lambda v=varlen, c=checkpoint: call(v, c), device, 5, backlog=True) * 1e3
        results[name] = {"host_us": host, "equal_to_varlen": same}
        print(f"{name:<20} host {host:10.1f} us a call   equal: {same}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
