"""The FlashKDA backends: ``flashkda`` (``flash_kda.fwd``) and ``flashkda-op`` (vLLM's build).

FlashKDA (MoonshotAI, CUTLASS, SM90+) runs the bounded gate only, with K = V = 128, bf16 inputs
and a ``[N, H, V, K]`` state (fp32 here). Its chunk is 16 tokens, so A = 16.

- ``flashkda``: ``flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
  initial_state, final_state, cu_seqlens)`` has no checkpoint argument. Checkpoints come from
  chaining segments: every segment round of the plan is one packed varlen call whose fp32 final
  states go to their slots (``chaining``). Any callable with that signature can be passed as
  ``fwd``; :meth:`FlashKDAOpBackend.fwd_without_checkpoints` provides one built on vLLM's op,
  which is how this path is exercised where the ``flash_kda`` package cannot load.
- ``flashkda-op``: ``torch.ops._flashkda_C.fwd`` from the ``_flashkda_C.abi3.so`` shipped inside
  the vLLM wheel, loaded from ``library`` or the ``PREFIXCACHE_FLASHKDA_LIB`` environment
  variable. It takes ``checkpoint_state`` ``[N, H, V, K]`` and ``checkpoint_offsets`` ``[N]``: one
  checkpoint per sequence per call, written to a dense staging tensor that this backend then
  copies into the slots. Rows with more checkpoints are chained, each call exporting one interior
  checkpoint and ending at the next. The op silently skips an offset off its 16-grid; the plan
  check refuses such offsets first.

In both, the rows of one query token (decode rows) take one step of the Triton decode kernel
instead (``kda_decode_triton``: their states read from and written to their slots in place, no
state moves, no chunked call for them), and a round's states go straight between the cache and
the kernel where its slots are consecutive (``chaining``): a prefill row beside decode rows
moves no state at all.

Measured on the H200 (docs/BENCHMARKS.md): FlashKDA's results do not depend on the packing or on
the checkpoint arguments, and an in-kernel checkpoint equals the prefix run's final state bit for
bit; but a run resumed from a state differs from the uninterrupted run by about one bf16 ulp in
its outputs. So ``flashkda-op`` matches split forwards in its checkpoints exactly and in outputs
and final states to that rounding, and ``flashkda`` (which always chains) matches split forwards
exactly but an unsplit run only to that rounding. With one checkpoint per sequence
``flashkda-op`` runs in place (+1% over no export); a second checkpoint costs a second call whose
tokens are gathered when the batch has several rows.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .backend import KDABackend, require_cuda
from .chaining import SegmentBatch, plan_rounds, run_rounds
from .errors import BackendUnavailableError, UnsupportedLayerError
from .kda_decode_triton import kda_decode_triton, one_token_rows
from .params import KDALayerParams
from .plan import StatePlan

__all__ = [
    "LIBRARY_ENV",
    "FlashKDABackend",
    "FlashKDAFwd",
    "FlashKDAOpBackend",
    "load_flashkda_op",
]

LIBRARY_ENV = "PREFIXCACHE_FLASHKDA_LIB"
FLASHKDA_CHUNK = 16
SM90 = (9, 0)

# flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
#               initial_state=None, final_state=None, cu_seqlens=None) -> None
FlashKDAFwd = Callable[..., None]


def _check_flashkda_layer(
    backend: str, params: KDALayerParams, dtype: torch.dtype, device: torch.device
) -> None:
    if device.type != "cuda":
        raise UnsupportedLayerError(f"backend {backend!r} runs on CUDA tensors, got {device}")
    if params.lower_bound is None:
        raise UnsupportedLayerError(
            f"backend {backend!r} runs the bounded gate only (lower_bound set); this layer "
            f"uses the softplus gate: use 'fla' or 'torch'"
        )
    if not -5.0 <= params.lower_bound <= 0:
        raise UnsupportedLayerError(
            f"FlashKDA needs -5 <= lower_bound <= 0, got {params.lower_bound}"
        )
    if params.head_dim_k != 128 or params.head_dim_v != 128:
        raise UnsupportedLayerError(
            f"FlashKDA needs K = V = 128, got K = {params.head_dim_k}, V = {params.head_dim_v}"
        )
    if dtype != torch.bfloat16:
        raise UnsupportedLayerError(f"FlashKDA takes bf16 inputs, got {dtype}")


def _lower_bound(params: KDALayerParams) -> float:
    if params.lower_bound is None:
        raise UnsupportedLayerError("FlashKDA runs the bounded gate only (lower_bound set)")
    return float(params.lower_bound)


def _buffer(given: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Where a call writes: the destination the round gave it, else a new tensor like ``like``."""
    return torch.empty_like(like) if given is None else given


