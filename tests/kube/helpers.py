"""Shared helpers for the Kubernetes source tests (watcher, end to end, credentials).

- `Cluster` plays ClusterD against the emulator's store (docs/architecture.md section 4)
  and remembers every state each job went through, so a test can check that
  what a client saw is a faithful (possibly relist-compressed) replay of it;
- `expected_summary` / `cluster_jobs` compute what a client must hold, from
  the same parsing and assembly rules the store documents;
- `SignalLog` subscribes to a Broadcaster before the watcher starts and
  decodes every frame, so tests observe exactly what a gRPC client would get;
- `open_watcher` runs a Watcher against an emulator over real 127.0.0.1 HTTP;
- `GrpcStream` reads one grpcio response stream in a worker thread;
- `eventually` polls a condition under a deadline instead of sleeping.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import trio
import trio.lowlevel
import trio.testing
import yaml

from jobsignal._proto.job import JobSummarySignal
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.kube.api import KubeApi, TokenProvider
from jobsignal.kube.watcher import Credentials, Watcher, WatchSettings
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import ConfigMapStore, KubeEmulator, Selector, StatusError
from jobsignal.status import SourceStatus
from jobsignal.store import JobKey, JobStore, JobSummary
from jobsignal.store.configmap import BadConfigMap, Slice, parse_slice
from jobsignal.store.jobs import assemble

T = TypeVar("T")
Json = dict[str, Any]

SELECTOR = "outside-job-info=true"
#: The watcher's wall clock in the watcher tests: the deleteTime it stamps on
#: jobs whose ConfigMaps vanished without ClusterD's delete rewrite.
WALL = 1_800_000_000.0


# -- what the cluster holds -------------------------------------------------------


def configmap_json(
    namespace: str, name: str, data: Mapping[str, str], labels: Mapping[str, str] = JOB_LABELS
) -> Json:
    return {
        "metadata": {"namespace": namespace, "name": name, "labels": dict(labels)},
        "data": dict(data),
    }


def expected_summary(
    job: ClusterdJob, status: str, operator: str = "add", delete_time: int | None = None
) -> JobSummary:
    """The job event a client must receive for `job` written in this state."""
    slices = [
        parse_slice(configmap_json(job.namespace, name, data))
        for name, data in job.configmaps(status, operator, delete_time)
    ]
    summary = assemble(slices)
    assert summary is not None
    return summary


def cluster_states(
    state: ConfigMapStore, label_selector: str = SELECTOR, namespaces: Iterable[str] = ()
) -> dict[JobKey, JobSummary | None]:
    """Every job the selected ConfigMaps describe now (None: slices inconsistent)."""
    wanted = set(namespaces)
    by_job: dict[JobKey, list[Slice]] = {}
    for obj in state.objects(Selector.parse(None, label_selector)):
        if wanted and obj.namespace not in wanted:
            continue
        try:
            piece = parse_slice(obj.to_json())
        except BadConfigMap:
            continue
        by_job.setdefault(JobKey(obj.namespace, piece.fields.job_id), []).append(piece)
    return {key: assemble(slices) for key, slices in by_job.items()}


def cluster_jobs(
    state: ConfigMapStore, label_selector: str = SELECTOR, namespaces: Iterable[str] = ()
) -> dict[JobKey, JobSummary]:
    """The live jobs a client must hold once the watcher has caught up."""
    return {
        key: summary
        for key, summary in cluster_states(state, label_selector, namespaces).items()
        if summary is not None and not summary.is_deleted
    }


class Cluster:
    """ClusterD's writes, straight into the emulator's store (as the demo does).

    After every action it records each job's state, so `history` holds, per
    job, every distinct state it went through (a `None` entry: ConfigMaps gone).
    """

    def __init__(
        self,
        state: ConfigMapStore,
        label_selector: str = SELECTOR,
        namespaces: Iterable[str] = (),
    ) -> None:
        self.state = state
        self._selector = label_selector
        self._namespaces = tuple(namespaces)
        self.history: dict[JobKey, list[JobSummary | None]] = {}
        self._record()

    def write(
        self,
        job: ClusterdJob,
        status: str,
        operator: str = "add",
        delete_time: int | None = None,
        *,
        labels: Mapping[str, str] = JOB_LABELS,
    ) -> None:
        """Create or rewrite every ConfigMap of `job`, as ClusterD does on a change."""
        for name, data in job.configmaps(status, operator, delete_time):
            try:
                self.state.get(job.namespace, name)
            except StatusError:
                self.state.create_configmap(job.namespace, name, labels, data)
            else:
                self.state.update_configmap(job.namespace, name, data=data)
        self._record()

    def remove(self, job: ClusterdJob) -> None:
        """Delete the job's ConfigMaps (ClusterD does it a minute or two after the delete)."""
        for index in range(job.configmap_count):
            self.state.delete_configmap(job.namespace, job.configmap_name(index))
        self._record()

    def delete_configmap(self, namespace: str, name: str) -> None:
        """Delete one ConfigMap by hand: its job ends (docs/architecture.md section 4)."""
        ended = self._job_of(namespace, name)
        self.state.delete_configmap(namespace, name)
        self._record(ended)

    def relabel(self, namespace: str, name: str, labels: Mapping[str, str]) -> None:
        """Replace a ConfigMap's labels; one that stops matching ends its job."""
        ended = self._job_of(namespace, name)
        self.state.update_configmap(namespace, name, labels=labels)
        self._record(ended)

    def _job_of(self, namespace: str, name: str) -> JobKey:
        job_id = self.state.get(namespace, name).data["job_id"]
        return JobKey(namespace, job_id)

    def live(self) -> dict[JobKey, JobSummary]:
        return cluster_jobs(self.state, self._selector, self._namespaces)

    def _record(self, ended: JobKey | None = None) -> None:
        now = cluster_states(self.state, self._selector, self._namespaces)
        if ended is not None and now.get(ended) is None:
            now.pop(ended, None)  # lost a ConfigMap: the job ended
        for key in set(now) | set(self.history):
            states = self.history.setdefault(key, [])
            current = now.get(key)
            if key in now and current is None:
                continue  # mid-rewrite of a multi-ConfigMap job: not a state
            if not states or states[-1] != current:
                states.append(current)


