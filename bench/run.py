"""`python -m bench [--quick] [--out DIR] [--only S,...] [--merge]`: scenarios, then the report.

`--only real_path` runs the real-path family (bench/real_path.py), `--only
real_path_20k` one of them; `--merge` keeps the other scenarios' figures
already in `--out/results.json`.

The orchestrator (this process) starts every server, load generator and
cluster as a separate process on 127.0.0.1, talks to them over pipes
(bench/common.py), samples their CPU and memory from /proc, and stops them.
Each scenario runs in its own set of processes; a failing scenario is
recorded in the report and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import gobuild, machine
from bench.common import STUBS_ENV, generate_stubs
from bench.events import make_jobs, signal_fields
from bench.figures import fairness, latency_summary, median
from bench.procs import (
    REPO,
    Child,
    ChildError,
    CpuMeter,
    CpuSplit,
    cpu_seconds,
    split_cpus,
    wait_for,
)
from bench.real_path import FULL_REAL_PATH, QUICK_REAL_PATH, RealPath, run_scenario

SERVERS = ("jobsignal", "reference")
SERVER_MODULES = {"jobsignal": "bench.jobsignal_server", "reference": "bench.reference_server"}
# The servers of the server-bound scenarios, driven by the Go load generator:
# jobsignal, the grpc.aio reference and the grpc-go reference ("go").
GO_SERVERS = ("jobsignal", "reference", "go")
# The scenarios that build and run Go programs (bench/gobuild.py); `--without-go` leaves them out.
GO_SCENARIOS = frozenset({"e2e_go", "server_fanout", "server_one_conn", "server_latency"})
GO_SOURCES = {
    "loadgen": Path(__file__).resolve().parent / "go" / "loadgen" / "main.go",
    "reference": Path(__file__).resolve().parent / "go" / "reference" / "main.go",
}
# Go packages the programs share (the child-process contract of bench/common.py).
GO_LIBRARIES = {
    name: Path(__file__).resolve().parent / "go" / name for name in ("childproc", "kubewatch")
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
# The attacks of the under-attack scenario, in the order they run (bench/attacker.py).
ATTACKS = (
    "rapid_reset",
    "settings_flood",
    "ping_flood",
    "window_update_flood",
    "empty_data_flood",
    "settings_no_read",
    "silent",
    "stalled_subscriber",
    "spread_control_flood",
)


@dataclass(frozen=True)
class Sizes:
    """How big and how long every scenario is."""

    reps: int
    warmup: float
    window: float
    fanout: tuple[int, ...]
    latency_subs: int
    latency_rate: float
    latency_window: float
    e2e_subs: int
    e2e_rate: float
    memory_subs: int
    large_servers: int
    large_per_cm: int
    large_subs: int
    ingest_configmaps: int
    ingest_rate: float
    slow_subs: int
    slow_stuck: int
    profile_subs: int
    profile_seconds: float
    # Under attack: healthy subscribers and their event rate, seconds of each
    # attack (and of the baseline measured just before it), the server's
    # handshake and write-stall timeouts, connections per attack at most.
    attack_subs: int
    attack_rate: float
    attack_window: float
    attack_handshake_timeout: float
    attack_stall_timeout: float
    attack_max_connections: int
    # Big and small: subscribers of the big events (each on its own
    # connection), servers (x 8 NPUs) of the big job, subscribers of the small
    # events and their rate, seconds of each phase, seconds between big events
    # in each phase (0: back to back), big events per phase at most.
    big_subs: int
    big_servers: int
    small_subs: int
    small_rate: float
    big_window: float
    big_every: tuple[float, ...]
    big_max_rounds: int
    # Subscribers per load-generator process, and the fewest processes used.
    per_client: int = 1250
    min_clients: int = 2
    # Flood driver: publish a batch while the 95th percentile of the queues is
    # below the threshold.
    flood_threshold: int = 128
    flood_batch: int = 16
    # Hard deadline of every child process, seconds.
    deadline: float = 300.0
    # Server-bound scenarios (Go load generator): subscribers, connections they
    # share (0: one each), events per second offered (above capacity).
    server_fanout: tuple[int, int, float] = (1000, 20, 60.0)
    server_one_conn: tuple[int, int, float] = (500, 0, 120.0)
    # Under capacity (20,000 deliveries/s): latency, not throughput.
    server_latency: tuple[int, int, float] = (1000, 20, 20.0)
    # The Go load generator decodes every n-th message of a subscriber for latency.
    go_sample_every: int = 10
    # The real-path scenarios (bench/real_path.py), each server measured this many
    # times (alternating), warmed up and measured for these many seconds.
    real_path: tuple[RealPath, ...] = FULL_REAL_PATH
    real_path_runs: int = 3
    real_path_warmup: float = 2.0
    real_path_window: float = 5.0


FULL = Sizes(
    reps=3,
    warmup=1.5,
    window=3.0,
    fanout=(10, 100, 1000, 5000),
    latency_subs=1000,
    latency_rate=20.0,
    latency_window=5.0,
    e2e_subs=100,
    e2e_rate=20.0,
    memory_subs=10_000,
    large_servers=5000,
    large_per_cm=1000,
    large_subs=20,
    ingest_configmaps=10_000,
    ingest_rate=2000.0,
    slow_subs=1000,
    slow_stuck=10,
    profile_subs=1000,
    profile_seconds=6.0,
    attack_subs=100,
    attack_rate=20.0,
    attack_window=6.0,
    attack_handshake_timeout=5.0,  # jobsignal's default
    attack_stall_timeout=3.0,  # 30 s by default: shortened to fit the window
    attack_max_connections=20_000,
    big_subs=20,
    # 57,600 NPUs: 4.16 MB encoded, just under gRPC's default 4 MiB receive
    # limit (jobsignal sends a bigger one without its rank table).
    big_servers=7200,
    small_subs=100,
    small_rate=20.0,
    big_window=6.0,
    big_every=(1.0, 0.0),
    big_max_rounds=30,
)

QUICK = Sizes(
    reps=1,
    warmup=0.2,
    window=0.4,
    fanout=(3,),
    latency_subs=4,
    latency_rate=20.0,
    latency_window=0.4,
    e2e_subs=2,
    e2e_rate=20.0,
    memory_subs=8,
    large_servers=40,
    large_per_cm=10,
    large_subs=2,
    ingest_configmaps=100,
    ingest_rate=200.0,
    slow_subs=4,
    slow_stuck=1,
    profile_subs=0,
    profile_seconds=0.0,
    attack_subs=2,
    attack_rate=20.0,
    attack_window=0.3,
    attack_handshake_timeout=1.0,
    attack_stall_timeout=0.5,
    attack_max_connections=200,
    big_subs=2,
    big_servers=40,
    small_subs=2,
    small_rate=20.0,
    big_window=0.3,
    big_every=(1.0, 0.0),
    big_max_rounds=2,
    min_clients=1,
    deadline=120.0,
    server_fanout=(4, 2, 20.0),
    server_one_conn=(3, 0, 20.0),
    server_latency=(4, 2, 5.0),
    go_sample_every=1,
    real_path=QUICK_REAL_PATH,
    real_path_runs=1,
    real_path_warmup=0.2,
    real_path_window=0.5,
)


class Bench:
    def __init__(
        self,
        sizes: Sizes,
        out: Path,
        work: Path,
        log: Callable[[str], None],
        attacks: Sequence[str] = ATTACKS,
    ) -> None:
        self.sizes = sizes
        self.attacks = attacks
        self.out = out
        self.work = work
        self.log = log
        self.log_dir = out / "logs"
        shutil.rmtree(self.log_dir, ignore_errors=True)
        self.log_dir.mkdir(parents=True)
        stubs = work / "stubs"
        stubs.mkdir()
        generate_stubs(stubs)
        self.env = {
            **os.environ,
            STUBS_ENV: str(stubs),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        self.results: dict[str, Any] = {"sizes": dataclasses.asdict(sizes), "errors": {}}
        self._children = 0
        self._go: dict[str, Path] | None = None

    # -- processes -----------------------------------------------------------

    def child(
        self,
        name: str,
        module: str,
        *args: str,
        wait: bool = True,
        executable: Path | None = None,
        cpus: frozenset[int] | None = None,
    ) -> Child:
        """Start `python -m module args` (or `executable args`), on `cpus` if given;
        with `wait`, until it reports ready."""
        self._children += 1
        child = Child(
            f"{self._children:03d}-{name}",
            module,
            [*args, "--deadline", str(self.sizes.deadline)],
            env=self.env,
            log_dir=self.log_dir,
            executable=executable,
            cpus=cpus,
        )
        if wait:
            child.wait_ready()
        return child

    @contextlib.contextmanager
    def running(self) -> Iterator[list[Child]]:
        """A list to put children in; all of them are stopped on exit."""
        children: list[Child] = []
        try:
            yield children
        finally:
            for child in reversed(children):
                child.stop()

    def server(
        self, children: list[Child], kind: str, *args: str, cpus: frozenset[int] | None = None
    ) -> Child:
        if kind == "go":
            server = self.child(
                "go-reference",
                "",
                "--jobs-file",
                str(self.go_jobs_file()),
                *args,
                executable=self.go_programs()["reference"],
                cpus=cpus,
            )
        else:
            server = self.child(kind, SERVER_MODULES[kind], *args, cpus=cpus)
        children.append(server)
        return server

    def go_programs(self) -> dict[str, Path]:
        """The Go load generator and reference server, built once per run (in `work`)."""
        if self._go is None:
            self._go = gobuild.build_go_programs(
                self.work / "go",
                GO_SOURCES,
                import_root="jobsignalbench",
                libraries=GO_LIBRARIES,
                who="the benchmark's Go load generator and reference server",
            )
        return self._go

    def go_jobs_file(self) -> Path:
        """The jobs the Python servers' drivers cycle (64 jobs of 2 servers: their
        defaults), for the Go reference server."""
        path = self.work / "go-jobs.json"
        if not path.exists():
            path.write_text(json.dumps([signal_fields(job) for job in make_jobs(64, 2)]))
        return path

    def go_clients(
        self,
        children: list[Child],
        server: Child,
        count: int,
        connections: int,
        cpus: frozenset[int] | None = None,
        sample_every: int | None = None,
        extra: Sequence[str] = (),
        wait_seconds: float | None = None,
    ) -> Child:
        """One Go load generator with `count` subscribers over `connections` (0: one
        each), sampling every `sample_every`-th message (default: the run's), with
        `extra` arguments; waits until the server has all of them (ChildError after
        `wait_seconds`, by default 30 s and 20 ms per subscriber; the load
        generator is in `children` then too)."""
        baseline = self.subscribers(server)
        client = self.child(
            "go-loadgen",
            "",
            "--target",
            f"127.0.0.1:{server.ready['port']}",
            "--count",
            str(count),
            "--connections",
            str(connections),
            "--sample-every",
            str(sample_every or self.sizes.go_sample_every),
            *extra,
            executable=self.go_programs()["loadgen"],
            cpus=cpus,
        )
        children.append(client)
        self.wait_subscribed(server, [client], baseline, count, wait_seconds)
        return client

    def cluster(self, children: list[Child], cpus: frozenset[int] | None = None) -> Child:
        cluster = self.child("cluster", "bench.cluster", cpus=cpus)
        children.append(cluster)
        return cluster

    def clients(
        self, children: list[Child], server: Child, count: int, *, stall: int = 0
    ) -> list[Child]:
        """`count` subscribers over several load-generator processes; waits until
        the server has all of them."""
        sizes = self.sizes
        processes = min(count, max(sizes.min_clients, math.ceil(count / sizes.per_client)))
        target = f"127.0.0.1:{server.ready['port']}"
        baseline = self.subscribers(server)
        started: list[Child] = []
        for index in range(processes):
            share = count // processes + (1 if index < count % processes else 0)
            stall_share = stall // processes + (1 if index < stall % processes else 0)
            client = self.child(
                "loadgen",
                "bench.loadgen",
                "--target",
                target,
                "--count",
                str(share),
                "--stall",
                str(stall_share),
                wait=False,
            )
            children.append(client)
            started.append(client)
        for client in started:
            client.wait_ready()
        self.wait_subscribed(server, started, baseline, count)
        return started

    @staticmethod
    def subscribers(server: Child) -> int:
        """How many subscribers the server has now."""
        return int(server.request({"cmd": "stats"})["subscribers"])

    def wait_subscribed(
        self,
        server: Child,
        clients: list[Child],
        baseline: int,
        count: int,
        timeout: float | None = None,
    ) -> None:
        """Wait until the server has `count` subscribers more than `baseline`;
        ChildError as soon as one of the load generators `clients` reports a
        failed subscription, or after `timeout` (default: 30 s, 20 ms each)."""

        def subscribed() -> bool:
            for client in clients:
                reply = client.request({"cmd": "count"})
                if reply["failed"]:
                    raise ChildError(f"{client.name}: subscriptions failed: {reply['errors']}")
            return self.subscribers(server) - baseline >= count

        wait_for(subscribed, f"{count} subscriptions", timeout=timeout or 30 + count / 50)

    # -- measurements --------------------------------------------------------

    @staticmethod
    def received(clients: list[Child]) -> tuple[int, int]:
        """Messages received so far: (by reading subscribers, by stalled ones)."""
        total = stalled = 0
        for client in clients:
            reply = client.request({"cmd": "count"})
            total += int(reply["received"])
            stalled += int(reply["stalled_received"])
        return total, stalled

    def delivery_windows(self, server: Child, clients: list[Child]) -> dict[str, list[float]]:
        """`windows` under the Python load generators `clients` (reading
        subscribers only; the load generators' CPU from /proc)."""

        def progress() -> tuple[int, float]:
            return self.received(clients)[0], sum(cpu_seconds(client.pid) for client in clients)

        return self.windows(server, progress, "client")

    def loadgen_windows(self, server: Child, client: Child) -> dict[str, list[float]]:
        """`windows` under the Go load generator `client` (its CPU from its own
        getrusage)."""

        def progress() -> tuple[int, float]:
            reply = client.request({"cmd": "count"})
            return int(reply["received"]), float(reply["cpu_seconds"])

        return self.windows(server, progress, "loadgen")

    def windows(
        self, server: Child, progress: Callable[[], tuple[int, float]], prefix: str
    ) -> dict[str, list[float]]:
        """Per window: delivered msg/s, the server's CPU (/proc) and the load
        generators' (under `{prefix}_...`), in cores and µs per delivered message.
        `progress()` is what the load generators have received and the CPU seconds
        they have used so far."""
        rows: dict[str, list[float]] = {
            "rate": [],
            "server_cpu": [],
            "us_per_msg": [],
            f"{prefix}_cpu": [],
            f"{prefix}_us_per_msg": [],
        }
        for _ in range(self.sizes.reps):
            meter = CpuMeter([server.pid])
            meter.start()
            received_before, cpu_before = progress()
            started = time.perf_counter()
            time.sleep(self.sizes.window)
            received_after, cpu_after = progress()
            elapsed = time.perf_counter() - started
            server_cpu = meter.stop()[0]
            rate = (received_after - received_before) / elapsed
            client_cpu = (cpu_after - cpu_before) / elapsed
            rows["rate"].append(rate)
            rows["server_cpu"].append(server_cpu)
            rows["us_per_msg"].append(server_cpu * 1e6 / rate if rate else math.nan)
            rows[f"{prefix}_cpu"].append(client_cpu)
            rows[f"{prefix}_us_per_msg"].append(client_cpu * 1e6 / rate if rate else math.nan)
        return rows

    def latency_window(self, clients: list[Child], seconds: float) -> list[int]:
        """Latencies (ns) of every message the reading subscribers got in `seconds`."""
        self.reset_latencies(clients)
        time.sleep(seconds)
        return self.collect_latencies(clients)

    def latency_windows(
        self, clients: list[Child], seconds: float, pids: list[int]
    ) -> tuple[dict[str, Any], list[list[float]]]:
        """`reps` latency windows of `seconds`: the summary over all of them (with
        each window's, `per_rep`, and a histogram), and the CPU (cores) of the
        processes `pids` in each window."""
        pooled: list[int] = []
        per_rep = []
        cpu = []
        for _ in range(self.sizes.reps):
            meter = CpuMeter(pids)
            meter.start()
            samples = self.latency_window(clients, seconds)
            cpu.append(meter.stop())
            per_rep.append(latency_summary(samples))
            pooled += samples
        summary = latency_summary(pooled)
        summary["per_rep"] = per_rep
        summary["histogram_ms"] = _histogram(pooled)
        return summary, cpu

    @staticmethod
    def reset_latencies(clients: list[Child]) -> None:
        for client in clients:
            client.request({"cmd": "lat_reset"})

    def collect_latencies(self, clients: list[Child]) -> list[int]:
        """Latencies (ns) of the messages received since `reset_latencies`."""
        samples: list[int] = []
        for index, client in enumerate(clients):
            path = self.work / f"latency-{index}.bin"
            reply = client.request({"cmd": "lat_dump", "path": str(path)})
            values = array("q")
            with path.open("rb") as source:
                values.fromfile(source, int(reply["samples"]))
            samples.extend(values)
            path.unlink()
        return samples

    def deliver_to_all(
        self, clients: list[Child], what: str, send: Callable[[], dict[str, Any]]
    ) -> tuple[dict[str, Any], list[int]]:
        """Have one event sent (`send()`, which returns its reply) and wait until
        every subscriber has one more message; the reply, and the latencies (ns) of
        the messages the subscribers received meanwhile."""
        self.reset_latencies(clients)
        before, _ = self.received(clients)
        reply = send()
        subscribers = sum(int(client.request({"cmd": "count"})["started"]) for client in clients)
        wait_for(
            lambda: self.received(clients)[0] >= before + subscribers,
            f"{what} at {subscribers} subscribers",
            timeout=60,
            interval=0.02,
        )
        return reply, self.collect_latencies(clients)

    def flood(self, server: Child) -> None:
        server.request(
            {
                "cmd": "mode",
                "mode": "flood",
                "threshold": self.sizes.flood_threshold,
                "batch": self.sizes.flood_batch,
                "quantile": 0.95,
            }
        )

    # -- scenarios -------------------------------------------------------------

    def run_all(self, only: set[str] | None, without: frozenset[str] = frozenset()) -> None:
        real_path = {spec.name for spec in self.sizes.real_path}
        scenarios: list[tuple[str, Callable[[], None]]] = [
            ("fanout", self.scenario_fanout),
            ("latency", self.scenario_latency),
            ("e2e", self.scenario_e2e),
            ("e2e_go", self.scenario_e2e_go),
            ("memory", self.scenario_memory),
            ("large", self.scenario_large),
            ("ingest", self.scenario_ingest),
            ("slow", self.scenario_slow),
            ("profile", self.scenario_profile),
            ("publish", self.scenario_publish),
            ("attack", self.scenario_attack),
            ("big_and_small", self.scenario_big_and_small),
            ("server_fanout", self.scenario_server_fanout),
            ("server_one_conn", self.scenario_server_one_conn),
            ("server_latency", self.scenario_server_latency),
            *(
                (spec.name, functools.partial(run_scenario, self, spec))
                for spec in self.sizes.real_path
            ),
        ]
        for name, scenario in scenarios:
            # `--only real_path` runs the whole family.
            wanted = not only or name in only or ("real_path" in only and name in real_path)
            if not wanted or name in without:
                continue
            started = time.perf_counter()
            self.log(f"scenario {name} ...")
            try:
                scenario()
            except Exception as error:  # recorded in the report; the rest still runs
                self.results["errors"][name] = f"{type(error).__name__}: {error}"
                self.log(traceback.format_exc())
            elapsed = time.perf_counter() - started
            self.results.setdefault("scenario_load", {})[name] = {
                "seconds": elapsed,
                "load_average": machine.load_average(),
            }
            self.log(
                f"scenario {name} done in {elapsed:.1f}s, load {machine.load_average()[0]:.2f}"
            )

    def scenario_fanout(self) -> None:
        """Events published as fast as the subscribers' queues drain."""
        results: dict[str, dict[str, Any]] = {kind: {} for kind in SERVERS}
        self.results["fanout"] = results
        for count in self.sizes.fanout:
            for kind in SERVERS:
                with self.running() as children:
                    server = self.server(children, kind)
                    clients = self.clients(children, server, count)
                    self.flood(server)
                    time.sleep(self.sizes.warmup)
                    rows: dict[str, Any] = self.delivery_windows(server, clients)
                    server.request({"cmd": "mode", "mode": "idle"})
                    stats = server.request({"cmd": "stats"})
                    rows["rss_bytes"] = server.rss_bytes()
                    rows["ended"] = stats.get("ended", {})
                    rows["coalesced"] = stats.get("coalesced", 0)
                    rows["clients"] = len(clients)
                    results[kind][str(count)] = rows
                    self.log(
                        f"  fan-out {kind} {count}: {median(rows['rate']):,.0f} msg/s,"
                        f" server {median(rows['server_cpu']):.2f} cores"
                    )

    def scenario_latency(self) -> None:
        sizes = self.sizes
        results: dict[str, Any] = {}
        self.results["latency"] = results
        for kind in SERVERS:
            with self.running() as children:
                server = self.server(children, kind)
                clients = self.clients(children, server, sizes.latency_subs)
                server.request({"cmd": "mode", "mode": "rate", "rate": sizes.latency_rate})
                time.sleep(sizes.warmup)
                summary, cpu = self.latency_windows(clients, sizes.latency_window, [server.pid])
                if kind == "jobsignal" and sizes.profile_subs:
                    self.results["profile_latency"] = {
                        **self.record_profile(server, "latency", sizes.profile_seconds),
                        "subscribers": sizes.latency_subs,
                        "rate": sizes.latency_rate,
                    }
                server.request({"cmd": "mode", "mode": "idle"})
                summary["server_cpu"] = [window[0] for window in cpu]
                summary["rss_bytes"] = server.rss_bytes()
                results[kind] = summary
                self.log(
                    f"  latency {kind}: p50 {summary['p50_ms']:.2f} ms,"
                    f" p99 {summary['p99_ms']:.2f} ms"
                )

    def e2e_source(
        self, children: list[Child], placement: CpuSplit | None = None
    ) -> tuple[Child, Child]:
        """The end-to-end scenarios' source: the emulated cluster with 64 jobs, and
        jobsignal watching it; with `placement`, the server on its own CPU and the
        emulator on the others."""
        server_cpus, peer_cpus = placement or (None, None)
        cluster = self.cluster(children, peer_cpus)
        cluster.request({"cmd": "populate", "count": 64, "servers": 2})
        server = self.server(
            children,
            "jobsignal",
            "--source",
            "kube",
            "--kube-url",
            cluster.ready["url"],
            cpus=server_cpus,
        )
        return cluster, server

    def scenario_e2e(self) -> None:
        """ConfigMap write in the emulator -> watcher -> store -> subscriber."""
        sizes = self.sizes
        with self.running() as children:
            cluster, server = self.e2e_source(children)
            clients = self.clients(children, server, sizes.e2e_subs)
            cluster.request({"cmd": "mode", "mode": "churn", "rate": sizes.e2e_rate})
            time.sleep(sizes.warmup)
            server.request({"cmd": "reset_lags"})
            # The CPU over all the windows together.
            meter = CpuMeter([server.pid, cluster.pid])
            meter.start()
            summary, _ = self.latency_windows(clients, sizes.latency_window, [])
            server_cpu, cluster_cpu = meter.stop()
            cluster.request({"cmd": "mode", "mode": "idle"})
            lags = server.request({"cmd": "lags"})["lags_ns"]
            summary["watch_to_publish"] = latency_summary(lags)
            summary["server_cpu"] = server_cpu
            summary["cluster_cpu"] = cluster_cpu
            self.results["e2e"] = {"jobsignal": summary}
            self.log(f"  e2e: p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms")

    def scenario_e2e_go(self) -> None:
        """The e2e scenario with the Go load generator as the subscribers (one
        connection each), so their own decoding does not share the cores with the
        server: ConfigMap write (its time in `sid`) to arrival, sampled messages.

        Measured twice. First with the server on a CPU of its own and the emulator
        and the subscribers on the others, as in a cluster, where the clients run on
        other machines: the headline figure. Then where the kernel puts them, which
        on two CPUs has the peers that the server's writes wake run on the server's
        CPU as well, preempting it (bench/FINDINGS.md, "End to end on a CPU of its
        own")."""
        self.go_programs()  # a missing Go package fails here, named
        placement = split_cpus()
        separate = self.e2e_go_run(placement) if placement else None
        shared = self.e2e_go_run(None)
        self.results["e2e_go"] = {
            "subscribers": self.sizes.e2e_subs,
            "rate": self.sizes.e2e_rate,
            "jobsignal": separate or shared,
            "placement": (
                {"server_cpus": sorted(placement[0]), "peer_cpus": sorted(placement[1])}
                if placement
                else "one CPU: shared"
            ),
            "shared_cpus": shared,
            "run": self.provenance(),
        }

    def e2e_go_run(self, placement: CpuSplit | None) -> dict[str, Any]:
        """One `e2e_go` measurement: the server on `placement`'s first CPUs and the
        emulator and the Go subscribers on its second, or all where the kernel puts them."""
        sizes = self.sizes
        with self.running() as children:
            cluster, server = self.e2e_source(children, placement)
            client = self.go_clients(
                children, server, sizes.e2e_subs, 0, placement[1] if placement else None
            )
            cluster.request({"cmd": "mode", "mode": "churn", "rate": sizes.e2e_rate})
            time.sleep(sizes.warmup)
            self.reset_latencies([client])
            server.request({"cmd": "reset_lags"})
            time.sleep(sizes.latency_window)
            samples = self.collect_latencies([client])
            lags = server.request({"cmd": "lags"})
            cluster.request({"cmd": "mode", "mode": "idle"})
        summary = latency_summary(samples)
        # Where the time goes: the write to publish, and publish to all subscribers.
        summary["watch_to_publish"] = latency_summary(lags["lags_ns"])
        summary["publish"] = latency_summary(lags["publish_ns"])
        where = "server on a CPU of its own" if placement else "CPUs shared"
        self.log(
            f"  e2e (Go subscribers, {where}): p50 {summary['p50_ms']:.2f} ms,"
            f" p99 {summary['p99_ms']:.2f} ms ({summary['samples']} samples);"
            f" write to publish p50 {summary['watch_to_publish']['p50_ms']:.2f} ms,"
            f" publish to all p50 {summary['publish']['p50_ms']:.2f} ms"
        )
        return summary

    def scenario_memory(self) -> None:
        results: dict[str, Any] = {}
        self.results["memory"] = results
        count = self.sizes.memory_subs
        for kind in SERVERS:
            with self.running() as children:
                server = self.server(children, kind)
                time.sleep(self.sizes.warmup)
                baseline = server.rss_bytes()
                started = time.perf_counter()
                self.clients(children, server, count)
                connect_seconds = time.perf_counter() - started
                time.sleep(self.sizes.warmup)
                rss = server.rss_bytes()
                results[kind] = {
                    "subscribers": count,
                    "baseline_bytes": baseline,
                    "rss_bytes": rss,
                    "per_subscriber_bytes": (rss - baseline) / count,
                    "connect_seconds": connect_seconds,
                }
                self.log(
                    f"  memory {kind}: {(rss - baseline) / count / 1024:.1f} KiB per subscriber"
                )

    def scenario_large(self) -> None:
        sizes = self.sizes
        results: dict[str, Any] = {}
        self.results["large"] = results
        npus = sizes.large_servers * 8
        # Through the watcher: ConfigMap writes -> reassembled job at every subscriber.
        with self.running() as children:
            cluster = self.cluster(children)
            server = self.server(
                children, "jobsignal", "--source", "kube", "--kube-url", cluster.ready["url"]
            )
            clients = self.clients(children, server, sizes.large_subs)
            time.sleep(0.5)
            rss_before = server.rss_bytes()
            reps = []
            large_job = {
                "cmd": "large",
                "servers": sizes.large_servers,
                "servers_per_configmap": sizes.large_per_cm,
            }
            for rep in range(sizes.reps):
                server.request({"cmd": "reset_lags"})
                written, samples = self.deliver_to_all(
                    clients,
                    f"the large job (write {rep})",
                    functools.partial(cluster.request, large_job, timeout=120),
                )
                # From the first write to the broadcaster's publish: the watch,
                # the store's parse and join (the rest is the fan-out).
                published = server.request({"cmd": "lags"})["lags_ns"]
                reps.append(
                    {
                        "all_delivered_s": max(samples) / 1e9,
                        "first_delivered_s": min(samples) / 1e9,
                        "configmaps": written["configmaps"],
                        "write_s": written["write_seconds"],
                        "published_s": max(published) / 1e9 if published else None,
                    }
                )
            results["e2e"] = {
                "npus": npus,
                "subscribers": sizes.large_subs,
                "reps": reps,
                "rss_before_bytes": rss_before,
                "peak_rss_bytes": server.peak_rss_bytes(),
            }
            published = [r["published_s"] for r in reps if r["published_s"] is not None]
            self.log(
                f"  large job e2e: {median([r['all_delivered_s'] for r in reps]):.3f} s"
                f" to {sizes.large_subs} subscribers (published after"
                f" {median(published) if published else math.nan:.3f} s)"
            )
        # Straight from the event source, for both servers.
        direct: dict[str, Any] = {}
        results["direct"] = direct
        for kind in SERVERS:
            with self.running() as children:
                server = self.server(children, kind, "--large-servers", str(sizes.large_servers))
                clients = self.clients(children, server, sizes.large_subs)
                time.sleep(0.5)
                rss_before = server.rss_bytes()
                reps = []
                for rep in range(sizes.reps):
                    _, samples = self.deliver_to_all(
                        clients,
                        f"the large message ({kind}, {rep})",
                        functools.partial(server.request, {"cmd": "publish_large"}),
                    )
                    reps.append({"all_delivered_s": max(samples) / 1e9})
                direct[kind] = {
                    "reps": reps,
                    "rss_before_bytes": rss_before,
                    "peak_rss_bytes": server.peak_rss_bytes(),
                }
                self.log(
                    f"  large message {kind}: {median([r['all_delivered_s'] for r in reps]):.3f} s"
                )

    def scenario_ingest(self) -> None:
        sizes = self.sizes
        with self.running() as children:
            cluster = self.cluster(children)
            populated = cluster.request(
                {"cmd": "populate", "count": sizes.ingest_configmaps, "servers": 2}, timeout=300
            )
            list_seconds = []
            replace_seconds = []
            server: Child | None = None
            for rep in range(sizes.reps):
                server = self.child(
                    "jobsignal", SERVER_MODULES["jobsignal"], "--source", "kube", "--kube-url",
                    cluster.ready["url"],
                )  # fmt: skip
                list_seconds.append(float(server.ready["list_seconds"]))
                stats = server.request({"cmd": "stats"})
                replace_seconds.append(float(stats["replace_all_seconds"][0]))
                if stats["jobs"] != sizes.ingest_configmaps:
                    raise ChildError(f"LIST loaded {stats['jobs']} jobs")
                if rep < sizes.reps - 1:
                    server.stop()
            assert server is not None
            children.append(server)
            # Steady changes through WATCH.
            cluster.request({"cmd": "mode", "mode": "churn", "rate": sizes.ingest_rate})
            time.sleep(sizes.warmup)
            server.request({"cmd": "reset_lags"})
            rows: dict[str, list[float]] = {
                "events_per_s": [],
                "changes_per_s": [],
                "server_cpu": [],
                "cluster_cpu": [],
            }
            for _ in range(sizes.reps):
                meter = CpuMeter([server.pid, cluster.pid])
                meter.start()
                published0 = server.request({"cmd": "stats"})["published"]
                changes0 = cluster.request({"cmd": "stats"})["changes"]
                started = time.perf_counter()
                time.sleep(sizes.window)
                published1 = server.request({"cmd": "stats"})["published"]
                changes1 = cluster.request({"cmd": "stats"})["changes"]
                elapsed = time.perf_counter() - started
                server_cpu, cluster_cpu = meter.stop()
                rows["events_per_s"].append((published1 - published0) / elapsed)
                rows["changes_per_s"].append((changes1 - changes0) / elapsed)
                rows["server_cpu"].append(server_cpu)
                rows["cluster_cpu"].append(cluster_cpu)
            cluster.request({"cmd": "mode", "mode": "idle"})
            lags = server.request({"cmd": "lags"})["lags_ns"]
            final = server.request({"cmd": "stats"})
            self.results["ingest"] = {
                "configmaps": populated["configmaps"],
                "list_seconds": list_seconds,
                "replace_all_seconds": replace_seconds,
                "rate_asked": sizes.ingest_rate,
                **rows,
                "change_to_publish": latency_summary(lags),
                "apply_us": final["apply_seconds"] * 1e6 / max(1, final["applied"]),
                "rss_bytes": server.rss_bytes(),
            }
            self.log(
                f"  ingest: LIST {median(list_seconds):.2f} s,"
                f" {median(rows['events_per_s']):,.0f} events/s"
            )

    def scenario_slow(self) -> None:
        sizes = self.sizes
        results: dict[str, Any] = {}
        self.results["slow"] = results
        for kind in SERVERS:
            with self.running() as children:
                server = self.server(children, kind)
                clients = self.clients(children, server, sizes.slow_subs, stall=sizes.slow_stuck)
                phases: dict[str, Any] = {}
                for phase in ("all_reading", "with_stuck"):
                    if phase == "with_stuck":
                        for client in clients:
                            client.request({"cmd": "stall"})
                    self.flood(server)
                    time.sleep(sizes.warmup)
                    rows: dict[str, Any] = self.delivery_windows(server, clients)
                    server.request({"cmd": "mode", "mode": "rate", "rate": sizes.latency_rate})
                    time.sleep(sizes.warmup)
                    samples: list[int] = []
                    for _ in range(sizes.reps):
                        samples += self.latency_window(clients, sizes.latency_window / 2)
                    server.request({"cmd": "mode", "mode": "idle"})
                    rows["latency"] = latency_summary(samples)
                    rows["server_stats"] = server.request({"cmd": "stats"})
                    rows["rss_bytes"] = server.rss_bytes()
                    phases[phase] = rows
                results[kind] = phases
                base = median(phases["all_reading"]["rate"])
                stuck = median(phases["with_stuck"]["rate"])
                self.log(f"  slow {kind}: {base:,.0f} -> {stuck:,.0f} msg/s for the others")

    def scenario_profile(self) -> None:
        """Where jobsignal's time goes during fan-out (py-spy if present, else cProfile)."""
        sizes = self.sizes
        if not sizes.profile_subs:
            self.results["profile"] = {"skipped": "not in --quick"}
            return
        with self.running() as children:
            server = self.server(children, "jobsignal")
            clients = self.clients(children, server, sizes.profile_subs)
            self.flood(server)
            time.sleep(sizes.warmup)
            before, _ = self.received(clients)
            started = time.perf_counter()
            profile = self.record_profile(server, "fanout", sizes.profile_seconds)
            after, _ = self.received(clients)
            rate = (after - before) / (time.perf_counter() - started)
            server.request({"cmd": "mode", "mode": "idle"})
            self.results["profile"] = {
                **profile,
                "subscribers": sizes.profile_subs,
                "rate_while_profiling": rate,
            }

    def record_profile(self, server: Child, name: str, seconds: float) -> dict[str, str]:
        """Profile the jobsignal server for `seconds`: py-spy if installed, else
        cProfile; which tool, and the profile's file name in `out`."""
        py_spy = shutil.which("py-spy") or shutil.which(
            "py-spy", path=str(Path(sys.executable).parent)
        )
        if py_spy:
            path = self.out / f"profile-jobsignal-{name}.speedscope.json"
            command = [
                py_spy, "record", "--pid", str(server.pid), "--duration", str(int(seconds)),
                "--rate", "200", "--format", "speedscope", "--output", str(path), "--nonblocking",
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0 or not path.exists():
                raise ChildError(f"py-spy failed: {done.stderr.strip()[-500:]}")
            return {"tool": "py-spy", "file": path.name}
        path = self.out / f"profile-jobsignal-{name}.cprofile"
        server.request({"cmd": "profile_start"})
        time.sleep(seconds)
        server.request({"cmd": "profile_stop", "path": str(path)})
        return {"tool": "cProfile", "file": path.name}

    def scenario_publish(self) -> None:
        """Microbenchmark of Broadcaster.publish vs. the proposed inner loop (bench/micro.py)."""
        quick = self.sizes.profile_subs == 0
        args = ["--subscribers", "10" if quick else "1000,5000"]
        args += ["--rounds", "1" if quick else "5", "--ballast", "10000" if quick else "1000000"]
        args += ["--hops", "200" if quick else "20000"]
        done = subprocess.run(
            [sys.executable, "-m", "bench.micro", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=self.sizes.deadline,
            check=False,
        )
        if done.returncode != 0:
            raise ChildError(f"bench.micro failed: {done.stderr.strip()[-1000:]}")
        self.results["publish"] = json.loads(done.stdout.strip().splitlines()[-1])

    def scenario_attack(self) -> None:
        """A healthy load's latency while a raw HTTP/2 attacker runs each attack in
        turn, next to the same figure measured just before it (bench/attacker.py)."""
        sizes = self.sizes
        rows: list[dict[str, Any]] = []
        self.results["attack"] = {
            "subscribers": sizes.attack_subs,
            "rate": sizes.attack_rate,
            "window_s": sizes.attack_window,
            "handshake_timeout_s": sizes.attack_handshake_timeout,
            "write_stall_timeout_s": sizes.attack_stall_timeout,
            "attacks": rows,
            "run": self.provenance(),
        }
        with self.running() as children:
            server = self.server(
                children,
                "jobsignal",
                "--handshake-timeout",
                str(sizes.attack_handshake_timeout),
                "--write-stall-timeout",
                str(sizes.attack_stall_timeout),
            )
            clients = self.clients(children, server, sizes.attack_subs)
            attacker = self.child(
                "attacker",
                "bench.attacker",
                "--target",
                f"127.0.0.1:{server.ready['port']}",
                "--max-connections",
                str(sizes.attack_max_connections),
            )
            children.append(attacker)
            server.request({"cmd": "mode", "mode": "rate", "rate": sizes.attack_rate})
            time.sleep(sizes.warmup)
            for name in self.attacks:
                row = self.one_attack(server, clients, attacker, name)
                rows.append(row)
                during, before = row["healthy"], row["baseline"]
                self.log(
                    f"  attack {name}: healthy p50/p99 {during['p50_ms']:.1f}/"
                    f"{during['p99_ms']:.1f} ms (baseline {before['p50_ms']:.1f}/"
                    f"{before['p99_ms']:.1f}), server {row['server_cpu']:.2f} cores,"
                    f" answers {row['attacker']['answers']}"
                )
            server.request({"cmd": "mode", "mode": "idle"})

    def one_attack(
        self, server: Child, clients: list[Child], attacker: Child, name: str
    ) -> dict[str, Any]:
        window = self.sizes.attack_window
        time.sleep(self.sizes.warmup)  # what the last attack left behind settles
        meter = CpuMeter([server.pid])
        meter.start()
        baseline = self.latency_window(clients, window)
        baseline_cpu = meter.stop()[0]
        health_before = self.health(clients)
        stats_before = server.request({"cmd": "stats"})
        rss_before = server.rss_bytes()
        self.reset_latencies(clients)
        meter = CpuMeter([server.pid, attacker.pid])
        meter.start()
        attacker.request({"cmd": "start", "attack": name, "seconds": window})
        time.sleep(window)

        def finished() -> dict[str, Any] | None:
            reply = attacker.request({"cmd": "result"})
            return None if reply["running"] else reply

        result = wait_for(
            finished,
            f"the {name} attack to end",
            timeout=window + 30,
            interval=0.05,
        )
        server_cpu, attacker_cpu = meter.stop()
        samples = self.collect_latencies(clients)
        stats_after = server.request({"cmd": "stats"})
        health_after = self.health(clients)
        closed = {
            reason: count - stats_before["closed_by_server"].get(reason, 0)
            for reason, count in stats_after["closed_by_server"].items()
        }
        return {
            "attack": name,
            "baseline": latency_summary(baseline),
            "baseline_server_cpu": baseline_cpu,
            "healthy": latency_summary(samples),
            "server_cpu": server_cpu,
            "attacker_cpu": attacker_cpu,
            "attacker": result["record"],
            "server_closed": {reason: n for reason, n in closed.items() if n},
            "rss_before_bytes": rss_before,
            "rss_after_bytes": server.rss_bytes(),
            "healthy_ended": health_after["ended"] - health_before["ended"],
            "healthy_subscribers": health_after["started"] - health_after["ended"],
        }

    def provenance(self) -> dict[str, Any]:
        """Which source a scenario measured, and how busy the machine was: kept with
        its figures, which may be merged into the results of another run."""
        described = self.results.get("machine", {})
        return {
            "commit": described.get("commit"),
            "dirty_jobsignal_files": described.get("dirty_jobsignal_files", []),
            "cpu_model": described.get("cpu_model"),
            "load_average": machine.load_average(),
        }

    @staticmethod
    def health(clients: list[Child]) -> dict[str, int]:
        """Subscriptions started and ended so far over all load generators."""
        replies = [client.request({"cmd": "count"}) for client in clients]
        return {key: sum(int(r[key]) for r in replies) for key in ("started", "ended")}

    def scenario_big_and_small(self) -> None:
        """Big events to some subscribers, small ones to the others: what the big
        writes cost the small events' latency, and how long the big ones take."""
        sizes = self.sizes
        with self.running() as children:
            server = self.server(children, "jobsignal", "--large-servers", str(sizes.big_servers))
            big = self.clients(children, server, sizes.big_subs)
            tagged = server.request({"cmd": "tag_big"})["tagged"]
            if tagged != sizes.big_subs:
                raise ChildError(f"{tagged} subscribers tagged for the big events")
            small = self.clients(children, server, sizes.small_subs)
            server.request({"cmd": "mode", "mode": "rate", "rate": sizes.small_rate})
            time.sleep(sizes.warmup)
            meter = CpuMeter([server.pid])
            meter.start()
            without = self.latency_window(small, sizes.big_window)
            cpu_without = meter.stop()[0]
            phases = [self.big_phase(server, big, small, every) for every in sizes.big_every]
            server.request({"cmd": "mode", "mode": "idle"})
            self.results["big_and_small"] = {
                "run": self.provenance(),
                "big_subscribers": sizes.big_subs,
                "small_subscribers": sizes.small_subs,
                "small_rate": sizes.small_rate,
                "window_s": sizes.big_window,
                "without_big": latency_summary(without),
                "server_cpu_without": cpu_without,
                "phases": phases,
                "peak_rss_bytes": server.peak_rss_bytes(),
            }

    def big_phase(
        self, server: Child, big: list[Child], small: list[Child], every: float
    ) -> dict[str, Any]:
        """For one window, a big event every `every` seconds (0: each one as soon as
        every big subscriber has the last); the small events' latency meanwhile."""
        sizes = self.sizes
        self.reset_latencies(small)
        meter = CpuMeter([server.pid])
        meter.start()
        started = time.perf_counter()
        rounds: list[dict[str, Any]] = []
        while len(rounds) < sizes.big_max_rounds:
            due = started + len(rounds) * every if every else time.perf_counter()
            if due - started >= sizes.big_window:
                break
            time.sleep(max(0.0, due - time.perf_counter()))
            published, samples = self.deliver_to_all(
                big,
                f"big event {len(rounds)}",
                functools.partial(server.request, {"cmd": "publish_big"}),
            )
            rounds.append(
                {
                    "first_delivered_s": min(samples) / 1e9,
                    "all_delivered_s": max(samples) / 1e9,
                    "bytes": published["bytes"],
                    "npus": published["npus"],
                }
            )
        # The small events are measured for the whole window, also when the
        # rounds ran out first (the quick run).
        time.sleep(max(0.0, started + sizes.big_window - time.perf_counter()))
        server_cpu = meter.stop()[0]
        during = latency_summary(self.collect_latencies(small))
        last = median([r["all_delivered_s"] for r in rounds])
        pace = f"every {every:g} s" if every else "back to back"
        self.log(
            f"  big and small, big events {pace}: small p50/p99"
            f" {during['p50_ms']:.1f}/{during['p99_ms']:.1f} ms; big event to"
            f" {sizes.big_subs} subscribers in {last:.3f} s"
        )
        return {
            "every_s": every,
            "small": during,
            "server_cpu": server_cpu,
            "seconds": time.perf_counter() - started,
            "rounds": rounds,
        }

    def scenario_server_fanout(self) -> None:
        """Many subscribers sharing a few connections, more events offered than any
        server delivers, measured with the Go load generator."""
        self.server_bound("server_fanout", *self.sizes.server_fanout)

    def scenario_server_one_conn(self) -> None:
        """Every subscriber on its own connection (each client its own channel)."""
        self.server_bound("server_one_conn", *self.sizes.server_one_conn)

    def scenario_server_latency(self) -> None:
        """1,000 subscribers at 20 events/s, under every server's capacity: the latency
        of sampled messages (issue 10's p99 target) with the cheap Go load generator."""
        self.server_bound("server_latency", *self.sizes.server_latency)

    def server_bound(self, key: str, subscribers: int, connections: int, rate: float) -> None:
        """jobsignal, grpc.aio and grpc-go side by side under one Go load generator
        (about 2-6 µs of CPU per received message, so the server is the limit):
        delivered msg/s, server CPU per delivered message, latency of sampled
        messages, received counts per subscriber, the load generator's own CPU."""
        sizes = self.sizes
        servers: dict[str, Any] = {}
        self.results[key] = {
            "subscribers": subscribers,
            "connections": connections or subscribers,
            "rate": rate,
            "offered_per_s": rate * subscribers,
            "window_s": sizes.window,
            "reps": sizes.reps,
            "sample_every": sizes.go_sample_every,
            "servers": servers,
            "run": self.provenance(),
        }
        self.go_programs()  # a missing Go package fails here, named, before any server starts
        for kind in GO_SERVERS:
            with self.running() as children:
                server = self.server(children, kind)
                client = self.go_clients(children, server, subscribers, connections)
                server.request({"cmd": "mode", "mode": "rate", "rate": rate})
                time.sleep(sizes.warmup)
                published_before = server.request({"cmd": "stats"})["published"]
                first = client.request({"cmd": "per_subscriber"})["received"]
                self.reset_latencies([client])
                started = time.perf_counter()
                rows = self.loadgen_windows(server, client)
                measured = time.perf_counter() - started
                last = client.request({"cmd": "per_subscriber"})["received"]
                stats = server.request({"cmd": "stats"})
                server.request({"cmd": "mode", "mode": "idle"})
                samples = self.collect_latencies([client])
                health = client.request({"cmd": "count"})
                received = [after - before for before, after in zip(first, last, strict=True)]
                servers[kind] = {
                    **rows,
                    "offered_per_s": (stats["published"] - published_before)
                    * subscribers
                    / measured,
                    "latency": latency_summary(samples),
                    "fairness": fairness(received, connections or subscribers),
                    "measured_s": measured,
                    "rss_bytes": server.rss_bytes(),
                    "server_stats": stats,
                    "loadgen_ended": health["ended"],
                    "loadgen_errors": health["errors"],
                }
                spread = servers[kind]["fairness"]
                self.log(
                    f"  {key} {kind}: {median(rows['rate']):,.0f} msg/s,"
                    f" server {median(rows['us_per_msg']):.1f} µs/msg,"
                    f" loadgen {median(rows['loadgen_us_per_msg']):.1f} µs/msg, p50/p99"
                    f" {servers[kind]['latency']['p50_ms']:.1f}/"
                    f"{servers[kind]['latency']['p99_ms']:.1f} ms, per subscriber"
                    f" {spread['min']}/{spread['median']:g}/{spread['max']}"
                )


def _histogram(samples_ns: list[int], bins: int = 60) -> dict[str, list[float]]:
    """A compact log-spaced histogram of latencies, for the plots."""
    if not samples_ns:
        return {"edges_ms": [], "counts": []}
    low = max(min(samples_ns) / 1e6, 0.01)
    high = max(max(samples_ns) / 1e6, low * 1.01)
    ratio = (high / low) ** (1 / bins)
    edges = [low * ratio**i for i in range(bins + 1)]
    counts = [0.0] * bins
    scale = math.log(ratio)
    for value in samples_ns:
        ms = max(value / 1e6, low)
        index = min(bins - 1, int(math.log(ms / low) / scale))
        counts[index] += 1
    return {"edges_ms": edges, "counts": counts}


# Keys of the results that describe the run, not one scenario.
RUN_KEYS = ("sizes", "errors", "machine", "quick", "elapsed_seconds", "scenario_load")


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`old` results with the scenarios of `new` in place of theirs (each scenario
    section keeps its own provenance); the runs merged in are listed."""
    ran = set(new.get("scenario_load", {}))
    result = {**old, **{k: v for k, v in new.items() if k not in RUN_KEYS}}
    errors = {k: v for k, v in old.get("errors", {}).items() if k not in ran}
    result["errors"] = {**errors, **new.get("errors", {})}
    result["scenario_load"] = {**old.get("scenario_load", {}), **new.get("scenario_load", {})}
    machine_info = dict(old.get("machine", {}))
    machine_info["merged_runs"] = [
        *machine_info.get("merged_runs", []),
        {"scenarios": sorted(ran), "machine": new.get("machine", {})},
    ]
    result["machine"] = machine_info
    return result


def with_overrides(sizes: Sizes, overrides: list[str], parser: argparse.ArgumentParser) -> Sizes:
    """`sizes` with each `name=value` of --set applied (a number; a tuple as a,b,c)."""
    fields = {field.name: field for field in dataclasses.fields(Sizes)}
    changes: dict[str, Any] = {}
    for override in overrides:
        name, _, text = override.partition("=")
        if name not in fields or not text:
            parser.error(f"--set {override!r}: expected SIZE=VALUE, SIZE one of {sorted(fields)}")
        current = getattr(sizes, name)
        try:
            if isinstance(current, tuple):
                changes[name] = tuple(int(part) for part in text.split(","))
            else:
                changes[name] = type(current)(text)
        except ValueError:
            parser.error(f"--set {override!r}: {text!r} is not a {type(current).__name__}")
    return dataclasses.replace(sizes, **changes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="jobsignal vs. a grpc.aio reference server"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated scenarios (fanout,latency,e2e,memory,...; real_path: all of"
        f" {','.join(spec.name for spec in FULL_REAL_PATH)})",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SIZE=VALUE",
        help="override one size of the run, e.g. --set e2e_rate=100 --set e2e_subs=10",
    )
    parser.add_argument(
        "--attacks",
        default="",
        help=f"comma-separated attacks of the attack scenario (default all: {','.join(ATTACKS)})",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other scenarios of the results.json in --out: replace only those run",
    )
    parser.add_argument(
        "--without-go",
        action="store_true",
        help="leave out the scenarios with Go programs (where `nox -s peers` could not get Go)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite REPORT.md and the plots from the results.json in --out, without running",
    )
    args = parser.parse_args(argv)
    sizes = with_overrides(QUICK if args.quick else FULL, args.set, parser)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        from bench.report import write_report

        print(write_report(json.loads((out / "results.json").read_text()), out))
        return 0
    only = {name.strip() for name in args.only.split(",") if name.strip()} or None
    attacks = [name.strip() for name in args.attacks.split(",") if name.strip()] or ATTACKS
    if unknown := sorted(set(attacks) - set(ATTACKS)):
        parser.error(f"--attacks: unknown {', '.join(unknown)}; known: {', '.join(ATTACKS)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    machine_info = machine.describe()
    log(
        f"bench: {'quick' if args.quick else 'full'} run on {machine_info['nproc']} cores"
        f" ({machine_info['cpu_model']}), load {machine_info['load_average_start'][0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="jobsignal-bench-") as work:
        bench = Bench(sizes, out, Path(work), log, attacks)
        bench.results["machine"] = machine_info
        bench.results["quick"] = args.quick
        real_path = frozenset(spec.name for spec in sizes.real_path)  # Go subscribers, all
        bench.run_all(only, GO_SCENARIOS | real_path if args.without_go else frozenset())
    results = bench.results
    results["machine"]["load_average_end"] = machine.load_average()
    results["elapsed_seconds"] = elapsed = time.perf_counter() - started
    if args.merge and (out / "results.json").exists():
        results = merged(json.loads((out / "results.json").read_text()), results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    from bench.report import write_report

    report = write_report(results, out)
    log(f"bench: report at {report} ({elapsed:.0f}s)")
    return 1 if results["errors"] else 0
