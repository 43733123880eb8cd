"""grpc.health.v1 Health (Check and Watch) with betterproto2 messages.

The answers are those of grpclib's own health service, which the server used
before: an entry's status is SERVING when all its checks are healthy,
UNKNOWN when none has a status yet, NOT_SERVING otherwise; Check on an
unknown entry ends with NOT_FOUND, Watch on one sends SERVICE_UNKNOWN and
stays open. Serving them with the messages generated from
protos/grpc/health/v1/health.proto means that an idle server, probed or not,
never loads the protobuf runtime (docs/architecture.md section 2,
"Health and reflection"); server reflection still describes the service
(jobsignal/rpc/reflection.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from typing import Any

from grpclib.const import Cardinality, Handler, Status
from grpclib.health.check import CheckBase
from grpclib.server import Stream

from jobsignal._proto.grpc.health.v1 import HealthCheckRequest, HealthCheckResponse
from jobsignal._proto.grpc.health.v1 import HealthCheckResponseServingStatus as Serving
from jobsignal.rpc.requests import read_request

HEALTH_SERVICE = "grpc.health.v1.Health"


def service_name(servable: Any) -> str:
    """The gRPC service name of a grpclib servable: "job.Job" for "/job.Job/Register"."""
    path = next(iter(servable.__mapping__()))
    return str(path.split("/")[1])


def combined_status(checks: Collection[CheckBase]) -> Serving:
    statuses = {check.__status__() for check in checks}
    if statuses == {None}:
        return Serving.UNKNOWN
    return Serving.SERVING if statuses == {True} else Serving.NOT_SERVING


async def _sleep_forever() -> None:
    """Until the call is cancelled (the peer ends it, or the server stops)."""
    await asyncio.Event().wait()


class Health:
    """The health entries, by name ("" is the server as a whole), and their checks.

    A request is read as job.Job's are (`requests.read_request`): it must
    come within `request_timeout` seconds, and a call without one ends with
    INVALID_ARGUMENT.
    """

    def __init__(
        self, entries: Mapping[str, Collection[CheckBase]], *, request_timeout: float
    ) -> None:
        self._entries = {name: list(checks) for name, checks in entries.items()}
        self._request_timeout = request_timeout

    def __mapping__(self) -> dict[str, Handler]:
        prefix = f"/{HEALTH_SERVICE}/"
        return {
            prefix + "Check": Handler(
                self.check, Cardinality.UNARY_UNARY, HealthCheckRequest, HealthCheckResponse
            ),
            prefix + "Watch": Handler(
                self.watch, Cardinality.UNARY_STREAM, HealthCheckRequest, HealthCheckResponse
            ),
        }

    async def check(self, stream: Stream[HealthCheckRequest, HealthCheckResponse]) -> None:
        request = await read_request(stream, HealthCheckRequest, self._request_timeout)
        checks = self._entries.get(request.service)
        if checks is None:
            await stream.send_trailing_metadata(status=Status.NOT_FOUND)
            return
        for check in checks:
            await check.__check__()
        status = combined_status(checks) if checks else Serving.SERVING
        await stream.send_message(HealthCheckResponse(status=status))

    async def watch(self, stream: Stream[HealthCheckRequest, HealthCheckResponse]) -> None:
        request = await read_request(stream, HealthCheckRequest, self._request_timeout)
        checks = self._entries.get(request.service)
        if not checks:
            unknown = checks is None
            status = Serving.SERVICE_UNKNOWN if unknown else Serving.SERVING
            await stream.send_message(HealthCheckResponse(status=status))
            await _sleep_forever()  # nothing will change; the peer ends the call
        assert checks is not None
        changed = [await check.__subscribe__() for check in checks]
        try:
            await stream.send_message(HealthCheckResponse(status=combined_status(checks)))
            while True:
                await _first_set(changed)
                for event in changed:
                    if event.is_set():
                        event.clear()
                await stream.send_message(HealthCheckResponse(status=combined_status(checks)))
        finally:
            for check, event in zip(checks, changed, strict=True):
                await check.__unsubscribe__(event)


async def _first_set(events: Collection[asyncio.Event]) -> None:
    """Return once any of `events` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
