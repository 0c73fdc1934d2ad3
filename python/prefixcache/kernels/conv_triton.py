"""The short causal convolution in one Triton launch: the same contract as ``conv.causal_conv``.

``conv.causal_conv`` builds an extended copy of the batch and makes several passes over it in
torch (a dozen launches and as many passes over the activations per layer). Here one kind of
program covers the packed batch's tokens in blocks (each token finds its row by a binary search
of the query start locations, so a step of decode rows beside one long prefill row launches the
blocks of its tokens, not rows x blocks of the longest row, most of which would exit at once:
on the H200 that grid cost 74 us a layer at 4,096 tokens beside 7 decode rows), reads each
input element W times from the packed batch (or the row's initial window in the
cache), accumulates in float32 (float64 for float64 inputs) in the order ``j = 0 .. W-1``,
applies the activation and writes each channel into its split's output; the launch's other
programs, one per cut, write the conv window of every cut (each checkpoint, then the end of each
row's query) into its slot (until 2026-12-06 a second kernel: its launch cost 2.6 to 3.1 us of
GPU time and a launch of host time a KDA layer). The plan check guarantees that no written slot
is any row's initial slot, so the two kinds of program never read what the other writes.

Every output element is computed from the same inputs in the same order whatever the packing,
so a forward split at a cut reproduces the unsplit outputs exactly, as with the torch version;
the two versions agree to rounding (Triton may contract a multiply and an add into one FMA).

The stored windows equal the torch version's, except that rows taken from a row's initial window
are copied as stored where the torch version rounds them to the inputs' dtype (bf16 inputs with
a float32 conv cache); both resume exactly, since both round those rows on use.

The kernels are compiled on first use. With ``TRITON_INTERPRET=1`` in the environment before
that, Triton runs them on CPU tensors through its interpreter: that is how the CPU tests check
them.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._convert import to_device
from .conv import check_conv_inputs
from .params import KDALayerParams
from .plan import StatePlan

__all__ = ["bind_index", "causal_conv_triton", "triton_runs_on", "triton_unavailable_reason"]

logger = logging.getLogger(__name__)

BLOCK_T = 32
BLOCK_C = 64


def triton_unavailable_reason(device: torch.device) -> str | None:
    """``None`` when the Triton kernels can run on ``device`` here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton is not installed ({error})"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"the Triton kernels run on CUDA tensors (got {device}); on a CPU only through "
        "Triton's interpreter (TRITON_INTERPRET=1 before the first call)"
    )


def triton_runs_on(device: torch.device, what: str) -> bool:
    """Whether ``what`` (a kernel, named in the warning) runs its Triton version on ``device`` by
    default: on CUDA whenever Triton runs there (else a warning says why torch's runs instead),
    never elsewhere (the CPU never imports Triton; its tests call the Triton kernels themselves,
    through the interpreter)."""
    if device.type != "cuda":
        return False
    reason = triton_unavailable_reason(device)
    if reason is not None:
        logger.warning("%s on %s runs in torch: %s", what, device, reason)
    return reason is None


