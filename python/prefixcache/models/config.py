"""Shapes of the reference hybrid model: :class:`ModelConfig` and its named sizes.

The model has the layer pattern of Kimi-Linear and Kimi-K3 (three KDA layers for every
full-attention layer). Named sizes (:data:`MODEL_NAMES`, :meth:`ModelConfig.named`):

- ``tiny`` (:meth:`ModelConfig.tiny`, the CPU default): width 64, 4 KDA heads of 16, vocabulary
  1000, one group of 3 KDA + 1 attention layers.
- ``kimi-k3-tp8`` (:meth:`ModelConfig.kimi_k3_tp8`, the GPU default): a *cost proxy* of Kimi-K3
  on one GPU of a TP8 deployment, with random weights. Every shape is the per-GPU shape of the
  published model (:data:`KIMI_K3`), so a token costs one GPU about what it costs in Kimi-K3,
  layer for layer; only the depth is cut (``groups`` of 3 KDA + 1 attention layers instead of
  69 + 24) and the MoE and MLA blocks are replaced by dense blocks of the same cost:

  - width 7,168; KDA 12 heads of 128 per GPU (96 / 8), full-rank gate, bounded gate (-5), short
    convolution of width 4;
  - a dense SwiGLU block whose multiply-adds per token equal the MoE block's *active*
    multiply-adds per token per GPU (16 routed experts of 3,072 in a 3,584-wide latent space,
    its two projections, 2 shared experts of 3,072 and the router, over 8 GPUs): width 4,160
    (:func:`kimi_k3_mlp_width`);
  - grouped-query attention with 12 query heads of 128 per GPU and 2 key/value heads of 128:
    its cache holds 1,024 bytes per token per layer against MLA's 1,152 (the 576-wide latent in
    bf16), so decode reads about what MLA reads;
  - vocabulary 163,840 / 8 (the vocabulary-parallel shard).

  ``kimi-k3-tp8/N`` divides every width by N (the layer pattern and head counts stay): the
  same model at reduced size, for the CPU and for tests.

What the model does not represent is said in ``prefixcache.models``'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["KIMI_K3", "MODEL_NAMES", "LayerKind", "ModelConfig", "kimi_k3_mlp_width"]

LayerKind = Literal["kda", "attention"]

#: The named model sizes (``ModelConfig.named``; ``kimi-k3-tp8/N`` divides its widths by N).
MODEL_NAMES = ("tiny", "kimi-k3-tp8")

#: Kimi-K3's published text-backbone shape (its ``config.json``) and the deployment the proxy
#: stands for (tensor parallelism over 8 GPUs).
KIMI_K3: dict[str, int] = {
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "kda_layers": 69,
    "full_attention_layers": 24,
    "kda_num_heads": 96,
    "kda_head_dim": 128,
    "short_conv_kernel_size": 4,
    "num_attention_heads": 96,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "vocab_size": 163840,
    "num_experts_per_token": 16,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "num_shared_experts": 2,
    "num_experts": 896,
    "tensor_parallel": 8,
}


def kimi_k3_mlp_width(multiple: int = 64) -> int:
    """Width of the dense SwiGLU block whose multiply-adds per token (``3 * d * F``) equal
    Kimi-K3's active MoE multiply-adds per token per GPU at TP8, rounded to ``multiple``.

    Active per token: 16 routed SwiGLU experts of width 3,072 over the 3,584-wide latent
    (``3 * 3584 * 3072`` each), the latent down and up projections (``2 * 7168 * 3584``), 2 shared
    SwiGLU experts of 3,072 over the full width (``3 * 7168 * 6144``) and the router
    (``7168 * 896``): 718.4M multiply-adds, 89.8M per GPU, ``F = 4176`` before rounding.
    """
    k3 = KIMI_K3
    d, latent, inner = (
        k3["hidden_size"],
        k3["routed_expert_hidden_size"],
        k3["moe_intermediate_size"],
    )
    routed = k3["num_experts_per_token"] * 3 * latent * inner + 2 * d * latent
    shared = 3 * d * inner * k3["num_shared_experts"]
    router = d * k3["num_experts"]
    per_gpu = (routed + shared + router) / k3["tensor_parallel"]
    return max(multiple, round(per_gpu / (3 * d) / multiple) * multiple)


@dataclass(frozen=True)
class ModelConfig:
    """Every shape and constant of :class:`~prefixcache.models.HybridModel`.

    Attributes:
        vocab_size: token ids are ``0 .. vocab_size - 1``.
        hidden_size: width of the residual stream.
        layers: the layer kinds in order (``"kda"`` or ``"attention"``).
        kda_heads, kda_head_dim: H and K = V of every KDA layer.
        kda_gate: ``"bounded"`` (Kimi-K3, lower bound -5) or ``"softplus"`` (Kimi-Linear).
        kda_full_rank_gate: the gate input is one ``[H*K, hidden]`` projection (Kimi-K3) instead
            of a rank-K pair (Kimi-Linear).
        conv_width: width of the KDA short causal convolution.
        attention_heads, attention_kv_heads, attention_head_dim: grouped-query attention shape.
        mlp_hidden_size: width of the SwiGLU feed-forward block.
        rms_eps: epsilon of every RMS norm.
        seed: seed of the random weights (same seed, same model on the same kind of device:
            on a GPU the large matrices are drawn there).
        name: the named size this configuration is (reports print it).
    """

    vocab_size: int = 1000
    hidden_size: int = 64
    layers: tuple[LayerKind, ...] = field(default=("kda", "kda", "kda", "attention"))
    kda_heads: int = 4
    kda_head_dim: int = 16
    kda_gate: Literal["bounded", "softplus"] = "bounded"
    kda_full_rank_gate: bool = False
    conv_width: int = 4
    attention_heads: int = 4
    attention_kv_heads: int = 2
    attention_head_dim: int = 16
    mlp_hidden_size: int = 192
    rms_eps: float = 1e-6
    seed: int = 0
    name: str = "custom"

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
        return cls(seed=seed, name="tiny")

    @classmethod
    def kimi_k3_tp8(cls, groups: int = 2, *, divisor: int = 1, seed: int = 0) -> ModelConfig:
        """The Kimi-K3 cost proxy on one GPU of TP8 (module docstring), ``groups`` x (3 KDA + 1
        attention) layers deep, every width divided by ``divisor``.

        At ``divisor=1`` it is meant for ``--device cuda`` (FlashKDA needs K = V = 128).
        """
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        k3 = KIMI_K3
        tp = k3["tensor_parallel"]
        widths = {
            "hidden_size": k3["hidden_size"],
            "kda_head_dim": k3["kda_head_dim"],
            "attention_head_dim": k3["kda_head_dim"],
            "mlp_hidden_size": kimi_k3_mlp_width(),
            "vocab_size": k3["vocab_size"] // tp,
        }
        if divisor < 1 or any(width % divisor for width in widths.values()):
            raise ValueError(
                f"divisor must be >= 1 and divide every width {sorted(widths.values())}, "
                f"got {divisor}"
            )
        scaled = {key: width // divisor for key, width in widths.items()}
        return cls(
            layers=("kda", "kda", "kda", "attention") * groups,
            kda_heads=k3["kda_num_heads"] // tp,
            kda_gate="bounded",
            kda_full_rank_gate=True,
            conv_width=k3["short_conv_kernel_size"],
            attention_heads=k3["num_attention_heads"] // tp,
            attention_kv_heads=2,
            seed=seed,
            name="kimi-k3-tp8" if divisor == 1 else f"kimi-k3-tp8/{divisor}",
            **scaled,
        )

    @classmethod
    def named(cls, name: str, groups: int | None = None, *, seed: int = 0) -> ModelConfig:
        """The named size ``name`` (``tiny``, ``kimi-k3-tp8`` or ``kimi-k3-tp8/N``);
        ``groups`` sets the depth of the Kimi-K3 proxy (default 2; ``tiny`` has one group)."""
        base, _, divisor = name.partition("/")
        if base == "tiny" and not divisor:
            if groups not in (None, 1):
                raise ValueError("the tiny model has one group of layers")
            return cls.tiny(seed)
        if base == "kimi-k3-tp8":
            try:
                factor = int(divisor) if divisor else 1
            except ValueError:
                factor = 0
            if factor < 1:
                raise ValueError(f"kimi-k3-tp8/N needs a positive integer N, got {name!r}")
            return cls.kimi_k3_tp8(2 if groups is None else groups, divisor=factor, seed=seed)
        raise ValueError(f"unknown model {name!r}; choose tiny, kimi-k3-tp8 or kimi-k3-tp8/N")

    def macs_per_token(self) -> dict[str, int]:
        """Multiply-adds per token of each layer kind's weights (attention's context term,
        ``2 * heads * head_dim`` per context token, excluded), and of the whole stack."""
        d, heads, dim = self.hidden_size, self.kda_heads, self.kda_head_dim
        gate = d * heads * dim if self.kda_full_rank_gate else d * dim + dim * heads * dim
        kda = d * 3 * heads * dim + gate + d * heads + d * dim + dim * heads * dim + heads * dim * d
        q_heads, kv_heads = self.attention_heads, self.attention_kv_heads
        head = self.attention_head_dim
        attention = d * (q_heads + 2 * kv_heads) * head + q_heads * head * d
        mlp = 3 * d * self.mlp_hidden_size
        stack = self.num_kda_layers * kda + self.num_attention_layers * attention
        return {
            "kda": kda,
            "attention": attention,
            "mlp": mlp,
            "stack": stack + len(self.layers) * mlp,
        }

    @property
    def num_kda_layers(self) -> int:
        """Number of KDA layers (they share one state group of the cache manager)."""
        return sum(kind == "kda" for kind in self.layers)

    @property
    def num_attention_layers(self) -> int:
        """Number of full-attention layers (they share one paged group)."""
        return sum(kind == "attention" for kind in self.layers)
