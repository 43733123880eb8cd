"""A real server with real grpcio subscribers, for the tests of who is subscribed.

`open_subscribed_server` runs a whole jobsignal (`run_jobsignal`, with its
metrics port) against the Kubernetes API emulator, subscribes grpcio clients
of three kinds (a Signal stream, a Signal stream of a snapshot role, a List
stream), writes one job and waits until every stream has it, so each stream
has a known history: what `/debug/subscriptions`, `jobsignal clients` and the
page must show. `table_rows` reads the cells of the page's table.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import trio

from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.config import load_config
from jobsignal.rpc.session import Sessions
from jobsignal.rpc.subscriptions import short_id
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import open_emulator
from tests.support.cluster import TOKEN, write_kubeconfig
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

JOB = ClusterdJob("team-a", "llama-7b", "3b1f0c1e-5d2a-4c59-9a57-0f2d3b1c4e77")


@dataclass
class Subscription:
    """One grpcio subscriber and what the listing must say of it."""

    role: str
    rpc: str
    client_id: str
    stream: GrpcioStream
    call: Any  # grpcio's response iterator (cancel() ends the stream)
    messages_sent: int  # once the job was written

    @property
    def short_id(self) -> str:
        return short_id(self.client_id)


@dataclass
class SubscribedServer:
    server: RunningJobsignal
    metrics_port: int
    subscriptions: list[Subscription]

    @property
    def sessions(self) -> Sessions:
        return self.server._parts.grpc.sessions

    @property
    def metrics_target(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"


# (role, list stream?, messages each has once the job is written): a Signal stream
# gets the job's event; FdAgent's snapshot of an empty cluster is nothing; a List
# stream gets its snapshot (one empty batch) and the change.
KINDS = (("CCAgent", False, 1), ("FdAgent", False, 1), ("DefaultUser1", True, 2))


async def wait_for_streams(server: RunningJobsignal, count: int) -> None:
    await wait_until(lambda: len(server._parts.grpc.sessions) == count, what=f"{count} streams")


@asynccontextmanager
async def open_subscribed_server(
    tmp_path: Path, grpc_clients: GrpcioClients
) -> AsyncIterator[SubscribedServer]:
    async with open_emulator(token=TOKEN) as emulator, trio.open_nursery() as nursery:
        config = load_config(
            {
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "kubeconfig": str(write_kubeconfig(tmp_path / "kubeconfig", emulator.url)),
                "source": "kubernetes",
                "drain_delay": "0",
            },
            {},
        )
        server: RunningJobsignal = await nursery.start(run_jobsignal, config)
        assert server.metrics_port is not None
        await server.ready.wait()
        subscriptions = []
        for role, as_list, messages in KINDS:
            client = grpc_clients.connect(f"127.0.0.1:{server.port}")
            client_id = await in_thread(client.register_id, role)
            subscribe = client.subscribe_list if as_list else client.subscribe
            call = subscribe(role, client_id, timeout=120)
            rpc = "SubscribeJobSummarySignalList" if as_list else "SubscribeJobSummarySignal"
            stream = GrpcioStream(call).start(nursery)
            subscriptions.append(Subscription(role, rpc, client_id, stream, call, messages))
            # One at a time: the listing's order is the order they subscribed in.
            await wait_for_streams(server, len(subscriptions))
        for name, data in JOB.configmaps("running"):
            emulator.state.create_configmap(JOB.namespace, name, JOB_LABELS, data)
        for subscription in subscriptions:
            await subscription.stream.wait_for(subscription.messages_sent, within=30)
        try:
            yield SubscribedServer(server, server.metrics_port, subscriptions)
        finally:
            for subscription in subscriptions:
                subscription.call.cancel()
            server.request_shutdown()
            await server.stopped.wait()
            nursery.cancel_scope.cancel()


class TableRows(HTMLParser):
    """The text of every cell of a page's table, row by row (header first)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def table_rows(document: str) -> list[list[str]]:
    parser = TableRows()
    parser.feed(document)
    return parser.rows
