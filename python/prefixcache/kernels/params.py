"""Weights of one KDA layer, as the kernels consume them.

A KDA (Kimi Delta Attention) layer has, besides its projections (which belong to the model), a
depthwise short causal convolution over the packed ``q|k|v`` projections and the per-head gate
parameters. :class:`KDALayerParams` holds exactly those, with the shapes the kernels expect:

- ``A_log`` ``[H]`` and ``dt_bias`` ``[H, K]`` (the gate; fla and FlashKDA use these layouts),
- ``conv_weight`` ``[C, W]`` with ``C = 2*H*K + H*V`` channels in ``q|k|v`` order, head-major,
- ``lower_bound``: the bounded gate of Kimi-K3 when set (``-5``), the original softplus gate of
  Kimi-Linear when ``None``,
- ``conv_activation``: ``"silu"`` (what the Kimi models use) or ``None``.

The gate formulas are in ``reference.kda_gate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["ConvActivation", "GateKind", "KDALayerParams"]

GateKind = Literal["bounded", "softplus"]
ConvActivation = Literal["silu"] | None


@dataclass(frozen=True)
class KDALayerParams:
    """Gate and short-convolution weights of one KDA layer (see the module docstring)."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    conv_weight: torch.Tensor
    lower_bound: float | None = -5.0
    conv_activation: ConvActivation = "silu"

    def __post_init__(self) -> None:
        if self.A_log.dim() != 1:
            raise ValueError(f"A_log must be [num_heads], got shape {tuple(self.A_log.shape)}")
        num_heads = self.A_log.shape[0]
        if self.dt_bias.dim() != 2 or self.dt_bias.shape[0] != num_heads:
            raise ValueError(
                f"dt_bias must be [num_heads={num_heads}, head_dim_k], "
                f"got shape {tuple(self.dt_bias.shape)}"
            )
        if self.conv_weight.dim() != 2 or self.conv_weight.shape[1] < 1:
            raise ValueError(
                f"conv_weight must be [conv_channels, conv_width], "
                f"got shape {tuple(self.conv_weight.shape)}"
            )
        value_channels = self.conv_weight.shape[0] - 2 * num_heads * self.head_dim_k
        if value_channels <= 0 or value_channels % num_heads != 0:
            raise ValueError(
                f"conv_weight has {self.conv_weight.shape[0]} channels; expected "
                f"2*H*K + H*V with H={num_heads}, K={self.head_dim_k}"
            )
        if self.lower_bound is not None and not (
            math.isfinite(self.lower_bound) and self.lower_bound < 0
        ):
            raise ValueError(
                f"lower_bound must be a negative number or None, got {self.lower_bound}"
            )
        if self.conv_activation not in ("silu", None):
            raise ValueError(
                f"conv_activation must be 'silu' or None, got {self.conv_activation!r}"
            )

    @property
    def num_heads(self) -> int:
        """H: the number of KDA heads of this layer (on this rank)."""
        return int(self.A_log.shape[0])

    @property
    def head_dim_k(self) -> int:
        """K: the key (and query) head dimension."""
        return int(self.dt_bias.shape[1])

    @property
    def head_dim_v(self) -> int:
        """V: the value head dimension."""
        return (int(self.conv_weight.shape[0]) - 2 * self.num_heads * self.head_dim_k) // (
            self.num_heads
        )

    @property
    def conv_channels(self) -> int:
        """C = 2*H*K + H*V: the channels of the packed ``q|k|v`` projection."""
        return int(self.conv_weight.shape[0])

    @property
    def conv_width(self) -> int:
        """W: the width of the short causal convolution (4 in the Kimi models)."""
        return int(self.conv_weight.shape[1])

    @property
    def gate(self) -> GateKind:
        """``"bounded"`` when ``lower_bound`` is set, else ``"softplus"``."""
        return "softplus" if self.lower_bound is None else "bounded"

    def to(self, device: torch.device | str) -> KDALayerParams:
        """The same parameters on ``device`` (dtypes kept)."""
        return KDALayerParams(
            A_log=self.A_log.to(device),
            dt_bias=self.dt_bias.to(device),
            conv_weight=self.conv_weight.to(device),
            lower_bound=self.lower_bound,
            conv_activation=self.conv_activation,
        )

    @classmethod
    def random(
        cls,
        num_heads: int,
        head_dim: int,
        *,
        head_dim_v: int | None = None,
        gate: GateKind = "bounded",
        conv_width: int = 4,
        conv_activation: ConvActivation = "silu",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> KDALayerParams:
        """Random parameters in the ranges trained Kimi layers use (for tests and benchmarks).

        ``A_log = log(U(1, 16))``, ``dt_bias ~ N(0, 0.5)``, conv weights ``~ N(0, 1/W)``.
        ``A_log`` and ``dt_bias`` are float32 unless ``dtype`` is float64 (the kernels read them
        in float32); ``conv_weight`` has ``dtype``.
        """
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        a_log = torch.log(
            torch.empty(num_heads, dtype=gate_dtype).uniform_(1.0, 16.0, generator=generator)
        )
        dt_bias = 0.5 * torch.randn(num_heads, head_dim, dtype=gate_dtype, generator=generator)
        channels = 2 * num_heads * head_dim + num_heads * head_dim_v
        conv_weight = torch.randn(channels, conv_width, dtype=gate_dtype, generator=generator)
        conv_weight = conv_weight / math.sqrt(conv_width)
        return cls(
            A_log=a_log.to(device),
            dt_bias=dt_bias.to(device),
            conv_weight=conv_weight.to(device=device, dtype=dtype),
            lower_bound=-5.0 if gate == "bounded" else None,
            conv_activation=conv_activation,
        )
