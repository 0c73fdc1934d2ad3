"""prefixcache.engine: a reference continuous-batching engine around the cache manager.

- :class:`Engine` / :class:`EngineConfig`: the scheduler loop (admission with ``lookup`` /
  ``schedule``, chunked prefill under a token budget, ``build_plan_into`` one reused
  ``PlanBuffers`` -> the block tables apply the plan -> the model executes the
  ``kernels.Step`` (copies, layers, snapshots) -> ``commit`` or ``abort``; decode-only steps
  through ``decode_step``; preemption by recomputation, ``finish``), timing each request's
  time to first token.
- :mod:`.workloads`: the named workloads and their presets; :mod:`.cli`: the ``prefixcache``
  command (``prefixcache simulate``, also ``python -m prefixcache``).
- :class:`Policy`: the caching policies compared (``none``, ``block``, ``fine``).
- :func:`simulate`: every policy over one workload, checked against the no-cache run.
- :class:`RunResult` / :class:`RequestResult`: what a run produced; :func:`outputs_match`.
"""

from __future__ import annotations

from .engine import Engine, EngineConfig, EngineError, ForwardFn, PoolTooSmallError
from .policy import POLICY_NAMES, Policy, PolicyName
from .results import RequestResult, RoundSummary, RunResult, outputs_match, relative_difference
from .simulate import (
    FLOAT32_RTOL,
    LOW_PRECISION_RTOL,
    SimulationReport,
    build_model,
    engine_config_for,
    simulate,
)

__all__ = [
    "FLOAT32_RTOL",
    "LOW_PRECISION_RTOL",
    "POLICY_NAMES",
    "Engine",
    "EngineConfig",
    "EngineError",
    "ForwardFn",
    "Policy",
    "PolicyName",
    "PoolTooSmallError",
    "RequestResult",
    "RoundSummary",
    "RunResult",
    "SimulationReport",
    "build_model",
    "engine_config_for",
    "outputs_match",
    "relative_difference",
    "simulate",
]
