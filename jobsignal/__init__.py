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

import importlib
from typing import TYPE_CHECKING

from jobsignal.config import Config, ConfigError, configure
from jobsignal.version import __version__ as __version__

if TYPE_CHECKING:
    from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
    from jobsignal.app import RunningJobsignal
    from jobsignal.app import run_jobsignal as serve
    from jobsignal.client import open_subscription, subscribe
    from jobsignal.client_options import SubscribeFailed, SubscribeOptions
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

# Imported on first use, so that `jobsignal serve` loads none of the client (with
# grpclib's) and the in-process events API (about 0.1 MB at idle), and the command
# line's --help and `check` load no server. Importing jobsignal.rpc (the server, the
# client) installs the grpclib adapter (jobsignal/rpc/_grpclib.py).
_LAZY_NAMES = {
    "serve": "app",
    "RunningJobsignal": "app",
    "JobSummarySignal": "_proto.job",
    "JobSummarySignalList": "_proto.job",
    "SubscribeFailed": "client_options",
    "SubscribeOptions": "client_options",
    "open_subscription": "client",
    "subscribe": "client",
    "watch_jobs": "embed",
    **dict.fromkeys(
        (
            "EventKind",
            "FellBehind",
            "JobEvent",
            "JobEvents",
            "JobState",
            "RankDevice",
            "RankServer",
            "RankTable",
        ),
        "events",
    ),
}
# Public names that stand for another name in their module.
_ALIASES = {"serve": "run_jobsignal"}


def __getattr__(name: str) -> object:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'jobsignal' has no attribute {name!r}")
    module = importlib.import_module(f"jobsignal.{module_name}")
    value = getattr(module, _ALIASES.get(name, name))
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
