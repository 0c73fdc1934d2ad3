"""The backends' correctness contract as an executable check (for GPUs, benchmarks and tests).

:func:`check_parity` runs one packed step through a backend three ways and reports how they agree:

1. one forward with interior checkpoints (rows with 0 to 3 checkpoints, given out of order, some
   rows starting from a cached state, every unrelated slot poisoned with NaN);
2. the same rows split at the checkpoint offsets into separate steps, chained through the slots
   (what an engine would do without in-kernel export);
3. the float64 torch reference on the same inputs.

The contract: (1) equals (2) bit for bit for fp32 state paths on the
backend's grid, except that fla's ``h`` checkpoints equal the bf16 rounding of (2)'s state; (1)
and (3) agree to bf16 accuracy (relative L2 < 2e-2); nothing outside the plan's slots changes;
exporting checkpoints does not change the outputs. :func:`unaligned_plan_error` shows that an
offset off the backend's grid is refused rather than dropped.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .backend import KDABackend
from .errors import KernelPlanError
from .ops import kda_prefill
from .params import GateKind, KDALayerParams
from .state_cache import StateCache
from .torch_backend import TorchBackend

__all__ = ["ParityReport", "check_parity", "parity_plan", "unaligned_plan_error"]


@dataclass
class ParityReport:
    """How one backend's checkpointed forward agrees with split forwards and the reference."""

    backend: str
    gate: str
    lengths: list[int]
    checkpoints: list[list[int]]
    outputs_bitwise: bool = False
    running_bitwise: bool = False
    checkpoints_bitwise: bool = False
    checkpoints_bitwise_bf16: bool = False
    conv_bitwise: bool = False
    outputs_unchanged_by_export: bool = False
    untouched_slots_intact: bool = False
    max_abs: dict[str, float] = field(default_factory=dict)
    rel_l2: dict[str, float] = field(default_factory=dict)

    def passed(
        self, *, bf16_checkpoints: bool = False, exact_resume: bool = True, tolerance: float = 2e-2
    ) -> bool:
        """The contract: checkpoints bitwise equal to the split state (to its bf16 rounding with
        ``bf16_checkpoints``); outputs and final states bitwise equal to the split run and
        unchanged by export (unless ``exact_resume`` is False: a kernel whose run resumed from a
        state is not bit-identical to an uninterrupted run); untouched slots intact; the float64
        reference within ``tolerance`` (relative L2)."""
        checkpoints = (
            self.checkpoints_bitwise_bf16 if bf16_checkpoints else self.checkpoints_bitwise
        )
        exact = self.conv_bitwise and checkpoints
        if exact_resume:
            exact = exact and self.outputs_bitwise and self.running_bitwise
            exact = exact and self.outputs_unchanged_by_export
        close = all(value < tolerance for value in self.rel_l2.values())
        return exact and close and self.untouched_slots_intact

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form (for JSON)."""
        return asdict(self)


def parity_plan(alignment: int) -> tuple[list[int], list[list[int]], list[bool]]:
    """Row lengths, checkpoint offsets (unsorted) and which rows start from a cached state."""
    a = alignment
    lengths = [15 * a + 40, 5 * a + 3, 2 * a, 23 * a + 28]
    checkpoints = [[10 * a, 3 * a], [a], [a], [20 * a, 8 * a, 14 * a]]
    return lengths, checkpoints, [True, False, True, False]


def _rel_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.double(), reference.double()
    norm = float(torch.linalg.vector_norm(reference))
    return float(torch.linalg.vector_norm(value - reference)) / max(norm, 1e-30)


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
    )


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    difference = (a.double() - b.double()).abs()
    difference = difference[~torch.isnan(difference)]
    return float(difference.max()) if difference.numel() else 0.0


def check_parity(
    backend: KDABackend,
    *,
    gate: GateKind = "bounded",
    num_heads: int = 4,
    head_dim: int = 128,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    aligned_lengths: bool = False,
) -> ParityReport:
    """Run the contract check described in the module docstring on ``backend``.

    ``aligned_lengths`` rounds every row length up to a multiple of the backend's alignment, so
    every row starts on the grid in the packed batch too.
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    lengths, offsets, with_initial = parity_plan(backend.checkpoint_alignment)
    if aligned_lengths:
        grid = backend.checkpoint_alignment
        lengths = [-(-length // grid) * grid for length in lengths]
    rows = len(lengths)
    params = KDALayerParams.random(
        num_heads, head_dim, gate=gate, dtype=dtype, device=device, generator=generator
    )
    tokens = sum(lengths)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(device=device, dtype=dtype)

    x = randn(tokens, params.conv_channels)
    g = randn(tokens, num_heads, head_dim)
    beta = randn(tokens, num_heads)
    initial = [r if with_initial[r] else -1 for r in range(rows)]
    running = [rows + r for r in range(rows)]
    planned: list[list[tuple[int, int]]] = []
    next_slot = 2 * rows
    for row in offsets:
        planned.append([(offset, next_slot + i) for i, offset in enumerate(row)])
        next_slot += len(row)
    num_blocks = next_slot + 2
    conv_init = [randn(params.conv_channels, params.conv_width - 1) for _ in range(rows)]
    state_init = [
        (0.5 * torch.randn(num_heads, head_dim, head_dim, generator=generator)).to(device)
        for _ in range(rows)
    ]

    def fresh(conv_dtype: torch.dtype, state_dtype: torch.dtype) -> StateCache:
        cache = StateCache.for_layer(
            params, num_blocks, conv_dtype=conv_dtype, state_dtype=state_dtype, device=device
        )
        cache.fill_(math.nan)
        for row, slot in enumerate(initial):
            if slot >= 0:
                cache.conv[slot] = conv_init[row].to(conv_dtype)
                cache.recurrent[slot] = state_init[row].to(state_dtype)
        return cache

    def run(
        which: KDABackend,
        cache: StateCache,
        params_: KDALayerParams,
        index: torch.Tensor,
        seg_lengths: list[int],
        seg_initial: list[int],
        seg_running: list[int],
        checkpoints: list[list[tuple[int, int]]],
        cast: torch.dtype | None = None,
    ) -> torch.Tensor:
        width = max((len(c) for c in checkpoints), default=0)
        loc = [0]
        for length in seg_lengths:
            loc.append(loc[-1] + length)
        inputs = [t.index_select(0, index) for t in (x, g, beta)]
        if cast is not None:
            inputs = [t.to(cast) for t in inputs]
        return kda_prefill(
            which, inputs[0], inputs[1], inputs[2], params_, cache,
            torch.tensor(loc, dtype=torch.int32), torch.tensor(seg_initial, dtype=torch.int32),
            torch.tensor(seg_running, dtype=torch.int32),
            torch.tensor([[o for o, _ in c] + [0] * (width - len(c)) for c in checkpoints],
                         dtype=torch.int32).reshape(len(seg_lengths), width),
            torch.tensor([[s for _, s in c] + [-1] * (width - len(c)) for c in checkpoints],
                         dtype=torch.int32).reshape(len(seg_lengths), width),
        )  # fmt: skip

    starts = [sum(lengths[:r]) for r in range(rows)]
    everything = torch.arange(tokens, device=device)
    conv_dtype = dtype
    report = ParityReport(backend.name, gate, lengths, offsets)

    # 1. One forward with checkpoints; and one without, for the outputs.
    one = fresh(conv_dtype, torch.float32)
    out_one = run(backend, one, params, everything, lengths, initial, running, planned)
    plain = fresh(conv_dtype, torch.float32)
    out_plain = run(backend, plain, params, everything, lengths, initial, running, [[]] * rows)
    report.outputs_unchanged_by_export = torch.equal(out_one, out_plain)
    written = set(running) | {slot for row in planned for _, slot in row}
    untouched = [s for s in range(num_blocks) if s not in written]
    before = fresh(conv_dtype, torch.float32)
    report.untouched_slots_intact = _nan_equal(
        one.recurrent[untouched], before.recurrent[untouched]
    ) and _nan_equal(one.conv[untouched], before.conv[untouched])

    # 2. Split forwards, round by round, chained through the slots.
    split = fresh(conv_dtype, torch.float32)
    cuts = [
        [*sorted(row), (length, slot)]
        for row, length, slot in zip(planned, lengths, running, strict=True)
    ]
    pieces: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for step in range(max(len(c) for c in cuts)):
        members = [r for r in range(rows) if step < len(cuts[r])]
        ranges = []
        for r in members:
            first = 0 if step == 0 else cuts[r][step - 1][0]
            ranges.append((r, first, cuts[r][step][0]))
        index = torch.cat(
            [torch.arange(starts[r] + a, starts[r] + b, device=device) for r, a, b in ranges]
        )
        seg_lengths = [b - a for _, a, b in ranges]
        out = run(
            backend, split, params, index, seg_lengths,
            [initial[r] if step == 0 else cuts[r][step - 1][1] for r in members],
            [cuts[r][step][1] for r in members], [[] for _ in members],
        )  # fmt: skip
        for r, piece in zip(members, torch.split(out, seg_lengths), strict=True):
            pieces[r].append(piece)
    out_split = torch.cat([torch.cat(p) for p in pieces])
    checkpoint_slots = [slot for row in planned for _, slot in row]
    report.outputs_bitwise = torch.equal(out_one, out_split)
    report.running_bitwise = torch.equal(one.recurrent[running], split.recurrent[running])
    report.conv_bitwise = _nan_equal(one.conv, split.conv)
    ours, theirs = one.recurrent[checkpoint_slots], split.recurrent[checkpoint_slots]
    report.checkpoints_bitwise = torch.equal(ours, theirs)
    report.checkpoints_bitwise_bf16 = torch.equal(ours, theirs.to(torch.bfloat16).float())
    report.max_abs = {
        "outputs_vs_split": _max_abs(out_one, out_split),
        "running_vs_split": _max_abs(one.recurrent[running], split.recurrent[running]),
        "checkpoints_vs_split": _max_abs(ours, theirs),
    }

    # 3. The float64 reference.
    params64 = KDALayerParams(
        A_log=params.A_log.double(),
        dt_bias=params.dt_bias.double(),
        conv_weight=params.conv_weight.double(),
        lower_bound=params.lower_bound,
        conv_activation=params.conv_activation,
    )
    reference = fresh(torch.float64, torch.float64)
    out_ref = run(
        TorchBackend(compute_dtype=torch.float64), reference, params64, everything, lengths,
        initial, running, planned, cast=torch.float64,
    )  # fmt: skip
    report.rel_l2 = {
        "outputs": _rel_l2(out_one, out_ref),
        "running_states": _rel_l2(one.recurrent[running], reference.recurrent[running]),
        "checkpoint_states": _rel_l2(ours, reference.recurrent[checkpoint_slots]),
        "conv_windows": _rel_l2(one.conv[sorted(written)], reference.conv[sorted(written)]),
    }
    return report


def unaligned_plan_error(backend: KDABackend) -> str:
    """The message ``backend`` refuses an off-grid offset with (``AssertionError`` if it accepts).

    Needs ``checkpoint_alignment > 1``.
    """
    alignment = backend.checkpoint_alignment
    if alignment < 2:
        raise ValueError(f"backend {backend.name!r} accepts every offset (alignment 1)")
    try:
        backend.check_plan(
            query_start_loc=[0, 4 * alignment],
            initial_slot=[-1],
            running_slot=[0],
            checkpoint_offsets=[[alignment + alignment // 2]],
            checkpoint_slots=[[1]],
            num_slots=2,
        )
    except KernelPlanError as error:
        return str(error)
    raise AssertionError(f"backend {backend.name!r} accepted an offset off its grid")
