"""Server reflection (grpc.reflection.v1 and v1alpha), loaded on its first call.

grpclib's reflection service answers from protobuf descriptor pools, and the
protobuf runtime is the largest import the server would otherwise carry at
idle (docs/architecture.md section 2, "Health and reflection"). So the
server maps the reflection methods to `LazyReflection`, and only the first
reflection request imports grpclib's service and builds the pools; the
answers are grpclib's, as before.

job.proto's descriptor comes from jobsignal/_proto/descriptors.py (generated
with the messages) into a pool of its own; grpclib's health and reflection
files live in protobuf's default pool, where importing their generated
modules registers them. Lookups try each pool in turn (`ChainedPool`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from grpclib.const import Cardinality, Handler
from grpclib.server import Stream

REFLECTION_PATHS = tuple(
    f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    for version in ("v1", "v1alpha")
)


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


def own_pool() -> Any:
    """A protobuf DescriptorPool of jobsignal's own files (job.proto)."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    from jobsignal._proto.descriptors import FILES

    pool = descriptor_pool.DescriptorPool()
    for serialized in FILES.values():
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(serialized))
    return pool


def server_pool() -> ChainedPool:
    """jobsignal's own files, then protobuf's default pool with grpclib's health and
    reflection files (imported here, so reflection finds them there)."""
    from google.protobuf import descriptor_pool
    from grpclib.health.v1 import health_pb2  # noqa: F401  (registers its file)

    return ChainedPool([own_pool(), descriptor_pool.Default()])


class _Deferred:
    """A message type named now and resolved on first use: what grpclib hands the
    codec to decode a request with (`FromString`). Replies are protobuf messages,
    which the codec asks to encode themselves."""

    def __init__(self, name: str, resolve: Callable[[], Any]) -> None:
        self.__name__ = name
        self._resolve = resolve

    def FromString(self, data: bytes) -> Any:
        return self._resolve().FromString(data)


class LazyReflection:
    """Both reflection services for `services`, imported and built by the first
    call (grpclib's `ServerReflection.extend`), which every later call shares."""

    def __init__(self, services: Collection[Any]) -> None:
        self._services = list(services)
        self._handlers: dict[str, Handler] | None = None

    def _loaded(self) -> dict[str, Handler]:
        if self._handlers is None:
            from grpclib.reflection.service import ServerReflection

            extended = ServerReflection.extend(self._services, pool=server_pool())
            handlers: dict[str, Handler] = {}
            for reflection in extended[len(self._services) :]:
                handlers.update(reflection.__mapping__())
            self._handlers = handlers
        return self._handlers

    def __mapping__(self) -> dict[str, Handler]:
        return {path: self._handler(path) for path in REFLECTION_PATHS}

    def _handler(self, path: str) -> Handler:
        async def call(stream: Stream[Any, Any]) -> None:
            await self._loaded()[path].func(stream)

        def resolve(field: str) -> Callable[[], Any]:
            return lambda: getattr(self._loaded()[path], field)

        request = _Deferred("ServerReflectionRequest", resolve("request_type"))
        reply = _Deferred("ServerReflectionResponse", resolve("reply_type"))
        return Handler(call, Cardinality.STREAM_STREAM, request, reply)
