"""Parse one job-summary ConfigMap (as ClusterD writes it) into a validated slice.

A slice is one ConfigMap's share of a job: the job-level fields, which every
ConfigMap of the job repeats, and its part of the rank table's `server_list`.
Anything malformed raises `BadConfigMap` with a reason short enough for a log
line and a metric label.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The Kubernetes limit is 1 MiB per ConfigMap; anything far beyond it did not
# come from ClusterD and is refused before it costs a JSON parse.
MAX_VALUE_BYTES = 4 * 1024 * 1024
# A job split over more ConfigMaps than this is not a real job.
MAX_SLICES = 4096


class BadConfigMap(ValueError):
    """The ConfigMap cannot be turned into a slice; `reason` is a short label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ConfigMapRef:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class JobFields:
    """The job-level fields every ConfigMap of a job repeats; they must agree."""

    job_id: str
    job_name: str
    framework: str
    job_status: str
    total: int
    operator: str
    time: str
    delete_time: str
    shared_tor_ip: str
    master_addr: str
    sid: str


@dataclass(frozen=True, slots=True)
class Slice:
    ref: ConfigMapRef
    fields: JobFields
    cm_index: int
    # The original hccl.json text (validated JSON, or "" for an empty slice).
    hccl_raw: str
    # hccl.json without server_list, as (key, compact JSON value) pairs in the
    # original order; the server_list position is marked by `SERVER_LIST_SLOT`.
    header: tuple[tuple[str, str], ...] | None
    # This slice's servers, each as compact JSON.
    servers: tuple[str, ...]
    npu_count: int


SERVER_LIST_KEY = "server_list"
SERVER_LIST_SLOT = ""


def configmap_ref(configmap: Mapping[str, Any]) -> ConfigMapRef:
    """The (namespace, name) of a ConfigMap object, or BadConfigMap."""
    metadata = configmap.get("metadata")
    if not isinstance(metadata, Mapping):
        raise BadConfigMap("no_metadata", "object has no metadata")
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or not name:
        raise BadConfigMap("no_name", "metadata lacks namespace or name")
    return ConfigMapRef(namespace, name)


def parse_slice(configmap: Mapping[str, Any]) -> Slice:
    ref = configmap_ref(configmap)
    data = configmap.get("data") or {}
    if not isinstance(data, Mapping):
        raise BadConfigMap("bad_data", f"{ref}: data is not a mapping")
    for key, value in data.items():
        if not isinstance(value, str):
            raise BadConfigMap("bad_data", f"{ref}: data[{key!r}] is not a string")
        if len(value) > MAX_VALUE_BYTES:
            raise BadConfigMap("too_large", f"{ref}: data[{key!r}] has {len(value)} bytes")

    def text(key: str, default: str = "") -> str:
        return str(data.get(key, default))

    job_id = text("job_id")
    if not job_id:
        raise BadConfigMap("no_job_id", f"{ref}: data has no job_id")
    total = _small_int(ref, data, "total", default=1)
    cm_index = _small_int(ref, data, "cm_index", default=0)
    if total < 1 or cm_index >= total:
        raise BadConfigMap("bad_index", f"{ref}: cm_index {cm_index} / total {total}")
    fields = JobFields(
        job_id=job_id,
        job_name=text("job_name") or _job_name_from(ref.name),
        framework=text("framework"),
        job_status=text("job_status"),
        total=total,
        operator=text("operator"),
        time=text("time"),
        delete_time=text("deleteTime"),
        shared_tor_ip=text("sharedTorIp"),
        master_addr=text("masterAddr"),
        sid=text("sid"),
    )
    hccl_raw = text("hccl.json")
    # Only a job split over several ConfigMaps needs its table taken apart.
    header, servers, npu_count = _parse_rank_table(ref, hccl_raw, split=total > 1)
    return Slice(ref, fields, cm_index, hccl_raw, header, servers, npu_count)


def _small_int(ref: ConfigMapRef, data: Mapping[str, Any], key: str, *, default: int) -> int:
    raw = data.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadConfigMap("bad_index", f"{ref}: {key} {raw!r} is not an integer") from None
    if not 0 <= value <= MAX_SLICES:
        raise BadConfigMap("bad_index", f"{ref}: {key} {value} is out of range")
    return value


def _job_name_from(configmap_name: str) -> str:
    return configmap_name.removeprefix("job-summary-")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _parse_rank_table(
    ref: ConfigMapRef, raw: str, *, split: bool
) -> tuple[tuple[tuple[str, str], ...] | None, tuple[str, ...], int]:
    """Validate hccl.json; return (header, servers, NPU count).

    With `split` the header and servers come back as compact JSON pieces for
    reassembly; without it (a single-ConfigMap job, whose text is served as
    it is) they stay empty, which saves re-encoding every server.
    """
    if not raw.strip():
        return None, (), 0
    try:
        table = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadConfigMap("bad_hccl_json", f"{ref}: hccl.json is not JSON") from None
    if not isinstance(table, dict):
        raise BadConfigMap("bad_hccl_json", f"{ref}: hccl.json is not a JSON object")
    server_list = table.get(SERVER_LIST_KEY, [])
    if not isinstance(server_list, list) or not all(isinstance(s, dict) for s in server_list):
        raise BadConfigMap("bad_hccl_json", f"{ref}: server_list is not a list of objects")
    npu_count = 0
    for server in server_list:
        devices = server.get("device", [])
        npu_count += len(devices) if isinstance(devices, list) else 0
    if not split:
        return (), (), npu_count
    header = tuple(
        (key, SERVER_LIST_SLOT if key == SERVER_LIST_KEY else _compact(value))
        for key, value in table.items()
    )
    return header, tuple(_compact(s) for s in server_list), npu_count
