"""`watch_jobs`: job events in a trio program, without a gRPC server.

The same watcher, store and broadcaster a server runs (`app.run_source`), with
one in-process consumer instead of gRPC streams. See `jobsignal.events` for
what is delivered and the slow-consumer rule.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from jobsignal.app import choose_connection, run_source
from jobsignal.config import Config
from jobsignal.events import JobEvents
from jobsignal.fanout import Broadcaster
from jobsignal.status import SourceStatus
from jobsignal.store import JobStore
from jobsignal.util.blocks import background_tasks


@asynccontextmanager
async def watch_jobs(
    config: Config, *, environ: Mapping[str, str] = os.environ
) -> AsyncIterator[JobEvents]:
    """Watch the cluster `config` names and yield its job events.

    Enters once every watched scope's first LIST is applied (until then the
    watcher retries an unreachable API, so put a deadline around it if you
    need one); the channel then starts with an ADDED event for every live job,
    and carries every change after it. A broken kubeconfig is a `ConfigError`
    at once. Leaving the block, or cancelling it, stops the watcher and closes
    its connections. Bounds: `config.max_pending_messages` and
    `config.max_pending_bytes`, as for a gRPC stream.
    """
    connection = choose_connection(config, environ)
    store, status = JobStore(), SourceStatus()
    broadcaster = Broadcaster.from_config(config, jobs=store)  # the store owns the job state
    async with background_tasks() as nursery:
        await nursery.start(run_source, config, connection, store, broadcaster, status)
        await status.ready.wait()
        # Subscribed with the state loaded, in one step: the first LIST is
        # owed to the consumer, not counted as a backlog, and nothing falls
        # between it and the live events.
        events = JobEvents(broadcaster, snapshot=True)
        try:
            yield events
        finally:
            events.close()
