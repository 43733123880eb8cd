"""UUIDs in their text form, exactly as ``str(uuid.uuid4())`` and ``str(uuid.uuid5(...))``.

The standard library's `uuid` module loads libuuid (its `_uuid` extension) at
import, for the time-based UUIDs jobsignal never makes: about 0.35 MB of an
idle server's memory (docs/architecture.md section 10, "Memory at idle").
The two versions jobsignal makes are a few lines each (RFC 9562, sections
5.4 and 5.5).
"""

from __future__ import annotations

import hashlib
import os


def random_uuid() -> str:
    """A version 4 UUID: 122 random bits from the operating system."""
    return _text(os.urandom(16), version=4)


def name_uuid(namespace: bytes, name: str) -> str:
    """The version 5 UUID of `name` (UTF-8) under `namespace` (its 16 bytes)."""
    return _text(hashlib.sha1(namespace + name.encode("utf-8")).digest()[:16], version=5)


def _text(raw: bytes, *, version: int) -> str:
    value = bytearray(raw)
    value[6] = (value[6] & 0x0F) | (version << 4)
    value[8] = (value[8] & 0x3F) | 0x80  # the RFC's variant
    text = value.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
