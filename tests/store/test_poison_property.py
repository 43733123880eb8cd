"""Property: arbitrary ConfigMap data never gets past the store boundary unchecked.

Hypothesis writes, rewrites, deletes and relists job-summary ConfigMaps whose
data is arbitrary: unicode text including lone surrogates (raw in str values,
and as JSON escapes inside hccl.json), NaN and Infinity, deep nesting, huge
numbers, split jobs with bad, duplicate or out-of-range cm_index and total,
over-long ids and names. The events go through a Broadcaster to signal and
list subscribers, with relists sometimes settled in small steps while watch
events overtake them. Whatever happens:

- nothing raises out of the store, the broadcaster or the subscribers;
- every frame decodes, every string in it is valid UTF-8 (it was encoded),
  and every HcclJson parses with a strict RFC 8259 parser;
- no event is dropped for failing to encode (validation made that
  unreachable), and the store never holds more than it was given.

A second property checks the store's incremental tallies (`JobSlices`)
against a from-scratch assembly written independently here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.store import JobKey, JobStore, JobSummary
from jobsignal.store.configmap import SERVER_LIST_KEY, BadConfigMap, Slice, parse_slice
from jobsignal.store.jobs import ADDED, DELETED, MODIFIED, Changes, JobSlices
from jobsignal.store.strict_json import MAX_DEPTH
from tests.support.factories import configmap

NOW = 1_800_000_000.0

# Text: any code point, lone surrogates included (hypothesis leaves them out by default).
ALPHABET = st.one_of(
    st.characters(codec=None, categories=None, exclude_categories=()),
    st.sampled_from(["\udc80", "\ud800", "\udfff", "é", "\\", '"']),
)
TEXT = st.text(ALPHABET, max_size=12)

NAMESPACES = ["ns1", "ns1", "ns2"]
NAMES = ["job-summary-a", "job-summary-a-1", "job-summary-a-2", "job-summary-b"]
# (namespace, name) that no ConfigMap may have: too long, or not UTF-8.
BAD_REFS = [("n" * 64, NAMES[0]), ("ns\udc80", NAMES[0]), ("ns1", "c" * 254), ("ns1", "a\udc80")]
# (cm_index, total) of ConfigMaps ClusterD could write; poison adds others.
INDEX_PAIRS = [("0", "1"), ("0", "3"), ("1", "3"), ("2", "3"), ("0", "2"), ("1", "2"), ("", "")]
BAD_INDICES = ["3", "-1", "x", "4096", "4097", "+1", " 1", "\u0661", "9" * 30]
# (data key, value) poison for the fields other than the rank table.
BAD_FIELDS = [
    ("job_id", ""),
    ("job_id", "u" * 129),
    ("job_id", "uid\udc80"),
    ("job_name", "n" * 254),
    ("job_name", "train\ud800"),
    ("job_status", "s" * 65),
    ("framework", "\udfff"),
    ("sharedTorIp", '["\udc80"]'),
    ("masterAddr", "m" * 513),
    ("sid", "\udc80"),
]

SERVERS = [
    {
        "device": [
            {"device_id": str(d), "device_ip": f"10.0.{s}.{d}", "rank_id": str(s * 2 + d)}
            for d in range(2)
        ],
        "server_id": f"192.168.0.{s}",
        "server_name": f"node-{s}",
    }
    for s in range(6)
]

# JSON values that strict parsers refuse or that other languages choke on, plus fine ones.
JSON_VALUES = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e400",
    "9" * 5000,
    "9" * 65,
    "12.5",
    '"\\udc80"',
    '"\\ud800x"',
    '"\\ud83d\\ude00"',
    '"\\\\udc80"',
    '"\udc80"',
    '"\u00e9"',
    "[" * 80 + "]" * 80,
    "[" * 3000 + "]" * 3000,
    '{"a":' * 70 + "1" + "}" * 70,
    "[]",
    "null",
]


def small_int(text: str, default: int) -> int:
    return int(text) if text.isdigit() and text.isascii() else default


@st.composite
def rank_table(draw: st.DrawFn, cm_index: str, total: str, version: int, *, poison: bool) -> str:
    index, count = small_int(cm_index, 0), max(1, small_int(total, 1))
    servers = SERVERS[index * 2 : index * 2 + 2]
    table: dict[str, Any] = {
        "status": "complete",
        SERVER_LIST_KEY: servers,
        "server_count": str(min(len(SERVERS), count * 2)),
        "total": min(len(SERVERS), count * 2) * 2,
    }
    text = json.dumps(table, separators=(",", ":"))
    if not poison:
        if version == 0:
            return '{"status":"initializing"}'
        return draw(st.sampled_from([text] * 9 + [""]))
    shape = draw(st.sampled_from(["value", "value", "value", "name", "any"]))
    if shape == "value":
        value = draw(st.sampled_from(JSON_VALUES))
        where = draw(st.sampled_from(['"status":', '"device_id":', '"server_count":']))
        return text.replace(where, f'"x":{value},{where}', 1)
    if shape == "name":
        escape = draw(
            st.sampled_from(["\\udc80", "\\uDBFF", "\\ud83d\\ude00", "\udc80", "\\\\udc80"])
        )
        return text.replace('"node-', f'"{escape}node-')
    return draw(st.text(ALPHABET, max_size=40))


# What ClusterD writes for each name: (job_id, cm_index, total).
LAYOUT = {
    "job-summary-a": ("uid-a", "0", "3"),
    "job-summary-a-1": ("uid-a", "1", "3"),
    "job-summary-a-2": ("uid-a", "2", "3"),
    "job-summary-b": ("uid-b", "0", "1"),
}


@st.composite
def configmap_data(draw: st.DrawFn, name: str, version: int | None = None) -> dict[str, str]:
    """The data ClusterD writes under `name` (in one of three versions of the job),
    or one with another layout, or one with one poison in it."""
    poison = draw(
        st.sampled_from(["none"] * 6 + ["layout", "field", "index", "text"] + ["table"] * 3)
    )
    job_id, cm_index, total = LAYOUT.get(name, ("uid-b", "0", "1"))
    if poison == "layout":
        job_id = draw(st.sampled_from(["uid-a", "uid-b"]))
        cm_index, total = draw(st.sampled_from(INDEX_PAIRS))
    elif poison == "index":
        bad = draw(st.sampled_from(BAD_INDICES))
        cm_index, total = draw(st.sampled_from([(bad, total), (cm_index, bad)]))
    if version is None:
        version = draw(st.sampled_from([0, 1, 1, 1, 2]))  # pending, running, deleted
    data = {
        "job_id": job_id,
        "job_name": "train",
        "framework": "pytorch",
        "job_status": ["pending", "running", "complete"][version],
        "cm_index": cm_index,
        "total": total,
        "hccl.json": draw(rank_table(cm_index, total, version, poison=poison == "table")),
        "operator": ["add", "add", "delete"][version],
        "time": "1700000000",
        "deleteTime": "",
        "sid": "",
    }
    if poison == "field":
        key, value = draw(st.sampled_from(BAD_FIELDS))
        data[key] = value
    elif poison == "text":  # arbitrary unicode, lone surrogates included, in any field
        data[draw(st.sampled_from(sorted(data)))] = draw(TEXT)
    return data


@st.composite
def step(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict[str, str]]], int]:
    """(action, namespace, [(name, data)], settle budget)"""
    action = draw(
        st.sampled_from(
            ["write"] * 4 + ["write_job"] * 2 + ["bad_ref", "delete", "relist", "partial_relist"]
        )
    )
    # Mostly the single-ConfigMap job b: its poison would reach clients at once.
    namespace, name = (
        draw(st.sampled_from(NAMESPACES)),
        draw(st.sampled_from(NAMES + NAMES[3:] * 3)),
    )
    if action == "bad_ref":
        action, (namespace, name) = "write", draw(st.sampled_from(BAD_REFS))
    if action == "write_job":  # every ConfigMap of job a, as ClusterD rewrites it
        version = draw(st.sampled_from([0, 1, 1, 2]))
        writes = [(each, draw(configmap_data(each, version))) for each in NAMES[:3]]
        return "write", namespace, writes, 0
    return action, namespace, [(name, draw(configmap_data(name)))], draw(st.integers(1, 3))


def strict_loads(text: str) -> Any:
    """RFC 8259 as Go or Java read it: no NaN / Infinity, numbers in range, valid UTF-8."""

    def refuse(literal: str) -> Any:
        raise ValueError(f"not strict JSON: {literal}")

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"out of range: {literal}")
        return value

    text.encode("utf-8")
    return json.loads(text, parse_constant=refuse, parse_float=finite)


def depth(value: Any) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max((depth(child) for child in value), default=0)
    return 0


def check_signal(signal: JobSummarySignal) -> None:
    # Parsed from bytes, so every string was valid UTF-8; the table must be
    # strict JSON, within the store's documented nesting bound.
    if signal.hccl_json:
        table = strict_loads(signal.hccl_json)
        assert isinstance(table, dict)
        assert depth(table) <= MAX_DEPTH
        json.dumps(table, allow_nan=False, ensure_ascii=False).encode("utf-8")


def check_event(event: JobSummary) -> None:
    for value in dataclasses.astuple(event):
        if isinstance(value, str):
            value.encode("utf-8")
    if event.hccl_json:
        strict_loads(event.hccl_json)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step(), min_size=1, max_size=30))
def test_poison_never_escapes_the_store_boundary(steps: list[Any]) -> None:
    trio.run(_drive, steps)


async def _drive(steps: list[Any]) -> None:
    store = JobStore()
    broadcaster = Broadcaster(max_pending=100_000, jobs=store)
    signals = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "s", snapshot=True)
    lists = broadcaster.subscribe(StreamKind.LIST, "FdAgent", "l", snapshot=True)
    cluster: dict[tuple[str, str], dict[str, Any]] = {}
    written = 0
    live: set[JobKey] = set()  # the live jobs, replayed from the events

    def publish(changes: Changes) -> None:
        for event in changes.events:
            check_event(event)
            if event.is_deleted:
                live.discard(event.key)
            else:
                live.add(event.key)
        assert store.live_job_count() == len(live)
        broadcaster.publish(changes.events, 0.0)

    for action, namespace, writes, budget in steps:
        if action == "write":
            for name, data in writes:
                ref = (namespace, name)
                kind = MODIFIED if ref in cluster else ADDED
                cluster[ref] = configmap(namespace, name, data)
                written += 1
                publish(store.apply(kind, cluster[ref], NOW))
        elif action == "delete" and (namespace, writes[0][0]) in cluster:
            publish(store.apply(DELETED, cluster.pop((namespace, writes[0][0])), NOW))
        elif action == "relist":
            publish(store.replace_all(list(cluster.values()), NOW))
        elif action == "partial_relist":
            relist = store.relist(namespace)
            for obj in cluster.values():
                relist.add(obj)
            while not relist.commit(NOW, budget):
                pass
            publish(store.settle(budget))  # the rest waits; later events overtake it
        assert store.configmap_count() <= min(len(cluster), written)
        assert store.live_job_count() <= store.job_count() <= store.configmap_count()
        assert store.live_job_count() == len(store.live_jobs()) == len(live)
    publish(store.settle())
    assert store.pending == 0
    publish(store.replace_all(list(cluster.values()), NOW))

    assert broadcaster.stats.events_dropped == {}
    assert broadcaster.job_count() == store.live_job_count()
    assert store.configmap_count() <= len(cluster)
    while signals.pending:
        for frame in await signals.next_batch(1000):
            check_signal(JobSummarySignal.parse(frame))
    while lists.pending:
        for frame in await lists.next_batch(1000):
            for signal in JobSummarySignalList.parse(frame).job_summary_signals:
                check_signal(signal)
    # A new subscriber's snapshot is deliverable too.
    late = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "late", snapshot=True)
    assert late.pending == store.live_job_count()
    snapshot = (
        [JobSummarySignal.parse(f) for f in await late.next_batch(10_000)] if late.pending else []
    )
    assert len(snapshot) == store.live_job_count()
    for signal in snapshot:
        check_signal(signal)


# -- the incremental tallies against a from-scratch assembly --------------------------------


def assemble_from_scratch(slices: list[Slice]) -> tuple[str, str, int] | None:
    """The rule of `JobSlices.state`, spelled out naively: (status, hccl_json, NPUs) or None."""
    indices = [piece.cm_index for piece in slices]
    if len(set(indices)) != len(indices):
        return None
    by_index = {piece.cm_index: piece for piece in slices}
    if 0 not in by_index:
        return None
    first = by_index[0]
    total = first.fields.total
    members = [by_index.get(i) for i in range(total)]
    if any(piece is None or piece.fields != first.fields for piece in members):
        return None
    pieces = [piece for piece in members if piece is not None]
    headers = {piece.header for piece in pieces if piece.header is not None}
    if len(headers) > 1:
        return None
    if total == 1:
        hccl = first.hccl_raw
    elif headers:
        [header] = headers
        table: dict[str, Any] = {}
        for key, value in header:
            if key == SERVER_LIST_KEY:
                table[key] = [json.loads(s) for piece in pieces for s in piece.servers]
            else:
                table[key] = json.loads(value)
        hccl = json.dumps(table, separators=(",", ":"), ensure_ascii=False)
    else:
        hccl = ""
    return first.fields.job_status, hccl, sum(piece.npu_count for piece in pieces)


# (add or remove, which ConfigMap, its data)
@st.composite
def tally_steps(draw: st.DrawFn) -> list[tuple[bool, str, dict[str, str]]]:
    """Adds (or rewrites) and removes of job a's or b's ConfigMaps; often all of job a."""
    if draw(st.booleans()):
        version = draw(st.sampled_from([0, 1, 2]))
        return [(True, name, draw(configmap_data(name, version))) for name in NAMES[:3]]
    name = draw(st.sampled_from(NAMES))
    return [(draw(st.booleans()), name, draw(configmap_data(name)))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tally_steps(), max_size=20))
def test_incremental_tallies_match_a_from_scratch_assembly(steps: list[Any]) -> None:
    group = JobSlices()  # slices of any job id: the tallies do not look at it
    for add, name, data in (each for batch in steps for each in batch):
        ref_name = name
        if add:
            try:
                piece = parse_slice(configmap("ns1", ref_name, data))
            except BadConfigMap:
                continue
            if piece.ref in group.members:
                group.remove(piece.ref)
            group.add(piece)
        else:
            member = next((r for r in group.members if r.name == ref_name), None)
            if member is not None:
                group.remove(member)
        state = group.state()
        expected = assemble_from_scratch(list(group.members.values()))
        if expected is None:
            assert state is None
        else:
            assert state is not None
            status, hccl, npus = expected
            assert (state.job_status, state.npu_count) == (status, npus)
            if hccl and state.total != "1":
                assert json.loads(state.hccl_json) == json.loads(hccl)
            else:
                assert state.hccl_json == hccl
