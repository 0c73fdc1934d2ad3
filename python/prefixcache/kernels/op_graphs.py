"""The FlashKDA op's prefill calls replayed from CUDA graphs, one per layer and token bucket.

One eager call of vLLM's FlashKDA op costs the host 180 to 360 us (an H100; ``benchmarks/
gpu_op_host.py``), more than the op's GPU work at the seed preset's prefill sizes (about 127 us
at 2,048 tokens), and the GPU waits for it inside every KDA layer. A replay of a captured call
costs the host about 20 us. A graph holds fixed addresses and shapes, while each call has its own
token count T and sequence count N, so a call runs from the graph of its *bucket*:

- **Buckets.** T is rounded up to a multiple of :data:`BUCKET_TOKENS`; one graph per layer (its
  ``A_log`` and ``dt_bias``, which the graph reads where they lie), bucket, N and whether the call
  exports checkpoints. Calls over :data:`MAX_TOKENS` tokens or :data:`MAX_SEQUENCES` sequences run
  eagerly.
- **An empty last sequence.** The graph runs N + 1 sequences over the bucket's tokens: the call's
  N, then one of no tokens (``cu_seqlens`` ``[..., T, T]``, no checkpoint). The tokens from T to
  the bucket belong to no sequence, so the op reads none of them and spends no work on them: on
  an H100 a replay at T = 2,048 in a bucket of 2,176 took 126.2 us of GPU time against 126.8 us
  for the eager call, and its outputs, final state and checkpoint equalled the eager call's bit
  for bit at every T tried (``benchmarks/gpu_op_graph.py``).
- **Static buffers.** Every graph of a backend reads and writes one set of buffers, sized for the
  largest bucket and sequence count: inputs, outputs, initial / final / checkpoint states,
  ``cu_seqlens``, checkpoint offsets and the op's workspace. A call copies its five inputs and its
  initial states in (and the checkpoint rows it was given, which come back where the op writes
  none), replays, and copies its outputs and states out (the step's output and the
  state cache, where the eager call writes them directly). ``cu_seqlens`` and the offsets are
  the same device tensors for every layer of a step (``chaining``'s per-plan index arrays), so
  they are copied in only when a call brings different ones.
- **Capture** happens the first time a key is met (a warm-up pass meets every shape of a
  workload, so a measured pass captures nothing); all graphs share one memory pool. Nothing is
  captured while the current stream is itself capturing (the decode graphs): such a call runs
  eagerly.

Replaying costs GPU copies of the inputs and outputs (about 64 MB a call at 2,048 tokens of the
Kimi-K3 proxy's 12 heads, some 20 us on an H100) to take 150 to 300 us of host time out of the
layer. :class:`OpGraphs` takes the op and a capture function, so the CPU tests replay the same
buffers through a stand-in op with a capture that simply calls again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "BUCKET_TOKENS",
    "MAX_SEQUENCES",
    "MAX_TOKENS",
    "OpGraphs",
    "cuda_capture",
]

#: A call's tokens are rounded up to a multiple of this for its graph.
BUCKET_TOKENS = 512
#: The largest call replayed from a graph (tokens); larger calls run eagerly.
MAX_TOKENS = 8192
#: The most sequences of a call replayed from a graph; calls with more run eagerly.
MAX_SEQUENCES = 8

#: ``capture(fn) -> replay``: records ``fn`` (which calls the op on the static buffers) and returns
#: what runs it again.
Capture = Callable[[Callable[[], None]], Callable[[], None]]


class _Key(NamedTuple):
    a_log: int  # the layer: its parameters' addresses, which the graph reads
    dt_bias: int
    lower_bound: float
    scale: float
    tokens: int  # the bucket
    sequences: int  # N, before the empty one
    checkpoints: bool


@dataclass
class _Buffers:
    """The static tensors every graph of one layout reads and writes."""

    q: torch.Tensor  # [1, MAX_TOKENS, H, K]
    k: torch.Tensor
    v: torch.Tensor  # [1, MAX_TOKENS, H, V]
    g: torch.Tensor
    beta: torch.Tensor  # [1, MAX_TOKENS, H]
    out: torch.Tensor
    initial: torch.Tensor  # [MAX_SEQUENCES + 1, H, V, K] fp32
    final: torch.Tensor
    checkpoint: torch.Tensor
    cu_seqlens: torch.Tensor  # int64 [MAX_SEQUENCES + 2]
    offsets: torch.Tensor  # int64 [MAX_SEQUENCES + 1]
    workspace: torch.Tensor  # uint8, the largest size any graph asks for


def cuda_capture(pool: Any) -> Capture:
    """A capture function recording into CUDA graphs that share ``pool``."""

    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        # The op once on a side stream first (whatever it sets up on a first call), then the
        # capture (torch.cuda.graph synchronises and records on a stream of its own).
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    return capture


class OpGraphs:
    """The graphs of one backend's op calls (see the module docstring).

    ``fwd`` and ``workspace_size`` are the op's (``torch.ops._flashkda_C.fwd`` and
    ``get_workspace_size``); ``capture`` defaults to :func:`cuda_capture` with a pool of its own.
    """

    def __init__(
        self,
        fwd: Callable[..., None],
        workspace_size: Callable[[int, int, int], int],
        *,
        capture: Capture | None = None,
        max_tokens: int = MAX_TOKENS,
        max_sequences: int = MAX_SEQUENCES,
        bucket_tokens: int = BUCKET_TOKENS,
    ) -> None:
        if not 0 < bucket_tokens <= max_tokens or max_tokens % bucket_tokens:
            raise ValueError(
                f"max_tokens ({max_tokens}) must be a positive multiple of bucket_tokens "
                f"({bucket_tokens})"
            )
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be at least 1, got {max_sequences}")
        self._fwd = fwd
        self._workspace_size = workspace_size
        self._capture = capture
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.bucket_tokens = bucket_tokens
        self._graphs: dict[_Key, Callable[[], None]] = {}
        self._buffers: _Buffers | None = None
        # The index tensors the static copies hold now (kept alive, so never a recycled id).
        self._cu_source: torch.Tensor | None = None
        self._offsets_source: torch.Tensor | None = None

    def __len__(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def bucket(self, tokens: int, sequences: int) -> int | None:
        """The bucket a call of ``tokens`` over ``sequences`` replays, or ``None`` (eager)."""
        if not 0 < tokens <= self.max_tokens or not 0 < sequences <= self.max_sequences:
            return None
        return -(-tokens // self.bucket_tokens) * self.bucket_tokens

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        lower_bound: float,
        initial_state: torch.Tensor,
        final_state: torch.Tensor,
        cu_seqlens: torch.Tensor,
        checkpoint_state: torch.Tensor | None = None,
        checkpoint_offsets: torch.Tensor | None = None,
    ) -> bool:
        """The op's call with these arguments (packed ``[1, T, H, *]`` inputs, ``[N, H, V, K]``
        states, ``cu_seqlens`` ``[N + 1]`` on the device), from its bucket's graph. Writes
        ``out``, ``final_state`` and ``checkpoint_state`` as the call would; returns False,
        touching nothing, where the call must run eagerly instead (too large, or the stream is
        capturing)."""
        tokens, sequences = q.shape[1], cu_seqlens.shape[0] - 1
        bucket = self.bucket(tokens, sequences)
        if bucket is None or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False
        checkpoints = checkpoint_offsets is not None
        if checkpoints and checkpoint_state is None:
            raise ValueError("checkpoint_offsets without checkpoint_state")
        buffers = self._buffers_for(q, v)
        key = _Key(
            A_log.data_ptr(),
            dt_bias.data_ptr(),
            float(lower_bound),
            float(scale),
            bucket,
            sequences,
            checkpoints,
        )
        # The call's inputs into the static buffers; what lies past T is read by no sequence.
        for source, static in ((q, buffers.q), (k, buffers.k), (v, buffers.v), (g, buffers.g),
                               (beta, buffers.beta)):  # fmt: skip
            static[:, :tokens].copy_(source)
        buffers.initial[:sequences].copy_(initial_state)
        if checkpoints and checkpoint_state is not None:
            # What the op leaves unwritten (a row with no checkpoint, an offset off its grid)
            # comes back as the caller's, as from an eager call.
            buffers.checkpoint[:sequences].copy_(checkpoint_state)
        if self._cu_source is not cu_seqlens:
            buffers.cu_seqlens[: sequences + 1].copy_(cu_seqlens)
            # The empty last sequence: it ends where the call's last one does.
            buffers.cu_seqlens[sequences + 1 : sequences + 2].copy_(cu_seqlens[sequences:])
            self._cu_source = cu_seqlens
        if checkpoints and self._offsets_source is not checkpoint_offsets:
            buffers.offsets[:sequences].copy_(checkpoint_offsets)
            buffers.offsets[sequences : sequences + 1].zero_()  # the empty one exports nothing
            self._offsets_source = checkpoint_offsets
        replay = self._graphs.get(key)
        if replay is None:
            replay = self._record(key, buffers, A_log, dt_bias)
            self._graphs[key] = replay
        replay()
        out.copy_(buffers.out[:, :tokens])
        final_state.copy_(buffers.final[:sequences])
        if checkpoints and checkpoint_state is not None:
            checkpoint_state.copy_(buffers.checkpoint[:sequences])
        return True

    def _record(
        self, key: _Key, buffers: _Buffers, A_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> Callable[[], None]:
        bucket, n = key.tokens, key.sequences + 1
        heads = buffers.q.shape[2]
        workspace = buffers.workspace[: int(self._workspace_size(bucket, heads, n))]
        views = [x[:, :bucket] for x in (buffers.q, buffers.k, buffers.v, buffers.g, buffers.beta)]
        out = buffers.out[:, :bucket]
        checkpoint = buffers.checkpoint[:n] if key.checkpoints else None
        offsets = buffers.offsets[:n] if key.checkpoints else None
        initial, final, cu = buffers.initial[:n], buffers.final[:n], buffers.cu_seqlens[: n + 1]

        def call() -> None:
            self._fwd(
                *views, key.scale, out, workspace, A_log, dt_bias, key.lower_bound, initial,
                final, cu, checkpoint, offsets,
            )  # fmt: skip

        capture = self._capture
        if capture is None:
            capture = self._capture = cuda_capture(torch.cuda.graph_pool_handle())
        return capture(call)

    def _buffers_for(self, q: torch.Tensor, v: torch.Tensor) -> _Buffers:
        """The static buffers for this layout (allocated on first use; a new layout, device or
        dtype drops every graph, whose addresses would be stale)."""
        buffers = self._buffers
        heads, key_dim, value_dim = q.shape[2], q.shape[3], v.shape[3]
        if (
            buffers is not None
            and buffers.q.device == q.device
            and buffers.q.dtype == q.dtype
            and buffers.q.shape[2:] == q.shape[2:]
            and buffers.v.shape[3] == value_dim
        ):
            return buffers
        self._graphs.clear()
        self._cu_source = self._offsets_source = None
        tokens, n = self.max_tokens, self.max_sequences + 1
        device, dtype = q.device, q.dtype

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        states = (n, heads, value_dim, key_dim)
        workspace = max(
            int(self._workspace_size(bucket, heads, sequences + 1))
            for bucket in range(self.bucket_tokens, tokens + 1, self.bucket_tokens)
            for sequences in range(1, n)
        )
        buffers = _Buffers(
            q=zeros(1, tokens, heads, key_dim),
            k=zeros(1, tokens, heads, key_dim),
            v=zeros(1, tokens, heads, value_dim),
            g=zeros(1, tokens, heads, key_dim),
            beta=zeros(1, tokens, heads),
            out=zeros(1, tokens, heads, value_dim),
            initial=zeros(*states, dtype=torch.float32),
            final=zeros(*states, dtype=torch.float32),
            checkpoint=zeros(*states, dtype=torch.float32),
            cu_seqlens=zeros(n + 1, dtype=torch.int64),
            offsets=zeros(n, dtype=torch.int64),
            workspace=zeros(workspace, dtype=torch.uint8),
        )
        self._buffers = buffers
        return buffers
