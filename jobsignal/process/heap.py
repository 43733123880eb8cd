"""Giving the C heap's free pages back to the operating system.

A LIST parses every job's ConfigMaps at once. What it allocates on the way
(page bodies, decoded JSON, rank tables being compared) is freed once the
LIST is applied, but glibc's allocator keeps the pages, except free space at
the very top of its heap: without help the server's RSS stays at the highest
LIST peak it ever had. glibc's `malloc_trim(0)` returns every free page of
its heaps, wherever it lies (docs/architecture.md section 10, "Supported
Pythons and dependencies").

Other C libraries (musl, macOS) have no such call; there this does nothing.
CPython's small-object arenas need no help: it frees an arena once it is empty.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

_Trim = Callable[[int], int]


@functools.cache
def _malloc_trim() -> _Trim | None:
    """glibc's malloc_trim, looked up once; None under another C library."""
    try:
        # The symbols the process has loaded already, the C library's among them
        # (no search for the library's file, which would run ldconfig).
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    found: _Trim = trim
    return found


def can_release() -> bool:
    """Whether this process's C library can give free heap pages back (glibc)."""
    return _malloc_trim() is not None


def release_free_memory() -> bool:
    """Give every free page of the C heap back to the operating system; False
    where the C library cannot (nothing was done)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
