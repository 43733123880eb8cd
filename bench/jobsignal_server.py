"""Benchmark runner for jobsignal: its real gRPC server plus a small event driver.

    python -m bench.jobsignal_server [--source driver|kube --kube-url URL] [--deadline S]

With `--source driver` (fan-out, latency, memory, slow-client scenarios) the
runner publishes `JobSummary` events into the `Broadcaster` itself, on
command, at a fixed rate or as fast as the subscribers' queues drain. With
`--source kube` it runs jobsignal's real watcher (`jobsignal.app.run_source`)
against the Kubernetes API emulator at `--kube-url`, and the events come from
ConfigMap changes. Commands and replies are JSON lines (see bench/common.py).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import gc
import itertools
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import trio
import trio.lowlevel

from bench.common import (
    LEVEL_SAMPLE,
    MAX_CLIENTS,
    MAX_MESSAGE_BYTES,
    ROLES,
    answer_commands,
    emit,
    flood_batch,
    queue_level,
    run_child,
)
from bench.events import latency_ns, make_jobs, stamped
from jobsignal.app import run_source
from jobsignal.config import load_config
from jobsignal.fanout import Broadcaster, Subscriber
from jobsignal.fanout.encoding import encode_signal
from jobsignal.kube.credentials import KubeConnection
from jobsignal.process.gc_pacing import GcPacing
from jobsignal.rpc.guard import ProtocolLimits
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.server import RunningServer, ServerSettings, run_grpc_server
from jobsignal.rpc.session import SessionSettings
from jobsignal.status import SourceStatus
from jobsignal.store import JobStore, JobSummary
from jobsignal.store.jobs import Changes, Relist


class BenchBroadcaster(Broadcaster):
    """The real broadcaster, counting end reasons and the lag of stamped events."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ended: Counter[str] = Counter()
        self.lags_ns: list[int] = []
        # How long each publish of stamped events took (the fan-out itself).
        self.publish_ns: list[int] = []
        # Subscribers set apart by `tag_big`: they get only `publish_big` events.
        self.big: set[Subscriber] = set()

    def publish(self, jobs: Iterable[JobSummary], *args: Any, **kwargs: Any) -> None:
        jobs = list(jobs)
        now = time.time_ns()
        lags_before = len(self.lags_ns)
        for job in jobs:
            lag = latency_ns(job.sid, now)
            if lag is not None:
                self.lags_ns.append(lag)
        super().publish(jobs, *args, **kwargs)
        if len(self.lags_ns) > lags_before:
            self.publish_ns.append(time.time_ns() - now)

    def counters(self) -> dict[str, int]:
        """The broadcaster's own counters, wherever this version keeps them."""
        source = getattr(self, "stats", self)
        found = {}
        for name in ("events_published", "messages_queued", "messages_delivered", "coalesced"):
            value = getattr(source, name, None)
            if isinstance(value, int):
                found[name] = value
        return found

    def unsubscribe(self, subscriber: Subscriber) -> None:
        reason = subscriber.end_reason.value if subscriber.end_reason else "client_gone"
        self.ended[reason] += 1
        self.big.discard(subscriber)
        super().unsubscribe(subscriber)

    def tag_big(self) -> int:
        """Set the current subscribers apart (big-and-small scenario): from now on
        `publish` skips them and `publish_big` reaches only them. A benchmark
        device: jobsignal itself sends every event to every subscriber."""
        for subscriber in self.subscribers:
            super().unsubscribe(subscriber)
            self.big.add(subscriber)
        return len(self.big)

    def publish_big(self, job: JobSummary) -> int:
        """Queue one event, encoded once, for the tagged subscribers; its size."""
        signal = encode_signal(job, str(uuid.uuid4()))
        seen_at = trio.current_time()
        for subscriber in self.big:
            subscriber.push(job.key, signal, seen_at)
        return len(signal)


