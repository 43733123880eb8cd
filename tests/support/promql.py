"""The series a PromQL expression selects, for checking alerts and dashboards offline.

Not a PromQL parser: a tokenizer that knows what is not a series name
(functions, aggregations and their `by`/`without` lists, keywords, numbers,
durations, strings, Grafana's `$variables`) and reads each selector's metric
name and label matchers. Enough for the expressions of deploy/, which the
tests hold to it; a construct it does not know is an error, not a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<range>\[[^\]]*\])
    |(?P<number>[0-9][0-9a-zA-Z.]*)
    |(?P<variable>\$\{?\w+\}?)
    |(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
    |(?P<operator>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}])
    """,
    re.VERBOSE,
)

AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
# Followed by a parenthesised list of label names.
GROUPINGS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"})


@dataclass(frozen=True)
class Selector:
    """One series selector: its metric name and its label matchers (label, op, value)."""

    metric: str
    matchers: tuple[tuple[str, str, str], ...] = ()


@dataclass
class Parsed:
    selectors: list[Selector] = field(default_factory=list)
    # Label names of by/without/on/ignoring/group_* lists.
    grouping_labels: set[str] = field(default_factory=set)


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise ValueError(f"{expr!r}: cannot read from {expr[position:]!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text[1:-1])


def parse(expr: str) -> Parsed:
    """The selectors and grouping labels of `expr`."""
    tokens = _tokens(expr)
    parsed = Parsed()
    index = 0

    def at(offset: int) -> tuple[str, str]:
        position = index + offset
        return tokens[position] if position < len(tokens) else ("end", "")

    def matchers() -> tuple[tuple[str, str, str], ...]:
        """The `{label op "value", ...}` at `index` (which is the `{`)."""
        nonlocal index
        found: list[tuple[str, str, str]] = []
        index += 1
        while at(0) != ("operator", "}"):
            (kind_l, label), (_, op), (kind_v, value) = at(0), at(1), at(2)
            if kind_l != "name" or op not in ("=", "!=", "=~", "!~") or kind_v != "string":
                raise ValueError(f"{expr!r}: bad label matcher at {tokens[index : index + 3]}")
            found.append((label, op, _unquote(value)))
            index += 3
            if at(0) == ("operator", ","):
                index += 1
        index += 1
        return tuple(found)

    while index < len(tokens):
        kind, text = at(0)
        if kind == "name" and text in GROUPINGS:
            if at(1) != ("operator", "("):
                raise ValueError(f"{expr!r}: {text} without a label list")
            index += 2
            while at(0) != ("operator", ")"):
                label_kind, label = at(0)
                if label_kind == "name":
                    parsed.grouping_labels.add(label)
                elif at(0) != ("operator", ","):
                    raise ValueError(f"{expr!r}: bad label list after {text}")
                index += 1
            index += 1
        elif kind == "name" and at(1) == ("operator", "("):
            index += 1  # a function call, or an aggregation without a grouping
        elif kind == "name" and (text in AGGREGATIONS or text in KEYWORDS):
            index += 1
        elif kind == "name":
            index += 1
            found = matchers() if at(0) == ("operator", "{") else ()
            parsed.selectors.append(Selector(text, found))
        elif (kind, text) == ("operator", "{"):
            raise ValueError(f"{expr!r}: a selector without a metric name")
        else:
            index += 1
    return parsed


def metric_names(expr: str) -> set[str]:
    return {selector.metric for selector in parse(expr).selectors}
