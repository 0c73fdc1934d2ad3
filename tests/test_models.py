"""The tiny hybrid model: its caches carry everything between steps, exactly enough to resume.

Plans are written by hand here (no cache manager), so each test pins one property the engine
relies on: a prefill split into steps equals one step, a state resumed from an interior
checkpoint equals an unsplit run, the attention layer reads K/V only through the block table,
packing sequences together changes nothing, and decode equals prefill.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("prefixcache._core")

from prefixcache.engine import relative_difference
from prefixcache.kernels import (
    KernelPlanError,
    PagedKVCache,
    PagedStep,
    StateCache,
    StateStep,
    Step,
    TorchBackend,
    kda_prefill,
    paged_attention,
)
from prefixcache.models import (
    AttentionLayer,
    HybridModel,
    KDALayer,
    KernelTimer,
    ModelCaches,
    ModelConfig,
    paged_causal_attention,
    rms_norm,
)

BLOCK = 16
RTOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Row:
    """One sequence of a hand-written step."""

    tokens: Sequence[int]  # all tokens of the sequence so far
    start: int  # tokens computed before this step
    end: int  # tokens computed after it
    table: Sequence[int]  # block table (covers [0, end))
    initial: int  # state slot read (-1 = zero)
    running: int  # state slot written
    checkpoints: Sequence[tuple[int, int]] = ()  # (offset from start, slot)


def inputs(
    rows: Sequence[Row],
    copies: Sequence[tuple[int, int, int, int]] = (),
    snapshots: Sequence[tuple[int, int]] = (),
) -> tuple[Step, torch.Tensor]:
    """The step over ``rows`` (paged group 0, state group 1) and its token ids."""
    lengths = [row.end - row.start for row in rows]
    loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    width = max(len(row.table) for row in rows)
    tables = np.zeros((len(rows), width), dtype=np.int32)
    slots: list[int] = []
    ids: list[int] = []
    for r, row in enumerate(rows):
        tables[r, : len(row.table)] = row.table
        ids.extend(row.tokens[row.start : row.end])
        slots.extend(row.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(row.start, row.end))
    cmax = max(len(row.checkpoints) for row in rows)
    offsets = np.zeros((len(rows), cmax), dtype=np.int32)
    checkpoint_slots = np.full((len(rows), cmax), -1, dtype=np.int32)
    for r, row in enumerate(rows):
        for c, (offset, slot) in enumerate(row.checkpoints):
            offsets[r, c], checkpoint_slots[r, c] = offset, slot
    step = Step(
        query_start_loc=loc,
        seq_lens=np.array([row.end for row in rows], dtype=np.int64),
        copies=np.array(copies, dtype=np.int64).reshape(-1, 4),
        paged=(PagedStep(0, np.array(slots, dtype=np.int64), tables),),
        state=(
            StateStep(
                1,
                initial_slot=np.array([row.initial for row in rows], dtype=np.int32),
                running_slot=np.array([row.running for row in rows], dtype=np.int32),
                checkpoint_offsets=offsets,
                checkpoint_slots=checkpoint_slots,
                snapshots=np.array(snapshots, dtype=np.int32).reshape(-1, 2),
            ),
        ),
    )
    return step, torch.tensor(ids, dtype=torch.int64)


def execute(model: HybridModel, rows: Sequence[Row], caches: ModelCaches) -> torch.Tensor:
    """Logits of every row's last token after executing the step over ``rows``."""
    return model.execute(*inputs(rows), caches)


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelConfig.tiny(seed=3), TorchBackend(chunk_size=32))


def fresh(model: HybridModel) -> ModelCaches:
    return model.allocate_caches(paged_blocks=32, block_size=BLOCK, state_blocks=12)


def tokens(count: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, size=count).tolist()


