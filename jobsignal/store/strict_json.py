"""Strict RFC 8259 parsing of untrusted JSON text (a ConfigMap's hccl.json).

Python's `json` accepts more than RFC 8259 and more than other languages'
parsers do: `NaN`, `Infinity` and `-Infinity`; numbers that overflow to
infinity (`1e999`); escapes of lone surrogates (`"\\udc80"`, plain ASCII in
the ConfigMap), which decode to a str that cannot be UTF-8 encoded; nesting
deep enough to raise RecursionError (or to break a client with a lower
limit); integers only the interpreter's digit limit stops. `loads` refuses
all of them with `NotStrictJson`, whose `reason` is a short label, so what it
returns re-encodes to valid UTF-8 strict JSON.

`loads_items` decodes an object the same way and also returns the items of
one of its lists as compact JSON (`compact`): cut out of the text wherever
the text already holds an item in exactly that form, so a large rank table
is not re-encoded server by server.
"""

from __future__ import annotations

import json
import math
import re
from itertools import chain, compress, repeat
from operator import is_
from typing import Any

#: Nesting bound (objects and arrays): a rank table is 5 deep, and parsers of
#: other languages stop at 500 to 10,000.
MAX_DEPTH = 64
#: Longest number literal: a rank table's numbers are small counts.
MAX_NUMBER_CHARS = 64

NOT_JSON, NOT_STRICT, TOO_DEEP = "not_json", "not_strict", "too_deep"

