"""Hostile ConfigMaps at the store boundary: each is rejected with its reason, the
job keeps its last good state, and everything the store emits encodes as valid
UTF-8 with a strict-JSON rank table."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jobsignal._proto.job import JobSummarySignal
from jobsignal.fanout.encoding import encode_signal
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.store import JobStore, JobSummary
from jobsignal.store.configmap import (
    FIELD_LIMITS,
    MAX_NAME_CHARS,
    MAX_NAMESPACE_CHARS,
    REASONS,
    BadConfigMap,
    parse_slice,
)
from jobsignal.store.jobs import ADDED, MODIFIED
from tests.support.factories import configmap

NOW = 1_800_000_000.0


def strict_loads(text: str) -> Any:
    """RFC 8259 as Go and Java parse it: no NaN / Infinity, and valid UTF-8 throughout."""

    def refuse(literal: str) -> Any:
        raise ValueError(f"not JSON: {literal}")

    text.encode("utf-8")
    return json.loads(text, parse_constant=refuse)


def assert_deliverable(events: list[JobSummary]) -> None:
    for event in events:
        frame = encode_signal(event, "uuid")
        assert JobSummarySignal.parse(frame).job_id == event.job_id
        if event.hccl_json:
            strict_loads(event.hccl_json)


def split_job() -> ClusterdJob:
    return ClusterdJob("ns", "big", "uid-big", servers=2, servers_per_configmap=1)


def single_job() -> ClusterdJob:
    return ClusterdJob("ns", "one", "uid-one", servers=2)


def poisoned(job: ClusterdJob, **replace: str) -> list[tuple[str, dict[str, str]]]:
    """The job's running ConfigMaps with `old=new` text replaced in every hccl.json."""
    pieces = []
    for name, data in job.configmaps("running"):
        table = data["hccl.json"]
        for old, new in replace.items():
            table = table.replace(old, new)
        pieces.append((name, {**data, "hccl.json": table}))
    return pieces


def apply_all(store: JobStore, pieces: list[tuple[str, dict[str, str]]]) -> tuple[list[Any], ...]:
    events: list[JobSummary] = []
    rejected: list[BadConfigMap] = []
    for name, data in pieces:
        changes = store.apply(ADDED, configmap("ns", name, data), NOW)
        events += changes.events
        rejected += changes.rejected
    return events, rejected


def test_issue_repro_split_job_with_lone_surrogate_escapes_is_rejected() -> None:
    # The reported crash: decoding "\udc80" and re-encoding the joined table
    # made a str that betterproto2 could not UTF-8 encode.
    store = JobStore()
    events, rejected = apply_all(store, poisoned(split_job(), **{'"node-': '"node-\\udc80'}))
    assert events == []
    assert [r.reason for r in rejected] == ["hccl_json_not_strict"] * 2
    assert store.configmap_count() == 0


# (hccl.json text to substitute into the rank table, expected reason)
TABLE_POISON = {
    "lone-low-surrogate": ('"server_name":"node-', '"server_name":"\\udc80node-'),
    "lone-high-surrogate": ('"server_name":"node-', '"server_name":"\\uD800node-'),
    "surrogate-in-key": ('"server_sn"', '"\\udfff"'),
    "nan": ('"total":', '"nan":NaN,"total":'),
    "infinity": ('"total":', '"x":Infinity,"total":'),
    "minus-infinity": ('"total":', '"x":-Infinity,"total":'),
    "overflowing-float": ('"total":', '"x":1e999,"total":'),
    "huge-integer": ('"total":', f'"x":{"9" * 5000},"total":'),
    "long-integer": ('"total":', f'"x":{"9" * 65},"total":'),
    "deep": ('"total":', '"x":' + "[" * 100 + "]" * 100 + ',"total":'),
    "very-deep": ('"total":', '"x":' + "[" * 100_000 + "]" * 100_000 + ',"total":'),
}
EXPECTED_TABLE_REASON = {
    "deep": "hccl_json_too_deep",
    "very-deep": "hccl_json_too_deep",
}


