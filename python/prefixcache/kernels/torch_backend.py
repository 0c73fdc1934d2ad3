"""The reference backend: the KDA recurrence in plain torch, CPU or GPU, any dtype.

It runs every row segment by segment between the plan's cuts (checkpoints, then the end of the
query), either chunkwise (WY form, chunks counted from each segment's start) or token by token.
Between segments the state continues *as stored in the cache* (rounded to the cache's dtype), and
each segment is computed on fresh copies of its inputs, so a forward with checkpoints equals
forwards split at the same offsets, whatever the dtypes and the packing. Alignment is 1 by
default and can be set (16 and 64 exercise the GPU backends' grids on the CPU); checkpoints per
step are unbounded.
"""

from __future__ import annotations

from typing import Literal

import torch

from .backend import KDABackend, read_states, write_states
from .errors import UnsupportedLayerError
from .params import KDALayerParams
from .plan import StatePlan
from .reference import prepare_inputs, recurrence_chunked, recurrence_loop

__all__ = ["TorchBackend"]

Mode = Literal["chunked", "loop"]


class TorchBackend(KDABackend):
    """Reference KDA backend (``get_backend("torch")``).

    Args:
        checkpoint_alignment: A, default 1.
        mode: ``"chunked"`` (WY form, the default) or ``"loop"`` (token by token).
        chunk_size: chunk length of the chunked form.
        compute_dtype: dtype of the arithmetic; default float64 when the inputs or the cache are
            float64, else float32.
    """

    name = "torch"

    def __init__(
        self,
        checkpoint_alignment: int = 1,
        *,
        mode: Mode = "chunked",
        chunk_size: int = 64,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if checkpoint_alignment < 1:
            raise ValueError(f"checkpoint_alignment must be >= 1, got {checkpoint_alignment}")
        if mode not in ("chunked", "loop"):
            raise ValueError(f"mode must be 'chunked' or 'loop', got {mode!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.checkpoint_alignment = checkpoint_alignment
        self.max_checkpoints_per_step = None
        self.mode: Mode = mode
        self.chunk_size = chunk_size
        self.compute_dtype = compute_dtype

    def _dtype(self, *dtypes: torch.dtype) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.float64 if torch.float64 in dtypes else torch.float32

    def check_layer(self, params: KDALayerParams, dtype: torch.dtype, device: torch.device) -> None:
        """The reference runs any layer, on any device, in floating-point dtypes."""
        if not dtype.is_floating_point:
            raise UnsupportedLayerError(f"inputs must be floating point, got {dtype}")

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
        """See :meth:`KDABackend.forward`."""
        compute = self._dtype(v.dtype, recurrent.dtype)
        scale = q.shape[-1] ** -0.5
        initial = read_states(recurrent, plan.initial_slot, compute).transpose(-1, -2)

        if plan.num_checkpoints == 0 and plan.num_tokens == plan.num_rows:
            # Decode: one token per row, all rows at once.
            q_hat, k_hat, values, decay, beta_s = prepare_inputs(q, k, v, g, beta, params, compute)
            state = initial * torch.exp(decay)[..., None]
            u = values - torch.einsum("rhk,rhkv->rhv", k_hat, state)
            state = state + (beta_s[..., None] * k_hat)[..., None] * u[..., None, :]
            out = torch.einsum("rhk,rhkv->rhv", scale * q_hat, state)
            write_states(recurrent, plan.running_slot, state.transpose(-1, -2))
            return out.to(v.dtype)

        out = v.new_empty(v.shape)
        slots: list[int] = []
        states: list[torch.Tensor] = []
        for row in range(plan.num_rows):
            state = initial[row]
            start = plan.start(row)
            done = 0
            for cut in plan.cuts(row):
                part = slice(start + done, start + cut.offset)
                # Fresh copies: the segment's arithmetic must not depend on where it sits in the
                # packed batch (CPU kernels may round differently at other memory alignments).
                args = prepare_inputs(
                    q[part].clone(), k[part].clone(), v[part].clone(), g[part].clone(),
                    beta[part].clone(), params, compute,
                )  # fmt: skip
                if self.mode == "chunked":
                    o, state = recurrence_chunked(*args, scale, state, self.chunk_size)
                else:
                    o, state = recurrence_loop(*args, scale, state)
                out[part] = o.to(v.dtype)
                stored = state.transpose(-1, -2).to(recurrent.dtype)
                slots.append(cut.slot)
                states.append(stored)
                state = stored.transpose(-1, -2).to(compute)
                done = cut.offset
        write_states(recurrent, slots, torch.stack(states))
        return out
