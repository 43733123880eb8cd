"""Metrics scraped over HTTP match what happened: events, subscribers, idle closes."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import trio
import trio_asyncio

from jobsignal._proto.job import JobSummarySignal
from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.client import SubscribeOptions, subscribe
from jobsignal.config import load_config
from jobsignal.kube.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.kube.emulator import KubeEmulator, open_emulator
from jobsignal.metrics import Histogram, render


def kubeconfig_for(emulator: KubeEmulator, path: Path) -> Path:
    path.write_text(
        f"""
apiVersion: v1
kind: Config
current-context: emu
clusters: [{{name: emu, cluster: {{server: "{emulator.url}"}}}}]
users: [{{name: u, user: {{token: "t0ken"}}}}]
contexts: [{{name: emu, context: {{cluster: emu, user: u}}}}]
"""
    )
    return path


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} not in metrics"
    return float(match.group(1))


async def scrape(port: int) -> str:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return response.text


def more_than(items: list[str], count: int) -> bool:
    return len(items) > count


async def wait_for(condition: Callable[[], bool], timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


async def test_metrics_follow_events_subscribers_and_idle_closes(tmp_path: Path) -> None:
    async with open_emulator(token="t0ken") as emulator:
        config = load_config(
            {
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "kubeconfig": str(kubeconfig_for(emulator, tmp_path / "config")),
                "source": "kubernetes",
                "idle_timeout": "1.5",
                "keepalive_time": "30",
            },
            {},
        )
        received: list[str] = []
        async with trio.open_nursery() as nursery:
            server: RunningJobsignal = await nursery.start(run_jobsignal, config)
            assert server.metrics_port is not None
            await server.status.ready.wait()

            async def subscriber(role: str, keepalive: float) -> None:
                options = SubscribeOptions("127.0.0.1", server.port, role, keepalive_time=keepalive)
                async with trio_asyncio.open_loop():
                    async for message in subscribe(options):
                        assert isinstance(message, JobSummarySignal)
                        received.append(message.job_id)

            # One subscriber that pings every 0.5 s, one silent one (closed when idle).
            nursery.start_soon(subscriber, "CCAgent", 0.5)
            nursery.start_soon(subscriber, "FdAgent", 600)
            await wait_for(lambda: len(server.broadcaster.subscribers) == 2)
            text = await scrape(server.metrics_port)
            assert (
                sample(
                    text,
                    "jobsignal_subscribers",
                    '{role="CCAgent",rpc="SubscribeJobSummarySignal"}',
                )
                == 1
            )
            assert sample(text, "jobsignal_registered_ids") == 2

            job = ClusterdJob("ns", "train", "uid-1")
            for status in ("pending", "running", "complete"):
                for name, data in job.configmaps(status):
                    if status == "pending":
                        emulator.state.create_configmap("ns", name, JOB_LABELS, data)
                    else:
                        emulator.state.update_configmap("ns", name, data=data)
                await wait_for(partial(more_than, received, len(received)))

            await wait_for(lambda: server.broadcaster.stats.stream_ends["idle"] >= 1)
            text = await scrape(server.metrics_port)
            assert sample(text, "jobsignal_job_events_total") == 3
            assert sample(text, "jobsignal_jobs") == 1
            assert sample(text, "jobsignal_stream_ends_total", '{reason="idle"}') >= 1
            assert sample(text, "jobsignal_delivery_latency_seconds_count") >= 3
            assert sample(text, "jobsignal_watch_total", '{what="lists"}') == 1
            assert sample(text, "jobsignal_source_in_sync") == 1
            assert sample(text, "jobsignal_messages_delivered_total") >= 3
            server.request_shutdown()
            await server.stopped.wait()
            nursery.cancel_scope.cancel()


def test_histogram_buckets_are_cumulative() -> None:
    histogram = Histogram([0.1, 1])
    for value in (0.05, 0.5, 0.5, 5):
        histogram.observe(value)
    assert histogram.counts == [1, 2, 1]
    assert histogram.count == 4 and histogram.total == 6.05
    assert callable(render)