def test_model_shapes_follow_the_config(model: HybridModel) -> None:
    caches = fresh(model)
    assert [type(layer).__name__ for layer in model.mixers] == [
        "KDALayer",
        "KDALayer",
        "KDALayer",
        "AttentionLayer",
    ]
    assert len(caches.states) == 3 and len(caches.kv) == 1
    assert caches.states[0].recurrent.shape == (12, 4, 16, 16)
    assert caches.kv[0].key.shape == (32, BLOCK, 2, 16)
    seq = tokens(20)
    logits = execute(model, [Row(seq, 0, 20, [1, 2], -1, 1)], caches)
    assert logits.shape == (1, 1000) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_a_prefill_split_in_two_steps_equals_one_step(model: HybridModel) -> None:
    seq = tokens(100)
    table = [3, 5, 7, 9, 11, 13, 15]
    whole = execute(model, [Row(seq, 0, 100, table, -1, 1)], fresh(model))
    caches = fresh(model)
    execute(model, [Row(seq, 0, 40, table[:3], -1, 1)], caches)
    split = execute(model, [Row(seq, 40, 100, table, 1, 2)], caches)
    assert relative_difference(split.numpy(), whole.numpy()) <= RTOL


def test_resuming_from_an_interior_checkpoint_equals_the_unsplit_run(model: HybridModel) -> None:
    seq = tokens(100, seed=1)
    table = [1, 2, 3, 4, 5, 6, 7]
    caches = fresh(model)
    whole = execute(model, [Row(seq, 0, 100, table, -1, 1, checkpoints=[(48, 3)])], caches)
    # A second sequence with the same first 48 tokens shares blocks 1-3 and resumes from slot 3.
    other = [1, 2, 3, 20, 21, 22, 23]
    resumed = execute(model, [Row(seq, 48, 100, other, 3, 4)], caches)
    assert relative_difference(resumed.numpy(), whole.numpy()) <= RTOL
    # The checkpoint matters: resuming from the state after all 100 tokens is different.
    wrong = execute(model, [Row(seq, 48, 100, other, 1, 5)], caches)
    assert relative_difference(wrong.numpy(), whole.numpy()) > 1e-3


def test_attention_reads_keys_and_values_through_the_block_table(model: HybridModel) -> None:
    seq = tokens(64, seed=2)
    first = execute(model, [Row(seq, 0, 64, [1, 2, 3, 4], -1, 1)], fresh(model))
    moved = execute(model, [Row(seq, 0, 64, [30, 7, 19, 2], -1, 1)], fresh(model))
    assert torch.equal(first, moved)
    # Decoding one more token with a table entry pointing at another block reads the wrong
    # context (swapping entries would not show: attention without positions is order-blind).
    caches = fresh(model)
    execute(model, [Row(seq, 0, 64, [1, 2, 3, 4], -1, 1)], caches)
    longer = [*seq, 5]
    right = execute(model, [Row(longer, 64, 65, [1, 2, 3, 4, 6], 1, 2)], caches)
    wrong = execute(model, [Row(longer, 64, 65, [1, 2, 3, 12, 6], 1, 3)], caches)
    assert relative_difference(wrong.numpy(), right.numpy()) > 1e-4


def test_decode_equals_prefill(model: HybridModel) -> None:
    seq = tokens(61, seed=4)
    table = [1, 2, 3, 4]
    whole = execute(model, [Row(seq, 0, 61, table, -1, 1)], fresh(model))
    caches = fresh(model)
    execute(model, [Row(seq, 0, 60, table, -1, 1)], caches)
    decoded = execute(model, [Row(seq, 60, 61, table, 1, 2)], caches)
    assert relative_difference(decoded.numpy(), whole.numpy()) <= RTOL


def test_packing_sequences_in_one_step_changes_nothing(model: HybridModel) -> None:
    a, b = tokens(50, seed=5), tokens(33, seed=6)
    rows = [Row(a, 0, 50, [1, 2, 3, 4], -1, 1), Row(b, 0, 33, [5, 6, 7], -1, 2)]
    together = execute(model, rows, fresh(model))
    alone_a = execute(model, rows[:1], fresh(model))
    alone_b = execute(model, rows[1:], fresh(model))
    assert relative_difference(together[0].numpy(), alone_a[0].numpy()) <= RTOL
    assert relative_difference(together[1].numpy(), alone_b[0].numpy()) <= RTOL


