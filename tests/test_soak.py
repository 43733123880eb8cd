"""A bounded soak: the whole server, a changing cluster, and hundreds of grpcio clients.

`jobsignal.app.run_jobsignal` watches the Kubernetes API emulator over its
HTTP API (kubeconfig in tmp_path), while a driver walks ClusterD-format jobs
through their lifecycle (pending, running, rescaled, complete or failed,
operator delete, ConfigMaps removed, or removed without a delete) in bursts
separated by quiet spells longer than the idle timeout. Meanwhile client
processes (this file run as a script, each with tens of grpcio channels, one
TCP connection per subscription) subscribe with every role and both RPCs:

- long-lived clients, with gRPC keepalive, subscribe before the first job and
  must survive every quiet spell without a single stream end;
- churn clients, half without keepalive (as ClusterD's own agents dial), answer
  the server's keepalive PINGs and so also outlive every quiet spell; every
  few seconds one churn process is SIGKILLed (no goodbye) and a new one takes
  its place;
- at the end, fresh clients subscribe with snapshots (FdAgent signals and
  JobSummarySignalList).

Once the driver stops, every live subscriber must hold exactly the cluster's
final state (computed from the emulator's ConfigMaps with the store's own
parse_slice + assemble), with the same event uuid per job as the server's
latest; the server must hold exactly the live subscriptions, registrations
and connections; and when every client is gone, nothing is left: no
subscriber, claim, connection or per-address count, no extra trio task, no
extra file descriptor.

Everything is bounded: every wait has a deadline, every child process has a
timeout and is killed in a `finally`; only 127.0.0.1 is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

# -- the client process (this file run as a script) ------------------------------------------

# The 15 JobSummarySignal fields but uuid, by proto name: what a job's state is.
STATE_FIELDS = (
    "jobId",
    "jobName",
    "namespace",
    "frameWork",
    "jobStatus",
    "time",
    "cmIndex",
    "total",
    "HcclJson",
    "deleteTime",
    "sharedTorIp",
    "masterAddr",
    "operator",
    "sid",
)
SNAPSHOT_ROLES = frozenset({"FdAgent"})
KEEPALIVE_OPTIONS = {
    "keepalive_time_ms": 1000,
    "keepalive_permit_without_calls": 1,
    "http2__max_pings_without_data": 0,
}


def fingerprint(fields: dict[str, str]) -> str:
    text = json.dumps({name: fields[name] for name in STATE_FIELDS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SubSpec:
    role: str
    list_mode: bool
    keepalive: bool


class ClientSubscription(threading.Thread):
    """One grpcio channel (one connection) keeping one subscription, resubscribing on end."""

    def __init__(self, target: str, spec: SubSpec, stopping: threading.Event, stubs: Any) -> None:
        super().__init__(daemon=True)
        self.stubs = stubs
        self.target = target
        self.spec = spec
        self.stopping = stopping
        self.lock = threading.Lock()
        # job key -> (fingerprint of its fields, uuid of the event that set them)
        self.jobs: dict[str, tuple[str, str]] = {}
        self.live_id: str | None = None
        self.subscriptions = 0
        self.messages = 0
        # A List stream's first message (its snapshot's ReportTime and JobTotalNum),
        # and live list messages whose JobTotalNum was not ClusterD's 1.
        self.snapshot_time: str | None = None
        self.snapshot_total: int | None = None
        self.bad_live_totals = 0
        self.ends: Counter[str] = Counter()
        self.channel: Any = None

    def apply(self, message: Any) -> None:
        key = f"{message.namespace}/{message.jobId}"
        if message.operator == "delete":
            self.jobs.pop(key, None)
        else:
            fields = {name: getattr(message, name) for name in STATE_FIELDS}
            self.jobs[key] = (fingerprint(fields), message.uuid)

    def run(self) -> None:
        import grpc

        from tests.support.grpcio import channel_options

        stubs = self.stubs
        # Retries on, as in a default grpcio client: an RPC sent just as the server
        # closes an idle connection is retried transparently (GOAWAY shows it unseen).
        keepalive = KEEPALIVE_OPTIONS if self.spec.keepalive else {}
        options = channel_options(enable_retries=1, **keepalive)
        self.channel = grpc.insecure_channel(self.target, options=options)
        stub = stubs.job_pb2_grpc.JobStub(self.channel)
        rng = random.Random()
        while not self.stopping.is_set():
            try:
                status = stub.Register(stubs.job_pb2.ClientInfo(role=self.spec.role), timeout=10)
                if status.code != 200:
                    self.ends[f"register {status.code}"] += 1
                    self.stopping.wait(0.2)
                    continue
                info = stubs.job_pb2.ClientInfo(role=self.spec.role, clientId=status.clientId)
                method = (
                    stub.SubscribeJobSummarySignalList
                    if self.spec.list_mode
                    else stub.SubscribeJobSummarySignal
                )
                call = method(info, timeout=600)
                with self.lock:
                    self.jobs = {}
                    self.snapshot_time = self.snapshot_total = None
                    self.live_id = status.clientId
                    self.subscriptions += 1
                for message in call:
                    with self.lock:
                        self.messages += 1
                        if self.spec.list_mode:
                            for signal_message in message.jobSummarySignals:
                                self.apply(signal_message)
                            if self.snapshot_time is None:
                                self.snapshot_time = message.ReportTime
                                self.snapshot_total = message.JobTotalNum
                            elif message.ReportTime != self.snapshot_time:
                                self.bad_live_totals += message.JobTotalNum != 1
                        else:
                            self.apply(message)
                ending = "OK"
            except grpc.RpcError as error:
                details = error.details() or ""
                if "idle for" in details:
                    details = "idle"
                details = re.sub(r"'[0-9a-f-]{36}'", "'<id>'", details)
                ending = f"{error.code().name}: {details}"
            except ValueError:  # the channel was closed under us
                return
            with self.lock:
                self.live_id = None
                self.ends[ending] += 1
            self.stopping.wait(rng.uniform(0.05, 0.3))

    def report(self) -> dict[str, object]:
        with self.lock:
            return {
                "role": self.spec.role,
                "list": self.spec.list_mode,
                "keepalive": self.spec.keepalive,
                "live_id": self.live_id,
                "subscriptions": self.subscriptions,
                "messages": self.messages,
                "snapshot_total": self.snapshot_total,
                "bad_live_totals": self.bad_live_totals,
                "ends": dict(self.ends),
                "jobs": dict(self.jobs),
            }


def client_main(target: str, specs: list[SubSpec]) -> None:
    """Run the subscriptions; answer `dump` on stdin with one JSON line; `quit` or EOF ends."""
    from tests.support.grpcio import load

    stubs = load()
    stopping = threading.Event()
    threads = [ClientSubscription(target, spec, stopping, stubs) for spec in specs]
    for thread in threads:
        thread.start()
    print(json.dumps({"type": "started"}), flush=True)
    for line in sys.stdin:
        if line.strip() == "dump":
            print(json.dumps({"type": "dump", "subs": [t.report() for t in threads]}), flush=True)
        elif line.strip() == "quit":
            break
    stopping.set()
    for thread in threads:
        if thread.channel is not None:
            thread.channel.close()
    for thread in threads:
        thread.join(timeout=5)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    client_main(config["target"], [SubSpec(**spec) for spec in config["subs"]])
    sys.exit(0)


# -- the test ----------------------------------------------------------------------------------

import pytest  # noqa: E402
import trio  # noqa: E402
import trio.lowlevel  # noqa: E402

from jobsignal.app import RunningJobsignal, run_jobsignal  # noqa: E402
from jobsignal.config import configure  # noqa: E402
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob  # noqa: E402
from jobsignal.sim.emulator import (  # noqa: E402
    ConfigMapStore,
    KubeEmulator,
    StatusError,
    open_emulator,
)
from jobsignal.store.model import JobSummary  # noqa: E402
from tests.support.cluster import TOKEN, cluster_states, write_kubeconfig  # noqa: E402
from tests.support.grpcio import GrpcioStubs, cli_env, expected_signal  # noqa: E402
from tests.support.tasks import count_tasks  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

# Keepalive clients ping every second: they survive stalls of up to 3 s on a loaded machine.
IDLE_TIMEOUT = 4.0
DRIVE_SECONDS = 38.0
ACTIVE_SPELL = 3.5
# Longer than the idle timeout, with room for the watcher's lag: only heartbeats
# (their own PINGs, or their ACKs of the server's) keep quiet clients subscribed.
QUIET_SPELL = IDLE_TIMEOUT + 2.5
STEP = 0.06
TARGET_JOBS = 24
KILL_EVERY = 5.0
REGISTRATION_TTL = 10.0
SOAK_DEADLINE = 240.0  # the whole soak, on the busiest machine; about 50 s usually

LONG_LIVED_PROCESSES, LONG_LIVED_SUBS = 2, 30
CHURN_PROCESSES, CHURN_SUBS = 4, 40
FRESH_SUBS = 20
ROLES = ("CCAgent", "DefaultUser1", "DefaultUser2", "FdAgent")
NAMESPACES = ("team-a", "team-b", "team-c")


def long_lived_specs() -> list[SubSpec]:
    """Every role and both RPCs, all with keepalive."""
    return [
        SubSpec(ROLES[i % len(ROLES)], list_mode=(i % 3 == 2), keepalive=True)
        for i in range(LONG_LIVED_SUBS)
    ]


def churn_specs() -> list[SubSpec]:
    """Every role and both RPCs, half without keepalive (kept by the server's PINGs)."""
    return [
        SubSpec(ROLES[i % len(ROLES)], list_mode=(i % 5 == 4), keepalive=(i % 2 == 0))
        for i in range(CHURN_SUBS)
    ]


def fresh_specs() -> list[SubSpec]:
    """Subscriptions that start with the whole current state."""
    return [
        SubSpec("FdAgent" if i % 2 else "DefaultUser2", list_mode=(i % 2 == 0), keepalive=True)
        for i in range(FRESH_SUBS)
    ]


# -- the cluster: ClusterD's job lifecycle, driven continuously ------------------------------


@dataclass
class DrivenJob:
    job: ClusterdJob
    status: str = "pending"
    deleted: bool = False


@dataclass
class DriverStats:
    writes: Counter[str] = field(default_factory=Counter)


def write_job(state: ConfigMapStore, entry: DrivenJob, *, delete_time: int | None = None) -> None:
    """Write every ConfigMap of the job (as ClusterD does), removing slices past its end."""
    operator = "delete" if entry.deleted else "add"
    for name, data in entry.job.configmaps(entry.status, operator, delete_time):
        try:
            state.get(entry.job.namespace, name)
        except StatusError:
            state.create_configmap(entry.job.namespace, name, JOB_LABELS, data)
        else:
            state.update_configmap(entry.job.namespace, name, data=data)
    index = entry.job.configmap_count
    while True:
        try:
            state.delete_configmap(entry.job.namespace, entry.job.configmap_name(index))
        except StatusError:
            return
        index += 1


def remove_job(state: ConfigMapStore, entry: DrivenJob) -> None:
    for index in range(entry.job.configmap_count):
        state.delete_configmap(entry.job.namespace, entry.job.configmap_name(index))


def drive_step(
    state: ConfigMapStore, jobs: dict[str, DrivenJob], rng: random.Random, stats: DriverStats
) -> None:
    """One ClusterD action; every job's ConfigMaps agree again when it returns."""
    if len(jobs) < TARGET_JOBS and rng.random() < 0.5:
        number = stats.writes["create"]
        servers = rng.randint(1, 6)
        job = ClusterdJob(
            rng.choice(NAMESPACES),
            f"soak-{number}",
            f"uid-soak-{number:05d}",
            framework=rng.choice(("pytorch", "mindspore")),
            servers=servers,
            servers_per_configmap=rng.choice((1, 2, 1000)),
            created=1_700_000_000 + number,
        )
        entry = DrivenJob(job)
        jobs[job.name] = entry
        write_job(state, entry)
        stats.writes["create"] += 1
        return
    if not jobs:
        return
    entry = jobs[rng.choice(sorted(jobs))]
    if entry.deleted:
        remove_job(state, entry)  # ClusterD removes the ConfigMaps a while after the delete
        del jobs[entry.job.name]
        stats.writes["remove"] += 1
    elif rng.random() < 0.05:
        remove_job(state, entry)  # gone without a delete: the store must send one
        del jobs[entry.job.name]
        stats.writes["vanish"] += 1
    elif entry.status == "pending":
        entry.status = "running"
        write_job(state, entry)
        stats.writes["run"] += 1
    elif entry.status == "running" and rng.random() < 0.3:
        entry.job = replace(entry.job, servers=rng.randint(1, 6))  # rescaled rank table
        write_job(state, entry)
        stats.writes["rescale"] += 1
    elif entry.status == "running":
        entry.status = rng.choice(("complete", "failed"))
        write_job(state, entry)
        stats.writes["finish"] += 1
    else:
        entry.deleted = True
        write_job(state, entry, delete_time=int(time.time()))
        stats.writes["delete"] += 1


async def drive_jobs(
    state: ConfigMapStore, rng: random.Random, stats: DriverStats, until: float
) -> None:
    """Bursts of job changes, each followed by a quiet spell longer than the idle timeout."""
    jobs: dict[str, DrivenJob] = {}
    while trio.current_time() < until:
        spell_end = min(until, trio.current_time() + ACTIVE_SPELL)
        while trio.current_time() < spell_end:
            drive_step(state, jobs, rng, stats)
            await trio.sleep(STEP)
        stats.writes["quiet spells"] += 1
        await trio.sleep_until(min(until, trio.current_time() + QUIET_SPELL))


def job_fields(job: JobSummary) -> dict[str, str]:
    """The signal fields a client must see for `job`, all but the per-event uuid."""
    fields = expected_signal(job, "")
    del fields["uuid"]
    return fields


def cluster_jobs(state: ConfigMapStore) -> dict[str, JobSummary]:
    """The live jobs the cluster's ConfigMaps describe, by 'namespace/jobId'."""
    states = cluster_states(state)
    assert None not in states.values(), "the driver left a job inconsistent"
    return {str(key): job for key, job in states.items() if job and not job.is_deleted}


# -- client processes ------------------------------------------------------------------------


@dataclass(eq=False)
class ClientProcess:
    name: str
    specs: list[SubSpec]
    process: trio.Process
    buffer: bytearray = field(default_factory=bytearray)

    async def read_message(self) -> dict[str, Any]:
        stdout = self.process.stdout
        assert stdout is not None
        while b"\n" not in self.buffer:
            chunk = await stdout.receive_some()
            if not chunk:
                raise AssertionError(f"client {self.name} exited ({self.process.returncode})")
            self.buffer += chunk
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer[:] = rest
        message: dict[str, Any] = json.loads(line)
        return message

    async def dump(self) -> list[dict[str, Any]]:
        stdin = self.process.stdin
        assert stdin is not None
        await stdin.send_all(b"dump\n")
        with trio.fail_after(20):
            message = await self.read_message()
        assert message["type"] == "dump", message
        subs: list[dict[str, Any]] = message["subs"]
        return subs

    async def quit(self) -> None:
        """Leave politely: close every channel, exit."""
        stdin = self.process.stdin
        assert stdin is not None
        await stdin.send_all(b"quit\n")
        with trio.fail_after(20):
            await self.process.wait()
        assert self.process.returncode == 0, f"client {self.name}: {self.process.returncode}"

    async def kill(self) -> None:
        """Leave with no goodbye at all."""
        self.process.send_signal(signal.SIGKILL)
        with trio.fail_after(20):
            await self.process.wait()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            with trio.move_on_after(10):
                await self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    await trio.aclose_forcefully(stream)


SCRIPT = str(Path(__file__).resolve())


def open_log(path: Path) -> IO[bytes]:
    return open(path, "wb")  # closed in Clients.close_all


class Clients:
    """Every client process the test started; all killed in `close_all`."""

    def __init__(self, target: str, env: dict[str, str], logs: Path) -> None:
        self.target = target
        self.env = env
        self.logs = logs
        self.started: list[ClientProcess] = []
        self._log_files: list[IO[bytes]] = []

    async def start(self, name: str, specs: list[SubSpec]) -> ClientProcess:
        config = {"target": self.target, "subs": [vars(spec) for spec in specs]}
        stderr = open_log(self.logs / f"{name}.log")
        self._log_files.append(stderr)
        process = await trio.lowlevel.open_process(
            [sys.executable, SCRIPT, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=self.env,
        )
        client = ClientProcess(name, specs, process)
        self.started.append(client)
        with trio.fail_after(30):
            message = await client.read_message()
        assert message["type"] == "started", message
        return client

    async def close_all(self) -> None:
        for client in self.started:
            await client.close()
        for log_file in self._log_files:
            log_file.close()


# -- server-side bookkeeping -----------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def server_counts(server: RunningJobsignal) -> dict[str, object]:
    connections = server._parts.grpc.connections
    return {
        "subscribers": len(server._parts.broadcaster.subscribers),
        "active_subscriptions": server._parts.registry.active_subscriptions(),
        "connections": len(connections),
        "counted_total": connections.counter.total,
        "counted_per_ip": dict(connections.counter.per_ip),
    }


def expected_counts(live: int) -> dict[str, object]:
    return {
        "subscribers": live,
        "active_subscriptions": live,
        "connections": live,
        "counted_total": live,
        "counted_per_ip": {"127.0.0.1": live} if live else {},
    }


#: Polling interval of the soak's waits: the server is busy enough.
POLL = 0.05


async def wait_for_counts(server: RunningJobsignal, live: int, within: float = 20) -> None:
    want = expected_counts(live)
    try:
        await wait_until(lambda: server_counts(server) == want, within=within, interval=POLL)
    except AssertionError:
        raise AssertionError(f"server holds {server_counts(server)}, expected {want}") from None


async def wait_registrations_settle(server: RunningJobsignal, live: int) -> None:
    """Ids registered by killed clients that never subscribed expire after the TTL."""

    def settled() -> bool:
        server._parts.registry.expire(trio.current_time())
        return len(server._parts.registry) == live

    await wait_until(
        settled, within=REGISTRATION_TTL + 10, what=f"{live} registrations", interval=POLL
    )


# -- the soak ----------------------------------------------------------------------------------


@dataclass
class Expected:
    jobs: dict[str, tuple[str, str]]  # key -> (fingerprint, uuid)
    count: int


def expected_from(server: RunningJobsignal, cluster: dict[str, JobSummary]) -> Expected:
    latest = {str(entry.job.key): entry for entry in server._parts.broadcaster.latest()}
    assert sorted(latest) == sorted(cluster), "the server's latest state is not the cluster's"
    jobs = {}
    for key, job in cluster.items():
        assert latest[key].job == job, f"{key}: server has {latest[key].job}, cluster {job}"
        jobs[key] = (fingerprint(job_fields(job)), latest[key].uuid)
    return Expected(jobs, len(jobs))


def mismatches(subs: list[dict[str, Any]], expected: Expected) -> list[str]:
    problems = []
    for index, sub in enumerate(subs):
        label = f"sub {index} ({sub['role']}, list={sub['list']})"
        if sub["live_id"] is None:
            problems.append(f"{label}: not subscribed, ends {sub['ends']}")
            continue
        jobs = {key: tuple(value) for key, value in sub["jobs"].items()}
        if jobs != expected.jobs:
            missing = sorted(expected.jobs.keys() - jobs.keys())
            extra = sorted(jobs.keys() - expected.jobs.keys())
            differ = sorted(
                k for k in jobs.keys() & expected.jobs.keys() if jobs[k] != expected.jobs[k]
            )
            problems.append(f"{label}: missing {missing} extra {extra} differ {differ}")
        elif sub["list"] and (sub["snapshot_total"] is None or sub["bad_live_totals"]):
            problems.append(f"{label}: {sub['bad_live_totals']} live JobTotalNum other than 1")
    return problems


async def all_dumps(processes: list[ClientProcess]) -> list[dict[str, Any]]:
    subs: list[dict[str, Any]] = []
    for process in processes:
        subs += await process.dump()
    return subs


def ends_of(subs: list[dict[str, Any]]) -> Counter[str]:
    ends: Counter[str] = Counter()
    for sub in subs:
        ends.update(sub["ends"])
    return ends


def live_ids(subs: list[dict[str, Any]]) -> set[str]:
    return {sub["live_id"] for sub in subs if sub["live_id"] is not None}


@dataclass
class SoakReport:
    timings: dict[str, float] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)

    def __iter__(self) -> Iterator[str]:
        yield from (f"{k}={v:.1f}s" for k, v in self.timings.items())
        yield from (f"{k}={v}" for k, v in self.figures.items())


@pytest.mark.slow
async def test_soak_full_server_many_clients_changing_cluster(
    tmp_path: Path, grpcio_stubs: GrpcioStubs
) -> None:
    report = SoakReport()
    started = time.monotonic()
    rng = random.Random(20261129)
    async with open_emulator(token=TOKEN) as emulator:
        config = configure(
            listen="127.0.0.1:0",
            source="kubernetes",
            kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig", emulator.url)),
            idle_timeout=IDLE_TIMEOUT,
            keepalive_time=IDLE_TIMEOUT / 2,
            min_client_ping_interval=0.5,  # grpcio's 1 s keepalive is no flood
            max_subscriptions_per_role=1000,
            max_registrations=4000,
            # Every soak client connects from 127.0.0.1: it gets whole pools.
            max_subscriptions_per_role_per_ip=1000,
            max_registrations_per_ip=4000,
            registration_ttl=REGISTRATION_TTL,
            register_rate=100_000,
            register_burst=100_000,
            subscribe_rate=100_000,
            subscribe_burst=100_000,
            max_connections=4000,
            max_connections_per_ip=4000,
        )
        async with trio.open_nursery() as nursery:
            with trio.fail_after(20):
                server: RunningJobsignal = await nursery.start(
                    functools.partial(run_jobsignal, config, environ={})
                )
                await server.ready.wait()
            target = f"127.0.0.1:{server.port}"
            env = {**cli_env(grpcio_stubs), "GRPC_VERBOSITY": "ERROR"}
            clients = Clients(target, env, tmp_path)
            await trio.sleep(0.2)
            tasks_before, fds_before = count_tasks(), open_fds()
            try:
                with trio.fail_after(SOAK_DEADLINE):
                    await soak(server, emulator, clients, rng, report)
            finally:
                await clients.close_all()
            # Every client gone: nothing is left on the server.
            await wait_for_counts(server, live=0)
            await wait_registrations_settle(server, live=0)
            assert server._parts.broadcaster.subscribers == frozenset()
            await wait_until(lambda: count_tasks() <= tasks_before, what="tasks", interval=POLL)
            await wait_until(lambda: open_fds() <= fds_before + 2, what="fds", interval=POLL)
            report.figures["trio tasks before/after"] = f"{tasks_before}/{count_tasks()}"
            report.figures["fds before/after"] = f"{fds_before}/{open_fds()}"
            server.request_shutdown()
            with trio.fail_after(15):
                await server.stopped.wait()
            nursery.cancel_scope.cancel()
    report.timings["total"] = time.monotonic() - started
    print("\nsoak:", ", ".join(report))


async def soak(
    server: RunningJobsignal,
    emulator: KubeEmulator,
    clients: Clients,
    rng: random.Random,
    report: SoakReport,
) -> None:
    t0 = time.monotonic()
    # Long-lived subscribers first, so they see every job from its first event.
    long_lived = [
        await clients.start(f"long-lived-{i}", long_lived_specs())
        for i in range(LONG_LIVED_PROCESSES)
    ]
    long_lived_count = LONG_LIVED_PROCESSES * LONG_LIVED_SUBS
    await wait_for_counts(server, long_lived_count, within=30)
    churn = [await clients.start(f"churn-{i}", churn_specs()) for i in range(CHURN_PROCESSES)]
    report.timings["clients up"] = time.monotonic() - t0

    stats = DriverStats()
    client_ends: Counter[str] = Counter()
    peak = 0
    kills = 0
    drive_until = trio.current_time() + DRIVE_SECONDS
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive_jobs, emulator.state, rng, stats, drive_until)
        next_kill = trio.current_time() + KILL_EVERY
        while trio.current_time() < drive_until:
            await trio.sleep(0.25)
            peak = max(peak, len(server._parts.broadcaster.subscribers))
            if trio.current_time() >= next_kill:
                victim = churn.pop(rng.randrange(len(churn)))
                client_ends.update(ends_of(await victim.dump()))
                await victim.kill()
                kills += 1
                churn.append(await clients.start(f"churn-{CHURN_PROCESSES + kills}", churn_specs()))
                next_kill += KILL_EVERY
    report.timings["drive"] = time.monotonic() - t0 - report.timings["clients up"]
    report.figures["peak subscribers"] = peak
    report.figures["kills"] = kills
    report.figures["driver"] = dict(stats.writes)

    # Churn clients leave: half with no goodbye, half politely.
    for client in churn:
        client_ends.update(ends_of(await client.dump()))
    for index, client in enumerate(churn):
        await (client.kill() if index % 2 else client.quit())
    fresh = await clients.start("fresh", fresh_specs())
    live = long_lived_count + FRESH_SUBS
    await wait_for_counts(server, live, within=30)

    cluster = cluster_jobs(emulator.state)
    await wait_until(
        lambda: {str(job.key): job for job in server._parts.store.live_jobs()} == cluster,
        within=20,
        what="the job store to match the cluster",
        interval=POLL,
    )
    expected = expected_from(server, cluster)
    report.figures["final jobs"] = expected.count
    watching = [*long_lived, fresh]
    subs: list[dict[str, Any]] = []
    problems: list[str] = ["not checked yet"]
    with trio.move_on_after(20):
        while problems:
            subs = await all_dumps(watching)
            problems = mismatches(subs, expected)
            if problems:
                await trio.sleep(0.5)
    assert not problems, "\n".join(problems[:20])

    # The server holds exactly the live subscriptions, their ids and their connections.
    assert {s.client_id for s in server._parts.broadcaster.subscribers} == live_ids(subs)
    assert server_counts(server) == expected_counts(live)
    by_role = Counter(sub["role"] for sub in subs)
    for role in ROLES:
        assert server._parts.registry.active_subscriptions(role) == by_role[role], role
    await wait_registrations_settle(server, live)

    # Heartbeats kept every live subscription through every quiet spell: the
    # long-lived ones' own PINGs, the silent churn ones' ACKs of the server's.
    long_subs = subs[:long_lived_count]
    assert all(sub["subscriptions"] == 1 and not sub["ends"] for sub in long_subs), [
        sub["ends"] for sub in long_subs if sub["ends"]
    ]
    ends = server._parts.broadcaster.stats.stream_ends
    report.figures["stream ends"] = dict(ends)
    assert ends["idle"] == 0, dict(ends)
    assert ends["client_gone"] >= kills * CHURN_SUBS // 2, dict(ends)
    client_ends.update(ends_of(subs))
    report.figures["stream ends seen by clients"] = dict(client_ends)
    # No live client saw its stream end: no idle cut, refusal, slow-client cut or error.
    assert not client_ends, dict(client_ends)
    report.figures["messages delivered"] = server._parts.broadcaster.stats.messages_delivered
    report.figures["live tasks"] = count_tasks()

    for client in watching:
        await client.quit()
    report.timings["verify"] = (
        time.monotonic() - t0 - report.timings["clients up"] - report.timings["drive"]
    )