@pytest.mark.parametrize("shape", ["split", "single"])
@pytest.mark.parametrize("case", sorted(TABLE_POISON))
def test_rank_table_that_is_not_strict_json_keeps_the_last_good_state(
    case: str, shape: str
) -> None:
    job = split_job() if shape == "split" else single_job()
    store = JobStore()
    good, _ = apply_all(store, [(n, d) for n, d in job.configmaps("running")])
    assert len(good) == 1
    old, new = TABLE_POISON[case]
    events, rejected = apply_all(store, poisoned(job, **{old: new}))
    reason = EXPECTED_TABLE_REASON.get(case, "hccl_json_not_strict")
    assert events == []
    assert [r.reason for r in rejected] == [reason] * job.configmap_count
    assert store.rejected_total == {reason: job.configmap_count}
    assert store.live_jobs() == good  # the last good state stands
    # The rejection names the ConfigMap and quotes little of the value.
    assert all(len(str(r)) < 400 and "job-summary-" in str(r) for r in rejected)


@pytest.mark.parametrize(
    "text",
    [
        '"server_name":"\\ud83d\\ude00 node-',  # an escaped surrogate pair: one emoji
        '"server_name":"\\\\udc80 node-',  # an escaped backslash, then plain "udc80"
        '"server_name":"é node-',
    ],
)
@pytest.mark.parametrize("shape", ["split", "single"])
def test_valid_escapes_and_unicode_are_kept(text: str, shape: str) -> None:
    job = split_job() if shape == "split" else single_job()
    store = JobStore()
    events, rejected = apply_all(store, poisoned(job, **{'"server_name":"node-': text}))
    assert rejected == []
    [event] = events
    assert_deliverable(events)
    names = [s["server_name"] for s in strict_loads(event.hccl_json)["server_list"]]
    assert names[0] == json.loads('"' + text.split(':"', 1)[1] + '0"')


@pytest.mark.parametrize("blank", ["\r", " \n\t", "\u2003"])
def test_a_blank_rank_table_is_served_as_none(blank: str) -> None:
    # Found by the property test: a single-ConfigMap job served "\r" as its table.
    name, data = single_job().configmaps("running")[0]
    [event] = (
        JobStore().apply(ADDED, configmap("ns", name, {**data, "hccl.json": blank}), NOW).events
    )
    assert event.hccl_json == "" and event.npu_count == 0


def test_nesting_up_to_the_bound_is_accepted() -> None:
    def table(depth: int) -> str:
        # The table itself is level 1; "x" adds depth - 1 levels.
        return '{"status":"complete","x":' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

    store = JobStore()
    name, data = single_job().configmaps("pending")[0]
    [event] = store.apply(
        ADDED, configmap("ns", name, {**data, "hccl.json": table(64)}), NOW
    ).events
    assert strict_loads(event.hccl_json)["status"] == "complete"
    deeper = store.apply(MODIFIED, configmap("ns", name, {**data, "hccl.json": table(65)}), NOW)
    assert [r.reason for r in deeper.rejected] == ["hccl_json_too_deep"]


# (data key, poison value, expected reason)
FIELD_POISON = [
    ("job_name", "train\udc80", "not_utf8"),
    ("job_id", "\ud800uid", "not_utf8"),
    ("framework", "py\udfffthon", "not_utf8"),
    ("sharedTorIp", '["\udc80"]', "not_utf8"),
    ("masterAddr", "\udc80", "not_utf8"),
    ("hccl.json", '{"status":"initializing\udc80"}', "not_utf8"),
    ("job_id", "u" * (FIELD_LIMITS["job_id"] + 1), "too_long"),
    ("job_name", "n" * 254, "too_long"),
    ("job_status", "s" * 65, "too_long"),
    ("sid", "s" * 257, "too_long"),
    ("cm_index", "+0", "bad_index"),
    ("cm_index", " 0", "bad_index"),
    ("cm_index", "\u0660", "bad_index"),  # ARABIC-INDIC DIGIT ZERO: int() takes it
    ("total", "9" * 5000, "bad_index"),
    ("total", "1_0", "bad_index"),
]


@pytest.mark.parametrize(("key", "value", "reason"), FIELD_POISON)
def test_poison_field_values_are_rejected(key: str, value: str, reason: str) -> None:
    store = JobStore()
    name, data = single_job().configmaps("running")[0]
    [good] = store.apply(ADDED, configmap("ns", name, data), NOW).events
    changes = store.apply(MODIFIED, configmap("ns", name, {**data, key: value}), NOW)
    assert changes.events == [] and [r.reason for r in changes.rejected] == [reason]
    assert store.live_jobs() == [good]
    detail = str(changes.rejected[0])
    detail.encode("utf-8")  # a log line can always be written
    assert len(detail) < 400


