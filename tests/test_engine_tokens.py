"""A live sequence's token ids (``engine._Tokens``): the prompt, then every sampled token.

The rule, stated independently: after a prompt P and appended tokens a_1 .. a_n, the ids are the
list P + [a_1, ..., a_n]; ``len`` is its length, ``span(start, end)`` the ids at the positions
p with start <= p < end that exist (0 <= p < len), ``last()`` its final element, and a
slice taken earlier keeps its values whatever is appended after it.
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
)
def test_tokens_behave_as_the_prompt_then_the_appended_list(
    prompt: list[int], spare: int, appended: list[int], spans: list[tuple[int, int]]
) -> None:
    tokens = _Tokens(np.asarray(prompt, dtype=np.int64), spare)
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


def test_the_prompt_is_copied_not_shared() -> None:
    prompt = np.arange(5, dtype=np.int32)
    tokens = _Tokens(prompt, 2)
    prompt[0] = 99
    assert tokens.span(0, 5).tolist() == [0, 1, 2, 3, 4]
