"""Strict RFC 8259 parsing of untrusted JSON text (a ConfigMap's hccl.json).

Python's `json` accepts more than RFC 8259 and more than other languages'
parsers do: `NaN`, `Infinity` and `-Infinity`; numbers that overflow to
infinity (`1e999`); escapes of lone surrogates (`"\\udc80"`, plain ASCII in
the ConfigMap), which decode to a str that cannot be UTF-8 encoded; nesting
deep enough to raise RecursionError (or to break a client with a lower
limit); integers only the interpreter's digit limit stops. `loads` refuses
all of them with `NotStrictJson`, whose `reason` is a short label, so what it
returns re-encodes to valid UTF-8 strict JSON.
"""

from __future__ import annotations

import json
import math
import re
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


def loads(text: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Decode `text`, which must be strict JSON nested at most `max_depth` deep."""
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
        )
    except NotStrictJson:
        raise
    except RecursionError:
        raise NotStrictJson(TOO_DEEP, f"nested deeper than {max_depth}") from None
    except ValueError as error:
        raise NotStrictJson(NOT_JSON, f"not JSON ({str(error)[:80]})") from None
    # Fewer brackets than the bound cannot nest deeper: skip the walk.
    if text.count("[") + text.count("{") > max_depth and _deeper_than(value, max_depth):
        raise NotStrictJson(TOO_DEEP, f"nested deeper than {max_depth}")
    if "\\" in text and _SURROGATE_ESCAPE.search(text) and not _encodes(value):
        raise NotStrictJson(NOT_STRICT, "a string holds an escaped lone surrogate")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep (level by level: no recursion)."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            below += [child for child in children if type(child) in _CONTAINERS]
        level = below
    return False


# json.loads builds exactly these types, so a type lookup is enough (and faster).
_CONTAINERS = frozenset({dict, list})


def _encodes(value: Any) -> bool:
    """Whether every string (keys included) of a decoded value is valid UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
