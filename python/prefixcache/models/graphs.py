"""CUDA graphs for decode-only steps: one captured graph per row count and context bucket.

A decode step of the Kimi-K3 proxy is launch bound: its eager forward costs the host about three
times the GPU's work (several hundred small launches for a few milliseconds of GPU time). As
vLLM does, a step whose rows all have one query token is replayed from a CUDA graph instead:

- **What a graph is keyed by** (:func:`decode_graph_key`): the number of rows R (every size from
  1 to ``max_rows`` is its own graph, so no row is padding and nothing writes a slot no step
  owns) and the context bucket of the longest row (``kernels.decode_attention.context_bucket``:
  the split-K decode kernel launches the same grid for every step in a bucket, eager or graph),
  which also fixes the block tables' columns. A step qualifies when its rows are one token each,
  it samples every row in order, every row reads an existing state (no ``-1`` initial slot), it
  has no checkpoints and every KV slot is in range; any other step runs eagerly.
- **Static inputs** (:class:`StaticInputs`): the token ids (a device-to-device copy, so the
  overlapped worker's ids never visit the host), and in one pinned buffer uploaded without a
  stall, the KV slots, the state slots read and written, the context lengths and the block
  tables. Every index tensor the layers read is a view of these buffers: the Triton convolution's
  and the KDA decode kernel's index arrays are bound to them (``kernels.conv_triton.bind_index``,
  ``kernels.kda_decode_triton.bind_decode_inputs``), the attention layers' slots and decode rows
  too. A replay therefore reads the step being replayed, never the one captured.
- **Capture** happens at a key's first step: one eager warm-up run of that very step on a side
  stream (compiles kernels, sizes workspaces), the running states it wrote restored from a copy
  (so that the step's states advance once even where a row read a slot another row writes),
  then the capture, then the replay that computes the step. The graphs share one memory pool
  and return a copy of their logits. They hold the addresses of one caches object (not the
  object: a finished run's caches are freed with it); other caches start a new set. Runs that
  share one set of caches (``HybridModel.reusing_caches``: the simulator's warm pass and
  measured runs) share the graphs too, so a measured run captures nothing.

Not captured: the step's copy-on-write copies (before) and snapshots (after) run eagerly around
the replay; the KDA timer (a timed step runs eagerly). CUDA only, with the FlashKDA backends,
the Triton convolution and the Triton decode attention; elsewhere the model runs eagerly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ..kernels.conv_triton import bind_index
from ..kernels.decode_attention import DecodeRows, context_bucket
from ..kernels.kda_decode_triton import bind_decode_inputs
from ..kernels.plan import StatePlan

if TYPE_CHECKING:
    from .hybrid import HybridModel, ModelCaches

__all__ = [
    "DEFAULT_MAX_ROWS",
    "GRAPH_BACKENDS",
    "DecodeGraphKey",
    "DecodeGraphs",
    "StaticInputs",
    "decode_graph_key",
    "graphs_unavailable_reason",
]

#: The largest decode step replayed from a graph (rows); larger steps run eagerly.
DEFAULT_MAX_ROWS = 32
#: The kernel backends whose decode path the graphs bind (their one-token rows go through
#: ``kernels.kda_decode_triton``).
GRAPH_BACKENDS = ("flashkda-op", "flashkda")


class DecodeGraphKey(NamedTuple):
    """What one captured graph serves: ``rows`` decode rows whose longest context falls in
    ``context`` (a bucket), with block tables of ``columns`` entries."""

    rows: int
    context: int
    columns: int


def graphs_unavailable_reason(model: HybridModel) -> str | None:
    """Why ``model`` cannot replay decode steps from CUDA graphs, or ``None`` when it can."""
    if model.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {model.device}"
    if model.backend.name not in GRAPH_BACKENDS:
        return (
            f"CUDA graphs bind the FlashKDA backends' decode inputs "
            f"({', '.join(GRAPH_BACKENDS)}), the model runs {model.backend.name!r}"
        )
    if getattr(model.backend, "conv_impl", None) != "triton":
        return "CUDA graphs bind the Triton convolution's inputs (conv 'triton')"
    if model.decode_attention != "triton":
        return "CUDA graphs bind the Triton decode attention's inputs (decode_attention 'triton')"
    return None


def decode_graph_key(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    logits_indices: np.ndarray,
    initial_slot: np.ndarray,
    num_checkpoints: int,
    *,
    block_size: int,
    max_rows: int,
) -> DecodeGraphKey | None:
    """The graph a step replays from, or ``None`` when it runs eagerly (module docstring):
    1 to ``max_rows`` rows of one token each, every row sampled in order, every initial state
    present, no checkpoints."""
    loc = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    rows = loc.shape[0] - 1
    if rows < 1 or rows > max_rows or num_checkpoints:
        return None
    if not np.array_equal(loc, np.arange(rows + 1)):
        return None
    if not np.array_equal(np.asarray(logits_indices).reshape(-1), np.arange(rows)):
        return None
    initial = np.asarray(initial_slot).reshape(-1)
    if initial.shape[0] != rows or int(initial.min()) < 0:
        return None
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if lens.shape[0] != rows or int(lens.min()) < 1:
        return None
    context = context_bucket(int(lens.max()))
    return DecodeGraphKey(rows=rows, context=context, columns=-(-context // block_size))


class StaticInputs:
    """A graph's host-filled inputs: one int64 buffer on the host (pinned on CUDA) and its copy
    on the device, laid out as KV slots, initial slots, running slots and context lengths
    (``rows`` each), then the block tables (``rows x columns``, zero-padded)."""

    def __init__(self, rows: int, columns: int, device: torch.device) -> None:
        self.rows, self.columns = rows, columns
        size = 4 * rows + rows * columns
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        parts = torch.split(self.device_buffer, [rows, rows, rows, rows, rows * columns])
        self.slots, self.initial, self.running, self.lens = parts[:4]
        self.tables = parts[4].view(rows, columns)
        self._uploaded: Any = None  # the CUDA event after the last upload

    def pack(
        self,
        slots: np.ndarray,
        initial: np.ndarray,
        running: np.ndarray,
        lens: np.ndarray,
        tables: np.ndarray,
    ) -> None:
        """Write one step's values into the host buffer (after the previous upload of it has
        run). ``tables`` ``[rows, C]``: the first ``min(C, columns)`` entries of each row are
        kept, the rest of the row zeroed; the caller has checked that each row's context fits
        in ``columns`` blocks."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        rows, columns = self.rows, self.columns
        host = self.host.numpy()
        host[0:rows] = slots
        host[rows : 2 * rows] = initial
        host[2 * rows : 3 * rows] = running
        host[3 * rows : 4 * rows] = lens
        table = host[4 * rows :].reshape(rows, columns)
        width = min(columns, tables.shape[1])
        table[:, :width] = tables[:, :width]
        table[:, width:] = 0

    def upload(self) -> None:
        """Copy the host buffer to the device buffer (stream-ordered, no host stall on CUDA)."""
        cuda = self.device_buffer.device.type == "cuda"
        self.device_buffer.copy_(self.host, non_blocking=cuda)
        if cuda:
            self._uploaded = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._uploaded.record()


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: StaticInputs
    tokens: torch.Tensor
    logits: torch.Tensor
    # Everything else the captured kernels read (constants, the plan holding the bound index
    # tensors): a graph replays raw addresses, so what they point to must outlive it.
    keep: tuple[Any, ...]


