"""Backend selection by name: ``get_backend(name)``, name one of ``BACKEND_NAMES`` or ``"auto"``.

``"auto"`` tries, in order, ``flashkda-op`` (the fastest, with in-kernel checkpoints), ``flashkda``,
``fla`` and ``torch`` (always available), skips any that is unavailable here or (when ``params``
is given) cannot run that layer, and logs on the ``prefixcache.kernels`` logger which one it
picked and why the others were passed over. A backend requested by name that cannot be built
raises :class:`BackendUnavailableError` naming the missing package, library or GPU capability.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .backend import KDABackend
from .errors import BackendUnavailableError, UnsupportedLayerError
from .params import KDALayerParams

__all__ = ["AUTO_ORDER", "BACKEND_NAMES", "available_backends", "get_backend"]

logger = logging.getLogger("prefixcache.kernels")

BACKEND_NAMES = ("torch", "fla", "flashkda", "flashkda-op")
AUTO_ORDER = ("flashkda-op", "flashkda", "fla", "torch")


def _build(name: str, options: dict[str, Any]) -> KDABackend:
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(**options)
    if name == "fla":
        from .fla_backend import FlaBackend

        return FlaBackend(**options)
    if name == "flashkda":
        from .flashkda import FlashKDABackend

        return FlashKDABackend(**options)
    if name == "flashkda-op":
        from .flashkda import FlashKDAOpBackend

        return FlashKDAOpBackend(**options)
    raise ValueError(
        f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)} or 'auto'"
    )


def get_backend(
    name: str = "auto",
    *,
    params: KDALayerParams | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> KDABackend:
    """Build the backend called ``name`` with ``options`` (its constructor's keywords).

    With ``"auto"``, ``options`` may only hold ``library`` (for ``flashkda-op``); ``params`` and
    ``dtype`` (the layer's input dtype, bf16 by default) restrict the choice to backends that can
    run that layer.
    """
    if name != "auto":
        return _build(name, options)
    unknown = set(options) - {"library"}
    if unknown:
        raise ValueError(f"'auto' takes only the option 'library', got {sorted(unknown)}")
    passed: list[str] = []
    for candidate in AUTO_ORDER:
        candidate_options = dict(options) if candidate == "flashkda-op" else {}
        try:
            backend = _build(candidate, candidate_options)
        except BackendUnavailableError as error:
            passed.append(f"{candidate}: {error}")
            continue
        if params is not None and candidate != "torch":
            device = torch.device("cuda", torch.cuda.current_device())
            try:
                backend.check_layer(params, dtype or torch.bfloat16, device)
            except UnsupportedLayerError as error:
                passed.append(f"{candidate}: {error}")
                continue
        logger.info(
            "kernel backend 'auto' chose %r (checkpoint_alignment=%d, max_checkpoints_per_step=%s)"
            "%s",
            candidate,
            backend.checkpoint_alignment,
            backend.max_checkpoints_per_step,
            "; passed over: " + "; ".join(passed) if passed else "",
        )
        return backend
    raise BackendUnavailableError("no kernel backend available: " + "; ".join(passed))


def available_backends(**options: Any) -> dict[str, str | None]:
    """Each backend name mapped to ``None`` when it can be built here, else the reason."""
    result: dict[str, str | None] = {}
    for name in BACKEND_NAMES:
        try:
            _build(name, dict(options) if name == "flashkda-op" else {})
            result[name] = None
        except BackendUnavailableError as error:
            result[name] = str(error)
    return result