def test_a_step_runs_its_copies_before_and_its_snapshots_after_the_layers(
    model: HybridModel,
) -> None:
    # Step 1 prefills 40 tokens (blocks 1, 2 and 8 tokens of 3) and snapshots its running
    # state 1 into slot 5. Step 2 continues in a copy: block 3's 8 tokens copied on write into
    # block 4 before the layers, the state read from the snapshot. It must equal continuing in
    # the original blocks from the running state.
    seq = tokens(60, seed=9)
    caches = fresh(model)
    model.execute(*inputs([Row(seq, 0, 40, [1, 2, 3], -1, 1)], snapshots=[(1, 5)]), caches)
    for cache in caches.states:
        assert torch.equal(cache.recurrent[5], cache.recurrent[1])
        assert torch.equal(cache.conv[5], cache.conv[1])
    copied = model.execute(
        *inputs([Row(seq, 40, 60, [1, 2, 4, 6], 5, 7)], copies=[(0, 3, 4, 8)]), caches
    )
    original = execute(model, [Row(seq, 40, 60, [1, 2, 3, 9], 1, 2)], caches)
    assert torch.equal(caches.kv[0].key[4, :8], caches.kv[0].key[3, :8])
    assert relative_difference(copied.numpy(), original.numpy()) <= RTOL


@pytest.mark.parametrize(
    ("copies", "snapshots", "message"),
    [
        ([(0, 1, 2, 4)], [(1, 99)], "snapshot 0: destination slot 99"),
        ([(0, 1, 40, 4)], [(1, 5)], "copy 0: destination block 40"),
        ([(3, 1, 2, 4)], [(1, 5)], "group 3 has no paged KV cache"),
    ],
)
def test_a_bad_copy_or_snapshot_is_refused_before_anything_is_written(
    model: HybridModel,
    copies: list[tuple[int, int, int, int]],
    snapshots: list[tuple[int, int]],
    message: str,
) -> None:
    caches = fresh(model)
    caches.kv[0].key[1] = 1.0
    keys = caches.kv[0].key.clone()
    states = [cache.recurrent.clone() for cache in caches.states]
    step = inputs([Row(tokens(20), 0, 20, [5, 6], -1, 1)], copies=copies, snapshots=snapshots)
    with pytest.raises(KernelPlanError, match=message):
        model.execute(*step, caches)
    assert torch.equal(caches.kv[0].key, keys)
    assert all(torch.equal(b, c.recurrent) for b, c in zip(states, caches.states, strict=True))


def test_a_plan_the_backend_refuses_writes_nothing() -> None:
    model = HybridModel(ModelConfig.tiny(), TorchBackend(checkpoint_alignment=16))
    caches = fresh(model)
    before = [cache.recurrent.clone() for cache in caches.states]
    seq = tokens(40)
    with pytest.raises(KernelPlanError, match="alignment 16"):
        execute(model, [Row(seq, 0, 40, [1, 2, 3], -1, 1, [(20, 2)])], caches)
    assert all(torch.equal(b, c.recurrent) for b, c in zip(before, caches.states, strict=True))
    assert not caches.kv[0].key.any()


def test_the_seed_fixes_the_weights() -> None:
    seq = tokens(30)
    step = inputs([Row(seq, 0, 30, [1, 2], -1, 1)])
    logits = []
    for seed in (0, 0, 1):
        model = HybridModel(ModelConfig.tiny(seed=seed), TorchBackend())
        logits.append(model.execute(*step, fresh(model)))
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])


