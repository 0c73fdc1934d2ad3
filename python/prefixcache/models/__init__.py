"""prefixcache.models: a hybrid KDA + attention language model for the reference engine.

:class:`HybridModel` has the layer pattern of Kimi-Linear and Kimi-K3 (three Kimi Delta
Attention (KDA) layers for every full-attention layer), seeded random weights, float32 on the
CPU, greedy sampling, in two named sizes (:class:`ModelConfig`): ``tiny`` (width 64, vocabulary
1000; the CPU default) and ``kimi-k3-tp8``, a cost proxy of Kimi-K3 on one GPU of a TP8
deployment (the GPU default; per-GPU widths, dense blocks costing what Kimi-K3's MoE and MLA
blocks cost per token, a stated number of layer groups; ``kimi-k3-tp8/N`` is the same model N
times narrower, for the CPU). Its KDA layers run through the kernel layer
(:mod:`prefixcache.kernels`: short conv + KDA recurrence, reading and writing a ``StateCache`` at
the slots of the step plan, checkpoints included); its attention layer writes and reads a paged
KV cache through ``slot_mapping`` and block tables (on CUDA, decode rows through the Triton paged
decode kernel, which reads the blocks in place); its RMS norms are torch's fused one (one kernel
on CUDA). Nothing bypasses a cache: a wrong block id, a stale checkpoint or a missed
copy-on-write changes the logits.

What it represents: the cache traffic of a hybrid model (which states and blocks a step reads
and writes, in which order), the exact numerics of resuming a recurrent state from a checkpoint,
and the prefill work different caching policies save; with ``kimi-k3-tp8`` on a GPU, also a
real model's GPU time per token, layer for layer, so step and round times follow their tokens.

What it does not represent: output quality (the weights are random, the text is noise), the
absolute latency of a whole real model (the proxy is a few layer groups deep, not 23; on the CPU
the attention is a plain reference loop), Kimi's MoE routing (a dense SwiGLU of the same active
multiply-adds per token) and MLA's latent compression (grouped-query attention whose cache holds
about as many bytes per token, without positional encoding, like Kimi's NoPE layers).
"""

from __future__ import annotations

from .config import KIMI_K3, MODEL_NAMES, LayerKind, ModelConfig, kimi_k3_mlp_width
from .hybrid import (
    DECODE_ATTENTIONS,
    HybridModel,
    ModelCaches,
    default_decode_attention,
    default_dtype,
)
from .layers import MLP, AttentionLayer, KDALayer, paged_causal_attention, rms_norm
from .timing import KernelTimer

__all__ = [
    "DECODE_ATTENTIONS",
    "KIMI_K3",
    "MLP",
    "MODEL_NAMES",
    "AttentionLayer",
    "HybridModel",
    "KDALayer",
    "KernelTimer",
    "LayerKind",
    "ModelCaches",
    "ModelConfig",
    "default_decode_attention",
    "default_dtype",
    "kimi_k3_mlp_width",
    "paged_causal_attention",
    "rms_norm",
]