# -- what a client saw ----------------------------------------------------------------


def to_summary(signal: JobSummarySignal | Any) -> JobSummary:
    """A decoded JobSummarySignal (betterproto2 or grpcio) as the store's JobSummary."""
    if isinstance(signal, JobSummarySignal):
        values = {
            "namespace": signal.namespace,
            "job_id": signal.job_id,
            "job_name": signal.job_name,
            "framework": signal.frame_work,
            "job_status": signal.job_status,
            "time": signal.time,
            "total": signal.total,
            "hccl_json": signal.hccl_json,
            "delete_time": signal.delete_time,
            "shared_tor_ip": signal.shared_tor_ip,
            "master_addr": signal.master_addr,
            "operator": signal.operator,
            "sid": signal.sid,
        }
    else:  # grpcio message: proto field names
        values = {
            "namespace": signal.namespace,
            "job_id": signal.jobId,
            "job_name": signal.jobName,
            "framework": signal.frameWork,
            "job_status": signal.jobStatus,
            "time": signal.time,
            "total": signal.total,
            "hccl_json": signal.HcclJson,
            "delete_time": signal.deleteTime,
            "shared_tor_ip": signal.sharedTorIp,
            "master_addr": signal.masterAddr,
            "operator": signal.operator,
            "sid": signal.sid,
        }
    return JobSummary(**values)


@dataclass(frozen=True)
class Event:
    """One message a client received: its uuid, cmIndex and the job state."""

    uuid: str
    cm_index: str
    job: JobSummary


def event_of(signal: JobSummarySignal | Any) -> Event:
    if isinstance(signal, JobSummarySignal):
        return Event(signal.uuid, signal.cm_index, to_summary(signal))
    return Event(signal.uuid, signal.cmIndex, to_summary(signal))


def live_state(events: Iterable[Event]) -> dict[JobKey, JobSummary]:
    """The jobs a client holds after these events: the last one of each, unless deleted."""
    latest: dict[JobKey, JobSummary] = {}
    for event in events:
        latest[event.job.key] = event.job
    return {key: job for key, job in latest.items() if not job.is_deleted}


def by_job(events: Iterable[Event]) -> dict[JobKey, list[JobSummary]]:
    result: dict[JobKey, list[JobSummary]] = {}
    for event in events:
        result.setdefault(event.job.key, []).append(event.job)
    return result