def _attention_case(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Paged attention over rows of every kind, with the kernel layer's reference.

    Rows: a fresh prefill, a chunk at the end of a longer context, and a decode token.
    """
    generator = torch.Generator().manual_seed(0)
    cache = PagedKVCache(16, BLOCK, 2, 8, dtype=dtype, device=device)
    tables = np.array([[1, 2, 3, 0], [4, 5, 6, 7], [8, 9, 0, 0]], dtype=np.int32)
    seq_lens = np.array([40, 60, 17])
    query_lens = [40, 25, 1]
    for row, context in enumerate(seq_lens.tolist()):
        slots = [int(tables[row, p // BLOCK]) * BLOCK + p % BLOCK for p in range(context)]
        keys = torch.randn(context, 2, 8, generator=generator)
        values = torch.randn(context, 2, 8, generator=generator)
        cache.write(np.array(slots), keys.to(device, dtype), values.to(device, dtype))
    loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    query = torch.randn(int(loc[-1]), 4, 8, generator=generator).to(device, dtype)
    ours = paged_causal_attention(query, cache, tables, seq_lens, loc)
    reference = paged_attention(query, cache, tables, seq_lens, loc)
    return ours, reference


def test_attention_equals_the_kernel_layers_reference() -> None:
    ours, reference = _attention_case(torch.device("cpu"), torch.float32)
    assert relative_difference(ours.numpy(), reference.numpy()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_attention_on_the_gpu_equals_the_reference() -> None:
    # On CUDA a chunk after a cached prefix takes the flash kernel's bottom-right causal path.
    ours, reference = _attention_case(torch.device("cuda"), torch.bfloat16)
    ours_host = ours.float().cpu().numpy()
    assert relative_difference(ours_host, reference.float().cpu().numpy()) <= 2e-2


def _rms_norm_case(
    device: torch.device, dtype: torch.dtype, tokens: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of very different scales (one all zero), a weight far from one, and the norm each
    row should get: ``x / sqrt(mean(x^2) + eps) * weight`` in float64, from the inputs as
    rounded to ``dtype``."""
    generator = torch.Generator().manual_seed(7)
    scale = torch.logspace(-3, 3, tokens, dtype=torch.float64).unsqueeze(1)
    x = (torch.randn(tokens, width, generator=generator, dtype=torch.float64) * scale).to(dtype)
    x[tokens // 2] = 0
    weight = (0.5 + torch.rand(width, generator=generator, dtype=torch.float64)).to(dtype)
    exact = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + EPS_NORM)
    return x.to(device), weight.to(device), exact * weight.double()


EPS_NORM = 1e-6
#: The most a norm rounded once to each dtype may differ from the float64 one, relative to it
#: (a bfloat16 result within one of its ulps, 2^-7 of the value at most).
NORM_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


def _check_rms_norm(device: torch.device, dtype: torch.dtype, tokens: int, width: int) -> None:
    x, weight, expected = _rms_norm_case(device, dtype, tokens, width)
    result = rms_norm(x, weight, EPS_NORM)
    assert result.dtype == dtype and result.shape == x.shape
    error = (result.double().cpu() - expected).abs()
    assert bool((error <= NORM_TOLERANCE[dtype] * expected.abs() + 1e-300).all())
    assert not bool(result[tokens // 2].any())  # a zero row stays zero (eps, no NaN)
    # A row's norm does not depend on the rows batched with it: the output check's runs
    # (block, fine, no cache) put a token in steps of different sizes and compare bit for bit.
    for row in (0, tokens // 3, tokens - 1):
        assert torch.equal(rms_norm(x[row : row + 1], weight, EPS_NORM)[0], result[row])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_is_the_formula_rounded_once_and_row_by_row(dtype: torch.dtype) -> None:
    _check_rms_norm(torch.device("cpu"), dtype, tokens=37, width=96)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_the_gpu_is_the_formula_rounded_once_and_row_by_row(
    dtype: torch.dtype,
) -> None:
    # The Kimi-K3 proxy's hidden width at a seed prefill's token count.
    _check_rms_norm(torch.device("cuda"), dtype, tokens=2087, width=7168)


def test_greedy_sampling_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 1.0, 0.0]])
    assert HybridModel.sample(logits) == [1, 0]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("layers", ("kda", "mamba"), "layers"),
        ("attention_heads", 3, "multiple"),
        ("hidden_size", 0, "hidden_size"),
        ("conv_width", 1, "conv_width"),
    ],
)
def test_bad_model_configs_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{field: value})  # type: ignore[arg-type]


def test_the_kernel_timer_measures_only_enabled_blocks() -> None:
    timer = KernelTimer(torch.device("cpu"))
    with timer.measure():
        time.sleep(0.02)
    timer.enabled = False
    with timer.measure():
        time.sleep(0.05)
    seconds = timer.take()
    assert 0.02 <= seconds < 0.05
    assert timer.take() == 0.0


