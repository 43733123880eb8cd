"""Descriptor lookups for server reflection across both descriptor pools.

betterproto2 registers job.proto in a pool of its own, while grpclib's health
and reflection protos live in protobuf's default pool; reflection must answer
for all three services, so lookups try each pool in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChainedPool:
    def __init__(self, pools: Sequence[Any]) -> None:
        self._pools = pools

    def _first(self, method: str, *args: Any) -> Any:
        error: KeyError | None = None
        for pool in self._pools:
            try:
                return getattr(pool, method)(*args)
            except KeyError as missing:
                error = missing
        raise error or KeyError(args)

    def FindFileByName(self, name: str) -> Any:
        return self._first("FindFileByName", name)

    def FindFileContainingSymbol(self, symbol: str) -> Any:
        return self._first("FindFileContainingSymbol", symbol)

    def FindMessageTypeByName(self, name: str) -> Any:
        return self._first("FindMessageTypeByName", name)

    def FindExtensionByNumber(self, message: Any, number: int) -> Any:
        return self._first("FindExtensionByNumber", message, number)

    def FindAllExtensions(self, message: Any) -> Any:
        return self._first("FindAllExtensions", message)
