"""Shapes of the reference hybrid model: :class:`ModelConfig` and its two named sizes.

The model has the layer pattern of Kimi-Linear (three KDA layers for every full-attention layer),
scaled down. Two sizes are named:

- :meth:`ModelConfig.tiny` (the CPU default): width 64, 4 KDA heads of 16, vocabulary 1000.
- :meth:`ModelConfig.kimi_k3_per_gpu`: the KDA layers have Kimi-K3's per-GPU shape at TP8
  (12 heads of 128, bounded gate), so KDA prefill time on a GPU is measured on the real kernel
  shape; everything else stays small.

What it does not represent is said in ``prefixcache.models``'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["LayerKind", "ModelConfig"]

LayerKind = Literal["kda", "attention"]


@dataclass(frozen=True)
class ModelConfig:
    """Every shape and constant of :class:`~prefixcache.models.HybridModel`.

    Attributes:
        vocab_size: token ids are ``0 .. vocab_size - 1``.
        hidden_size: width of the residual stream.
        layers: the layer kinds in order (``"kda"`` or ``"attention"``).
        kda_heads, kda_head_dim: H and K = V of every KDA layer.
        kda_gate: ``"bounded"`` (Kimi-K3, lower bound -5) or ``"softplus"`` (Kimi-Linear).
        conv_width: width of the KDA short causal convolution.
        attention_heads, attention_kv_heads, attention_head_dim: grouped-query attention shape.
        mlp_hidden_size: width of the SwiGLU feed-forward block.
        rms_eps: epsilon of every RMS norm.
        seed: seed of the random weights (same seed, same model, on every device).
    """

    vocab_size: int = 1000
    hidden_size: int = 64
    layers: tuple[LayerKind, ...] = field(default=("kda", "kda", "kda", "attention"))
    kda_heads: int = 4
    kda_head_dim: int = 16
    kda_gate: Literal["bounded", "softplus"] = "bounded"
    conv_width: int = 4
    attention_heads: int = 4
    attention_kv_heads: int = 2
    attention_head_dim: int = 16
    mlp_hidden_size: int = 192
    rms_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "kda_heads": self.kda_heads,
            "kda_head_dim": self.kda_head_dim,
            "attention_heads": self.attention_heads,
            "attention_kv_heads": self.attention_kv_heads,
            "attention_head_dim": self.attention_head_dim,
            "mlp_hidden_size": self.mlp_hidden_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.conv_width < 2:
            raise ValueError(f"conv_width must be >= 2, got {self.conv_width}")
        if not self.layers or any(kind not in ("kda", "attention") for kind in self.layers):
            raise ValueError(
                f"layers must be a non-empty sequence of 'kda' / 'attention', got {self.layers}"
            )
        if self.attention_heads % self.attention_kv_heads:
            raise ValueError(
                f"attention_heads {self.attention_heads} must be a multiple of "
                f"attention_kv_heads {self.attention_kv_heads}"
            )
        if self.kda_gate not in ("bounded", "softplus"):
            raise ValueError(f"kda_gate must be 'bounded' or 'softplus', got {self.kda_gate!r}")

    @classmethod
    def tiny(cls, seed: int = 0) -> ModelConfig:
        """The CPU default: 3 KDA layers + 1 attention layer, width 64, vocabulary 1000."""
        return cls(seed=seed)

    @classmethod
    def kimi_k3_per_gpu(cls, seed: int = 0) -> ModelConfig:
        """KDA layers of Kimi-K3's per-GPU shape at TP8 (12 heads x 128, bounded gate).

        Meant for ``--device cuda`` (FlashKDA needs K = V = 128); width 1024, the rest small.
        """
        return cls(
            hidden_size=1024,
            kda_heads=12,
            kda_head_dim=128,
            attention_heads=8,
            attention_kv_heads=2,
            attention_head_dim=128,
            mlp_hidden_size=2048,
            seed=seed,
        )

    @property
    def num_kda_layers(self) -> int:
        """Number of KDA layers (they share one state group of the cache manager)."""
        return sum(kind == "kda" for kind in self.layers)

    @property
    def num_attention_layers(self) -> int:
        """Number of full-attention layers (they share one paged group)."""
        return sum(kind == "attention" for kind in self.layers)
