"""Decoding the API server's documents however deep they nest (jobsignal/kube/documents.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobsignal.kube.documents import MAX_DEPTH, loads, prune

# Deeper than Python's json decodes on any supported version.
TOO_DEEP = 20_000


def nested(depth: int, inner: str = "{}") -> str:
    return '{"f:a":' * depth + inner + "}" * depth


def test_a_document_json_decodes_is_returned_as_it_is() -> None:
    text = '{"kind":"ConfigMapList","items":[{"data":{"a":"[[{{"}}],"n":1.5}'
    assert loads(text) == (json.loads(text), 0)
    assert loads(text.encode()) == (json.loads(text), 0)


def test_invalid_utf8_becomes_the_replacement_character() -> None:
    assert loads(b'{"a":"x\xffy"}') == ({"a": "x\ufffdy"}, 0)


def test_values_too_deep_for_json_are_dropped_and_their_siblings_kept() -> None:
    managed = f'[{{"manager":"m","fieldsV1":{nested(TOO_DEEP)}}},{{"fieldsV1":{nested(3)}}}]'
    obj = f'{{"metadata":{{"managedFields":{managed}}},"data":{{"k":"v"}}}}'
    text = f'{{"type":"MODIFIED","object":{obj}}}'
    with pytest.raises(RecursionError):
        json.loads(text)
    document, dropped = loads(text)
    assert dropped == 1
    assert document["object"]["data"] == {"k": "v"}
    entries = document["object"]["metadata"]["managedFields"]
    assert entries[1] == {"fieldsV1": json.loads(nested(3))}
    # The first entry's fields are cut where they pass MAX_DEPTH.
    value: Any = entries[0]["fieldsV1"]
    depth = 5  # document, object, metadata, the list, its entry: then the fields
    while isinstance(value, dict):
        depth += 1
        value = value["f:a"]
    assert (value, depth) == (None, MAX_DEPTH)


def test_brackets_inside_strings_do_not_count() -> None:
    tricky = json.dumps('a"[[[\\' + "{" * 100)
    text = f'{{"s":{tricky},"deep":{nested(TOO_DEEP)}}}'
    document, dropped = loads(text)
    assert document["s"] == json.loads(tricky)
    assert dropped == 1


def test_every_value_too_deep_is_counted() -> None:
    text = "[" + ",".join([nested(TOO_DEEP)] * 3 + ["[1]"]) + "]"
    document, dropped = loads(text)
    assert dropped == 3
    assert document[3] == [1]


@pytest.mark.parametrize(
    "text",
    ["[" * TOO_DEEP, "[" * TOO_DEEP + "]" * (TOO_DEEP + 1), "[" * TOO_DEEP + "}" * TOO_DEEP],
    ids=["left-open", "closed-too-often", "mismatched"],
)
def test_deep_text_that_is_not_json_raises_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        loads(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ax\n\u00e9'),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=3), children, max_size=3)
    ),
    max_leaves=30,
)


def cut_below(value: Any, max_depth: int, depth: int = 0) -> Any:
    """`value` with every list or dict deeper than `max_depth` replaced by None."""
    if isinstance(value, list | dict):
        if depth + 1 > max_depth:
            return None
        if isinstance(value, list):
            return [cut_below(item, max_depth, depth + 1) for item in value]
        return {key: cut_below(item, max_depth, depth + 1) for key, item in value.items()}
    return value


def containers_at(value: Any, depth: int, at: int = 1) -> int:
    """How many lists and dicts sit exactly `depth` deep in `value`."""
    if not isinstance(value, list | dict):
        return 0
    if at == depth:
        return 1
    items = value if isinstance(value, list) else value.values()
    return sum(containers_at(item, depth, at + 1) for item in items)


@given(json_values, st.integers(min_value=0, max_value=6), st.booleans())
def test_prune_cuts_exactly_what_is_nested_too_deep(
    value: Any, max_depth: int, indent: bool
) -> None:
    text = json.dumps(value, indent=1 if indent else None)
    pruned, dropped = prune(text, max_depth)
    assert json.loads(pruned) == cut_below(value, max_depth)
    assert dropped == containers_at(value, max_depth + 1)
