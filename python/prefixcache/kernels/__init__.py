"""prefixcache.kernels: the KDA / paged-KV kernel layer that executes a step plan.

It consumes the plan's NumPy arrays and writes recurrent states and KV into the block slots the
core hands out. It asks the core, through the typed API, for the one rule it checks plans
against (``prefixcache.is_exportable_offset``: which checkpoint offsets a kernel can write) and
imports neither the models nor the engine.

- The step: :class:`Step` (built from one step plan, ``Step.from_plan``): the copies, per
  paged group (:class:`PagedStep`) the slot mapping and block tables, per state group
  (:class:`StateStep`) the slots, checkpoints and snapshots; what a model executes as a whole.
  :class:`BlockTables`: one paged group's tables, applied incrementally from the plans'
  ``appended`` / ``replaced`` entries, rolled back on abort.
- Storage: :class:`StateCache` (per KDA layer: conv windows and V-first recurrent states per state
  block), :class:`PagedKVCache` (per attention layer) and :func:`paged_attention` (reference).
- Layer weights: :class:`KDALayerParams`.
- Kernels: :func:`kda_prefill` and :func:`kda_decode` (short conv + KDA recurrence, writing every
  planned checkpoint), :func:`apply_copies` (copy-on-write KV blocks, before the forward) and
  :func:`apply_snapshots` (running state -> checkpoint block, after the forward).
- Checks: :mod:`.parity` runs the correctness contract on any backend (GPU benchmarks, tests).
- Backends: :func:`get_backend` (``"torch"``, ``"fla"``, ``"flashkda"``, ``"flashkda-op"``,
  ``"auto"``), each declaring ``checkpoint_alignment`` and ``max_checkpoints_per_step`` for the
  core's State group and validating every plan (:class:`KernelPlanError`).
"""

from __future__ import annotations

# Submodules used by name (kernels.parity.check_parity, kernels.reference.kda_gate, ...).
from . import chaining, conv, parity, reference, validate  # noqa: F401
from .attention import paged_attention
from .backend import KDABackend
from .block_tables import BlockTables
from .copies import apply_copies, apply_snapshots
from .errors import (
    BackendUnavailableError,
    KernelError,
    KernelPlanError,
    UnsupportedLayerError,
)
from .fla_backend import FlaBackend
from .flashkda import LIBRARY_ENV, FlashKDABackend, FlashKDAOpBackend
from .ops import kda_decode, kda_prefill, run_prefill
from .paged_kv import PagedKVCache
from .params import GateKind, KDALayerParams
from .plan import Checkpoint, StatePlan
from .registry import available_backends, get_backend
from .state_cache import StateCache
from .step import PagedStep, StateStep, Step
from .torch_backend import TorchBackend
from .validate import check_copies, check_snapshots, check_state_plan

__all__ = [
    "LIBRARY_ENV",
    "BackendUnavailableError",
    "BlockTables",
    "Checkpoint",
    "FlaBackend",
    "FlashKDABackend",
    "FlashKDAOpBackend",
    "GateKind",
    "KDABackend",
    "KDALayerParams",
    "KernelError",
    "KernelPlanError",
    "PagedKVCache",
    "PagedStep",
    "StateCache",
    "StatePlan",
    "StateStep",
    "Step",
    "TorchBackend",
    "UnsupportedLayerError",
    "apply_copies",
    "apply_snapshots",
    "available_backends",
    "check_copies",
    "check_snapshots",
    "check_state_plan",
    "get_backend",
    "kda_decode",
    "kda_prefill",
    "paged_attention",
    "run_prefill",
]
