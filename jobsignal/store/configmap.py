"""Parse one job-summary ConfigMap (as ClusterD writes it) into a validated slice.

A slice is one ConfigMap's share of a job: the job-level fields, which every
ConfigMap of the job repeats, and its part of the rank table's `server_list`.

This is the store's boundary for untrusted input (anyone who can create a
labelled ConfigMap): whatever passes it is valid UTF-8 within the length
bounds below, and its rank table is strict JSON (`strict_json`). Anything
else raises `BadConfigMap` with a `reason` from `REASONS` (a metric label)
and a detail that quotes at most about 200 characters of any value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobsignal.store import strict_json
from jobsignal.util.text import quote

# The Kubernetes limit is 1 MiB per ConfigMap; anything far beyond it did not
# come from ClusterD and is refused before it costs a JSON parse. Characters.
MAX_VALUE_BYTES = 4 * 1024 * 1024
# A job split over more ConfigMaps than this is not a real job.
MAX_SLICES = 4096
# Kubernetes' own bounds: a namespace is a DNS label, a ConfigMap name a DNS subdomain.
MAX_NAMESPACE_CHARS = 63
MAX_NAME_CHARS = 253
#: Longest value of each data key the store reads (characters). Ids and names
#: follow Kubernetes (a UID is 36 characters; object names at most 253); the
#: rank table has MAX_VALUE_BYTES; `cm_index` and `total` are checked as numbers.
FIELD_LIMITS: Mapping[str, int] = {
    "job_id": 128,
    "job_name": MAX_NAME_CHARS,
    "framework": 64,
    "job_status": 64,
    "operator": 64,
    "time": 64,
    "deleteTime": 64,
    "sid": 256,
    "masterAddr": 512,
    "sharedTorIp": 64 * 1024,
    "hccl.json": MAX_VALUE_BYTES,
}

#: Every rejection reason (the `reason` label of jobsignal_configmaps_rejected_total).
REASONS: Mapping[str, str] = {
    "no_metadata": "the object has no metadata",
    "no_name": "metadata lacks a namespace or a name",
    "bad_data": "data is not a mapping of strings",
    "too_large": f"a data value over {MAX_VALUE_BYTES} characters",
    "too_long": "a name, namespace, id or other field over its length bound",
    "not_utf8": "a string that is not valid UTF-8 (a lone surrogate)",
    "no_job_id": "data has no job_id",
    "bad_index": f"cm_index / total not decimal numbers 0..{MAX_SLICES}, or cm_index >= total",
    "bad_hccl_json": "hccl.json is not a JSON object with a list of server objects",
    "hccl_json_not_strict": "hccl.json is not strict JSON: NaN, Infinity, a number out of"
    f" range or over {strict_json.MAX_NUMBER_CHARS} characters, an escaped lone surrogate",
    "hccl_json_too_deep": f"hccl.json nests deeper than {strict_json.MAX_DEPTH}",
    "bad_event": "a watch event type other than ADDED, MODIFIED, DELETED",
    "internal_error": "an unexpected error while parsing (logged with its traceback)",
}


class BadConfigMap(ValueError):
    """The ConfigMap cannot be turned into a slice; `reason` is a key of `REASONS`."""

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

    @property
    def split(self) -> bool:
        """Whether the job is split over several ConfigMaps (the table taken apart)."""
        return self.fields.total > 1


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
    for what, value, limit in (
        ("namespace", namespace, MAX_NAMESPACE_CHARS),
        ("name", name, MAX_NAME_CHARS),
    ):
        if len(value) > limit:
            raise BadConfigMap("too_long", f"{what} {quote(value)} has {len(value)} characters")
        if not is_utf8(value):
            raise BadConfigMap("not_utf8", f"{what} {quote(value)} is not valid UTF-8")
    return ConfigMapRef(namespace, name)


def is_utf8(value: str) -> bool:
    """Whether `value` encodes as UTF-8 (holds no lone surrogate); ASCII costs nothing."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_slice(configmap: Mapping[str, Any], previous: Slice | None = None) -> Slice:
    """Validate `configmap` into a slice. `previous`, the slice of the version it
    replaces, lends its parsed rank table when the text is the same (ClusterD
    rewrites a job's ConfigMaps on each status change with an unchanged table)."""
    ref = configmap_ref(configmap)
    data = configmap.get("data") or {}
    if not isinstance(data, Mapping):
        raise BadConfigMap("bad_data", f"{ref}: data is not a mapping")
    for key, value in data.items():
        if not isinstance(value, str):
            raise BadConfigMap("bad_data", f"{ref}: data[{quote(key)}] is not a string")
        if len(value) > MAX_VALUE_BYTES:
            raise BadConfigMap(
                "too_large", f"{ref}: data[{quote(key)}] has {len(value)} characters"
            )
    for key, limit in FIELD_LIMITS.items():
        value = data.get(key, "")
        if len(value) > limit:
            raise BadConfigMap(
                "too_long", f"{ref}: {key} {quote(value)} has {len(value)} characters"
            )
        if not is_utf8(value):
            raise BadConfigMap("not_utf8", f"{ref}: {key} {quote(value)} is not valid UTF-8")

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
    if not hccl_raw.strip():
        hccl_raw = ""  # blank means no table: never serve whitespace as JSON
    # Only a job split over several ConfigMaps needs its table taken apart.
    split = total > 1
    if previous is not None and previous.hccl_raw == hccl_raw and previous.split == split:
        # Validated before, and taken apart the same way: share its pieces.
        header, servers, npu_count = previous.header, previous.servers, previous.npu_count
        return Slice(ref, fields, cm_index, previous.hccl_raw, header, servers, npu_count)
    header, servers, npu_count = _parse_rank_table(ref, hccl_raw, split=split)
    return Slice(ref, fields, cm_index, hccl_raw, header, servers, npu_count)


