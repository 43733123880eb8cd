"""jobsignal: stream Ascend job-summary ConfigMaps to ClusterD-compatible gRPC clients.

The public API for trio programs that embed jobsignal; everything else in
the package is private and may change.

Run a server inside your own nursery::

    config = jobsignal.configure(listen="127.0.0.1:0", source="demo")
    server = await nursery.start(jobsignal.serve, config)   # a RunningJobsignal
    await server.ready.wait()    # the first LIST is applied; also server.host, server.port,
                                 # server.addresses, server.metrics_port
    server.request_shutdown()    # streams end with UNAVAILABLE "server shutting down"
    await server.stopped.wait()

Subscribe from trio, with keepalive, re-registration and backoff built in::

    options = jobsignal.SubscribeOptions("127.0.0.1", server.port, role="CCAgent")
    async with jobsignal.open_subscription(options) as signals:
        async for signal in signals:   # JobSummarySignal (or JobSummarySignalList with list_mode)
            print(signal.job_name, signal.job_status)

Job events in-process, without gRPC (plain dataclasses; see jobsignal.events)::

    async with jobsignal.watch_jobs(config) as events:      # a watcher, no server
        async for event in events:                          # JobEvent
            print(event.kind, event.job.job_name, event.job.job_status, event.uuid)

    async with server.open_subscription() as events:        # on a running server
        ...
"""

from typing import TYPE_CHECKING

from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.app import RunningJobsignal
from jobsignal.app import run_jobsignal as serve
from jobsignal.config import Config, ConfigError, configure
from jobsignal.embed import watch_jobs
from jobsignal.events import (
    EventKind,
    FellBehind,
    JobEvent,
    JobEvents,
    JobState,
    RankDevice,
    RankServer,
    RankTable,
)
from jobsignal.rpc import _grpclib
from jobsignal.version import __version__ as __version__

if TYPE_CHECKING:
    from jobsignal.client import SubscribeFailed, SubscribeOptions, open_subscription, subscribe

# Before any grpclib handler or call runs on trio-asyncio (Python 3.12+).
_grpclib.install()

# The client (with grpclib's) is imported on first use: a server never loads it.
_CLIENT_NAMES = frozenset({"SubscribeFailed", "SubscribeOptions", "open_subscription", "subscribe"})


def __getattr__(name: str) -> object:
    if name not in _CLIENT_NAMES:
        raise AttributeError(f"module 'jobsignal' has no attribute {name!r}")
    from jobsignal import client

    value = getattr(client, name)
    globals()[name] = value  # found directly from now on
    return value


__all__ = [
    "Config",
    "ConfigError",
    "EventKind",
    "FellBehind",
    "JobEvent",
    "JobEvents",
    "JobState",
    "JobSummarySignal",
    "JobSummarySignalList",
    "RankDevice",
    "RankServer",
    "RankTable",
    "RunningJobsignal",
    "SubscribeFailed",
    "SubscribeOptions",
    "configure",
    "open_subscription",
    "serve",
    "subscribe",
    "watch_jobs",
]
