"""A prefill chunk's attention with its cached prefix split (``kernels.prefill_attention``).

The rule: a chunk of T query tokens ending a C-token context sees, for its i-th token, every key
at positions 0 .. C - T + i, with weights softmax(q . k * scale). Cutting the prefix into pieces
and merging the pieces' results by their log-sum-exps must give that attention, whatever the
number of pieces, a remainder that does not divide evenly, or grouped heads. Checked on the CPU
with plain softmax pieces against a direct masked softmax, and on a GPU with the flash kernel
against torch's scaled_dot_product_attention. The merge is checked in both forms, torch and the
Triton kernel (on the CPU through Triton's interpreter, ``TRITON_INTERPRET=1``, set by
``kernels_support`` before the kernel is first compiled), against that rule and against each other.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from kernels_support import DEVICE, kernels

prefill = importlib.import_module(f"{kernels.__name__}.prefill_attention")


def direct(q, k, v):
    """The rule, in float64: a boolean mask of what each query token sees."""
    query_len, context = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    sees = torch.ones(query_len, context, dtype=torch.bool, device=q.device).tril(
        diagonal=context - query_len
    )
    return F.scaled_dot_product_attention(
        q.double(),
        k.double().repeat_interleave(groups, dim=1),
        v.double().repeat_interleave(groups, dim=1),
        attn_mask=sees,
    )


def tensors(query_len, context, heads, kv_heads, dim, dtype, seed, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, query_len, dim, generator=generator)
    # Keys and values as the model passes them: token-major storage, head axis transposed.
    k = torch.randn(context, kv_heads, dim, generator=generator).transpose(0, 1).unsqueeze(0)
    v = torch.randn(context, kv_heads, dim, generator=generator).transpose(0, 1).unsqueeze(0)
    return (x.to(device=device, dtype=dtype) for x in (q, k, v))


@pytest.mark.parametrize(
    ("query_len", "context", "splits"),
    [(5, 29, 3), (5, 29, 24), (8, 9, 1), (16, 80, 4), (3, 100, 7)],
)
def test_split_prefix_equals_the_rule(query_len, context, splits):
    q, k, v = tensors(query_len, context, 6, 2, 8, torch.float64, seed=context + splits)
    got = prefill.split_prefix_attention(q, k, v, splits, prefill.math_attend)
    torch.testing.assert_close(got, direct(q, k, v), rtol=1e-12, atol=1e-12)


triton_only = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (the merge kernel)"
)


@triton_only
@pytest.mark.parametrize(
    ("query_len", "context", "splits", "dtype"),
    [
        (5, 29, 3, torch.float64),
        (5, 29, 24, torch.float64),
        (17, 100, 7, torch.float64),  # more tokens than a program's 16, a remainder piece
        (33, 70, 2, torch.float32),
        (8, 9, 1, torch.float32),
    ],
)
def test_triton_merge_equals_the_rule(query_len, context, splits, dtype):
    q, k, v = tensors(query_len, context, 6, 2, 8, dtype, seed=3 * context + splits, device=DEVICE)
    got = prefill.split_prefix_attention(
        q, k, v, splits, prefill.math_attend, merge=prefill.merge_partials_triton
    )
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), direct(q, k, v), rtol=tolerance, atol=tolerance)
    assert got.dtype == dtype and got.shape == q.shape


def partials(pieces, heads, tokens, dim, dtype, seed, token_major):
    """Partial results as a flash kernel returns them (``token_major``: [B, T, H, D] storage
    behind the [B, H, T, D] shape) with log-sum-exps spread over a wide range."""
    generator = torch.Generator().manual_seed(seed)
    shape = (pieces + 1, tokens, heads, dim) if token_major else (pieces + 1, heads, tokens, dim)
    outs = torch.randn(shape, generator=generator).to(dtype)
    if token_major:
        outs = outs.transpose(1, 2)
    lse = 30 * torch.randn(pieces + 1, heads, tokens, generator=generator)
    outs, lse = outs.to(DEVICE), lse.to(DEVICE)
    return outs[:pieces], lse[:pieces], outs[pieces:], lse[pieces:]


@triton_only
@pytest.mark.parametrize("token_major", [True, False])
def test_triton_merge_equals_the_torch_merge(token_major):
    head_out, head_lse, tail_out, tail_lse = partials(4, 3, 21, 24, torch.float32, 5, token_major)
    got = prefill.merge_partials_triton(head_out, head_lse, tail_out, tail_lse)
    expected = prefill.merge_partials_torch(head_out, head_lse, tail_out, tail_lse)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The merged value written out: sum_i exp(lse_i) o_i / sum_i exp(lse_i), in float64.
    lse = torch.cat([head_lse, tail_lse]).double()
    outs = torch.cat([head_out, tail_out]).double()
    weights = torch.exp(lse - lse.max(0).values)
    rule = (weights.unsqueeze(-1) * outs).sum(0) / weights.sum(0).unsqueeze(-1)
    torch.testing.assert_close(got[0].double(), rule, rtol=1e-5, atol=1e-5)


@triton_only
def test_triton_merge_refuses_partials_that_do_not_line_up():
    head_out, head_lse, tail_out, tail_lse = partials(2, 3, 5, 8, torch.float32, 1, False)
    with pytest.raises(ValueError, match="line up"):
        prefill.merge_partials_triton(head_out, head_lse[:, :, :4], tail_out, tail_lse)
    with pytest.raises(ValueError, match="tail"):
        prefill.merge_partials_triton(head_out, head_lse, tail_out.double(), tail_lse)


def test_the_cpu_merges_in_torch():
    assert prefill.default_merge(torch.device("cpu")) is prefill.merge_partials_torch


def test_math_attend_returns_the_log_sum_exp():
    q, k, v = tensors(4, 10, 2, 1, 8, torch.float64, seed=3)
    out, lse = prefill.math_attend(q, k, v, True, 0.25)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) * 0.25
    # Query 0 sees keys 0 .. 6 (7 of 10).
    torch.testing.assert_close(lse[0, :, 0], torch.logsumexp(scores[0, :, 0, :7], dim=-1))
    assert out.shape == q.shape


def test_a_split_needs_a_prefix_for_every_piece():
    q, k, v = tensors(4, 6, 2, 1, 8, torch.float64, seed=1)
    with pytest.raises(ValueError, match="pieces"):
        prefill.split_prefix_attention(q, k, v, 3, prefill.math_attend)


def test_splits_fill_the_gpu_without_tiny_pieces():
    # The proxy's 12 heads at T = 2,048 after 128K: 192 blocks, so 5 pieces (960 blocks).
    assert prefill.prefix_splits(2048, 131072, 12) == 5
    # T = 4,096: 384 blocks, 3 pieces. A chunk with half the target or more is not split
    # (8,192 tokens: 768 blocks, where 2 pieces were slower on the H200).
    assert prefill.prefix_splits(4096, 131072, 12) == 3
    assert prefill.prefix_splits(8192, 131072, 12) == 1
    assert prefill.prefix_splits(16384, 131072, 12) == 1
    # A short prefix is not cut below the smallest piece.
    assert prefill.prefix_splits(256, 3 * prefill.MIN_PIECE + 5, 12) == 3
    assert prefill.prefix_splits(256, prefill.MIN_PIECE - 1, 12) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("query_len", "context"), [(2048, 40000), (300, 20000), (1000, 1001)])
def test_flash_split_equals_sdpa_on_the_gpu(query_len, context):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = tensors(query_len, context, 12, 2, 128, torch.bfloat16, seed=7, device="cuda")
    expected = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(6, dim=1),
        v.repeat_interleave(6, dim=1),
        attn_mask=causal_lower_right(query_len, context),
    ).float()
    whole = prefill.flash_attend(q, k, v, True, 128**-0.5)[0].float()
    torch.testing.assert_close(whole, expected, rtol=1e-2, atol=1e-2)  # heads unrepeated
    splits = max(2, prefill.prefix_splits(query_len, context - query_len, 12))
    assert prefill.default_merge(q.device) is prefill.merge_partials_triton
    if context - query_len >= splits:
        got = prefill.split_prefix_attention(q, k, v, splits, prefill.flash_attend).float()
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        by_torch = prefill.split_prefix_attention(
            q, k, v, splits, prefill.flash_attend, merge=prefill.merge_partials_torch
        ).float()
        # Both merges round one float32 result to bf16: at most one bf16 ulp apart.
        torch.testing.assert_close(got, by_torch, rtol=8e-3, atol=8e-3)
    # The flash kernel's log-sum-exp is the natural one of the scaled scores.
    _, lse = prefill.flash_attend(q[:, :, :4], k[:, :, :64], v[:, :, :64], False, 128**-0.5)
    _, expected_lse = prefill.math_attend(
        q[:, :, :4].float(), k[:, :, :64].float(), v[:, :, :64].float(), False, 128**-0.5
    )
    torch.testing.assert_close(lse.float(), expected_lse, rtol=1e-3, atol=1e-3)
