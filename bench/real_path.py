"""The real-path scenarios (issue 35): ConfigMap write → WATCH → server → subscriber.

Each scenario `real_path_<key>` runs the benchmark's cluster (the Kubernetes
API emulator, bench/cluster.py) with `jobs` jobs of `servers` x 8 NPUs,
written once (`sid` "0") before any server starts, then one server watching
it, then the Go load generator's subscribers (every FDAGENT_EVERY-th in role
FdAgent: a snapshot of every job first), and only once the server reports
every subscription up does the cluster rewrite the jobs, one job change
every 1/`rate` s, each write stamping its time into `sid`. After a warm-up,
one window is measured: the server's CPU per delivered message (/proc), the
latency of sampled live messages (receive time minus write time) over time,
how evenly the subscribers were served, the load generator's own CPU per
message, and the snapshot messages (`sid` "0") that were late: still
arriving when the server said the stream was up, inside the window, or after
a live message on the same stream.

All three servers take the same path: jobsignal (its own watcher), the
grpc-go reference (bench/go/kubewatch) and the grpc.aio reference
(bench/kube_source.py). A full run measures each server `runs` times,
alternating (A, B, C, A, B, C, ...), and quotes the medians.
"""

from __future__ import annotations

import dataclasses
import math
import time
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.figures import fairness, latency_summary, median
from bench.procs import Child, ChildError, CpuMeter

if TYPE_CHECKING:
    from bench.run import Bench

# jobsignal, the grpc-go reference server, the grpc.aio reference server.
REAL_PATH_SERVERS = ("jobsignal", "go", "reference")
# Every n-th subscriber is an FdAgent: a quarter of them.
FDAGENT_EVERY = 4
# Latency samples per second the load generator aims at (it samples every n-th
# live message of a subscriber), and buckets of the latency-over-time series.
SAMPLES_PER_S = 5000
TIMELINE_BUCKETS = 250
# Seconds the arriving subscribers of `RealPath.arrivals` have to be all up.
ARRIVAL_WAIT = 20.0


@dataclass(frozen=True)
class RealPath:
    """One real-path scenario."""

    key: str
    subscribers: int
    # Connections the subscribers share (subscriber i on connection i mod c).
    connections: int
    # Job changes (ConfigMap writes of one job, so job events) per second.
    rate: float
    # Servers (x 8 NPUs) per job: the size of its rank table.
    servers: int
    # Jobs in the cluster: the size of an FdAgent's snapshot.
    jobs: int
    # Servers per ConfigMap: ClusterD splits a larger table over several.
    per_configmap: int = 1000
    # Seconds measured (0: the run's default), and seconds at its end without
    # writes, so that the last change's messages arrive inside the window (a
    # slow server's late messages are measured, not cut off).
    window: float = 0.0
    drain: float = 0.0
    # FdAgent subscribers (one more load generator, on `connections` connections
    # of its own) that arrive all at once a third into the window, while the
    # others are measured: does serving their snapshots delay the live events?
    arrivals: int = 0
    # What the rank table weighs, for the report.
    table: str = ""

    @property
    def name(self) -> str:
        return f"real_path_{self.key}"

    @property
    def offered_per_s(self) -> float:
        return self.rate * self.subscribers

    @property
    def sample_every(self) -> int:
        return max(1, round(self.offered_per_s / SAMPLES_PER_S))


