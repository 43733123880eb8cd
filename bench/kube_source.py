"""The grpc.aio reference server's Kubernetes source: job events from ConfigMaps.

LIST, then WATCH, of the labelled job-summary ConfigMaps of one namespace of
the benchmark's API emulator, over plain HTTP/1.1 on asyncio streams (one
request per connection; the watch body chunked, one JSON event per line),
turned into job events the way a ClusterD-style job cache would: a job's
slices (one ConfigMap per cm_index, all from the same write) are put back
together, and one event goes out per change of a complete job, none for a
rewrite that changes nothing. A watch that ends resumes from the last
resourceVersion; an ERROR event (410) or a failure relists.

Kept simple, but not slow: a job held in one ConfigMap passes its hccl.json
through as it is; a job split over several has each slice's hccl.json parsed
once per change of that slice and its servers joined as text. Nothing is
validated beyond that (the benchmark's input is well formed); jobsignal's own
store does more, which its figures include. The grpc-go reference server's
source (bench/go/kubewatch) works the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

SELECTOR = "outside-job-info=true"
# The data keys every slice of a job repeats (all but cm_index and hccl.json).
JOB_FIELDS = (
    "job_id",
    "job_name",
    "framework",
    "job_status",
    "total",
    "operator",
    "time",
    "deleteTime",
    "sharedTorIp",
    "masterAddr",
    "sid",
)
# JobSummarySignal's fields (proto names) from the data keys of index 0.
SIGNAL_FIELDS = {
    "jobId": "job_id",
    "jobName": "job_name",
    "frameWork": "framework",
    "jobStatus": "job_status",
    "time": "time",
    "total": "total",
    "deleteTime": "deleteTime",
    "sharedTorIp": "sharedTorIp",
    "masterAddr": "masterAddr",
    "operator": "operator",
    "sid": "sid",
}
RETRY_SECONDS = 1.0
COMPACT = (",", ":")

# Receives each job event: the job's key (namespace/job_id) and its
# JobSummarySignal fields but uuid.
Publish = Callable[[str, dict[str, str]], None]


class HttpError(Exception):
    """An answer other than 200 (410: relist)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@dataclass(eq=False)
class Slice:
    """One ConfigMap of a job; its hccl.json split once, when the job has several."""

    name: str
    data: dict[str, str]
    header: dict[str, Any] | None = None
    servers: str | None = None  # the servers of its server_list, as JSON text

    def split(self) -> tuple[dict[str, Any], str]:
        if self.header is None or self.servers is None:
            table = json.loads(self.data.get("hccl.json") or "{}")
            servers = table.pop("server_list", [])
            self.header = table
            self.servers = json.dumps(servers, separators=COMPACT)[1:-1]
        return self.header, self.servers


@dataclass(eq=False)
class Job:
    slices: dict[int, Slice] = field(default_factory=dict)
    last: dict[str, str] | None = None  # what was last published


def joined_rank_table(slices: list[Slice]) -> str:
    """The rank table of a split job: index 0's keys, every slice's servers."""
    parts = [piece.split() for piece in slices]
    header = parts[0][0]
    servers = ",".join(text for _, text in parts if text)
    items = [
        f"{json.dumps(key)}:"
        + (f"[{servers}]" if key == "server_list" else json.dumps(value, separators=COMPACT))
        for key, value in {**header, "server_list": None}.items()
    ]
    return "{" + ",".join(items) + "}"


