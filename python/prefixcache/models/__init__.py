"""prefixcache.models: a tiny hybrid KDA + attention language model for the reference engine.

:class:`HybridModel` has the shape of Kimi-Linear scaled down: by default three Kimi Delta
Attention (KDA) layers and one full-attention layer (:class:`ModelConfig`), width 64, vocabulary
1000, seeded random weights, float32 on the CPU, greedy sampling. Its KDA layers run through the
kernel layer (:mod:`prefixcache.kernels`: short conv + KDA recurrence, reading and writing a
``StateCache`` at the slots of the step plan, checkpoints included); its attention layer writes
and reads a paged KV cache through ``slot_mapping`` and block tables. Nothing bypasses a cache:
a wrong block id, a stale checkpoint or a missed copy-on-write changes the logits.

What it represents: the cache traffic of a hybrid model (which states and blocks a step reads
and writes, in which order), the exact numerics of resuming a recurrent state from a checkpoint,
and, relative to each other, the prefill work different caching policies save.

What it does not represent: output quality (the weights are random, the text is noise), the
absolute speed of a real model (it is thousands of times smaller, and on the CPU its attention is
a plain reference loop), Kimi-Linear's MoE feed-forward blocks (a dense SwiGLU here) and its
MLA latent compression (plain grouped-query attention, without positional encoding like Kimi
Linear's). ``ModelConfig.kimi_k3_per_gpu`` gives the KDA layers Kimi-K3's per-GPU shape for
kernel timing on a GPU; the rest of that model stays small.
"""

from __future__ import annotations

from .config import LayerKind, ModelConfig
from .hybrid import HybridModel, ModelCaches, default_dtype
from .layers import MLP, AttentionLayer, KDALayer, paged_causal_attention, rms_norm
from .timing import KernelTimer

__all__ = [
    "MLP",
    "AttentionLayer",
    "HybridModel",
    "KDALayer",
    "KernelTimer",
    "LayerKind",
    "ModelCaches",
    "ModelConfig",
    "default_dtype",
    "paged_causal_attention",
    "rms_norm",
]