FULL_REAL_PATH = (
    RealPath("2k", 100, 5, 20.0, servers=2, jobs=64, table="1 KB"),
    RealPath("20k", 1000, 20, 20.0, servers=2, jobs=64, table="1 KB"),
    RealPath("60k", 1000, 20, 60.0, servers=2, jobs=64, table="1 KB"),
    RealPath("50kb", 1000, 20, 2.0, servers=91, jobs=16, table="50 KB"),
    RealPath("5k", 5000, 1000, 4.0, servers=2, jobs=64, table="1 KB"),
    RealPath("arrive", 1000, 20, 20.0, servers=2, jobs=64, window=9.0, arrivals=1000, table="1 KB"),
    # One 700 MB fan-out every 4 s (changes at 4, 8 and 12 s of the churn), each
    # with 4 s or more inside the window to reach every subscriber.
    RealPath(
        "700kb", 1000, 1000, 0.25, servers=1240, jobs=4, window=16.0, drain=4.0, table="700 KB"
    ),
)
# The same shapes, tiny: every code path (a split rank table included) in seconds.
QUICK_REAL_PATH = (
    RealPath("2k", 4, 2, 20.0, servers=2, jobs=8, table="1 KB"),
    RealPath("20k", 4, 2, 20.0, servers=2, jobs=8, table="1 KB"),
    RealPath("60k", 4, 2, 40.0, servers=2, jobs=8, table="1 KB"),
    RealPath("50kb", 4, 2, 10.0, servers=91, jobs=4, table="50 KB"),
    RealPath("5k", 8, 8, 10.0, servers=2, jobs=8, table="1 KB"),
    RealPath("arrive", 4, 2, 20.0, servers=2, jobs=8, window=0.9, arrivals=4, table="1 KB"),
    RealPath(
        "700kb", 4, 4, 10.0, servers=40, jobs=2, per_configmap=15, drain=0.2, table="22 KB, split"
    ),
)


def scenario_names(specs: tuple[RealPath, ...]) -> list[str]:
    return [spec.name for spec in specs]