def assert_no_duplicates(events: list[Event]) -> None:
    """cmIndex 0, and per job never the same event (uuid) or state twice in a row.

    Event ids are derived from the state, so a job back in an earlier state
    (ended, then listed again unchanged) carries that state's uuid again.
    """
    last_uuid: dict[JobKey, str] = {}
    for event in events:
        assert last_uuid.get(event.job.key) != event.uuid, "an event was delivered twice"
        last_uuid[event.job.key] = event.uuid
    assert {event.cm_index for event in events} <= {"0"}
    for key, jobs in by_job(events).items():
        for before, after in itertools.pairwise(jobs):
            assert before != after, f"duplicate event for {key}: {after}"
            assert not (before.is_deleted and after.is_deleted), f"{key} deleted twice"


def made_up_delete(job: JobSummary, previous: JobSummary | None) -> bool:
    """`job` is the delete event the watcher makes up when a live job's ConfigMaps vanish."""
    if previous is None or previous.is_deleted or not job.is_deleted or not job.delete_time:
        return False
    delete_time = previous.delete_time or job.delete_time
    return job == dataclasses.replace(previous, operator="delete", delete_time=delete_time)


def assert_replays(cluster: Cluster, events: list[Event], *, exact: bool) -> None:
    """Each job's events replay its history in the cluster: real states, in order.

    A delete event made up for vanished ConfigMaps stands for a `None` entry.
    With `exact`, no live state after the job's first event may be missing (a
    watch resumed without relist delivers every change); otherwise states may
    be skipped (a relist after a gap only sees the newest).
    """
    for key, received in by_job(events).items():
        history = cluster.history.get(key, [])
        position = 0
        previous: JobSummary | None = None
        for index, job in enumerate(received):
            skipped: list[JobSummary | None] = []
            while True:
                if position >= len(history):
                    raise AssertionError(
                        f"{key}: event {job} is not a later state of the cluster;"
                        f" history {history}, received {received}"
                    )
                state = history[position]
                position += 1
                if state == job or (state is None and made_up_delete(job, previous)):
                    break
                skipped.append(state)
            if exact and index > 0:
                lost = [state for state in skipped if state is not None and not state.is_deleted]
                assert not lost, f"{key}: states never delivered: {lost}"
            previous = job


# -- observing a Broadcaster -------------------------------------------------------------


class SignalLog:
    """A SubscribeJobSummarySignal subscriber on the Broadcaster, decoded."""

    def __init__(self, broadcaster: Broadcaster) -> None:
        self.subscriber = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "test", snapshot=True)
        self.events: list[Event] = []
        self._changed = trio.Event()

    async def run(self) -> None:
        while True:
            for frame in await self.subscriber.next_batch(256):
                self.events.append(event_of(JobSummarySignal.parse(frame)))
            self._changed.set()
            self._changed = trio.Event()

    async def wait(
        self, condition: Callable[[], bool], *, timeout: float = 10.0, what: str = "events"
    ) -> None:
        """Wait until `condition` holds, re-checked after every batch of events."""
        try:
            with trio.fail_after(timeout):
                while not condition():
                    await self._changed.wait()
        except trio.TooSlowError:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None

    def live(self) -> dict[JobKey, JobSummary]:
        return live_state(self.events)

    def jobs(self) -> list[JobSummary]:
        return [event.job for event in self.events]


