"""`jobsignal.util.fifo.Fifo.take`: a bulk popleft, checked against a deque."""

from __future__ import annotations

import collections
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from jobsignal.util.fifo import Fifo


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(0, 9)),
            st.tuples(st.just("popleft")),
            st.tuples(st.just("take"), st.integers(0, 6)),
        ),
        max_size=200,
    )
)
def test_take_pops_the_front_items_in_order(steps: list[tuple[Any, ...]]) -> None:
    fifo: Fifo[int] = Fifo()
    reference: collections.deque[int] = collections.deque()
    for method, *args in steps:
        if method == "append":
            fifo.append(args[0])
            reference.append(args[0])
        elif method == "popleft":
            if reference:
                assert fifo.popleft() == reference.popleft()
        else:
            expected = [reference.popleft() for _ in range(min(args[0], len(reference)))]
            assert fifo.take(args[0]) == expected
        assert list(fifo) == list(reference) and len(fifo) == len(reference)


def test_take_frees_the_items_it_hands_out() -> None:
    fifo: Fifo[object] = Fifo(object() for _ in range(10))
    assert len(fifo.take(3)) == 3
    # The three taken are no longer referenced by the list underneath.
    assert fifo._items.count(None) == 3 and len(fifo) == 7
    fifo.take(4)  # past half: the list is cut instead
    assert None not in fifo._items and len(fifo) == 3
