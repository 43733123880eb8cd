"""The whole server as `jobsignal serve --kubeconfig` runs it, against the emulator.

`open_kube_server` runs `run_jobsignal` with a Config from `load_config`,
reaching the emulator through a kubeconfig with its bearer token, so the real
credential path is used; `subscribe` connects a grpcio client to it;
`take_fault` makes the emulator's next watch fail as a fault says.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.config import Config, load_config
from jobsignal.sim.emulator import Drop, ExpireWatch, KubeEmulator

from .cluster import write_kubeconfig
from .grpcio import GrpcioClients, GrpcioStream
from .threads import in_thread
from .waiting import wait_until


def target(server: RunningJobsignal) -> str:
    return f"127.0.0.1:{server.port}"


@asynccontextmanager
async def open_kube_server(
    emu: KubeEmulator,
    tmp_path: Path,
    *,
    ready: bool = False,
    settle_memory: bool = False,
    **flags: str,
) -> AsyncIterator[RunningJobsignal]:
    """`jobsignal serve` on 127.0.0.1 and an ephemeral port, watching `emu`.

    With `ready`, returns once the first LIST is loaded; `settle_memory` as
    `run_jobsignal` takes it (the CLI asks for it). `flags` are settings by
    name, as `load_config` takes them (e.g. `shutdown_grace="2"`).
    """
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
    config = load_config(
        {"listen": "127.0.0.1:0", "source": "kubernetes", "kubeconfig": str(kubeconfig), **flags},
        {},
    )
    async with open_configured_server(config, ready=ready, settle_memory=settle_memory) as server:
        yield server


@asynccontextmanager
async def open_configured_server(
    config: Config, *, ready: bool = False, settle_memory: bool = False
) -> AsyncIterator[RunningJobsignal]:
    """`run_jobsignal(config)` for the block, shut down gracefully after it; with
    `ready`, returns once its source's first LIST (or snapshot) is applied."""
    raised: BaseException | None = None
    async with trio.open_nursery() as nursery:
        server: RunningJobsignal = await nursery.start(
            functools.partial(run_jobsignal, config, environ={}, settle_memory=settle_memory)
        )
        try:
            if ready:
                with trio.fail_after(10):
                    await server.ready.wait()
            yield server
        except BaseException as exc:
            raised = exc  # raised again below, not wrapped in the nursery's group
        finally:
            server.request_shutdown()
            with trio.move_on_after(10):
                await server.stopped.wait()
            nursery.cancel_scope.cancel()
    if raised is not None:
        raise raised


async def subscribe(
    clients: GrpcioClients,
    server: RunningJobsignal,
    nursery: trio.Nursery,
    role: str = "CCAgent",
    *,
    as_list: bool = False,
    timeout: float = 60.0,
) -> GrpcioStream:
    """Register and subscribe with grpcio; returns once the server holds the stream."""
    client = clients.connect(target(server))
    client_id = await in_thread(client.register_id, role)
    active = server._parts.registry.active_subscriptions()
    call = (client.subscribe_list if as_list else client.subscribe)(
        role, client_id, timeout=timeout
    )
    stream = GrpcioStream(call).start(nursery)
    await wait_until(
        lambda: server._parts.registry.active_subscriptions() == active + 1,
        within=10,
        what="the subscription to be active",
    )
    return stream


async def take_fault(emu: KubeEmulator, fault: Drop | ExpireWatch) -> None:
    """Queue `fault`, end the open watch, and wait until the next watch has taken it."""
    applied = emu.stats.faults_applied
    emu.faults.push(fault)
    emu.restart(lose_history=False)  # watches end (cleanly); history is kept
    with trio.fail_after(10):
        await emu.wait_for(lambda: emu.stats.faults_applied == applied + 1)