async def eventually(
    condition: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` (trio's clock).

    In virtual time a poll costs no waiting but still CPU, so it polls less often.
    """
    virtual = isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
    interval = 0.05 if virtual else 0.01
    try:
        with trio.fail_after(timeout):
            while not condition():
                await trio.sleep(interval)
    except trio.TooSlowError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


# -- running a watcher ------------------------------------------------------------------------


@dataclass
class WatchHarness:
    emu: KubeEmulator
    watcher: Watcher
    store: JobStore
    broadcaster: Broadcaster
    status: SourceStatus
    log: SignalLog
    #: (trio time, "list" or "watch", query) of every request the watcher sent.
    sent: list[tuple[float, str, dict[str, str]]] = field(default_factory=list)

    def sent_times(self, kind: str) -> list[float]:
        return [when for when, what, _ in self.sent if what == kind]

    async def caught_up(self, cluster: Cluster, timeout: float = 30.0) -> None:
        """Wait until the client's view is the cluster's, and the store's too."""
        expected = cluster.live()
        await self.log.wait(
            lambda: self.log.live() == expected,
            timeout=timeout,
            what="the subscriber to hold the cluster's state",
        )
        assert {job.key: job for job in self.store.live_jobs()} == expected


@asynccontextmanager
async def open_watcher(
    emu: KubeEmulator,
    settings: WatchSettings | None = None,
    *,
    tokens: TokenProvider | None = None,
    credentials: Credentials | None = None,
    read_timeout: float = 90.0,
    rng: Callable[[], float] = lambda: 0.5,
    on_response: Callable[[httpx.Response], None] | None = None,
) -> AsyncIterator[WatchHarness]:
    """A Watcher on `emu` over real HTTP, observed through a Broadcaster subscriber."""
    settings = WatchSettings() if settings is None else settings
    store, broadcaster, status = JobStore(), Broadcaster(), SourceStatus()
    sent: list[tuple[float, str, dict[str, str]]] = []

    async def record_request(request: httpx.Request) -> None:
        params = dict(request.url.params)
        kind = "watch" if params.get("watch") else "list"
        sent.append((trio.current_time(), kind, params))

    async def record_response(response: httpx.Response) -> None:
        if on_response is not None:
            on_response(response)

    raised: BaseException | None = None
    timeout = httpx.Timeout(10.0, read=read_timeout + 5)
    async with (
        httpx.AsyncClient(
            base_url=emu.url,
            timeout=timeout,
            # Plain HTTP: no TLS, so skip loading the CA bundle (0.1 s per client).
            verify=not emu.url.startswith("http://"),
            event_hooks={"request": [record_request], "response": [record_response]},
        ) as client,
        trio.open_nursery() as nursery,
    ):
        api = KubeApi(client, tokens, read_timeout=read_timeout)
        watcher = Watcher(
            api,
            store,
            broadcaster.publish,
            status,
            settings,
            credentials=credentials,
            wall_clock=lambda: WALL,
            rng=rng,
        )
        log = SignalLog(broadcaster)
        nursery.start_soon(log.run)
        await nursery.start(watcher.run)
        harness = WatchHarness(emu, watcher, store, broadcaster, status, log, sent)
        try:
            yield harness
        except BaseException as exc:
            # Raised again below, outside the nursery that would wrap it in a group.
            raised = exc
        finally:
            nursery.cancel_scope.cancel()
    if raised is not None:
        raise raised


# -- kubeconfig files ------------------------------------------------------------------------


def write_kubeconfig(
    path: Path,
    server: str,
    *,
    user: Mapping[str, Any] | None = None,
    cluster: Mapping[str, Any] | None = None,
) -> Path:
    """A one-context kubeconfig for `server` (the emulator's URL)."""
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "jobsignal", "user": dict(user or {})}],
        "contexts": [
            {"name": "test", "context": {"cluster": "emulator", "user": "jobsignal"}},
        ],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(document))
    return path


# -- grpcio in a worker thread -----------------------------------------------------------------


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking grpcio call off the trio thread (every call carries a deadline)."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args), abandon_on_cancel=True)


@dataclass(eq=False)
class GrpcStream:
    """Reads one grpcio response stream in a worker thread until it ends."""

    call: Any
    messages: list[Any] = field(default_factory=list)
    ended: trio.Event = field(default_factory=trio.Event)
    error: Any = None

    def _consume(self) -> None:
        import grpc

        try:
            for message in self.call:
                self.messages.append(message)
        except grpc.RpcError as error:
            self.error = error

    async def run(self) -> None:
        await in_thread(self._consume)
        self.ended.set()

    def events(self) -> list[Event]:
        return [event_of(message) for message in list(self.messages)]

    async def wait_for(
        self, condition: Callable[[list[Event]], bool], *, timeout: float = 10.0, what: str
    ) -> list[Event]:
        await eventually(
            lambda: condition(self.events()) or self.ended.is_set(), timeout=timeout, what=what
        )
        events = self.events()
        assert condition(events), f"stream ended ({self.error}) before {what}: {events}"
        return events


def hccl(job: JobSummary) -> Json:
    decoded: Json = json.loads(job.hccl_json)
    return decoded
