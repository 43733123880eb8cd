"""Bounded text of untrusted values, for log lines and replies.

Pure (the job store uses it too): `quote` for a value inside a message,
`clip` for a structured log field. A peer that sends a megabyte id gets at
most a few hundred characters of it anywhere.
"""

from __future__ import annotations

QUOTE_LIMIT = 200


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)`, cut to at most `limit` characters (plus a note of what was cut)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit} more characters)"


def clip(value: str, limit: int = QUOTE_LIMIT) -> str:
    """An untrusted string for a structured log field: at most `limit` characters."""
    return value if len(value) <= limit else value[:limit] + "..."