def test_fields_at_their_bounds_are_accepted() -> None:
    data = single_job().configmaps("running")[0][1]
    long_data = {**data, **{key: "x" * limit for key, limit in FIELD_LIMITS.items()}}
    long_data["hccl.json"] = data["hccl.json"]
    namespace = "n" * MAX_NAMESPACE_CHARS
    long_name = "c" * MAX_NAME_CHARS
    [event] = JobStore().apply(ADDED, configmap(namespace, long_name, long_data), NOW).events
    assert event.job_id == "x" * FIELD_LIMITS["job_id"]
    assert_deliverable([event])


@pytest.mark.parametrize(
    ("namespace", "name", "reason"),
    [
        ("n" * (MAX_NAMESPACE_CHARS + 1), "job-summary-a", "too_long"),
        ("ns", "c" * (MAX_NAME_CHARS + 1), "too_long"),
        ("ns\udc80", "job-summary-a", "not_utf8"),
        # Without job_name the name becomes the job name clients see.
        ("ns", "job-summary-\udc80", "not_utf8"),
    ],
)
def test_poison_names_are_rejected(namespace: str, name: str, reason: str) -> None:
    data = single_job().configmaps("running")[0][1]
    del data["job_name"]
    changes = JobStore().apply(ADDED, configmap(namespace, name, data), NOW)
    assert changes.events == [] and [r.reason for r in changes.rejected] == [reason]
    str(changes.rejected[0]).encode("utf-8")


def test_rejections_quote_at_most_about_200_characters_of_a_value() -> None:
    name, data = single_job().configmaps("running")[0]
    megabyte = "\udc80" + "v" * (1 << 20)
    for key in ("job_name", "sharedTorIp", "cm_index"):
        with pytest.raises(BadConfigMap) as caught:
            parse_slice(configmap("ns", name, {**data, key: megabyte}))
        assert len(str(caught.value)) < 400
        str(caught.value).encode("utf-8")
    with pytest.raises(BadConfigMap) as caught:
        parse_slice(configmap("ns", name, {**data, "v" * 100_000: 7}))  # type: ignore[dict-item]
    assert caught.value.reason == "bad_data" and len(str(caught.value)) < 400


def test_every_reason_is_documented() -> None:
    reasons = {reason for _, _, reason in FIELD_POISON} | set(EXPECTED_TABLE_REASON.values())
    reasons |= {"hccl_json_not_strict", "internal_error"}
    assert reasons <= set(REASONS)


def reformatted_table(data: dict[str, str]) -> dict[str, str]:
    """`data` with the same rank table written with spaces: other text, same content."""
    return {**data, "hccl.json": json.dumps(json.loads(data["hccl.json"]))}


def test_unexpected_error_while_parsing_rejects_only_that_configmap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = JobStore()
    job = single_job()
    name, data = job.configmaps("running")[0]
    [good] = store.apply(ADDED, configmap("ns", name, data), NOW).events
    import jobsignal.store.configmap as configmap_module

    def broken(ref: Any, raw: str, *, split: bool) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(configmap_module, "_parse_rank_table", broken)
    # A new table text (an unchanged one would be reused, not parsed again).
    changed = reformatted_table(job.configmaps("complete")[0][1])
    changes = store.apply(MODIFIED, configmap("ns", name, changed), NOW)
    assert changes.events == [] and [r.reason for r in changes.rejected] == ["internal_error"]
    assert isinstance(changes.rejected[0].__cause__, KeyError)
    assert store.live_jobs() == [good] and store.rejected_total == {"internal_error": 1}
    # The same in a LIST: the broken ConfigMap keeps its last good slice.
    other = ClusterdJob("ns", "two", "uid-two")
    listing = [configmap("ns", n, reformatted_table(d)) for n, d in job.configmaps("complete")]
    listing += [configmap("ns", n, d) for n, d in other.configmaps("running")]
    monkeypatch.undo()
    broken_once = {"count": 0}
    real = configmap_module._parse_rank_table

    def fail_first(ref: Any, raw: str, *, split: bool) -> Any:
        broken_once["count"] += 1
        if broken_once["count"] == 1:
            raise RuntimeError("a bug")
        return real(ref, raw, split=split)

    monkeypatch.setattr(configmap_module, "_parse_rank_table", fail_first)
    relisted = store.replace_all(listing, NOW)
    assert [r.reason for r in relisted.rejected] == ["internal_error"]
    assert [e.job_id for e in relisted.events] == ["uid-two"]
    assert {j.job_id: j for j in store.live_jobs()}["uid-one"] == good
