"""A live sequence's token ids (``engine._Tokens``): the prompt, then every sampled token.

The rule, stated independently: after a prompt P and appended tokens a_1 .. a_n, the ids are the
list P + [a_1, ..., a_n]; ``len`` is its length, ``span(start, end)`` the ids at the positions
p with start <= p < end that exist (0 <= p < len), ``last()`` its final element, and a
slice taken earlier keeps its values whatever is appended after it. The prompt's own values
are never the caller's to change afterwards: a writable prompt is copied, a read-only one kept.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("prefixcache._core")

from prefixcache.engine.engine import _Tokens

ids = st.integers(min_value=0, max_value=2**31 - 1)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(ids, max_size=40),
    spare=st.integers(min_value=0, max_value=8),
    appended=st.lists(ids, max_size=80),
    spans=st.lists(st.tuples(st.integers(-3, 130), st.integers(-3, 130)), max_size=6),
    shared=st.booleans(),
)
def test_tokens_behave_as_the_prompt_then_the_appended_list(
    prompt: list[int],
    spare: int,
    appended: list[int],
    spans: list[tuple[int, int]],
    shared: bool,
) -> None:
    ids = np.asarray(prompt, dtype=np.int64)
    ids.flags.writeable = not shared  # a read-only prompt is kept, not copied
    tokens = _Tokens(ids, spare)
    model = list(prompt)
    taken: list[tuple[np.ndarray, list[int]]] = []
    for k, token in enumerate(appended):
        tokens.append(token)
        model.append(token)
        assert len(tokens) == len(model)
        assert tokens.last() == model[-1]
        start, end = spans[k % len(spans)] if spans else (0, len(model))
        view = tokens.span(start, end)
        expected = [model[p] for p in range(start, end) if 0 <= p < len(model)]
        assert view.tolist() == expected
        taken.append((view, expected))
    for view, expected in taken:  # earlier slices survive growth and later appends
        assert view.tolist() == expected
    assert tokens.span(0, len(model)).tolist() == model


def test_an_empty_sequence_has_no_last_token() -> None:
    tokens = _Tokens(np.zeros(0, dtype=np.int64), 0)
    assert len(tokens) == 0 and tokens.span(0, 5).tolist() == []
    with pytest.raises(IndexError):
        tokens.last()


def test_a_writable_prompt_is_copied_a_read_only_one_shared() -> None:
    prompt = np.arange(5, dtype=np.int32)
    tokens = _Tokens(prompt, 2)
    prompt[0] = 99
    assert tokens.span(0, 5).tolist() == [0, 1, 2, 3, 4]
    writable = np.arange(5, dtype=np.int64)
    tokens = _Tokens(writable, 2)
    writable[1] = 99
    assert tokens.span(0, 5).tolist() == [0, 1, 2, 3, 4]
    frozen = np.arange(5, dtype=np.int64)
    frozen.flags.writeable = False
    tokens = _Tokens(frozen, 2)
    assert np.shares_memory(tokens.span(0, 5), frozen)
    tokens.append(7)
    assert tokens.span(3, 6).tolist() == [3, 4, 7] and not frozen.flags.writeable


def test_a_request_holds_its_prompt_read_only() -> None:
    from prefixcache.engine.workloads import Request

    mine = np.arange(6, dtype=np.int64)
    request = Request(0, mine, output_len=1)
    mine[0] = 99
    assert request.prompt.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        request.prompt[0] = 1
    assert Request(1, request.prompt, output_len=1).prompt is request.prompt  # kept, no copy
    assert Request(2, [3, 4], output_len=1).prompt.dtype == np.int64
