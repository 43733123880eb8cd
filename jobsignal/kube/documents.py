"""Decoding the API server's JSON documents (LIST pages, WATCH lines, Status bodies).

Python's `json` raises RecursionError on nesting deeper than about 1,000
levels on 3.11, 1,500 on 3.12 and 10,000 on 3.13, where the API server's
decoder allows 10,000. A tenant who can write a ConfigMap can nest its
`metadata.managedFields` that deep, and the API server then sends it in every
LIST and WATCH: raised from the watcher, that would stop it for every tenant.
So a document too deep for `json` is decoded again with every value nested
deeper than `MAX_DEPTH` replaced by null: nothing the watcher reads is nested
that deep (a LIST item's `data` is at depth 4), and the rest of the object is
applied as usual. Text too malformed to decode raises `ValueError`.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: Values nested deeper than this are dropped (replaced by null) from a
#: document `json` cannot decode whole. A ConfigMap with its managedFields is
#: about 10 deep; strict_json.MAX_DEPTH bounds rank tables the same way.
MAX_DEPTH = 64

# A JSON string (skipped whole: brackets inside it do not count), an opening
# or a closing bracket. Group numbers are `lastindex`.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|([\[{])|([\]}])', re.DOTALL)
_OPENING, _CLOSING = 1, 2


def loads(data: bytes | str) -> tuple[Any, int]:
    """The decoded document, and how many values nested too deep were dropped.

    Bytes are UTF-8, as the API server sends them; an invalid sequence
    becomes U+FFFD, for the store to judge, instead of failing the document.
    """
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    try:
        return json.loads(text), 0
    except RecursionError:
        pruned, dropped = prune(text, MAX_DEPTH)
        # At most MAX_DEPTH deep now: this raises ValueError, if anything.
        return json.loads(pruned), dropped


def prune(text: str, max_depth: int) -> tuple[str, int]:
    """`text` with every array or object nested deeper than `max_depth` replaced
    by ``null``, and how many were. Brackets inside strings do not count.
    ValueError when the brackets do not balance: the text is not JSON.

    What is dropped is not read, so a fault inside it goes unnoticed; what is
    kept is cut out of `text` unchanged, for `json` to judge.
    """
    kept: list[str] = []
    kept_until = 0
    depth = 0
    dropped = 0
    cut_from = -1
    for token in _TOKEN.finditer(text):
        kind = token.lastindex
        if kind == _OPENING:
            depth += 1
            if depth == max_depth + 1:
                cut_from = token.start()
        elif kind == _CLOSING:
            if depth == max_depth + 1:
                kept.append(text[kept_until:cut_from])
                kept.append("null")
                kept_until = token.end()
                dropped += 1
            depth -= 1
            if depth < 0:
                break
    if depth != 0:
        raise ValueError("brackets that do not balance")
    kept.append(text[kept_until:])
    return "".join(kept), dropped