def rank_table_npus(ref: ConfigMapRef, raw: str) -> int:
    """Validate a whole job's rank table as a single ConfigMap's hccl.json is
    (strict JSON, an object with a list of server objects); its NPU count.
    Blank is no table (0). `BadConfigMap` as `parse_slice` raises it; the
    caller bounds the length. A relay checks its upstream's HcclJson with it."""
    return _parse_rank_table(ref, raw, split=False)[2]


_DECIMAL = re.compile(r"[0-9]{1,9}")


def _small_int(ref: ConfigMapRef, data: Mapping[str, Any], key: str, *, default: int) -> int:
    raw = data.get(key)
    if raw is None or raw == "":
        return default
    # ASCII digits only: int() would also take "+1", " 1", "1_0" and other scripts' digits.
    if not isinstance(raw, str) or not _DECIMAL.fullmatch(raw):
        raise BadConfigMap("bad_index", f"{ref}: {key} {quote(raw)} is not a decimal integer")
    value = int(raw)
    if not 0 <= value <= MAX_SLICES:
        raise BadConfigMap("bad_index", f"{ref}: {key} {value} is out of range")
    return value


def _job_name_from(configmap_name: str) -> str:
    return configmap_name.removeprefix("job-summary-")


_JSON_REASONS = {
    strict_json.NOT_JSON: "bad_hccl_json",
    strict_json.NOT_STRICT: "hccl_json_not_strict",
    strict_json.TOO_DEEP: "hccl_json_too_deep",
}


def _parse_rank_table(
    ref: ConfigMapRef, raw: str, *, split: bool
) -> tuple[tuple[tuple[str, str], ...] | None, tuple[str, ...], int]:
    """Validate hccl.json; return (header, servers, NPU count).

    With `split` the header and servers come back as compact JSON pieces for
    reassembly (a server written compactly is its own text, not re-encoded);
    without it (a single-ConfigMap job, whose text is served as it is) they
    stay empty.
    """
    if not raw.strip():
        return None, (), 0
    server_texts: list[str] | None = None
    try:
        if split:
            table, server_texts = strict_json.loads_items(raw, SERVER_LIST_KEY)
        else:
            table = strict_json.loads(raw)
    except strict_json.NotStrictJson as error:
        raise BadConfigMap(_JSON_REASONS[error.reason], f"{ref}: hccl.json: {error}") from None
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
        (key, SERVER_LIST_SLOT if key == SERVER_LIST_KEY else strict_json.compact(value))
        for key, value in table.items()
    )
    return header, tuple(server_texts or ()), npu_count
