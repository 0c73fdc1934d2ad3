"""Exceptions raised by the kernel layer.

Every failure the kernel layer detects before touching a cache is a :class:`KernelError`, so an
engine can catch one class. A plan that a backend would not execute exactly as written (an offset
off its grid, a slot out of range, a slot written twice) is a :class:`KernelPlanError`: the kernels
never silently drop part of a plan, because a checkpoint block that was allocated but not written
would later be served as a cached state.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "KernelError",
    "KernelPlanError",
    "UnsupportedLayerError",
]


class KernelError(Exception):
    """Base class of every error raised by :mod:`prefixcache.kernels`."""


class KernelPlanError(KernelError, ValueError):
    """A step plan (or a snapshot / copy list) that the kernels refuse to execute.

    Raised before any cache slot is written, with a message naming the row, the value and the
    rule it breaks.
    """


class BackendUnavailableError(KernelError, RuntimeError):
    """A backend was selected whose package, library or GPU capability is missing here."""


class UnsupportedLayerError(KernelError, ValueError):
    """A backend cannot run a layer's configuration (gate kind, head size, dtype)."""
