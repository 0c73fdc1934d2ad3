"""Conversions of plan arrays (NumPy, torch or lists) into index tensors and Python lists.

Plan arrays come from the Rust core as NumPy arrays on the host. Validation reads them on the
host; kernels need them as int64 tensors on the cache's device, copied without waiting for the
GPU (a non-blocking copy from the array where it is, :func:`to_device`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ArrayLike", "as_host_tensor", "as_index_tensor", "index_where_it_is", "to_device"]

ArrayLike = torch.Tensor | np.ndarray | Sequence[int] | Sequence[Sequence[int]]


def as_host_tensor(array: ArrayLike, name: str) -> torch.Tensor:
    """``array`` as an integer tensor on the CPU (NumPy arrays are shared, not copied).

    Raises ``TypeError`` when the array is not of an integer dtype.
    """
    if isinstance(array, torch.Tensor):
        tensor = array.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
    elif isinstance(array, np.ndarray):
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{name} must have an integer dtype, got {array.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    else:
        tensor = torch.as_tensor(array, dtype=torch.int64)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {tensor.dtype}")
    return tensor


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a host tensor to ``device``; to a GPU by a non-blocking copy from pageable memory.

    The driver stages a pageable source before the copy call returns (the host tensor may then
    be freed or changed) and does not wait for the work queued on the stream. A copy through
    pinned memory (``Tensor.pin_memory()`` then a non-blocking copy) allocates from the caching
    host allocator and copies twice: on the H200 it took 16 to 29 us of host time a call for a
    step's index arrays (8 to 32,768 int64) with the GPU idle and 32 to 115 us with it busy,
    against 7 to 24 us and 13 to 58 us for the pageable copy (``benchmarks/gpu_uploads.py``,
    2026-12-02). Buffers reused across steps (the decode graphs' inputs) stay pinned where they
    are allocated."""
    if device.type == "cpu":
        return tensor
    if device.type == "cuda" and torch.cuda.is_available():
        return tensor.to(device, non_blocking=True)
    return tensor.to(device)


def as_index_tensor(array: ArrayLike, name: str, *, device: torch.device) -> torch.Tensor:
    """``array`` as a 1-D int64 tensor on ``device``."""
    if isinstance(array, torch.Tensor) and array.device == device:
        if array.dtype.is_floating_point or array.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype, got {array.dtype}")
        return array.reshape(-1).to(torch.int64)
    tensor = as_host_tensor(array, name).reshape(-1).to(torch.int64)
    return to_device(tensor, device)


def index_where_it_is(
    array: ArrayLike, name: str, device: torch.device
) -> tuple[torch.Tensor, bool]:
    """``array`` as a 1-D int64 tensor where it already is, and whether that is on ``device``
    (not the CPU): host indices (the plan's NumPy arrays) are checked on the host and uploaded
    afterwards with :func:`to_device`, so checking them does not synchronise the GPU."""
    if isinstance(array, torch.Tensor) and array.device.type != "cpu":
        return as_index_tensor(array, name, device=device), True
    return as_host_tensor(array, name).reshape(-1).to(torch.int64), False