class _SegmentedFlashKDA(KDABackend):
    """What both FlashKDA backends share: the layer check and the segment-round driver. A
    subclass says how many interior checkpoints one kernel call writes per row and makes the
    call (``_call``)."""

    #: Interior checkpoints one call writes per row (0: states only at call boundaries).
    checkpoints_per_call = 0

    def check_layer(self, params: KDALayerParams, dtype: torch.dtype, device: torch.device) -> None:
        """Bounded gate, K = V = 128, bf16, CUDA."""
        _check_flashkda_layer(self.name, params, dtype, device)

    @abstractmethod
    def _call(
        self, params: KDALayerParams, batch: SegmentBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One kernel call over a packed segment round: (output, final states, checkpoints)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        params: KDALayerParams,
        recurrent: torch.Tensor,
        plan: StatePlan,
    ) -> torch.Tensor:
        """See :meth:`KDABackend.forward`. Rows of one token take one step of the Triton decode
        kernel, in place in the cache (``kda_decode_triton``); the other rows are chained over
        segment rounds, each round one packed varlen call."""
        g = g.to(q.dtype)  # contiguous already (run_prefill), and so after a conversion
        beta = beta.to(q.dtype)
        single, other = one_token_rows(plan)
        out = torch.empty_like(v)
        if other:
            rounds = plan_rounds(plan, per_call=self.checkpoints_per_call, rows=other)
            run_rounds(
                plan, rounds, q, k, v, g, beta, recurrent,
                lambda batch: self._call(params, batch), out=out,
            )  # fmt: skip
        if single:
            # After the rounds: the decode kernel's launch (host work) then overlaps the
            # recurrence's GPU work instead of delaying its start. The two touch disjoint rows
            # and slots (the plan check: no slot a step writes is one it reads), so either
            # order gives the same results. run_prefill has checked the layer's tensors,
            # check_layer its K = V = 128.
            kda_decode_triton(q, k, v, g, beta, params, recurrent, plan, out, checked=True)
        return out