class TimedStore(JobStore):
    """The real job store, timing its updates."""

    def __init__(self) -> None:
        super().__init__()
        # Per LIST: the store's own time in it (parsing, commit, settling), which
        # the watcher spreads over many steps with checkpoints between them.
        self.replace_all_seconds: list[float] = []
        self.apply_seconds = 0.0
        self.applied = 0

    def relist(self, namespace: str | None = None) -> Relist:
        self.replace_all_seconds.append(0.0)
        return TimedRelist(self, namespace)

    def settle(self, budget: int | None = None) -> Changes:
        started = time.perf_counter()
        try:
            return super().settle(budget)
        finally:
            self.add_list_time(time.perf_counter() - started)

    def add_list_time(self, seconds: float) -> None:
        if self.replace_all_seconds:
            self.replace_all_seconds[-1] += seconds

    def apply(self, event_type: str, configmap: Mapping[str, Any], now: float) -> Changes:
        started = time.perf_counter()
        try:
            return super().apply(event_type, configmap, now)
        finally:
            self.apply_seconds += time.perf_counter() - started
            self.applied += 1


class TimedRelist(Relist):
    """The real relist, adding its time to the store's figure for this LIST."""

    def __init__(self, store: TimedStore, namespace: str | None) -> None:
        super().__init__(store, namespace)
        self._timed = store

    def add(self, configmap: Mapping[str, Any]) -> int:
        started = time.perf_counter()
        try:
            return super().add(configmap)
        finally:
            self._timed.add_list_time(time.perf_counter() - started)

    def commit(self, now: float, budget: int | None = None) -> bool:
        started = time.perf_counter()
        try:
            return super().commit(now, budget)
        finally:
            self._timed.add_list_time(time.perf_counter() - started)


def roomy_settings(settings: ServerSettings) -> ServerSettings:
    """Lift jobsignal's connection and request-rate limits (if this version has them).

    Every benchmark client connects from 127.0.0.1, so per-address limits meant
    for a real cluster would refuse most of them; the reference server has none.
    """
    if not any(f.name == "limits" for f in dataclasses.fields(settings)):
        return settings
    limits: Any = getattr(settings, "limits")  # noqa: B009 - absent in older versions
    overrides: dict[str, Any] = {}
    for f in dataclasses.fields(limits):
        if f.name.startswith("max_") and not f.name.endswith("_bytes"):
            overrides[f.name] = MAX_CLIENTS
        elif f.name.endswith("_rate"):
            overrides[f.name] = 1e9
        elif f.name.endswith("_burst"):
            overrides[f.name] = 1_000_000_000
        elif f.name.endswith("_bytes"):
            overrides[f.name] = max(getattr(limits, f.name), MAX_MESSAGE_BYTES)
    return dataclasses.replace(settings, limits=dataclasses.replace(limits, **overrides))


def bench_settings(limits: ProtocolLimits | None = None) -> ServerSettings:
    """The benchmark server's settings: loopback, an ephemeral port, no idle close,
    a short shutdown grace, roomy limits (also for bench.memory_profile)."""
    return roomy_settings(
        ServerSettings(
            host="127.0.0.1",
            port=0,
            session=SessionSettings(idle_timeout=3600.0),
            shutdown_grace=2.0,
            protocol_limits=limits or ProtocolLimits(),
        )
    )


