"""strict_json.loads_items: the same decoding, checks and errors as `loads`, and
the objects of a list as exactly the text `compact` makes of them, whether they
were cut out of the input (written compactly) or encoded again (anything else)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobsignal.store import strict_json
from jobsignal.store.strict_json import MAX_DEPTH, NotStrictJson, compact, loads, loads_items

KEY = "server_list"

# A JSON document as written, repeated keys included: a scalar, ("number",
# literal) as written, ("list", items) or ("object", [(name, value), ...]).
Node = Any


def mostly(
    common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int
) -> st.SearchStrategy[Any]:
    """`common`, and `rare` about once in `one_in` draws."""
    return st.integers(0, one_in - 1).flatmap(lambda n: rare if n == one_in // 2 else common)


# Plain strings, which a compact text holds as they are, and strings that
# need escapes (or hold a lone surrogate) or hold a space.
PLAIN = st.lists(
    st.sampled_from(["a", "é", ":", "{", "[", "]", ",", "1.5", "-0", '":']), max_size=4
).map("".join)
AWKWARD = st.lists(
    st.sampled_from(['"', "\\", "\n", "\x01", "\udc80", " ", "a"]), min_size=1, max_size=3
).map("".join)
# Number literals json decodes to values it encodes differently (and some it does not).
LITERALS = st.sampled_from(["-0", "0", "1.50", "1E2", "-0.0", "2e-3", "10", "-7"])
CLEAN = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    PLAIN,
    st.tuples(st.just("number"), LITERALS),
)
SCALARS = mostly(
    CLEAN, st.one_of(st.floats(allow_nan=False, allow_infinity=False), AWKWARD), one_in=12
)
NAMES = st.sampled_from(["a", "b", "device", KEY, 'q"', "é"])


def nodes(max_leaves: int = 12) -> st.SearchStrategy[Node]:
    return st.recursive(
        SCALARS,
        lambda children: st.one_of(
            st.tuples(st.just("list"), st.lists(children, max_size=4)),
            st.tuples(st.just("object"), st.lists(st.tuples(NAMES, children), max_size=4)),
        ),
        max_leaves=max_leaves,
    )


def tables() -> st.SearchStrategy[Node]:
    """Mostly objects with a list under KEY (a rank table's shape), now and then
    with KEY twice."""
    item = st.tuples(st.just("object"), st.lists(st.tuples(NAMES, nodes(6)), max_size=4))
    server_list = st.tuples(st.just("list"), st.lists(st.one_of(item, item, nodes(3)), max_size=5))
    others = st.lists(st.tuples(NAMES.filter(lambda name: name != KEY), nodes(4)), max_size=3)
    repeated = mostly(st.just([]), st.tuples(st.just(KEY), nodes(3)).map(lambda p: [p]), 4)
    with_list = st.builds(
        lambda items, others, again, at: (
            "object",
            [*others[:at], (KEY, items), *others[at:], *again],
        ),
        server_list,
        others,
        repeated,
        st.integers(0, 3),
    )
    return mostly(with_list, st.one_of(st.tuples(st.just("object"), others), nodes(4)), 5)


def render(node: Node, style: str) -> str:
    """The text of `node`: "compact", "ascii" (escapes), "spaced" or "pretty"."""
    comma, colon, ascii_only = (
        (", ", ": ", False) if style in ("spaced", "pretty") else (",", ":", False)
    )
    if style == "ascii":
        ascii_only = True
    newline = "\n " if style == "pretty" else ""
    if isinstance(node, tuple):
        kind, content = node
        if kind == "number":
            return str(content)
        if kind == "list":
            return "[" + newline + comma.join(render(item, style) for item in content) + "]"
        parts = [
            json.dumps(name, ensure_ascii=ascii_only) + colon + render(value, style)
            for name, value in content
        ]
        return "{" + newline + comma.join(parts) + newline + "}"
    return json.dumps(node, ensure_ascii=ascii_only)


def outcome(decode: Any) -> tuple[str, Any]:
    try:
        return "ok", decode()
    except NotStrictJson as error:
        return "refused", error.reason


def expected(text: str, **kwargs: Any) -> tuple[str, Any]:
    def decode() -> tuple[Any, list[str] | None]:
        value = loads(text, **kwargs)
        items = value.get(KEY) if isinstance(value, dict) else None
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            return value, None
        return value, [compact(item) for item in items]

    return outcome(decode)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables(), st.sampled_from(["compact", "compact", "compact", "ascii", "spaced", "pretty"]))
def test_loads_items_agrees_with_loads_and_compact(table: Node, style: str) -> None:
    text = render(table, style)
    assert outcome(lambda: loads_items(text, KEY)) == expected(text)


@pytest.mark.parametrize(
    ("text", "items"),
    [
        ('{"server_list":[{"a":1},{"b":[true,null]}]}', ['{"a":1}', '{"b":[true,null]}']),
        ('{"server_list":[{"a":1,"a":2}],"x":0}', ['{"a":2}']),  # a key repeated in an item
        (
            '{"server_list":[{"n":-0},{"f":1.50},{"e":1E2}]}',
            ['{"n":0}', '{"f":1.5}', '{"e":100.0}'],
        ),
        ('{"server_list":[{"n":-0}]}', ['{"n":0}']),
        ('{"server_list":[{"f":2.5}]}', ['{"f":2.5}']),
        ('{"server_list":[ {"a" : "x y"} ]}', ['{"a":"x y"}']),
        ('{"server_list":[{"a":"\\u00e9\\/"}]}', ['{"a":"é/"}']),
        ('{"server_list":[1],"server_list":[{"a":2}]}', ['{"a":2}']),  # the last one counts
        ('{"server_list":[{"a":1}],"server_list":"x"}', None),
        ('{"server_list":[]}', []),
        ('{"server_list":[{"a":1},2]}', None),  # not a list of objects
        ('{"status":"initializing"}', None),
        ("[1,2]", None),
    ],
)
def test_items_are_their_compact_encoding(text: str, items: list[str] | None) -> None:
    value, texts = loads_items(text, KEY)
    assert value == json.loads(text)
    assert texts == items


def test_compact_items_are_cut_out_not_encoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = [{"device": [{"device_id": str(d), "rank_id": str(d)} for d in range(8)]}] * 3
    text = compact({"status": "complete", KEY: servers, "total": 24})
    encoded: list[Any] = []

    def counted(value: Any) -> str:
        encoded.append(value)
        return compact(value)

    monkeypatch.setattr(strict_json, "compact", counted)
    _, texts = loads_items(text, KEY)
    assert encoded == []
    assert texts == [json.dumps(server, separators=(",", ":")) for server in servers]


def nested(depth: int) -> str:
    """A value `depth` levels deep."""
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["item", "header"])
def test_nesting_is_bounded_in_the_items_and_the_other_members(where: str) -> None:
    def table(depth: int) -> str:
        # The table is level 1, the list 2, an item 3.
        if where == "item":
            return '{"server_list":[{"a":' + nested(depth - 3) + "}]}"
        return '{"server_list":[],"x":' + nested(depth - 1) + "}"

    loads_items(table(MAX_DEPTH), KEY)
    with pytest.raises(NotStrictJson) as refused:
        loads_items(table(MAX_DEPTH + 1), KEY)
    assert refused.value.reason == strict_json.TOO_DEEP
    assert expected(table(MAX_DEPTH + 1)) == ("refused", strict_json.TOO_DEEP)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"server_list":[{"a":NaN}]}', strict_json.NOT_STRICT),
        ('{"server_list":[{"a":1e999}]}', strict_json.NOT_STRICT),
        ('{"server_list":[{"a":' + "9" * 65 + "}]}", strict_json.NOT_STRICT),
        ('{"server_list":[{"a":"\\udc80"}]}', strict_json.NOT_STRICT),
        ('{"server_list":[{"a":1}]} x', strict_json.NOT_JSON),
        ('{"server_list":[{"a":1},]}', strict_json.NOT_JSON),
        ('{"server_list":[{"a":1}}', strict_json.NOT_JSON),
        ('{"server_list":[{"a":"\x01"}]}', strict_json.NOT_JSON),
        ('\ufeff{"server_list":[]}', strict_json.NOT_JSON),
        ('{"server_list":[' + nested(100_000) + "]}", strict_json.TOO_DEEP),
    ],
)
def test_hostile_tables_are_refused_as_loads_refuses_them(text: str, reason: str) -> None:
    assert outcome(lambda: loads_items(text, KEY)) == ("refused", reason)
    assert expected(text) == ("refused", reason)