def test_gpu_timing_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        KernelTimer(torch.device("cpu"), "gpu")
    with pytest.raises(ValueError, match="timing mode 'events' needs a CUDA device"):
        KernelTimer(torch.device("cpu"), "events")
    with pytest.raises(ValueError, match="one of wall, gpu, events"):
        KernelTimer(torch.device("cpu"), "cpu")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_timing_excludes_the_host_time_to_launch() -> None:
    device = torch.device("cuda")
    x = torch.randn(1024, 1024, device=device)
    torch.cuda.synchronize()
    wall, gpu = KernelTimer(device, "wall"), KernelTimer(device, "gpu")
    for timer in (wall, gpu):
        for _ in range(3):
            with timer.measure():
                time.sleep(0.002)  # host time inside the block (within the ~5 ms backlog)
                x @ x
    assert wall.take() >= 0.006
    assert gpu.take() < 0.002
    assert gpu.underruns == 0
    # Host time beyond the backlog would be idle GPU time: it is counted, and the backlog grows.
    backlog = gpu.backlog_cycles
    with gpu.measure():
        time.sleep(0.05)
        x @ x
    assert gpu.underruns == 1
    assert gpu.backlog_cycles == 2 * backlog
    for _ in range(64):  # a run of blocks without an underrun halves it again
        with gpu.measure():
            x @ x
    assert gpu.underruns == 1
    assert gpu.backlog_cycles == backlog


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_event_timing_adds_no_synchronisation_and_counts_the_gpu_work() -> None:
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    timer = KernelTimer(device, "events")
    started = time.perf_counter()
    for _ in range(3):
        with timer.measure():
            for _ in range(20):
                x @ x
    enqueued = time.perf_counter() - started
    seconds = timer.take()
    # 60 products of 4096^3 take far longer to run than to launch: the blocks did not wait.
    assert seconds > 3 * enqueued
    assert timer.take() == 0.0


# --- the Kimi-K3 cost proxy ---------------------------------------------------------------

# Kimi-K3's published shape, restated here (config.json of the text backbone): hidden 7168,
# 93 layers of which 24 MLA and 69 KDA, 96 KDA heads of 128, conv 4, vocabulary 163840;
# MoE: 16 of 896 experts active, routed experts SwiGLU 3072 wide over a 3584-wide latent,
# 2 shared experts SwiGLU 3072 wide; TP8.
K3_ACTIVE_MOE_MACS = (
    16 * 3 * 3584 * 3072  # routed experts
    + 7168 * 3584 * 2  # latent down and up projections
    + 2 * 3 * 7168 * 3072  # shared experts
    + 7168 * 896  # router
)