@functools.cache
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def conv_kernel(  # type: ignore[no-untyped-def]
        x_ptr, cache_ptr, w_ptr, out0_ptr, out1_ptr, out2_ptr,
        qsl_ptr, initial_ptr, cut_row_ptr, cut_offset_ptr, cut_slot_ptr,
        rows, tokens, channels, x_stride, split1, split2, token_blocks,
        WIDTH: tl.constexpr, ACTIVATION: tl.constexpr, COMPUTE_F64: tl.constexpr,
        SEARCH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        # One launch, two kinds of programs: the first token_blocks convolve the batch, the
        # rest (one per cut) write the windows; neither reads what the other writes.
        block = tl.program_id(0)
        if block < token_blocks:
            # One program: BT consecutive tokens of the packed batch (whatever rows they belong
            # to) by BC channels; the grid covers the batch's tokens, not rows x the longest row.
            token = block.to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
            channel = tl.program_id(1) * BC + tl.arange(0, BC).to(tl.int64)
            in_batch = token < tokens
            in_channels = channel < channels
            # Each token's row: the last r in [0, rows) with query_start_loc[r] <= token, by a
            # binary search of SEARCH = ceil(log2(rows)) halvings (lo <= row < hi throughout).
            lo = token * 0
            hi = token * 0 + rows
            for _ in tl.static_range(SEARCH):
                mid = (lo + hi) // 2
                below = tl.load(qsl_ptr + mid, mask=in_batch, other=0).to(tl.int64) <= token
                lo = tl.where(below, mid, lo)
                hi = tl.where(below, hi, mid)
            start = tl.load(qsl_ptr + lo, mask=in_batch, other=0).to(tl.int64)
            slot = tl.load(initial_ptr + lo, mask=in_batch, other=-1).to(tl.int64)
            position = token - start  # the token's offset in its row
            history = WIDTH - 1
            if COMPUTE_F64:
                acc = tl.zeros((BT, BC), dtype=tl.float64)
            else:
                acc = tl.zeros((BT, BC), dtype=tl.float32)
            for j in tl.static_range(WIDTH):
                source = position - history + j  # position in the row; < 0: the initial window
                from_batch = in_batch & (source >= 0)
                from_window = in_batch & (source < 0) & (slot >= 0)
                batch_value = tl.load(
                    x_ptr + (token - history + j)[:, None] * x_stride + channel[None, :],
                    mask=from_batch[:, None] & in_channels[None, :],
                    other=0.0,
                )
                window_value = tl.load(
                    cache_ptr
                    + (slot * channels * history)[:, None]
                    + channel[None, :] * history
                    + (source + history)[:, None],
                    mask=from_window[:, None] & in_channels[None, :],
                    other=0.0,
                )
                weight = tl.load(w_ptr + channel * WIDTH + j, mask=in_channels, other=0.0)
                value = tl.where(
                    from_batch[:, None], batch_value, window_value.to(x_ptr.dtype.element_ty)
                )
                if COMPUTE_F64:
                    term = value.to(tl.float64) * weight.to(tl.float64)[None, :]
                else:
                    term = value.to(tl.float32) * weight.to(tl.float32)[None, :]
                acc = acc + term  # from zero: the first term is taken exactly
            if ACTIVATION:
                acc = acc / (1.0 + tl.exp(-acc))
            mask = in_batch[:, None] & in_channels[None, :]
            width0 = split1
            width1 = split2 - split1
            width2 = channels - split2
            result = acc.to(out0_ptr.dtype.element_ty)
            c = channel[None, :]
            t = token[:, None]
            tl.store(out0_ptr + t * width0 + c, result, mask=mask & (c < split1))
            tl.store(
                out1_ptr + t * width1 + (c - split1),
                result,
                mask=mask & (c >= split1) & (c < split2),
            )
            tl.store(out2_ptr + t * width2 + (c - split2), result, mask=mask & (c >= split2))
        else:
            # A cut's window (names prefixed: a runtime branch's two sides must give any
            # name they share one type).
            w_cut = block - token_blocks
            w_history = WIDTH - 1
            w_row = tl.load(cut_row_ptr + w_cut).to(tl.int64)
            w_offset = tl.load(cut_offset_ptr + w_cut).to(tl.int64)
            w_target = tl.load(cut_slot_ptr + w_cut).to(tl.int64)
            w_start = tl.load(qsl_ptr + w_row).to(tl.int64)
            w_slot = tl.load(initial_ptr + w_row).to(tl.int64)
            w_channel = tl.program_id(1) * BC + tl.arange(0, BC).to(tl.int64)
            w_in_channels = w_channel < channels
            w_has_window = (w_channel * 0 + w_slot) >= 0
            for k in tl.static_range(WIDTH - 1):
                w_source = w_offset - w_history + k
                w_batch_value = tl.load(
                    x_ptr + (w_start + w_source) * x_stride + w_channel,
                    mask=w_in_channels & ((w_channel * 0 + w_source) >= 0),
                    other=0.0,
                )
                w_window_value = tl.load(
                    cache_ptr
                    + w_slot * channels * w_history
                    + w_channel * w_history
                    + (w_source + w_history),
                    mask=w_in_channels & ((w_channel * 0 + w_source) < 0) & w_has_window,
                    other=0.0,
                )
                # Rows of the initial window are copied as stored (conv.causal_conv rounds them to
                # the inputs' dtype first; both resume exactly, since each rounds them on use).
                w_batch_value = w_batch_value.to(cache_ptr.dtype.element_ty)
                w_value = tl.where(w_source >= 0, w_batch_value, w_window_value)
                tl.store(
                    cache_ptr + w_target * channels * w_history + w_channel * w_history + k,
                    w_value,
                    mask=w_in_channels,
                )

    return conv_kernel


@dataclass(frozen=True)
class _Index:
    """One plan's launch arrays on the device (shared by every layer of the step)."""

    query_start_loc: torch.Tensor
    initial: torch.Tensor
    cut_rows: torch.Tensor
    cut_offsets: torch.Tensor
    cut_slots: torch.Tensor

    @classmethod
    def build(cls, plan: StatePlan, device: torch.device) -> _Index:
        cuts = plan.all_cuts()
        host = torch.tensor(
            [
                *plan.query_start_loc,
                *plan.initial_slot,
                *(row for row, _ in cuts),
                *(cut.offset for _, cut in cuts),
                *(cut.slot for _, cut in cuts),
            ],
            dtype=torch.int64,
        )
        sizes = [plan.num_rows + 1, plan.num_rows, len(cuts), len(cuts), len(cuts)]
        loc, initial, rows, offsets, slots = torch.split(to_device(host, device), sizes)
        return cls(loc, initial, rows, offsets, slots)


def bind_index(
    plan: StatePlan,
    device: torch.device,
    *,
    query_start_loc: torch.Tensor,
    initial: torch.Tensor,
    cut_rows: torch.Tensor,
    cut_offsets: torch.Tensor,
    cut_slots: torch.Tensor,
) -> None:
    """Make :func:`causal_conv_triton` read ``plan``'s launch arrays from these int64 device
    tensors instead of uploading them: a CUDA graph's static inputs, refilled before each
    replay with the values of the step replayed (``plan``'s own values then only shape the
    launch: its rows and its tokens)."""
    index = _Index(query_start_loc, initial, cut_rows, cut_offsets, cut_slots)
    plan.derived(("conv-triton", device), lambda: index)


def causal_conv_triton(
    x: torch.Tensor,
    params: KDALayerParams,
    conv_cache: torch.Tensor,
    plan: StatePlan,
    splits: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """``conv.causal_conv`` (same arguments, same results to rounding) in one Triton launch.

    ``x``'s rows must be contiguous (its channels one after the other) but may lie apart: a
    column slice of a wider projection's output is read where it lies, without a copy. The
    conv cache must be contiguous; at most three splits.
    """
    num_tokens, channels, history = check_conv_inputs(x, params, conv_cache, plan)
    width = params.conv_width
    if not ((x.stride(1) == 1 or channels == 1) and conv_cache.is_contiguous()):
        raise ValueError(
            "the Triton conv needs x with contiguous rows (channel stride 1) and a contiguous "
            f"conv cache, got x strides {tuple(x.stride())}"
        )
    split_sizes = [channels] if splits is None else list(splits)
    if sum(split_sizes) != channels or not 1 <= len(split_sizes) <= 3:
        raise ValueError(f"splits {split_sizes} must be 1 to 3 sizes adding up to {channels}")
    device = x.device
    index = plan.derived(("conv-triton", device), lambda: _Index.build(plan, device))
    outputs = [x.new_empty(num_tokens, size) for size in split_sizes]
    padded = [*outputs, *([outputs[-1]] * (3 - len(outputs)))]
    split1 = split_sizes[0]
    split2 = split1 + (split_sizes[1] if len(split_sizes) > 1 else 0)
    if len(split_sizes) == 1:
        split1 = split2 = channels
    elif len(split_sizes) == 2:
        split2 = channels
    weight = params.conv_weight.to(device=device).contiguous()
    if num_tokens:
        rows = plan.num_rows
        token_blocks = -(-num_tokens // BLOCK_T)
        windows = index.cut_slots.numel() if history else 0
        _kernels()[(token_blocks + windows, -(-channels // BLOCK_C))](
            x, conv_cache, weight, *padded, index.query_start_loc, index.initial,
            index.cut_rows, index.cut_offsets, index.cut_slots,
            rows, num_tokens, channels, x.stride(0), split1, split2, token_blocks,
            WIDTH=width, ACTIVATION=params.conv_activation == "silu",
            COMPUTE_F64=x.dtype == torch.float64, SEARCH=(rows - 1).bit_length(),
            BT=BLOCK_T, BC=BLOCK_C,
        )  # fmt: skip
    return outputs