def run_scenario(bench: Bench, spec: RealPath) -> None:
    """`runs` alternating runs of every server on `spec`; their medians."""
    sizes = bench.sizes
    bench.go_programs()  # a missing Go package fails here, named, before anything starts
    window = spec.window or sizes.real_path_window
    servers: dict[str, Any] = {kind: {"runs": []} for kind in REAL_PATH_SERVERS}
    bench.results[spec.name] = {
        "spec": dataclasses.asdict(spec),
        "offered_per_s": spec.offered_per_s,
        "window_s": window,
        "warmup_s": sizes.real_path_warmup,
        "runs": sizes.real_path_runs,
        "sample_every": spec.sample_every,
        "fdagent_every": FDAGENT_EVERY,
        "servers": servers,
        "run": bench.provenance(),
    }
    for rep in range(sizes.real_path_runs):
        for kind in REAL_PATH_SERVERS:
            row = one_run(bench, spec, kind, window)
            servers[kind]["runs"].append(row)
            latency = row["latency"]
            bench.log(
                f"  {spec.name} {kind} (run {rep + 1}): {row['delivered_per_s']:,.0f} msg/s,"
                f" server {row['us_per_msg']:.1f} µs/msg, loadgen"
                f" {row['loadgen_us_per_msg']:.1f} µs/msg, p50/p99/max"
                f" {latency['p50_ms']:.1f}/{latency['p99_ms']:.1f}/{latency['max_ms']:.1f} ms,"
                f" within 10%: {row['fairness']['within_10pct']:.0%}, late snapshot messages"
                f" {row['snapshot']['in_window']}"
            )
    for kind in REAL_PATH_SERVERS:
        servers[kind].update(medians(servers[kind]["runs"]))


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The headline figures: the median over the runs of each."""
    figures = {
        "delivered_per_s": [r["delivered_per_s"] for r in runs],
        "us_per_msg": [r["us_per_msg"] for r in runs],
        "loadgen_us_per_msg": [r["loadgen_us_per_msg"] for r in runs],
        "p50_ms": [r["latency"]["p50_ms"] for r in runs],
        "p99_ms": [r["latency"]["p99_ms"] for r in runs],
        "max_ms": [r["latency"]["max_ms"] for r in runs],
        "within_10pct": [r["fairness"]["within_10pct"] for r in runs],
        "snapshot_in_window": [r["snapshot"]["in_window"] for r in runs],
        "snapshot_after_live": [r["snapshot"]["after_live"] for r in runs],
    }
    return {name: median([float(v) for v in values]) for name, values in figures.items()}


def kube_server(bench: Bench, children: list[Child], kind: str, url: str) -> Child:
    """`kind` serving the jobs of the API at `url`; ready once it has LISTed them."""
    if kind == "go":
        server = bench.child(
            "go-reference", "", "--kube-url", url, executable=bench.go_programs()["reference"]
        )
        children.append(server)
        return server
    if kind == "jobsignal":
        return bench.server(children, kind, "--source", "kube", "--kube-url", url)
    return bench.server(children, kind, "--kube-url", url)


def one_run(bench: Bench, spec: RealPath, kind: str, window: float) -> dict[str, Any]:
    """One server on `spec`: set up, subscribe, churn, warm up, measure one window."""
    sizes = bench.sizes
    with bench.running() as children:
        cluster = bench.cluster(children)
        cluster.request(
            {
                "cmd": "populate",
                "count": spec.jobs,
                "servers": spec.servers,
                "servers_per_configmap": spec.per_configmap,
            },
            timeout=120,
        )
        server = kube_server(bench, children, kind, cluster.ready["url"])
        started = time.perf_counter()
        client = bench.go_clients(
            children,
            server,
            spec.subscribers,
            spec.connections,
            sample_every=spec.sample_every,
            extra=("--fdagent-every", str(FDAGENT_EVERY)),
        )
        subscribe_s = time.perf_counter() - started
        at_up = client.request({"cmd": "per_subscriber"})
        cluster.request({"cmd": "mode", "mode": "churn", "rate": spec.rate})
        time.sleep(sizes.real_path_warmup)
        before = client.request({"cmd": "per_subscriber"})
        count_before = client.request({"cmd": "count"})
        stats_before = server.request({"cmd": "stats"})
        changes_before = cluster.request({"cmd": "stats"})["changes"]
        bench.reset_latencies([client])
        meter = CpuMeter([server.pid, cluster.pid])
        meter.start()
        window_start_ns = time.time_ns()
        measured_start = time.perf_counter()
        arrived: dict[str, Any] | None = None
        late: Child | None = None  # the arrivals' load generator
        if spec.arrivals:
            time.sleep(window / 3)
            late, arrived = arrive(bench, children, server, spec, window_start_ns)
        time.sleep(max(0.0, measured_start + window - spec.drain - time.perf_counter()))
        cluster.request({"cmd": "mode", "mode": "idle"})
        time.sleep(spec.drain)
        after = client.request({"cmd": "per_subscriber"})
        count_after = client.request({"cmd": "count"})
        late_count = late.request({"cmd": "count"}) if late is not None else None
        measured = time.perf_counter() - measured_start
        window_end_ns = time.time_ns()
        server_cores, cluster_cores = meter.stop()
        stats_after = server.request({"cmd": "stats"})
        # (Read while the server runs: the children stop when this block ends.)
        rss_bytes = server.rss_bytes() if server.proc.poll() is None else None
        changes_after = cluster.request({"cmd": "stats"})["changes"]
        pairs = collect_samples(bench, client)
    in_window = [(t, lat) for t, lat in pairs if window_start_ns <= t <= window_end_ns]
    received = count_after["received"] - count_before["received"]
    if arrived is not None and late_count is not None:
        # Their messages (snapshots and live) are deliveries of the window too.
        arrived["received"] = late_count["received"]
        arrived["loadgen_errors"] = late_count["errors"]
        received += late_count["received"]
    live = [
        (a - a_snap) - (b - b_snap)
        for a, a_snap, b, b_snap in zip(
            after["received"], after["snapshot"], before["received"], before["snapshot"],
            strict=True,
        )
    ]  # fmt: skip
    server_cpu = server_cores * measured
    loadgen_cpu = count_after["cpu_seconds"] - count_before["cpu_seconds"]
    return {
        "delivered": received,
        "delivered_per_s": received / measured,
        "live_per_s": sum(live) / measured,
        "measured_s": measured,
        "subscribe_s": subscribe_s,
        "server_cores": server_cores,
        "cluster_cores": cluster_cores,
        "us_per_msg": server_cpu * 1e6 / received if received else math.nan,
        "loadgen_cores": loadgen_cpu / measured,
        "loadgen_us_per_msg": loadgen_cpu * 1e6 / received if received else math.nan,
        "published": stats_after["published"] - stats_before["published"],
        "changes": changes_after - changes_before,
        "latency": latency_summary([lat for _, lat in in_window]),
        "timeline": timeline(in_window, window_start_ns, window_end_ns),
        "fairness": fairness(live, spec.connections or spec.subscribers),
        "snapshot": snapshot_figures(spec, at_up, before, after),
        "arrivals": arrived,
        "loadgen_errors": count_after["errors"],
        "loadgen_ended": count_after["ended"],
        "rss_bytes": rss_bytes,
    }


def arrive(
    bench: Bench, children: list[Child], server: Child, spec: RealPath, window_start_ns: int
) -> tuple[Child | None, dict[str, Any]]:
    """`spec.arrivals` FdAgent subscribers at once (a load generator of their own):
    how long until the server has them all up (None: not within ARRIVAL_WAIT s),
    and how many messages each had by then."""
    started = time.perf_counter()
    started_ns = time.time_ns()
    figures: dict[str, Any] = {
        "subscribers": spec.arrivals,
        "at_s": (started_ns - window_start_ns) / 1e9,  # into the window
        "all_up_s": None,
    }
    started_children = len(children)
    try:
        late = bench.go_clients(
            children,
            server,
            spec.arrivals,
            spec.connections,
            sample_every=1_000_000_000,  # their latency is not measured
            extra=("--fdagent-every", "1"),
            wait_seconds=ARRIVAL_WAIT,
        )
    except ChildError as error:  # not all up in time: the others are measured still
        figures["error"] = str(error)
        started_one = len(children) > started_children  # and it is in `children`
        return (children[started_children] if started_one else None), figures
    figures["all_up_s"] = time.perf_counter() - started
    counts = late.request({"cmd": "per_subscriber"})["received"]
    # Messages per arriving stream once the server had them all up: at least its
    # snapshot (the jobs) if the server sends that first.
    figures["at_up_min"] = min(counts, default=0)
    figures["at_up_median"] = median([float(c) for c in counts])
    return late, figures


def collect_samples(bench: Bench, client: Child) -> list[tuple[int, int]]:
    """The load generator's (arrival ns, latency ns) samples since `lat_reset`."""
    path = bench.work / "samples.bin"
    reply = client.request({"cmd": "samples_dump", "path": str(path)})
    values = array("q")
    with path.open("rb") as source:
        values.fromfile(source, int(reply["samples"]))
    path.unlink()
    return list(zip(values[0::2], values[1::2], strict=True))


