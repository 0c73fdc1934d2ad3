"""The short causal convolution over a packed batch, with checkpointed conv windows.

Depthwise, width W (4 in the Kimi models), applied to the packed pre-conv ``q|k|v`` projection
``x`` ``[T, C]``: ``y[t, c] = act(sum_j w[c, j] * x[t - (W-1) + j, c])`` where rows before a
sequence's first token come from its initial conv window (zeros for ``initial_slot == -1``).

The conv state of a sequence after ``t`` tokens is the window of the last ``W-1`` *pre-conv* rows,
``t-3, t-2, t-1`` for W = 4, oldest first, taking rows from the initial window when ``t < W-1``.
Every cut of the plan (each checkpoint, then the end of the query into the running slot) stores
that window; resuming from it reproduces the unsplit outputs bit for bit, because each output
element is computed from the same inputs in the same order whatever the packing.

Implementation: the batch is laid out in an extended buffer where each sequence is preceded by
its W-1 initial rows, so the convolution is W shifted, contiguous multiply-adds (no per-sequence
loop), and conv windows are plain row ranges of that buffer. Works on CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._convert import to_device
from .params import KDALayerParams
from .plan import StatePlan

__all__ = ["causal_conv", "check_conv_inputs"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class _ConvIndex:
    """The index tensors of one plan's convolution, on the device (shared by every layer).

    The batch is laid out in an extended buffer where each row is preceded by its W-1 initial
    rows: ``token_position`` / ``initial_position`` place the tokens / initial windows there,
    ``output`` picks each token's output row, ``window_position`` the W-1 rows of each cut's
    window and ``cut_slots`` its slot. ``initial`` lists the slots of rows with an initial state
    (all rows when ``present`` is None, else the rows ``present``).
    """

    token_position: torch.Tensor
    initial_position: torch.Tensor
    output: torch.Tensor
    window_position: torch.Tensor
    cut_slots: torch.Tensor
    initial: torch.Tensor
    present: torch.Tensor | None

    @classmethod
    def build(cls, plan: StatePlan, history: int, device: torch.device) -> _ConvIndex:
        # Host-side index arithmetic (plain int64), moved to the device once.
        rows, num_tokens = plan.num_rows, plan.num_tokens
        lengths = torch.tensor(plan.lengths(), dtype=torch.int64)
        starts = torch.tensor(plan.query_start_loc[:-1], dtype=torch.int64)
        row_of_token = torch.repeat_interleave(torch.arange(rows), lengths)
        extended_start = starts + torch.arange(rows) * history  # first initial row of each row
        token_position = torch.arange(num_tokens) + history * (row_of_token + 1)
        initial_position = (extended_start[:, None] + torch.arange(history)).reshape(-1)
        cuts = plan.all_cuts()
        cut_rows = [row for row, _ in cuts]
        cut_offsets = torch.tensor([cut.offset for _, cut in cuts], dtype=torch.int64)
        window_position = (
            (extended_start[cut_rows] + cut_offsets)[:, None] + torch.arange(history)
        ).reshape(-1)
        initial = torch.tensor(plan.initial_slot, dtype=torch.int64)
        has_initial = initial >= 0
        every = bool(has_initial.all())
        present = None if every else to_device(torch.nonzero(has_initial).reshape(-1), device)
        return cls(
            token_position=to_device(token_position, device),
            initial_position=to_device(initial_position, device),
            output=to_device(token_position - history, device),
            window_position=to_device(window_position, device),
            cut_slots=to_device(torch.tensor([cut.slot for _, cut in cuts]), device),
            initial=to_device(initial if every else initial[has_initial], device),
            present=present,
        )


def check_conv_inputs(
    x: torch.Tensor, params: KDALayerParams, conv_cache: torch.Tensor, plan: StatePlan
) -> tuple[int, int, int]:
    """``(T, C, W-1)`` after checking ``x`` ``[T, C]`` and the conv cache against the plan."""
    num_tokens, channels = x.shape
    history = params.conv_width - 1
    if num_tokens != plan.num_tokens or channels != params.conv_channels:
        raise ValueError(
            f"x must be [T={plan.num_tokens}, C={params.conv_channels}], got {tuple(x.shape)}"
        )
    if tuple(conv_cache.shape[1:]) != (channels, history):
        raise ValueError(
            f"conv cache rows are {tuple(conv_cache.shape[1:])}, expected ({channels}, {history})"
        )
    return num_tokens, channels, history


def causal_conv(
    x: torch.Tensor,
    params: KDALayerParams,
    conv_cache: torch.Tensor,
    plan: StatePlan,
    splits: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Convolve the packed batch ``x`` ``[T, C]`` and store the conv window at every cut.

    Reads each row's initial window from ``conv_cache[initial_slot]`` (zeros for -1) before
    writing anything, then writes the window at each checkpoint into its slot and the window at
    the end of the query into the running slot. Returns the outputs split along channels by
    ``splits`` (default: one tensor), each contiguous ``[T, split]`` in ``x``'s dtype.
    """
    num_tokens, channels, history = check_conv_inputs(x, params, conv_cache, plan)
    width = params.conv_width
    rows = plan.num_rows
    device = x.device
    index = plan.derived(("conv", device, history), lambda: _ConvIndex.build(plan, history, device))

    extended = x.new_empty(num_tokens + rows * history, channels)
    extended.index_copy_(0, index.token_position, x)
    if history:
        if index.present is None:
            windows = conv_cache.index_select(0, index.initial)
        else:
            windows = conv_cache.new_zeros(rows, channels, history)
            windows.index_copy_(0, index.present, conv_cache.index_select(0, index.initial))
        extended.index_copy_(
            0, index.initial_position, windows.transpose(1, 2).reshape(-1, channels).to(x.dtype)
        )

    compute = _compute_dtype(x.dtype)
    weight = params.conv_weight.to(device=device, dtype=compute)
    valid = extended.shape[0] - history
    split_sizes = [channels] if splits is None else list(splits)
    if sum(split_sizes) != channels:
        raise ValueError(f"splits {split_sizes} do not add up to {channels} channels")
    # All channels at once (a few launches per layer, not a few per split); type promotion
    # computes in ``compute`` without materialising converted copies.
    acc = extended[0:valid] * weight[:, 0]
    for j in range(1, width):
        acc.addcmul_(extended[j : j + valid], weight[:, j])
    out = acc.index_select(0, index.output)
    if params.conv_activation == "silu":
        out = F.silu(out)
    out = out.to(x.dtype)
    starts = [sum(split_sizes[:i]) for i in range(len(split_sizes))]
    outputs = [
        out if size == channels else out.narrow(1, start, size).contiguous()
        for start, size in zip(starts, split_sizes, strict=True)
    ]

    if history:
        cut_windows = extended.index_select(0, index.window_position).view(-1, history, channels)
        conv_cache.index_copy_(0, index.cut_slots, cut_windows.transpose(1, 2).to(conv_cache.dtype))
    return outputs