class DecodeGraphs:
    """The captured decode graphs of one model (see the module docstring).

    ``captures`` / ``replays`` count what happened since the object was made.
    """

    def __init__(self, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.captures = 0
        self.replays = 0
        self._graphs: dict[DecodeGraphKey, _Graph] = {}
        # The caches the graphs were captured on, weakly: a finished run's caches are freed
        # with it (its graphs are never replayed again, and go at the next run's first step).
        self._caches: weakref.ref[ModelCaches] | None = None
        self._pool: Any = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(
        self,
        model: HybridModel,
        key: DecodeGraphKey,
        token_ids: torch.Tensor,
        caches: ModelCaches,
        host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> torch.Tensor:
        """The logits of the decode step ``host`` describes (``(slots, initial, running, lens,
        tables)``, checked by the caller), replayed from ``key``'s graph (captured first if
        needed)."""
        if self._caches is None or self._caches() is not caches:
            # Graphs hold the addresses of one run's caches: new caches, new graphs.
            self._graphs.clear()
            self._caches = weakref.ref(caches)
            self._pool = torch.cuda.graph_pool_handle()
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(model, key, token_ids, caches, host)
            self._graphs[key] = entry
            self.captures += 1
        else:
            entry.inputs.pack(*host)
            entry.inputs.upload()
            entry.tokens.copy_(token_ids)
        entry.graph.replay()
        self.replays += 1
        return entry.logits.clone()

    def _capture(
        self,
        model: HybridModel,
        key: DecodeGraphKey,
        token_ids: torch.Tensor,
        caches: ModelCaches,
        host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> _Graph:
        rows = key.rows
        inputs = StaticInputs(rows, key.columns, model.device)
        # The kernels key what they derive from a plan by their tensors' device, which names
        # its index ("cuda:0" where the model may say "cuda").
        device = inputs.device_buffer.device
        inputs.pack(*host)
        inputs.upload()
        tokens = token_ids.detach().clone()
        positions = torch.arange(rows + 1, dtype=torch.int64, device=device)
        token_index = torch.arange(rows, dtype=torch.int32, device=device)
        ones = torch.ones(rows, dtype=torch.int64, device=device)
        plan = StatePlan(
            query_start_loc=tuple(range(rows + 1)),
            initial_slot=(0,) * rows,
            running_slot=tuple(range(rows)),
            checkpoints=((),) * rows,
        )
        bind_index(
            plan,
            device,
            query_start_loc=positions,
            initial=inputs.initial,
            cut_rows=positions[:rows],
            cut_offsets=ones,
            cut_slots=inputs.running,
        )
        bind_decode_inputs(
            plan, device, token=positions[:rows], initial=inputs.initial, running=inputs.running
        )
        host_loc = np.arange(rows + 1, dtype=np.int64)
        host_lens = np.full(rows, key.context, dtype=np.int64)
        host_tables = np.zeros((rows, key.columns), dtype=np.int32)

        def body() -> torch.Tensor:
            decode = DecodeRows(
                rows=np.arange(rows),
                token_index=token_index,
                block_tables=inputs.tables.to(torch.int32),
                seq_lens=inputs.lens.to(torch.int32),
                max_seq_len=key.context,
                block_size=caches.block_size,
            )
            return model.forward_layers(
                tokens,
                caches,
                plan=plan,
                slot_mapping=inputs.slots,
                slots_checked=True,
                block_tables=host_tables,
                seq_lens=host_lens,
                query_start_loc=host_loc,
                decode=decode,
                logits_index=positions[:rows],
            )

        graph = _capture_graph(body, caches, inputs.running, self._pool)
        return _Graph(
            graph=graph[0],
            inputs=inputs,
            tokens=tokens,
            logits=graph[1],
            keep=(positions, token_index, ones, plan),  # not body: it holds the caches
        )


def _capture_graph(
    body: Callable[[], torch.Tensor],
    caches: ModelCaches,
    running: torch.Tensor,
    pool: Any,
) -> tuple[Any, torch.Tensor]:
    """Warm ``body`` up once on a side stream (it runs the real step), put back the running
    states it wrote, and capture it; returns ``(graph, its logits buffer)``."""
    saved = [
        (cache.conv.index_select(0, running), cache.recurrent.index_select(0, running))
        for cache in caches.states
    ]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    for cache, (conv, recurrent) in zip(caches.states, saved, strict=True):
        cache.conv.index_copy_(0, running, conv)
        cache.recurrent.index_copy_(0, running, recurrent)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the overlapped engine's host thread may wait on events meanwhile.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        logits = body()
    return graph, logits
