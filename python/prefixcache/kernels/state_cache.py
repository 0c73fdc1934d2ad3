"""Per-layer storage of recurrent states, indexed by the state group's block ids.

One :class:`StateCache` per recurrent (KDA) layer. A *slot* is a block id of the layer's state
group: the Rust core hands out running-state blocks and checkpoint blocks from one id space, so
every slot of a step plan indexes both tensors here.

- ``conv`` ``[num_blocks, conv_channels, conv_width - 1]``: the last ``W-1`` *pre-conv* input rows
  of the packed ``q|k|v`` projection, oldest first along the last axis (vLLM's layout).
- ``recurrent`` ``[num_blocks, num_heads, head_dim_v, head_dim_k]``: the KDA state ``S^T``
  (V-first, FlashKDA's and vLLM's layout).

On a GPU the serving dtypes are bf16 for ``conv`` and fp32 for ``recurrent``; tests use float64 for
both. The cache owns no policy: which slot is read or written is the plan's business.
"""

from __future__ import annotations

import torch

from .params import KDALayerParams

__all__ = ["StateCache"]


class StateCache:
    """Conv windows and recurrent states of one KDA layer, one row per state block."""

    def __init__(
        self,
        num_blocks: int,
        *,
        conv_channels: int,
        conv_width: int,
        num_heads: int,
        head_dim_k: int,
        head_dim_v: int,
        conv_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if conv_width < 2:
            raise ValueError(f"conv_width must be >= 2, got {conv_width}")
        self.conv = torch.zeros(
            num_blocks, conv_channels, conv_width - 1, dtype=conv_dtype, device=device
        )
        self.recurrent = torch.zeros(
            num_blocks, num_heads, head_dim_v, head_dim_k, dtype=state_dtype, device=device
        )

    @classmethod
    def for_layer(
        cls,
        params: KDALayerParams,
        num_blocks: int,
        *,
        conv_dtype: torch.dtype | None = None,
        state_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> StateCache:
        """A cache shaped for ``params``.

        Defaults: the device of ``params``; on CUDA bf16 conv windows and fp32 states, on the
        CPU float32 for both. Pass float64 for exact tests.
        """
        device = params.A_log.device if device is None else torch.device(device)
        on_gpu = torch.device(device).type == "cuda"
        if conv_dtype is None:
            conv_dtype = torch.bfloat16 if on_gpu else torch.float32
        if state_dtype is None:
            state_dtype = torch.float32
        return cls(
            num_blocks,
            conv_channels=params.conv_channels,
            conv_width=params.conv_width,
            num_heads=params.num_heads,
            head_dim_k=params.head_dim_k,
            head_dim_v=params.head_dim_v,
            conv_dtype=conv_dtype,
            state_dtype=state_dtype,
            device=device,
        )

    @property
    def num_blocks(self) -> int:
        """Number of slots (state blocks) of this layer."""
        return int(self.recurrent.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of both tensors."""
        return self.recurrent.device

    @property
    def conv_width(self) -> int:
        """W, the width of the short convolution whose windows are stored."""
        return int(self.conv.shape[2]) + 1

    @property
    def num_heads(self) -> int:
        """H, heads of the recurrent state."""
        return int(self.recurrent.shape[1])

    @property
    def head_dim_v(self) -> int:
        """V, first state axis."""
        return int(self.recurrent.shape[2])

    @property
    def head_dim_k(self) -> int:
        """K, second state axis."""
        return int(self.recurrent.shape[3])

    def bytes_per_block(self) -> int:
        """Bytes one slot holds (conv window plus recurrent state)."""
        conv = self.conv[0].numel() * self.conv.element_size()
        state = self.recurrent[0].numel() * self.recurrent.element_size()
        return int(conv + state)

    def fill_(self, value: float) -> StateCache:
        """Fill every slot with ``value`` (NaN poisoning in tests); returns ``self``."""
        self.conv.fill_(value)
        self.recurrent.fill_(value)
        return self

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy conv windows and states of slots ``src`` into slots ``dst`` (both int64 [n]).

        Reads all sources before writing: ``dst`` must not repeat, and a slot that is both read
        and written reads its old content. Callers validate the indices.
        """
        if src.numel() == 0:
            return
        self.conv.index_copy_(0, dst, self.conv.index_select(0, src))
        self.recurrent.index_copy_(0, dst, self.recurrent.index_select(0, src))
