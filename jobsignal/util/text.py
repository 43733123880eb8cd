"""Bounded text of untrusted values, for log lines, replies and terminal tables.

Pure (the job store uses it too): `quote` for a value inside a message,
`clip` for a structured log field. A peer that sends a megabyte id gets at
most a few hundred characters of it anywhere. `cell`, `columns` and
`human_age` print tables as `kubectl get` does (the client commands, the
metrics port's subscriptions page).
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


# -- tables for the terminal, as `kubectl get` prints them ----------------------------


def cell(text: str) -> str:
    """A table cell from server data: no blanks or control characters to break columns."""
    return "".join(c if c.isprintable() and not c.isspace() else "?" for c in text) or "<none>"


def columns(rows: list[list[str]]) -> str:
    """`rows` (the first one the header, if any) as left-aligned columns three spaces apart."""
    if not rows:
        return ""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "   ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# kubectl's steps (its HumanDuration): an age below `bound` seconds is shown in
# `unit`, followed by the remainder in `then` unless that is zero or `then` is "".
_AGE_STEPS = (
    (2 * 60, "s", ""),
    (10 * 60, "m", "s"),
    (3 * 3600, "m", ""),
    (8 * 3600, "h", "m"),
    (48 * 3600, "h", ""),
    (8 * 86400, "d", "h"),
    (2 * 365 * 86400, "d", ""),
    (8 * 365 * 86400, "y", "d"),
)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "y": 365 * 86400}


def human_age(seconds: float) -> str:
    """An age the way kubectl prints one: 45s, 7m3s, 2h10m, 3d4h, 400d, 3y12d."""
    s = max(0, int(seconds))
    unit, then = next(((unit, then) for bound, unit, then in _AGE_STEPS if s < bound), ("y", ""))
    size = _UNIT_SECONDS[unit]
    text = f"{s // size}{unit}"
    rest = (s % size) // _UNIT_SECONDS[then] if then else 0
    return f"{text}{rest}{then}" if rest else text


def human_bytes(count: int) -> str:
    """A byte count for a table: 512B, 1.5KiB, 3.0MiB, 2.0GiB."""
    size = float(max(0, count))
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{int(size)}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}GiB"