class FlashKDABackend(_SegmentedFlashKDA):
    """``flash_kda.fwd`` with segment chaining (``get_backend("flashkda", fwd=None)``)."""

    name = "flashkda"

    def __init__(self, fwd: FlashKDAFwd | None = None) -> None:
        if fwd is None:
            require_cuda(self.name, SM90)
            try:
                import flash_kda
            except ImportError as error:
                raise BackendUnavailableError(
                    f"backend 'flashkda' needs the flash_kda package (PyPI tokenspeed-flashkda, "
                    f"built for this torch {torch.__version__}): {error}"
                ) from error
            fwd = flash_kda.fwd
        self._fwd: FlashKDAFwd = fwd
        self.checkpoint_alignment = FLASHKDA_CHUNK
        self.max_checkpoints_per_step = None

    def _call(
        self, params: KDALayerParams, batch: SegmentBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out = _buffer(batch.out, batch.v)
        final = _buffer(batch.final_state, batch.initial_state)
        self._fwd(
            batch.q,
            batch.k,
            batch.v,
            batch.g,
            batch.beta,
            batch.q.shape[-1] ** -0.5,
            out,
            params.A_log.float(),
            params.dt_bias.float(),
            _lower_bound(params),
            initial_state=batch.initial_state,
            final_state=final,
            cu_seqlens=batch.cu_seqlens,
        )
        return out, final, None


def load_flashkda_op(library: str | os.PathLike[str] | None = None) -> Any:
    """Load vLLM's ``_flashkda_C`` library and return ``torch.ops._flashkda_C``.

    ``library`` defaults to ``$PREFIXCACHE_FLASHKDA_LIB``. Raises ``BackendUnavailableError``
    naming what is missing.
    """
    namespace = torch.ops._flashkda_C
    try:
        namespace.fwd  # noqa: B018 - already registered (loaded once per process)
        return namespace
    except (AttributeError, RuntimeError):
        pass
    path = library if library is not None else os.environ.get(LIBRARY_ENV)
    if not path:
        raise BackendUnavailableError(
            f"backend 'flashkda-op' needs vLLM's _flashkda_C.abi3.so: pass library=... or set "
            f"{LIBRARY_ENV} (the file is inside the vllm==0.33.0 wheel, vllm/_flashkda_C.abi3.so)"
        )
    if not Path(path).is_file():
        raise BackendUnavailableError(f"{LIBRARY_ENV} / library points to no file: {path}")
    try:
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
        namespace.fwd  # noqa: B018
    except (OSError, AttributeError, RuntimeError) as error:
        raise BackendUnavailableError(
            f"could not load the FlashKDA op from {path} with torch {torch.__version__}: {error}"
        ) from error
    schema = str(namespace.fwd.default._schema)
    if "checkpoint_offsets" not in schema:
        raise BackendUnavailableError(
            f"the FlashKDA op in {path} has no checkpoint arguments (schema: {schema})"
        )
    return namespace


class FlashKDAOpBackend(_SegmentedFlashKDA):
    """vLLM's FlashKDA op with one checkpoint per call (``get_backend("flashkda-op")``)."""

    name = "flashkda-op"
    checkpoints_per_call = 1

    def __init__(self, library: str | os.PathLike[str] | None = None) -> None:
        device = require_cuda(self.name, SM90)
        if torch.cuda.get_device_capability(device)[0] != 9:
            raise BackendUnavailableError(
                "backend 'flashkda-op' is vLLM's sm_90a build: it runs on SM90 (H100/H200) only"
            )
        self._ops = load_flashkda_op(library)
        self.checkpoint_alignment = FLASHKDA_CHUNK
        self.max_checkpoints_per_step = None

    # The op's scratch memory, kept between calls: every KDA layer of a step asks for the same
    # size, so a step sizes it once and allocates it at most once (calls run in stream order on
    # one device, so none can overwrite another's scratch while it runs).
    _workspace_key: tuple[int, int, int] | None = None
    _workspace_size = 0
    _workspace: torch.Tensor | None = None

    def _scratch(self, q: torch.Tensor, sequences: int) -> torch.Tensor:
        """A uint8 workspace of at least the size the op needs for ``q`` and ``sequences``."""
        key = (q.shape[0] * q.shape[1], q.shape[2], sequences)
        if key != self._workspace_key:
            self._workspace_size = int(self._ops.get_workspace_size(*key))
            self._workspace_key = key
        workspace = self._workspace
        if (
            workspace is None
            or workspace.numel() < self._workspace_size
            or workspace.device != q.device
        ):
            workspace = torch.empty(self._workspace_size, dtype=torch.uint8, device=q.device)
            self._workspace = workspace
        return workspace[: self._workspace_size]

    def _run(
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
        initial_state: torch.Tensor | None,
        final_state: torch.Tensor | None,
        cu_seqlens: torch.Tensor,
        checkpoint_state: torch.Tensor | None = None,
        checkpoint_offsets: torch.Tensor | None = None,
    ) -> None:
        workspace = self._scratch(q, cu_seqlens.shape[0] - 1)
        self._ops.fwd(
            q, k, v, g, beta, float(scale), out, workspace, A_log, dt_bias, float(lower_bound),
            initial_state, final_state, cu_seqlens, checkpoint_state, checkpoint_offsets,
        )  # fmt: skip

    def fwd_without_checkpoints(self) -> FlashKDAFwd:
        """A callable with ``flash_kda.fwd``'s signature, running this op without checkpoints.

        Use it as ``FlashKDABackend(fwd=...)`` to exercise the segment-chaining path where the
        ``flash_kda`` package cannot load.
        """

        def fwd(
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
            initial_state: torch.Tensor | None = None,
            final_state: torch.Tensor | None = None,
            cu_seqlens: torch.Tensor | None = None,
        ) -> None:
            if cu_seqlens is None:
                cu_seqlens = torch.arange(
                    0, (q.shape[0] + 1) * q.shape[1], q.shape[1], device=q.device
                )
                q, k, v, g, beta, out = (
                    x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v, g, beta, out)
                )
            self._run(
                q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                initial_state, final_state, cu_seqlens,
            )  # fmt: skip

        return fwd

    def _call(
        self, params: KDALayerParams, batch: SegmentBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out = _buffer(batch.out, batch.v)
        final = _buffer(batch.final_state, batch.initial_state)
        staging = None
        if batch.checkpoint_offsets is not None:
            staging = _buffer(batch.checkpoint_state, batch.initial_state)
        self._run(
            batch.q, batch.k, batch.v, batch.g, batch.beta, batch.q.shape[-1] ** -0.5, out,
            params.A_log.float(), params.dt_bias.float(), _lower_bound(params),
            batch.initial_state, final, batch.cu_seqlens, staging, batch.checkpoint_offsets,
        )  # fmt: skip
        return out, final, staging
