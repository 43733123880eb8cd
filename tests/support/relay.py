"""A relay server for tests: `jobsignal serve --source relay` in front of an upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from jobsignal.app import RunningJobsignal
from jobsignal.config import load_config
from jobsignal.sim.emulator import KubeEmulator

from .kube_server import open_configured_server, open_kube_server


@asynccontextmanager
async def open_relay_server(
    upstream_port: int, *, ready: bool = True, **flags: str
) -> AsyncIterator[RunningJobsignal]:
    """A relay on 127.0.0.1 and an ephemeral port, of the job.Job server at
    127.0.0.1:`upstream_port`; with `ready`, returns once its first snapshot is
    applied. `flags` are settings by name, as `load_config` takes them."""
    settings = {
        "listen": "127.0.0.1:0",
        "source": "relay",
        "upstream": f"127.0.0.1:{upstream_port}",
        "shutdown_grace": "1",
    }
    config = load_config({**settings, **flags}, {})
    async with open_configured_server(config, ready=ready) as server:
        yield server


async def serve_upstream(
    emu: KubeEmulator,
    tmp_path: Path,
    stop: trio.Event,
    listen: str,
    *,
    task_status: trio.TaskStatus[RunningJobsignal] = trio.TASK_STATUS_IGNORED,
) -> None:
    """An upstream jobsignal watching `emu` on `listen` until `stop` is set: a task
    of its own, so a relay opened after it can outlive it (and see it restart)."""
    async with open_kube_server(
        emu, tmp_path, ready=True, shutdown_grace="1", listen=listen
    ) as server:
        task_status.started(server)
        await stop.wait()