def test_the_kimi_k3_proxy_has_kimi_k3s_per_gpu_shapes_and_cost() -> None:
    config = ModelConfig.kimi_k3_tp8(3)
    assert config.layers == ("kda", "kda", "kda", "attention") * 3
    assert config.name == "kimi-k3-tp8"
    assert (config.hidden_size, config.kda_heads, config.kda_head_dim) == (7168, 96 // 8, 128)
    assert config.kda_gate == "bounded" and config.kda_full_rank_gate
    assert config.conv_width == 4 and config.vocab_size == 163840 // 8
    # The dense block costs the MoE's active multiply-adds per token per GPU, to rounding.
    per_gpu = K3_ACTIVE_MOE_MACS / 8
    dense = 3 * config.hidden_size * config.mlp_hidden_size
    assert abs(dense - per_gpu) / per_gpu < 0.01
    assert config.macs_per_token()["mlp"] == dense
    # The attention cache holds about MLA's bytes per token per layer (576-wide latent, bf16).
    kv_bytes = 2 * config.attention_kv_heads * config.attention_head_dim * 2
    assert abs(kv_bytes - 576 * 2) / (576 * 2) < 0.15
    assert config.attention_heads == 96 // 8


def test_the_multiply_adds_per_token_are_the_layers_weights() -> None:
    model = HybridModel(ModelConfig.kimi_k3_tp8(1, divisor=32), TorchBackend(chunk_size=32))
    macs = model.config.macs_per_token()
    kda = next(layer for layer in model.mixers if isinstance(layer, KDALayer))
    attention = next(layer for layer in model.mixers if isinstance(layer, AttentionLayer))
    assert kda.gate_up is None  # the full-rank gate
    # The stacked input projection counts its four parts' rows, not the zero rows between them.
    stacked = sum(rows for _, rows in kda.in_parts) * model.config.hidden_size
    assert macs["kda"] == stacked + kda.out_gate_up.numel() + kda.out.numel()
    assert macs["attention"] == attention.qkv.numel() + attention.out.numel()
    assert macs["mlp"] == model.mlps[0].gate_up.numel() + model.mlps[0].down.numel()
    assert macs["stack"] == 3 * macs["kda"] + macs["attention"] + 4 * macs["mlp"]


@pytest.mark.parametrize("full_rank_gate", [True, False])
def test_a_kda_layer_projects_its_input_as_four_separate_projections_would(
    full_rank_gate: bool,
) -> None:
    """The layer runs its four input projections (q|k|v, gate, beta, the output gate's down
    projection) as one GEMM over one stacked matrix. Stated here without it: the same matrices
    drawn one by one, in Kimi's order, from the same seed, each applied by its own product (the
    kernel layer given packed copies), give the layer's output and caches (float64)."""
    config = ModelConfig.kimi_k3_tp8(1, divisor=32)
    if not full_rank_gate:
        config = ModelConfig.tiny(seed=5)
    assert config.kda_full_rank_gate == full_rank_gate
    layer = KDALayer.random(
        config,
        torch.Generator().manual_seed(11),
        0.5,
        params_generator=torch.Generator().manual_seed(12),
    ).to(torch.device("cpu"), torch.float64)
    d, heads, dim = config.hidden_size, config.kda_heads, config.kda_head_dim
    generator = torch.Generator().manual_seed(11)

    def draw(rows: int, columns: int) -> torch.Tensor:
        return (torch.randn(rows, columns, generator=generator) / columns**0.5).double()

    qkv = draw(3 * heads * dim, d)
    gate_down = draw(heads * dim if full_rank_gate else dim, d)
    gate_up = None if full_rank_gate else draw(heads * dim, dim)
    beta = draw(heads, d)
    out_gate_down, out_gate_up = draw(dim, d), draw(heads * dim, dim)
    out = draw(d, heads * dim) * 0.5
    backend = TorchBackend(chunk_size=8)
    lengths, initial, running = [37, 1, 20], [-1, 0, -1], [1, 2, 3]
    loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = torch.randn(int(loc[-1]), d, generator=torch.Generator().manual_seed(13)).double()
    caches = []
    for _ in range(2):
        cache = StateCache.for_layer(
            layer.params, 6, conv_dtype=torch.float64, state_dtype=torch.float64
        )
        cache.conv[0].normal_(generator=torch.Generator().manual_seed(14))
        cache.recurrent[0].normal_(generator=torch.Generator().manual_seed(15))
        caches.append(cache)
    plan = backend.check_plan(
        query_start_loc=loc,
        initial_slot=initial,
        running_slot=running,
        checkpoint_offsets=[[16], [0], [0]],
        checkpoint_slots=[[4], [-1], [-1]],
        num_slots=6,
        num_tokens=int(loc[-1]),
    )
    got = layer.forward(x, backend, caches[0], plan)
    # Every part starts 128-byte aligned in a bf16 output row as wide as a multiple of 64 (an
    # odd width made the H100's GEMM and convolution twice as slow); the rows between are zero.
    assert layer.in_proj.shape[0] % 64 == 0
    covered = torch.zeros(layer.in_proj.shape[0], dtype=torch.bool)
    for (start, rows), matrix in zip(
        layer.in_parts, (qkv, gate_down, beta, out_gate_down), strict=True
    ):
        assert start % 64 == 0 and rows == matrix.shape[0]
        covered[start : start + rows] = True
    assert not layer.in_proj[~covered].any()

    gate = x @ gate_down.T if gate_up is None else (x @ gate_down.T) @ gate_up.T
    o = kda_prefill(
        backend, x @ qkv.T, gate.view(-1, heads, dim), x @ beta.T, layer.params, caches[1],
        loc, initial, running, [[16], [0], [0]], [[4], [-1], [-1]],
    )  # fmt: skip
    o = o / (o.pow(2).mean(-1, keepdim=True) + config.rms_eps).sqrt()
    o = o * torch.sigmoid(((x @ out_gate_down.T) @ out_gate_up.T).view(-1, heads, dim))
    expected = o.reshape(x.shape[0], -1) @ out.T
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    for a, b in ((caches[0].conv, caches[1].conv), (caches[0].recurrent, caches[1].recurrent)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_model_names_choose_the_size_and_depth() -> None:
    assert ModelConfig.named("tiny") == ModelConfig.tiny()
    assert ModelConfig.named("kimi-k3-tp8") == ModelConfig.kimi_k3_tp8(2)
    small = ModelConfig.named("kimi-k3-tp8/16", 1)
    assert small == ModelConfig.kimi_k3_tp8(1, divisor=16)
    assert (small.hidden_size, small.kda_head_dim, small.kda_heads) == (448, 8, 12)
    assert small.name == "kimi-k3-tp8/16" and len(small.layers) == 4
    for name, groups, message in [
        ("kimi-k3-tp8/0", None, "positive integer"),
        ("kimi-k3-tp8/x", None, "positive integer"),
        ("kimi-k3-tp8/3", None, "divide every width"),
        ("kimi-k3-tp8", 0, "groups must be >= 1"),
        ("tiny", 2, "one group"),
        ("huge", None, "unknown model"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.named(name, groups)


def test_the_reduced_kimi_k3_proxy_resumes_exactly_on_the_cpu() -> None:
    model = HybridModel(ModelConfig.kimi_k3_tp8(1, divisor=32), TorchBackend(chunk_size=32))
    vocab = model.config.vocab_size
    seq = np.random.default_rng(7).integers(0, vocab, size=100).tolist()
    table = [1, 2, 3, 4, 5, 6, 7]
    caches = fresh(model)
    whole = execute(model, [Row(seq, 0, 100, table, -1, 1, checkpoints=[(48, 3)])], caches)
    other = [1, 2, 3, 20, 21, 22, 23]
    resumed = execute(model, [Row(seq, 48, 100, other, 3, 4)], caches)
    assert relative_difference(resumed.numpy(), whole.numpy()) <= RTOL
    wrong = execute(model, [Row(seq, 48, 100, other, 1, 5)], caches)
    assert relative_difference(wrong.numpy(), whole.numpy()) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_model_on_the_gpu_resumes_exactly_through_checked_slots() -> None:
    # On CUDA the step's slot mapping is checked once on the host and uploaded once; the
    # attention layers write through it without reading it back.
    device = torch.device("cuda")
    model = HybridModel(
        ModelConfig.kimi_k3_tp8(1, divisor=32), TorchBackend(chunk_size=32), device=device
    )

    def run(rows: Sequence[Row], caches: ModelCaches) -> torch.Tensor:
        step, ids = inputs(rows)
        return model.execute(step, ids.to(device), caches).cpu()

    def gpu_caches() -> ModelCaches:
        return model.allocate_caches(paged_blocks=32, block_size=BLOCK, state_blocks=12)

    seq = np.random.default_rng(8).integers(0, model.config.vocab_size, size=100).tolist()
    table = [1, 2, 3, 4, 5, 6, 7]
    caches = gpu_caches()
    whole = run([Row(seq, 0, 100, table, -1, 1, checkpoints=[(48, 3)])], caches)
    resumed = run([Row(seq, 48, 100, [1, 2, 3, 20, 21, 22, 23], 3, 4)], caches)
    assert relative_difference(resumed.numpy(), whole.numpy()) <= 1e-4
    moved = run([Row(seq, 0, 100, [9, 30, 11, 12, 13, 14, 15], -1, 1)], gpu_caches())
    assert relative_difference(moved.numpy(), whole.numpy()) <= 1e-5


def test_the_attention_layers_caches_share_one_storage():
    """A model's attention layers' caches are the layers of one stacked storage, so a
    copy-on-write copy runs once for all of them; each layer's keys and values stay its own."""
    model = HybridModel(ModelConfig.kimi_k3_tp8(2, divisor=64), TorchBackend(chunk_size=32))
    caches = model.allocate_caches(paged_blocks=8, block_size=BLOCK, state_blocks=4)
    assert len(caches.kv) == 2
    storage = caches.kv[0].stack[0]
    assert all(cache.stack[0] is storage for cache in caches.kv)
    assert [cache.stack[1] for cache in caches.kv] == [0, 1]
    assert storage.shape[:3] == (2, 2, 8)
    caches.kv[1].key.fill_(1.0)
    assert not caches.kv[0].key.any() and not caches.kv[1].value.any()
