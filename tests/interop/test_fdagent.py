"""A grpc-go client that behaves like ClusterD's fault-diagnosis agent, against the whole server.

The agent (FD-OL) is what matters most among ClusterD's clients, and it is
unforgiving: it dials with grpc-go's defaults (no keepalive), and its v7.x
releases never recover from a stream end. The peer's `fdagent` command
(tests/interop/go/main.go, the project's own code) does what the server can
see of it: Register as FdAgent, retried 20 times; the List and the Signal
streams; any stream end is fatal. Here it runs against `run_jobsignal`
watching the Kubernetes API emulator, on the real clock with the idle rule
scaled down (2 s, keepalive PINGs after 0.5 s), through: a server that is not
up yet, a quiet stretch of more than twice the idle timeout, a burst of large
rank tables, and a drain (health NOT_SERVING, live streams still served).
Its streams may end only at the shutdown that follows the drain.
"""

from __future__ import annotations

import os
import signal
import socket
from collections import Counter
from functools import partial
from pathlib import Path

import trio

from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.config import load_config
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import KubeEmulator, open_emulator
from tests.support.cluster import TOKEN, write_kubeconfig
from tests.support.grpcio import GrpcioStubs, health_statuses
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

from .peers import Peer, flag_argv, running

IDLE_TIMEOUT = 2.0
QUIET = 2.5 * IDLE_TIMEOUT
DRAIN = 3.0
BURST_JOBS = 6
BURST_SERVERS = 500  # 4,000 NPUs each: a rank table of about 0.6 MB


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def write_job(emulator: KubeEmulator, job: ClusterdJob, status: str, *, create: bool) -> None:
    for name, data in job.configmaps(status):
        if create:
            emulator.state.create_configmap(job.namespace, name, JOB_LABELS, data)
        else:
            emulator.state.update_configmap(job.namespace, name, data=data)


def statuses_by_rpc(peer: Peer) -> dict[str, Counter[tuple[str, str]]]:
    """(jobName, jobStatus) of every signal received, per RPC."""
    received: dict[str, Counter[tuple[str, str]]] = {"list": Counter(), "signal": Counter()}
    for message in peer.messages:
        kind = "list" if "JobTotalNum" in message else "signal"
        received[kind].update((s["jobName"], s["jobStatus"]) for s in message["signals"])
    return received


async def test_an_fd_ol_like_client_stays_subscribed_through_quiet_bursts_and_a_drain(
    go_peer: Path, grpcio_stubs: GrpcioStubs, tmp_path: Path
) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    agent_argv = [
        str(go_peer),
        "fdagent",
        *flag_argv(
            {
                "target": target,
                "role": "FdAgent",
                "register_every": "200ms",
                "run_for": "120s",
                "timeout": "150s",
            },
            "-",
        ),
    ]
    first, second = ClusterdJob("ns", "first", "uid-1"), ClusterdJob("ns", "second", "uid-2")
    burst = [
        ClusterdJob("ns", f"big-{n}", f"uid-big-{n}", servers=BURST_SERVERS)
        for n in range(BURST_JOBS)
    ]
    async with (
        open_emulator(token=TOKEN, bookmark_interval=0.25) as emulator,
        running(agent_argv) as agent,
        trio.open_nursery() as nursery,
    ):
        # The agent starts before the server: its first Registers fail, it retries.
        await agent.wait_for(lambda p: bool(p.of("register-failed")), 10, "a failed Register")
        write_job(emulator, first, "pending", create=True)
        write_job(emulator, second, "pending", create=True)
        config = load_config(
            {
                "listen": target,
                "kubeconfig": str(write_kubeconfig(tmp_path / "config", emulator.url)),
                "source": "kubernetes",
                "idle_timeout": str(IDLE_TIMEOUT),
                "keepalive_time": "0.5",
                "keepalive_timeout": "1",
                "drain_delay": str(DRAIN),
            },
            {},
        )
        server: RunningJobsignal = await nursery.start(
            partial(run_jobsignal, config, handle_signals=True)
        )
        broadcaster = server._parts.broadcaster
        await wait_until(lambda: len(broadcaster.subscribers) == 2, within=15)

        write_job(emulator, first, "running", create=False)
        await trio.sleep(QUIET)
        assert broadcaster.stats.stream_ends["idle"] == 0
        for job in burst:
            write_job(emulator, job, "running", create=True)
        await agent.wait_for(lambda p: len(p.messages) >= 2 + 2 * (1 + BURST_JOBS), 30, "the burst")

        os.kill(os.getpid(), signal.SIGTERM)  # a rollout: drain, then shut down
        await trio.sleep(0.2)  # (the handler turns health NOT_SERVING at once)
        health = await in_thread(health_statuses, grpcio_stubs, target, "", "job.Job")
        write_job(emulator, first, "complete", create=False)
        await agent.wait_exit(within=DRAIN + 15)
        await server.stopped.wait()

    assert health == {"": "NOT_SERVING", "job.Job": "NOT_SERVING"}
    assert len(agent.of("registered")) == 2, agent.describe()
    # Every job change on both streams: the snapshot (both jobs pending), then each
    # change, the one written during the drain included.
    expected = Counter(
        [("first", "pending"), ("second", "pending"), ("first", "running")]
        + [(job.name, "running") for job in burst]
        + [("first", "complete")]
    )
    assert statuses_by_rpc(agent) == {"list": expected, "signal": expected}, agent.describe()
    # Its streams ended only when the server shut down after the drain.
    (fatal,) = agent.of("fatal")
    end = next(e for e in agent.of("end") if e["rpc"] == fatal["rpc"])
    assert end["message"] == "server shutting down", agent.describe()
    assert agent.returncode == 3