def timeline(pairs: list[tuple[int, int]], start_ns: int, end_ns: int) -> dict[str, Any]:
    """Latency over the window: per bucket of time, the samples' p50 and max."""
    bucket_ns = max(1, (end_ns - start_ns) // TIMELINE_BUCKETS)
    buckets: list[list[int]] = [[] for _ in range(TIMELINE_BUCKETS + 1)]
    for arrival, latency in pairs:
        buckets[min(TIMELINE_BUCKETS, (arrival - start_ns) // bucket_ns)].append(latency)
    t, p50, peak, counts = [], [], [], []
    for index, values in enumerate(buckets):
        if not values:
            continue
        values.sort()
        t.append(round(index * bucket_ns / 1e9, 4))
        p50.append(round(values[len(values) // 2] / 1e6, 3))
        peak.append(round(values[-1] / 1e6, 3))
        counts.append(len(values))
    return {"bucket_s": bucket_ns / 1e9, "t_s": t, "p50_ms": p50, "max_ms": peak, "n": counts}


def snapshot_figures(
    spec: RealPath, at_up: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    """Were the snapshots on time? Per FdAgent stream, the snapshot messages it had
    when the server reported every stream up (a ClusterD-style server: all of
    them), those that arrived inside the window, and those after a live message."""
    fdagent = after["fdagent"]
    streams = [i for i, flag in enumerate(fdagent) if flag]
    at_up_counts = [at_up["snapshot"][i] for i in streams]
    final = [after["snapshot"][i] for i in streams]
    return {
        "fdagent_streams": len(streams),
        "jobs": spec.jobs,
        "at_up_min": min(at_up_counts, default=0),
        "at_up_median": median([float(c) for c in at_up_counts]),
        "short_at_up": sum(1 for c in at_up_counts if c < spec.jobs),
        "final_min": min(final, default=0),
        "final_max": max(final, default=0),
        "in_window": sum(after["snapshot"][i] - before["snapshot"][i] for i in streams),
        "after_live": sum(after["snapshot_after_live"][i] for i in streams),
        "on_other_streams": sum(after["snapshot"][i] for i, flag in enumerate(fdagent) if not flag),
    }
