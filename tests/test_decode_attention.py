"""The Triton paged decode attention (``kernels.decode_attention``) against plain softmax attention.

The reference here is written out from the definition: a decode row's query token attends to
every token of its context with weights ``softmax(q . k / sqrt(D))`` (its grouped key/value
head), computed in float64 on the context read token by token through the block table. On a
machine without CUDA the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``kernels_support`` before they are first compiled); on a GPU
they are compiled.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from kernels_support import DEVICE, kernels

pytest.importorskip("triton")  # after kernels_support, which sets TRITON_INTERPRET

decode = importlib.import_module(f"{kernels.__name__}.decode_attention")


def reference(query, key, value, tables, lengths, tokens):
    """Each decode row's output from the definition, in float64, token by token."""
    block = key.shape[1]
    heads, kv_heads = query.shape[1], key.shape[2]
    group = heads // kv_heads
    out = {}
    for row, (length, token) in enumerate(zip(lengths, tokens, strict=True)):
        slots = [(tables[row][p // block], p % block) for p in range(length)]
        k = torch.stack([key[b, o] for b, o in slots]).double()  # [L, Hkv, D]
        v = torch.stack([value[b, o] for b, o in slots]).double()
        q = query[token].double()  # [Hq, D]
        result = torch.empty(heads, q.shape[1], dtype=torch.float64)
        for head in range(heads):
            scores = k[:, head // group] @ q[head] / q.shape[1] ** 0.5
            result[head] = torch.softmax(scores, 0) @ v[:, head // group]
        out[token] = result
    return out


def random_case(lengths, *, block, kv_heads, group, head_dim, dtype, seed, prefill=()):
    """A cache whose blocks are handed out shuffled, tables padded with garbage past each row's
    last block, and a packed step: prefill rows of ``prefill`` tokens, then one token per row."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    all_lengths = list(prefill) + list(lengths)
    needed = [-(-n // block) for n in all_lengths]
    num_blocks = sum(needed) + 3
    order = rng.permutation(num_blocks)
    columns = max(needed) + 2
    tables = np.full((len(all_lengths), columns), 10**6, dtype=np.int32)  # out of range
    used = 0
    for row, count in enumerate(needed):
        tables[row, :count] = order[used : used + count]
        used += count
    shape = (num_blocks, block, kv_heads, head_dim)
    key = torch.randn(shape, generator=generator).to(dtype)
    value = torch.randn(shape, generator=generator).to(dtype)
    query_lens = [min(n, 5) for n in prefill] + [1] * len(lengths)
    loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    query = torch.randn(int(loc[-1]), kv_heads * group, head_dim, generator=generator).to(dtype)
    return key, value, tables, np.asarray(all_lengths), loc, query


CASES = [
    # (decode lengths, block size, kv heads, group, head dim, prefill rows)
    ([1, 17, 65, 300], 16, 2, 6, 32, ()),  # the proxy's 6-query-head group, D padded
    ([700, 5], 96, 1, 2, 16, (40, 3)),  # several splits, an odd block size, mixed step
    ([33], 4, 2, 2, 8, ()),  # head dim under 16 (the narrow proxies), tiny blocks
]


# Triton's interpreter (3.9) multiplies bf16 tiles wrongly (a 16x16 bf16 tl.dot is off by 1e10
# there, float16 is right), so on the CPU the low-precision path is checked in float16.
LOW = [torch.bfloat16] if torch.cuda.is_available() else [torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_equals_the_definition(case, dtype):
    lengths, block, kv_heads, group, head_dim, prefill = case
    key, value, tables, all_lengths, loc, query = random_case(
        lengths, block=block, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype,
        seed=len(lengths) + block, prefill=prefill,
    )  # fmt: skip
    rows = decode.DecodeRows.select(
        tables, all_lengths, loc, num_blocks=key.shape[0], block_size=block, device=DEVICE
    )
    assert rows is not None and rows.rows.tolist() == list(range(len(prefill), len(all_lengths)))
    out = torch.full_like(query, float("nan")).to(DEVICE)
    decode.paged_decode_attention(
        query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), rows, out, block_n=16
    )
    tokens = loc[len(prefill) : -1].tolist()
    expected = reference(query, key, value, tables[len(prefill) :], lengths, tokens)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    out = out.cpu()
    for token, result in expected.items():
        torch.testing.assert_close(out[token].double(), result, rtol=tolerance, atol=tolerance)
    # Only the decode rows' tokens are written.
    others = [t for t in range(query.shape[0]) if t not in expected]
    assert torch.isnan(out[others]).all()
    assert out.dtype == dtype


def test_splits_cover_the_longest_row():
    # 164K tokens over 8 rows of the proxy (2 kv heads): whole tiles, at most MAX_SPLITS
    # splits and none empty, and enough programs to fill a large GPU several times over.
    split = decode.split_tokens(164_000, 8 * 2)
    splits = -(-164_000 // split)
    assert split % decode.DECODE_BLOCK_N == 0
    assert decode.MAX_SPLITS - 2 <= splits <= decode.MAX_SPLITS
    assert split * (splits - 1) < 164_000 <= split * splits
    assert 8 * 2 * splits >= 4 * 132
    # A short context is not cut below the minimum split.
    assert decode.split_tokens(300, 1) >= decode.MIN_SPLIT_TOKENS


def test_select_checks_what_the_kernel_reads():
    tables = np.array([[3, 99], [1, 2]], dtype=np.int32)
    lens = np.array([4, 7])
    loc = np.array([0, 1, 2])
    # Row 0 needs one block of 4: its padding (99) is never read, so it passes.
    rows = decode.DecodeRows.select(tables, lens, loc, num_blocks=4, block_size=4, device="cpu")
    assert rows is not None and rows.block_tables.tolist() == [[3, 0], [1, 2]]
    with pytest.raises(IndexError):  # row 1's second block is outside a 2-block cache
        decode.DecodeRows.select(tables, lens, loc, num_blocks=2, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="needs 3 blocks"):
        decode.DecodeRows.select(
            tables, np.array([4, 9]), loc, num_blocks=4, block_size=4, device="cpu"
        )
    with pytest.raises(ValueError, match="at least 1 token"):
        decode.DecodeRows.select(
            tables, np.array([0, 1]), loc, num_blocks=4, block_size=4, device="cpu"
        )
    prefill_only = np.array([0, 3, 5])
    assert (
        decode.DecodeRows.select(
            tables, lens, prefill_only, num_blocks=4, block_size=4, device="cpu"
        )
        is None
    )


def test_the_reduced_proxy_decodes_the_same_through_the_kernel():
    # The engine's decode rows through the kernel (the Kimi-K3 proxy's head groups at 1/32 width)
    # give the outputs and final logits of the torch path that gathers each row's context.
    pytest.importorskip("prefixcache._core")
    from prefixcache.engine import build_model, simulate
    from prefixcache.engine.results import outputs_match
    from prefixcache.engine.simulate import FLOAT32_RTOL
    from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload
    from prefixcache.models import ModelConfig

    spec = GrowingPrefixSpec(streams=2, first_prompt=70, growth=20, rounds=2, output_len=4)
    workload = PresetWorkload(
        "growing-prefix",
        "test",
        spec,
        Geometry(block_size=16, unit=8, token_budget=64, max_running=2),
    )
    config = ModelConfig.kimi_k3_tp8(1, divisor=32)
    runs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for impl in ("torch", "triton"):
            model = build_model(DEVICE.type, "torch", config=config, decode_attention=impl)
            assert model.decode_attention == impl
            report = simulate(workload, ["fine"], model, warm_up="none", reference=False)
            assert report.runs["fine"].decode_steps > 0
            # Every measured step is timed, by its shape.
            times = report.to_json()["policies"]["fine"]["step_times"]
            assert times["decode_steps"] + times["prefill_steps"] == report.runs["fine"].steps
            assert times["decode_steps"] > 0 and times["decode_ms_p50"] > 0
            runs[impl] = report.runs
    finally:
        torch.set_num_threads(threads)
    match, detail = outputs_match(runs["triton"]["fine"], runs["torch"]["fine"], FLOAT32_RTOL)
    assert match, detail


def test_the_decode_attention_choice_is_checked():
    pytest.importorskip("prefixcache._core")
    from prefixcache.kernels import UnsupportedLayerError
    from prefixcache.models import HybridModel

    assert HybridModel.check_decode_attention("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="decode_attention"):
        HybridModel.check_decode_attention("flash", torch.device("cpu"))
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(UnsupportedLayerError):
            HybridModel.check_decode_attention("triton", torch.device("cpu"))
