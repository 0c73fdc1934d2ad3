"""The ``fla`` backend: fla-core's Triton ``chunk_kda`` (GPU only; fla-core 0.6.0).

Chunk size 64, so interior checkpoints must sit on multiples of 64 (A = 64); unbounded C. Two
ways to produce checkpoints, chosen by ``checkpoint_mode``:

- ``"h"`` (default): one call with ``return_intermediate_states=True``. fla computes the state at
  every chunk boundary anyway and returns it as ``h`` ``[1, NT, H, V, K]`` in the inputs' dtype
  (bf16), ``h[:, base + i]`` being the state after ``64 * i`` tokens of the sequence whose chunks
  start at ``base``. Nearly free, but a checkpoint is the bf16 rounding of the state.
- ``"chain"``: fp32-exact. One call per segment round (``chaining``), each segment's fp32 final
  state going to its slot; the result equals forwards split at the same offsets bit for bit, and
  on the 64-grid the outputs equal the unsplit run's.

Both gates: the bounded gate through ``safe_gate=True, lower_bound`` (fla requires
``-5 <= lower_bound < 0``), the softplus gate without. Inputs may be bf16 or fp32; the state is
fp32 (fla requires an fp32 initial state). ``fla`` may dispatch ``chunk_kda`` to FlashKDA when
that package is installed (``FLA_FLASH_KDA=0`` turns this off); ``"h"`` mode always runs Triton.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .backend import KDABackend, read_states_at, require_cuda, upload, write_states_at
from .chaining import SegmentBatch, plan_rounds, run_rounds
from .errors import BackendUnavailableError, UnsupportedLayerError
from .params import KDALayerParams
from .plan import StatePlan

__all__ = ["FlaBackend"]

CheckpointMode = Literal["h", "chain"]
FLA_CHUNK = 64


class FlaBackend(KDABackend):
    """fla-core ``chunk_kda`` backend (``get_backend("fla", checkpoint_mode="h" | "chain")``)."""

    name = "fla"

    def __init__(self, checkpoint_mode: CheckpointMode = "h") -> None:
        if checkpoint_mode not in ("h", "chain"):
            raise ValueError(f"checkpoint_mode must be 'h' or 'chain', got {checkpoint_mode!r}")
        require_cuda(self.name)
        try:
            from fla.ops.kda import chunk_kda
        except ImportError as error:
            raise BackendUnavailableError(
                f"backend 'fla' needs the fla-core package (pip install fla-core==0.6.0, which "
                f"needs triton): {error}"
            ) from error
        self._chunk_kda: Any = chunk_kda
        self.checkpoint_mode: CheckpointMode = checkpoint_mode
        self.checkpoint_alignment = FLA_CHUNK
        self.max_checkpoints_per_step = None

    def check_layer(self, params: KDALayerParams, dtype: torch.dtype, device: torch.device) -> None:
        """fla runs on CUDA, K <= 256, bf16/fp16/fp32 inputs, lower_bound in [-5, 0)."""
        if device.type != "cuda":
            raise UnsupportedLayerError(f"backend 'fla' runs on CUDA tensors, got {device}")
        if params.head_dim_k > 256:
            raise UnsupportedLayerError(f"fla supports K <= 256, got {params.head_dim_k}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise UnsupportedLayerError(f"fla takes bf16, fp16 or fp32 inputs, got {dtype}")
        if params.lower_bound is not None and not -5.0 <= params.lower_bound < 0:
            raise UnsupportedLayerError(
                f"fla's bounded gate needs -5 <= lower_bound < 0, got {params.lower_bound}"
            )

    def _call(
        self, params: KDALayerParams, batch: SegmentBatch, *, intermediate: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        bounded = params.lower_bound is not None
        result = self._chunk_kda(
            q=batch.q,
            k=batch.k,
            v=batch.v,
            g=batch.g,
            beta=batch.beta,
            scale=batch.q.shape[-1] ** -0.5,
            initial_state=batch.initial_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=bounded,
            lower_bound=params.lower_bound,
            A_log=params.A_log.float(),
            dt_bias=params.dt_bias.float().reshape(-1),
            state_v_first=True,
            cu_seqlens=batch.cu_seqlens,
            cu_seqlens_cpu=batch.cu_seqlens_host,
            return_intermediate_states=intermediate,
        )
        if intermediate:
            out, final, h = result
            return out, final, h
        out, final = result
        return out, final, None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        params: KDALayerParams,
        recurrent: torch.Tensor,
        plan: StatePlan,
    ) -> torch.Tensor:
        """See :meth:`KDABackend.forward`; checkpoints per ``checkpoint_mode``."""
        g = g.to(q.dtype)
        beta = beta.to(q.dtype)
        if self.checkpoint_mode == "chain" or plan.num_checkpoints == 0:
            rounds = plan_rounds(plan, per_call=0)
            return run_rounds(
                plan, rounds, q, k, v, g, beta, recurrent,
                lambda batch: self._call(params, batch, intermediate=False),
            )  # fmt: skip
        chunks: list[int] = []
        slots: list[int] = []
        chunk_base = 0
        for row, length in enumerate(plan.lengths()):
            for checkpoint in plan.checkpoints[row]:
                chunks.append(chunk_base + checkpoint.offset // FLA_CHUNK)
                slots.append(checkpoint.slot)
            chunk_base += -(-length // FLA_CHUNK)
        # Every index array of the step in one host-to-device copy.
        cu_d, initial_d, chunks_d, slots_d, running_d = upload(
            q.device, plan.query_start_loc, plan.initial_slot, chunks, slots, plan.running_slot
        )
        batch = SegmentBatch(
            q=q.unsqueeze(0),
            k=k.unsqueeze(0),
            v=v.unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.unsqueeze(0),
            cu_seqlens=cu_d,
            cu_seqlens_host=torch.tensor(plan.query_start_loc, dtype=torch.int64),
            initial_state=read_states_at(recurrent, initial_d, torch.float32),
            checkpoint_offsets=None,
        )
        with torch.inference_mode():
            out, final, h = self._call(params, batch, intermediate=True)
            if h is None:
                raise RuntimeError("fla returned no intermediate states")
            write_states_at(recurrent, slots_d, h[0], rows=chunks_d)
            write_states_at(recurrent, running_d, final)
        return out.squeeze(0)
