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

import torch
import torch.nn.functional as F

from ._convert import to_device
from .params import KDALayerParams
from .plan import StatePlan

__all__ = ["causal_conv"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    num_tokens, channels = x.shape
    width = params.conv_width
    history = width - 1
    rows = plan.num_rows
    if num_tokens != plan.num_tokens or channels != params.conv_channels:
        raise ValueError(
            f"x must be [T={plan.num_tokens}, C={params.conv_channels}], got {tuple(x.shape)}"
        )
    if tuple(conv_cache.shape[1:]) != (channels, history):
        raise ValueError(
            f"conv cache rows are {tuple(conv_cache.shape[1:])}, expected ({channels}, {history})"
        )
    device = x.device

    # Host-side index arithmetic (plain int64), moved to the device once.
    lengths = torch.tensor(plan.lengths(), dtype=torch.int64)
    starts = torch.tensor(plan.query_start_loc[:-1], dtype=torch.int64)
    row_of_token = torch.repeat_interleave(torch.arange(rows), lengths)
    extended_start = starts + torch.arange(rows) * history  # first initial row of each sequence
    token_position = torch.arange(num_tokens) + history * (row_of_token + 1)
    initial_position = (extended_start[:, None] + torch.arange(history)).reshape(-1)
    cut_rows = [row for row in range(rows) for _ in plan.cuts(row)]
    cut_offsets = torch.tensor([c.offset for row in range(rows) for c in plan.cuts(row)])
    cut_slots = torch.tensor([c.slot for row in range(rows) for c in plan.cuts(row)])
    window_position = (
        (extended_start[cut_rows] + cut_offsets)[:, None] + torch.arange(history)
    ).reshape(-1)
    initial = torch.tensor(plan.initial_slot, dtype=torch.int64)
    has_initial = initial >= 0

    token_position_d = to_device(token_position, device)
    initial_position_d = to_device(initial_position, device)
    window_position_d = to_device(window_position, device)
    cut_slots_d = to_device(cut_slots, device)
    output_index_d = to_device(token_position - history, device)

    extended = x.new_empty(num_tokens + rows * history, channels)
    extended.index_copy_(0, token_position_d, x)
    if history:
        if bool(has_initial.all()):
            windows = conv_cache.index_select(0, to_device(initial, device))
        else:
            windows = conv_cache.new_zeros(rows, channels, history)
            present = to_device(torch.nonzero(has_initial).reshape(-1), device)
            windows.index_copy_(
                0, present, conv_cache.index_select(0, to_device(initial[has_initial], device))
            )
        extended.index_copy_(
            0, initial_position_d, windows.transpose(1, 2).reshape(-1, channels).to(x.dtype)
        )

    compute = _compute_dtype(x.dtype)
    weight = params.conv_weight.to(device=device, dtype=compute)
    valid = extended.shape[0] - history
    outputs: list[torch.Tensor] = []
    split_sizes = [channels] if splits is None else list(splits)
    if sum(split_sizes) != channels:
        raise ValueError(f"splits {split_sizes} do not add up to {channels} channels")
    first = 0
    for size in split_sizes:
        part = slice(first, first + size)
        first += size
        # Type promotion computes in ``compute`` without materialising converted copies.
        acc = extended[0:valid, part] * weight[part, 0]
        for j in range(1, width):
            acc.addcmul_(extended[j : j + valid, part], weight[part, j])
        out = acc.index_select(0, output_index_d)
        if params.conv_activation == "silu":
            out = F.silu(out)
        outputs.append(out.to(x.dtype))

    if history:
        cut_windows = extended.index_select(0, window_position_d).view(-1, history, channels)
        conv_cache.index_copy_(0, cut_slots_d, cut_windows.transpose(1, 2).to(conv_cache.dtype))
    return outputs