class KubeJobs:
    """The jobs of one namespace, kept up to date from the API at `base_url`."""

    def __init__(self, base_url: str, namespace: str, publish: Publish) -> None:
        split = urlsplit(base_url)
        if split.scheme != "http" or split.hostname is None:
            raise ValueError(f"expected http://HOST:PORT, not {base_url!r}")
        self.host = split.hostname
        self.port = split.port or 80
        self.namespace = namespace
        self.publish = publish
        self.version = ""
        self.jobs: dict[str, Job] = {}
        self.where: dict[str, str] = {}  # ConfigMap name -> job key
        self.events = 0

    # -- HTTP/1.1 ----------------------------------------------------------------

    def _target(self, **params: str) -> str:
        query = urlencode({"labelSelector": SELECTOR, **params})
        return f"/api/v1/namespaces/{self.namespace}/configmaps?{query}"

    async def _get(self, target: str) -> AsyncIterator[bytes]:
        """The body of GET `target`, piece by piece (chunked or not)."""
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 24)
        try:
            writer.write(
                f"GET {target} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                "Accept: application/json\r\nConnection: close\r\n\r\n".encode()
            )
            status = int((await reader.readline()).split()[1])
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if status != 200:
                raise HttpError(status)
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while size := int((await reader.readline()).split(b";")[0], 16):
                    yield await reader.readexactly(size)
                    await reader.readexactly(2)  # the chunk's CRLF
            elif "content-length" in headers:
                yield await reader.readexactly(int(headers["content-length"]))
            else:
                while data := await reader.read(1 << 20):
                    yield data
        finally:
            writer.close()

    # -- LIST and WATCH ------------------------------------------------------------

    async def list(self) -> None:
        """Load every ConfigMap; a relist publishes only the differences."""
        body = b"".join([piece async for piece in self._get(self._target())])
        listed = json.loads(body)
        seen = set()
        touched = set()
        for item in listed.get("items") or []:
            seen.add(item["metadata"]["name"])
            if key := self._put(item):
                touched.add(key)
        for name in [name for name in self.where if name not in seen]:
            touched.add(self._remove(name))
        for key in sorted(touched):
            self._settle(key)
        self.version = listed["metadata"]["resourceVersion"]

    async def run(self) -> None:
        """Watch until cancelled (after `list`)."""
        while True:
            try:
                relist = await self._watch()
            except (OSError, ValueError, asyncio.IncompleteReadError, HttpError) as error:
                relist = True
                if not (isinstance(error, HttpError) and error.status == 410):
                    await asyncio.sleep(RETRY_SECONDS)
            while relist:
                try:
                    await self.list()
                    relist = False
                except (OSError, ValueError, asyncio.IncompleteReadError, HttpError):
                    await asyncio.sleep(RETRY_SECONDS)

    async def _watch(self) -> bool:
        """One watch from `version`; whether to relist."""
        target = self._target(
            watch="true",
            resourceVersion=self.version,
            allowWatchBookmarks="true",
            timeoutSeconds="300",
        )
        pending = b""
        async for piece in self._get(target):
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip() and self._event(json.loads(line)):
                    return True
        return False

    def _event(self, event: dict[str, Any]) -> bool:
        """Apply one watch event; whether to relist."""
        self.events += 1
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            return True
        if kind in ("ADDED", "MODIFIED"):
            if key := self._put(obj):
                self._settle(key)
        elif kind == "DELETED" and obj["metadata"]["name"] in self.where:
            self._settle(self._remove(obj["metadata"]["name"]))
        self.version = obj["metadata"].get("resourceVersion") or self.version
        return False

    # -- the job cache ---------------------------------------------------------------

    def _put(self, obj: dict[str, Any]) -> str:
        """Store a ConfigMap as a slice of its job; the job's key ("" if unusable)."""
        name = obj["metadata"]["name"]
        data: dict[str, str] = obj.get("data") or {}
        try:
            index = int(data.get("cm_index", ""))
        except ValueError:
            index = -1
        if index < 0 or not data.get("job_id"):
            if name in self.where:
                self._settle(self._remove(name))
            return ""
        key = f"{obj['metadata']['namespace']}/{data['job_id']}"
        if self.where.get(name, key) != key:
            self._settle(self._remove(name))
        job = self.jobs.setdefault(key, Job())
        for at, piece in list(job.slices.items()):  # a ConfigMap that changed its index
            if piece.name == name and at != index:
                del job.slices[at]
        job.slices[index] = Slice(name, data)
        self.where[name] = key
        return key

    def _remove(self, name: str) -> str:
        key = self.where.pop(name)
        job = self.jobs.get(key)
        if job is not None:
            for at, piece in list(job.slices.items()):
                if piece.name == name:
                    del job.slices[at]
        return key

    def _settle(self, key: str) -> None:
        """Publish the job if complete and changed, or a delete if it lost a ConfigMap."""
        job = self.jobs.get(key)
        if job is None:
            return
        current = self._assemble(key, job)
        if current is None:
            if not job.slices:
                del self.jobs[key]
            last = job.last
            lost = last is not None and len(job.slices) < int(last["total"] or 1)
            if last is not None and lost and last["operator"] != "delete":
                job.last = {**last, "operator": "delete"}
                self.publish(key, job.last)
            return
        if current != job.last:
            job.last = current
            self.publish(key, current)

    @staticmethod
    def _assemble(key: str, job: Job) -> dict[str, str] | None:
        first = job.slices.get(0)
        if first is None:
            return None
        try:
            total = int(first.data.get("total", ""))
        except ValueError:
            return None
        if total < 1 or len(job.slices) != total:
            return None
        slices = [job.slices.get(index) for index in range(total)]
        pieces = [piece for piece in slices if piece is not None]
        if len(pieces) != total:
            return None
        # Every slice from the same write of the job: ClusterD rewrites them all.
        expected = [first.data.get(name) for name in JOB_FIELDS]
        if any([piece.data.get(name) for name in JOB_FIELDS] != expected for piece in pieces):
            return None
        data = first.data
        fields = {proto: data.get(name, "") for proto, name in SIGNAL_FIELDS.items()}
        fields["namespace"] = key.partition("/")[0]
        fields["cmIndex"] = "0"
        try:
            fields["HcclJson"] = (
                data.get("hccl.json", "") if total == 1 else joined_rank_table(pieces)
            )
        except (ValueError, AttributeError):
            return None
        return fields