# A \u escape of a surrogate; a pair is fine, so a hit only means "look closer".
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class NotStrictJson(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _refuse_constant(literal: str) -> Any:
    raise NotStrictJson(NOT_STRICT, f"{literal} is not a JSON number")


def _bounded_int(literal: str) -> int:
    if len(literal) > MAX_NUMBER_CHARS:
        raise NotStrictJson(NOT_STRICT, f"a number of {len(literal)} characters")
    return int(literal)


def _finite_float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise NotStrictJson(NOT_STRICT, f"a number of {len(literal)} characters")
    value = float(literal)
    if not math.isfinite(value):
        raise NotStrictJson(NOT_STRICT, f"a number out of range ({literal[:20]})")
    return value


_DECODER = json.JSONDecoder(
    parse_constant=_refuse_constant, parse_int=_bounded_int, parse_float=_finite_float
)


def compact(value: Any) -> str:
    """`value` as compact JSON, non-ASCII characters as they are."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def loads(text: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Decode `text`, which must be strict JSON nested at most `max_depth` deep."""
    try:
        value = _DECODER.decode(text)
    except NotStrictJson:
        raise
    except RecursionError:
        raise NotStrictJson(TOO_DEEP, f"nested deeper than {max_depth}") from None
    except ValueError as error:
        raise NotStrictJson(NOT_JSON, f"not JSON ({str(error)[:80]})") from None
    # Fewer brackets than the bound cannot nest deeper: skip the walk.
    if _brackets(text) > max_depth and _deeper_than(value, max_depth):
        raise _too_deep(max_depth)
    _check_escapes(text, value)
    return value


def loads_items(text: str, key: str, *, max_depth: int = MAX_DEPTH) -> tuple[Any, list[str] | None]:
    """`loads(text)`, and when that is an object whose `key` holds a list of
    objects, those objects, each as `compact` encodes it (None otherwise).

    Text without whitespace or escapes is decoded member by member and the
    list item by item, so each item's place in it is known; when it is the
    object's compact encoding (no fraction, exponent or -0 either, and no
    repeated key) the items are cut out of it instead of encoded again.
    Everything else goes through `loads`, with the same checks and errors.
    """
    scan = _Scan()
    scanned = None if _has_space_or_escape(text) else scan.object(text, key)
    if scanned is None:
        value = loads(text, max_depth=max_depth)
        items = value.get(key) if type(value) is dict else None
        if type(items) is not list or not all(type(item) is dict for item in items):
            return value, None
        return value, [compact(item) for item in items]
    table, spans = scanned
    members = _members(table, max_depth)
    if members < 0:
        raise _too_deep(max_depth)
    # (Text without a backslash holds no escaped surrogate.)
    if spans is None:
        return table, None
    # Without escapes every '"' delimits a string, so '":' ends a key: as many
    # as the decoded objects' members means that no key was repeated.
    if scan.as_encoded and text.count('":') == members:
        return table, [text[start:end] for start, end in spans]
    return table, [compact(item) for item in table[key]]


def _too_deep(max_depth: int) -> NotStrictJson:
    return NotStrictJson(TOO_DEEP, f"nested deeper than {max_depth}")


def _brackets(text: str) -> int:
    """Opening brackets in `text`, counting those in strings: a bound on its nesting."""
    return text.count("[") + text.count("{")


def _check_escapes(text: str, value: Any) -> None:
    if "\\" in text and _SURROGATE_ESCAPE.search(text) and not _encodes(value):
        raise NotStrictJson(NOT_STRICT, "a string holds an escaped lone surrogate")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep (level by level: no recursion)."""
    return _members(value, limit) < 0


def _members(value: Any, limit: int) -> int:
    """How many members the objects in `value` have, at every level; -1 when
    containers nest more than `limit` deep. Level by level (no recursion),
    with the iteration in C: a 1,000-server rank table has 10,000 containers."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = members = 0
    while level:
        depth += 1
        if depth > limit:
            return -1
        types = list(map(type, level))
        dicts = list(compress(level, map(is_, types, repeat(dict))))
        members += sum(map(len, dicts))
        children = list(chain.from_iterable(map(dict.values, dicts)))
        if len(dicts) < len(level):
            children += chain.from_iterable(compress(level, map(is_, types, repeat(list))))
        level = list(compress(children, map(_is_container, map(type, children))))
    return members


# json.loads builds exactly these types, so a type lookup is enough (and faster).
_CONTAINERS = frozenset({dict, list})
_is_container = _CONTAINERS.__contains__


def _encodes(value: Any) -> bool:
    """Whether every string (keys included) of a decoded value is valid UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- decoding compact text member by member --------------------------------------------

Spans = list[tuple[int, int]]


def _has_space_or_escape(text: str) -> bool:
    return any(char in text for char in " \t\n\r\\")  # JSON's whitespace, a backslash


class _NotObjects(ValueError):
    pass


class _Scan:
    """One member-by-member decoding of text without whitespace, noting number
    literals that `compact` would write differently (a fraction or exponent, -0)."""

    def __init__(self) -> None:
        self.as_encoded = True
        self._decode = json.JSONDecoder(
            parse_constant=_refuse_constant, parse_int=self._int, parse_float=self._float
        ).raw_decode

    def _int(self, literal: str) -> int:
        if literal == "-0":
            self.as_encoded = False
        return _bounded_int(literal)

    def _float(self, literal: str) -> float:
        self.as_encoded = False
        return _finite_float(literal)

    def object(self, text: str, key: str) -> tuple[dict[str, Any], Spans | None] | None:
        """Decode `text` as an object whose `key` (if a list) is decoded item by item.

        Returns the object, as `json.loads` makes it (a repeated name keeps its
        first place and its last value), and where each item of `key`'s list
        starts and ends in `text` (None when `key` holds no list). None when
        `text` is not an object, not valid strict JSON, has whitespace between
        the members or the items, or `key`'s list holds other things than
        objects: for `loads` to judge.
        """
        try:
            return self._members(text, key)
        except (ValueError, RecursionError, IndexError):
            return None

    def _members(self, text: str, key: str) -> tuple[dict[str, Any], Spans | None] | None:
        decode = self._decode
        if text[:1] != "{":
            return None
        table: dict[str, Any] = {}
        spans: Spans | None = None
        at = 1
        if text[at] == "}":
            at += 1
        else:
            while True:
                if text[at] != '"':
                    return None
                name, at = decode(text, at)
                if text[at] != ":":
                    return None
                if name == key and text[at + 1] == "[":
                    table[name], spans, at = self._list(text, at + 1)
                else:
                    table[name], at = decode(text, at + 1)
                    if name == key:
                        spans = None  # the last value counts, as in json.loads
                if text[at] == ",":
                    at += 1
                elif text[at] == "}":
                    at += 1
                    break
                else:
                    return None
        return (table, spans) if at == len(text) else None

    def _list(self, text: str, at: int) -> tuple[list[Any], Spans, int]:
        """Decode the list at `text[at]` ("["): its items, their spans, its end."""
        decode = self._decode
        items: list[Any] = []
        spans: Spans = []
        if text[at + 1] == "]":
            return items, spans, at + 2
        at += 1
        while True:
            item, end = decode(text, at)
            if type(item) is not dict:
                raise _NotObjects  # not for cutting out: let `loads` decide
            items.append(item)
            spans.append((at, end))
            if text[end] == "]":
                return items, spans, end + 1
            if text[end] != ",":
                raise ValueError("expected , or ]")
            at = end + 1
