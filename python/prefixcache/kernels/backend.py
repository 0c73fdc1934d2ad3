"""The backend interface: what every KDA kernel backend declares, checks and runs.

A backend declares ``checkpoint_alignment`` (A: interior checkpoint offsets must be multiples of
it) and ``max_checkpoints_per_step`` (C: interior checkpoints per sequence per step; ``None`` =
unbounded). The Rust core's State group is configured from these two attributes
(:meth:`KDABackend.state_group_config`), so the planner and the kernels cannot drift apart; and
every plan a backend receives goes through :meth:`KDABackend.check_plan`, which raises on anything
the backend would not execute exactly.

A backend runs the recurrence part of a KDA layer (:meth:`KDABackend.forward`): post-conv
``q, k, v``, raw gate input and raw beta, reading each row's initial state from the cache and
writing every cut's state into its slot. The short convolution and its conv windows are shared
by all backends: ``conv.causal_conv`` (torch) or, when a backend's ``conv_impl`` is
``"triton"``, ``conv_triton.causal_conv_triton`` (one Triton launch; CUDA tensors, or CPU tensors
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Literal, get_args

import torch

from ._convert import ArrayLike, to_device
from .errors import BackendUnavailableError
from .params import KDALayerParams
from .plan import StatePlan
from .rows_triton import default_row_copy
from .validate import check_state_plan

ConvImpl = Literal["torch", "triton"]
#: The short-convolution implementations a backend can run (``KDABackend.conv_impl``).
CONV_IMPLS: tuple[ConvImpl, ...] = get_args(ConvImpl)

__all__ = [
    "CONV_IMPLS",
    "ConvImpl",
    "KDABackend",
    "read_states",
    "read_states_at",
    "require_cuda",
    "upload",
    "write_states",
    "write_states_at",
]


class KDABackend(ABC):
    """Base class of the KDA kernel backends (``torch``, ``fla``, ``flashkda``, ``flashkda-op``)."""

    name: ClassVar[str]
    checkpoint_alignment: int
    max_checkpoints_per_step: int | None
    #: Which short-convolution implementation runs before the recurrence ("torch" or
    #: "triton"); set it on an instance to switch.
    conv_impl: ConvImpl = "torch"

    def state_group_config(self) -> dict[str, int | None]:
        """The two attributes the Rust State group is built from."""
        return {
            "checkpoint_alignment": self.checkpoint_alignment,
            "max_checkpoints_per_step": self.max_checkpoints_per_step,
        }

    def check_plan(
        self,
        *,
        query_start_loc: ArrayLike,
        initial_slot: ArrayLike,
        running_slot: ArrayLike,
        checkpoint_offsets: ArrayLike | None = None,
        checkpoint_slots: ArrayLike | None = None,
        num_slots: int,
        num_tokens: int | None = None,
    ) -> StatePlan:
        """Validate plan arrays against this backend's A and C (raises ``KernelPlanError``)."""
        return check_state_plan(
            query_start_loc=query_start_loc,
            initial_slot=initial_slot,
            running_slot=running_slot,
            checkpoint_offsets=checkpoint_offsets,
            checkpoint_slots=checkpoint_slots,
            num_slots=num_slots,
            alignment=self.checkpoint_alignment,
            max_checkpoints=self.max_checkpoints_per_step,
            num_tokens=num_tokens,
            backend=self.name,
        )

    @abstractmethod
    def check_layer(self, params: KDALayerParams, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``UnsupportedLayerError`` when this backend cannot run such a layer (inputs of
        ``dtype`` on ``device``)."""

    @abstractmethod
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
        """Run the recurrence over a packed batch and store the states the plan asks for.

        ``q``, ``k`` ``[T, H, K]`` and ``v`` ``[T, H, V]`` are post-conv, ``g`` ``[T, H, K]`` is
        the raw gate input and ``beta`` ``[T, H]`` the raw beta logits, all five contiguous
        (``run_prefill`` makes them so).
        ``recurrent`` is the ``StateCache.recurrent`` tensor; ``plan`` was validated by this
        backend. Reads every row's initial state before writing any slot, writes each
        checkpoint's state and then each running state, and touches no other slot.
        Returns ``o`` ``[T, H, V]`` in ``v``'s dtype.
        """

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(checkpoint_alignment={self.checkpoint_alignment}, "
            f"max_checkpoints_per_step={self.max_checkpoints_per_step})"
        )


def upload(device: torch.device, *arrays: Sequence[int] | torch.Tensor) -> list[torch.Tensor]:
    """Int64 tensors on ``device`` of ``arrays`` (lists or host tensors), in one host-to-device
    copy.

    Each launch-side index array of a step costs host time; one copy instead of many keeps the
    kernels' Python wrapper cheaper than the kernels. Pass long arrays as tensors (building
    them from Python lists costs more than the copy).
    """
    parts = [torch.as_tensor(array, dtype=torch.int64).reshape(-1) for array in arrays]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return list(torch.split(to_device(flat, device), [part.numel() for part in parts]))


def read_states_at(
    recurrent: torch.Tensor, index: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """States ``[n, H, V, K]`` at device ``index`` (a copy, in ``dtype``); entries ``-1`` give
    zero states (``rows_triton``'s move)."""
    states = recurrent.new_empty((index.numel(), *recurrent.shape[1:]), dtype=dtype)
    default_row_copy(recurrent.device)(recurrent, states, src_index=index)
    return states


def write_states_at(
    recurrent: torch.Tensor,
    index: torch.Tensor,
    states: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Store ``states`` ``[n, H, V, K]`` at device ``index`` (distinct), converting the dtype;
    with ``rows``, store ``states[rows[i]]`` at ``index[i]``."""
    if index.numel():
        default_row_copy(recurrent.device)(states, recurrent, src_index=rows, dst_index=index)


def read_states(recurrent: torch.Tensor, slots: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """States ``[n, H, V, K]`` of ``slots`` in ``dtype``, zeros where a slot is -1 (a copy)."""
    (index,) = upload(recurrent.device, slots)
    return read_states_at(recurrent, index, dtype)


def write_states(recurrent: torch.Tensor, slots: Sequence[int], states: torch.Tensor) -> None:
    """Store ``states`` ``[n, H, V, K]`` into ``slots`` (distinct), converting the dtype."""
    if slots:
        (index,) = upload(recurrent.device, slots)
        write_states_at(recurrent, index, states)


def require_cuda(backend: str, capability: tuple[int, int] | None = None) -> torch.device:
    """The current CUDA device, or ``BackendUnavailableError`` naming what is missing.

    ``capability`` is the minimum compute capability, e.g. ``(9, 0)`` for SM90.
    """
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"backend {backend!r} needs a CUDA GPU; torch {torch.__version__} sees none"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    if capability is not None:
        found = torch.cuda.get_device_capability(device)
        if found < capability:
            name = torch.cuda.get_device_name(device)
            raise BackendUnavailableError(
                f"backend {backend!r} needs compute capability >= {capability[0]}.{capability[1]}"
                f"; {name} has {found[0]}.{found[1]}"
            )
    return device