def bench_registry() -> Registry:
    """A registry that turns no benchmark client away."""
    return Registry(
        roles=ROLES,
        max_registrations=MAX_CLIENTS,
        max_subscriptions_per_role=MAX_CLIENTS,
        ttl=3600.0,
    )


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.broadcaster = BenchBroadcaster(max_pending=args.max_pending)
        self.registry = bench_registry()
        self.status = SourceStatus()
        self.store = TimedStore()
        self.shutdown = trio.Event()
        self.jobs: list[JobSummary] = []
        self.large: JobSummary | None = None
        self.driver_scope: trio.CancelScope | None = None
        self.list_seconds: float | None = None
        self.profile: cProfile.Profile | None = None
        self.server: RunningServer | None = None

    async def main(self) -> None:
        args = self.args
        settings = bench_settings(protocol_limits(args))
        if args.source == "driver":
            self.jobs = make_jobs(args.jobs, args.servers)
            if args.large_servers:
                (self.large,) = make_jobs(1, args.large_servers)
        async with trio.open_nursery() as nursery:
            server: RunningServer = await nursery.start(
                run_grpc_server,
                settings,
                self.broadcaster,
                self.registry,
                self.status,
                self.shutdown,
            )
            self.server = server
            if args.source == "kube":
                started = time.perf_counter()
                await nursery.start(self._run_source)
                await self.status.ready.wait()
                self.list_seconds = time.perf_counter() - started
                # As `jobsignal serve` tends its own process (app._settle_memory_after_lists,
                # process/gc_pacing.py): the start-up state frozen, full collections short.
                gc.collect()
                gc.freeze()
                await nursery.start(GcPacing().run)
            else:
                self.status.mark_ready(time.time())
            emit(
                {
                    "ready": True,
                    "port": server.port,
                    "pid": os.getpid(),
                    "list_seconds": self.list_seconds,
                }
            )
            nursery.start_soon(self._commands, nursery)
            await server.stopped.wait()
            nursery.cancel_scope.cancel()

    async def _run_source(self, *, task_status: trio.TaskStatus[Any]) -> None:
        config = load_config(
            {"source": "kubernetes", "namespaces": "bench", "log_level": "warning"}, {}
        )
        connection = KubeConnection(
            base_url=self.args.kube_url,
            verify=None,  # plain http
            token_source=None,
            description="benchmark Kubernetes API emulator",
            default_namespace=None,
        )
        await run_source(
            config,
            connection,
            self.store,
            self.broadcaster,
            self.status,
            task_status=task_status,
        )

    # -- commands ----------------------------------------------------------

    async def _commands(self, nursery: trio.Nursery) -> None:
        await answer_commands(functools.partial(self._handle, nursery=nursery))
        self.shutdown.set()

    def _handle(self, command: dict[str, Any], nursery: trio.Nursery) -> dict[str, Any]:
        name = command["cmd"]
        if name == "stats":
            return self._stats()
        if name == "mode":
            self._set_mode(command, nursery)
            return {"ok": True}
        if name == "publish_large":
            assert self.large is not None, "start the runner with --large-servers"
            self.broadcaster.publish([stamped(self.large, time.time_ns())])
            return {"ok": True, "npus": self.large.npu_count}
        if name == "tag_big":
            return {"tagged": self.broadcaster.tag_big()}
        if name == "publish_big":
            assert self.large is not None, "start the runner with --large-servers"
            size = self.broadcaster.publish_big(stamped(self.large, time.time_ns()))
            return {"bytes": size, "npus": self.large.npu_count}
        if name == "profile_start":
            self.profile = cProfile.Profile()
            self.profile.enable()
            return {"ok": True}
        if name == "profile_stop":
            assert self.profile is not None
            self.profile.disable()
            self.profile.dump_stats(command["path"])
            self.profile = None
            return {"ok": True}
        if name == "gc":
            # Garbage-collector figures; with "freeze", move every object to the
            # permanent generation (an experiment for FINDINGS.md, off by default).
            started = time.perf_counter()
            if command.get("freeze"):
                gc.collect()
                gc.freeze()
            return {
                "objects": len(gc.get_objects()),
                "frozen": gc.get_freeze_count(),
                "collections": [g["collections"] for g in gc.get_stats()],
                "seconds": time.perf_counter() - started,
            }
        if name == "reset_lags":
            self.broadcaster.lags_ns.clear()
            self.broadcaster.publish_ns.clear()
            return {"ok": True}
        if name == "lags":
            return {"lags_ns": self.broadcaster.lags_ns, "publish_ns": self.broadcaster.publish_ns}
        return {"error": f"unknown command {name!r}"}

    def _stats(self) -> dict[str, Any]:
        subscribers = self.broadcaster.subscribers | self.broadcaster.big
        counters = self.broadcaster.counters()
        connections = self.server.connections if self.server else None
        closed = dict(connections.closed_by_server) if connections is not None else {}
        return {
            # Streams up, as the Go reference counts them: their snapshot written.
            "subscribers": sum(1 for s in subscribers if s.up),
            "connections": len(connections) if connections is not None else 0,
            "closed_by_server": closed,
            "published": counters.get("events_published", 0),
            "queued": counters.get("messages_queued", 0),
            "coalesced": counters.get("coalesced", 0),
            "pending": sum(s.pending for s in subscribers),
            "ended": dict(self.broadcaster.ended),
            "jobs": self.broadcaster.job_count(),
            "list_seconds": self.list_seconds,
            "replace_all_seconds": self.store.replace_all_seconds,
            "applied": self.store.applied,
            "apply_seconds": self.store.apply_seconds,
        }

    def _set_mode(self, command: dict[str, Any], nursery: trio.Nursery) -> None:
        if self.driver_scope is not None:
            self.driver_scope.cancel()
            self.driver_scope = None
        mode = command["mode"]
        if mode == "idle":
            return
        scope = trio.CancelScope()
        self.driver_scope = scope
        if mode == "flood":
            nursery.start_soon(
                self._flood, scope, command["threshold"], command["batch"], command["quantile"]
            )
        elif mode == "rate":
            nursery.start_soon(self._rate, scope, command["rate"])
        else:
            raise ValueError(f"unknown mode {mode!r}")

    async def _flood(
        self, scope: trio.CancelScope, threshold: int, batch: int, quantile: float
    ) -> None:
        """Publish whenever the subscribers' queues (at `quantile`) hold < `threshold`."""
        jobs = self.jobs
        index = 0
        with scope:
            while True:
                subscribers = self.broadcaster.subscribers
                sample = itertools.islice(subscribers, LEVEL_SAMPLE)
                level = queue_level([s.pending for s in sample], quantile)
                if level < threshold:
                    now = time.time_ns()
                    count = flood_batch(batch, len(subscribers))
                    events = [stamped(jobs[(index + k) % len(jobs)], now) for k in range(count)]
                    index += count
                    self.broadcaster.publish(events)
                    await trio.lowlevel.checkpoint()
                else:
                    await trio.sleep(0.001)

    async def _rate(self, scope: trio.CancelScope, rate: float) -> None:
        """Publish one event every 1/`rate` seconds."""
        jobs = self.jobs
        interval = 1.0 / rate
        index = 0
        with scope:
            deadline = trio.current_time()
            while True:
                job = jobs[index % len(jobs)]
                index += 1
                self.broadcaster.publish([stamped(job, time.time_ns())])
                deadline += interval
                await trio.sleep_until(deadline)


def protocol_limits(args: argparse.Namespace) -> ProtocolLimits:
    """jobsignal's HTTP/2 abuse budgets, with the timeouts the command line sets."""
    overrides = {
        name: value
        for name in ("handshake_timeout", "write_stall_timeout")
        if (value := getattr(args, name)) is not None
    }
    return dataclasses.replace(ProtocolLimits(), **overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", choices=("driver", "kube"), default="driver")
    parser.add_argument("--kube-url", default="")
    parser.add_argument("--jobs", type=int, default=64, help="distinct jobs the driver cycles")
    parser.add_argument("--servers", type=int, default=2, help="servers (x 8 NPUs) per job")
    parser.add_argument("--large-servers", type=int, default=0)
    parser.add_argument("--max-pending", type=int, default=1024)
    parser.add_argument("--handshake-timeout", type=float, help="default: jobsignal's")
    parser.add_argument("--write-stall-timeout", type=float, help="default: jobsignal's")
    run_child(parser, lambda args: trio.run(Runner(args).main))


if __name__ == "__main__":
    main()
