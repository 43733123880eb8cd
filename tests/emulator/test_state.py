"""The emulator's pure store against the documented API semantics (no sockets).

Covers resourceVersions, CRUD errors, the bounded history and 410, list
resourceVersion semantics and chunking, label and field selectors, and what a
filtered watcher sees.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from jobsignal.sim.emulator.state import (
    Change,
    ConfigMap,
    ConfigMapStore,
    FieldSelector,
    LabelSelector,
    ListOptions,
    ResourceVersionTooLarge,
    Selector,
    StatusError,
    filter_change,
)


def make_store(history_size: int = 100) -> ConfigMapStore:
    uids = (f"uid-{i}" for i in itertools.count())
    return ConfigMapStore(
        history_size=history_size, wall_clock=lambda: 0.0, new_uid=lambda: next(uids)
    )


def names(items: tuple[ConfigMap, ...] | list[ConfigMap]) -> list[str]:
    return [f"{obj.namespace}/{obj.name}" for obj in items]


# ------------------------------------------------------------------ resourceVersion


def test_every_write_takes_the_next_global_resource_version() -> None:
    store = make_store()
    start = store.resource_version
    a = store.create_configmap("ns1", "a", {"x": "1"}, {"k": "v"})
    b = store.create_configmap("ns2", "b")
    a2 = store.update_configmap("ns1", "a", data={"k": "w"})
    gone = store.delete_configmap("ns2", "b")
    assert [a.resource_version, b.resource_version, a2.resource_version] == [
        start + 1,
        start + 2,
        start + 3,
    ]
    # A deletion is a write too; the deleted object carries the deletion's version.
    assert gone.resource_version == start + 4 == store.resource_version
    assert [c.type for c in store.history] == ["ADDED", "ADDED", "MODIFIED", "DELETED"]


def test_wire_form_has_metadata_strings_and_omits_empty_maps() -> None:
    store = make_store()
    obj = store.create_configmap("ns", "a", {"app": "x"}, {"k": "v"})
    wire = obj.to_json()
    assert wire["kind"] == "ConfigMap" and wire["apiVersion"] == "v1"
    assert wire["metadata"] == {
        "name": "a",
        "namespace": "ns",
        "uid": "uid-0",
        "resourceVersion": str(obj.resource_version),
        "creationTimestamp": "1970-01-01T00:00:00Z",
        "labels": {"app": "x"},
    }
    assert wire["data"] == {"k": "v"}
    bare = store.create_configmap("ns", "b").to_json(with_type=False)
    assert "kind" not in bare and "labels" not in bare["metadata"] and "data" not in bare


def test_an_update_that_changes_nothing_is_not_a_write() -> None:
    store = make_store()
    obj = store.create_configmap("ns", "a", {"app": "x"}, {"k": "v"})
    again = store.update_configmap("ns", "a", labels={"app": "x"}, data={"k": "v"})
    assert again == obj
    assert store.resource_version == obj.resource_version
    assert len(store.history) == 1


def test_update_replaces_only_what_it_is_given() -> None:
    store = make_store()
    store.create_configmap("ns", "a", {"app": "x"}, {"k": "v"})
    only_labels = store.update_configmap("ns", "a", labels={"app": "y"})
    assert only_labels.labels == {"app": "y"} and only_labels.data == {"k": "v"}
    only_data = store.update_configmap("ns", "a", data={"n": "1"})
    assert only_data.labels == {"app": "y"} and only_data.data == {"n": "1"}
    assert only_data.uid == only_labels.uid


def test_crud_errors_are_status_objects() -> None:
    store = make_store()
    store.create_configmap("ns", "a")
    with pytest.raises(StatusError) as exists:
        store.create_configmap("ns", "a")
    status = exists.value.to_status()
    assert status["kind"] == "Status" and status["status"] == "Failure"
    assert (status["code"], status["reason"]) == (409, "AlreadyExists")
    assert status["details"] == {"name": "a", "kind": "configmaps"}
    calls: list[Callable[[], object]] = [
        lambda: store.get("ns", "missing"),
        lambda: store.update_configmap("ns", "missing", data={}),
        lambda: store.delete_configmap("other", "a"),
    ]
    for call in calls:
        with pytest.raises(StatusError) as missing:
            call()
        assert (missing.value.code, missing.value.reason) == (404, "NotFound")
    with pytest.raises(StatusError) as invalid:
        store.create_configmap("ns", "Not_A_DNS_Name")
    assert invalid.value.code == 422


def test_stale_writer_gets_409_conflict() -> None:
    store = make_store()
    first = store.create_configmap("ns", "a", data={"k": "1"})
    store.update_configmap("ns", "a", data={"k": "2"})
    with pytest.raises(StatusError) as conflict:
        store.update_configmap(
            "ns", "a", data={"k": "3"}, expected_resource_version=first.resource_version
        )
    assert (conflict.value.code, conflict.value.reason) == (409, "Conflict")
    assert store.get("ns", "a").data == {"k": "2"}


# ----------------------------------------------------------------- history and 410


def test_history_is_bounded_and_older_versions_expire() -> None:
    store = make_store(history_size=3)
    base = store.resource_version
    for i in range(5):
        store.create_configmap("ns", f"cm{i}")
    assert len(store.history) == 3
    # The two oldest changes were dropped, so everything after base+2 is still known.
    assert store.oldest_resource_version == base + 2
    assert [c.resource_version for c in store.changes_since(base + 2)] == [
        base + 3,
        base + 4,
        base + 5,
    ]
    with pytest.raises(StatusError) as gone:
        store.changes_since(base + 1)
    assert (gone.value.code, gone.value.reason) == (410, "Expired")


def test_compaction_and_restart_lose_history_but_keep_counting() -> None:
    store = make_store()
    store.create_configmap("ns", "a")
    before = store.resource_version
    store.compact()
    with pytest.raises(StatusError):
        store.changes_since(before - 1)
    assert store.changes_since(before) == []
    epoch = store.epoch
    store.restart(lose_history=True)
    assert store.epoch == epoch + 1
    after = store.create_configmap("ns", "b")
    assert after.resource_version == before + 1


def test_restart_without_history_loss_keeps_the_window() -> None:
    store = make_store()
    base = store.resource_version
    store.create_configmap("ns", "a")
    store.restart(lose_history=False)
    assert [c.object.name for c in store.changes_since(base)] == ["a"]


# --------------------------------------------------------------------------- lists


def test_list_is_in_key_order_at_the_current_version() -> None:
    store = make_store()
    store.create_configmap("b", "z")
    store.create_configmap("a", "y")
    store.create_configmap("a", "x")
    page = store.list_configmaps(ListOptions())
    assert names(page.items) == ["a/x", "a/y", "b/z"]
    assert page.resource_version == store.resource_version
    assert page.continue_token is None
    assert names(store.list_configmaps(ListOptions(namespace="a")).items) == ["a/x", "a/y"]
    wire = page.to_json()
    assert wire["kind"] == "ConfigMapList" and wire["apiVersion"] == "v1"
    assert wire["metadata"] == {"resourceVersion": str(store.resource_version)}


def test_chunks_are_one_consistent_snapshot() -> None:
    store = make_store()
    for i in range(5):
        store.create_configmap("ns", f"cm{i}", data={"v": "old"})
    first = store.list_configmaps(ListOptions(limit=2))
    assert names(first.items) == ["ns/cm0", "ns/cm1"]
    assert first.remaining_item_count == 3 and first.continue_token
    # Writes after the first chunk must not show in the later chunks.
    store.update_configmap("ns", "cm3", data={"v": "new"})
    store.delete_configmap("ns", "cm4")
    store.create_configmap("ns", "cm5")
    second = store.list_configmaps(ListOptions(limit=2, continue_token=first.continue_token))
    assert second.resource_version == first.resource_version
    assert names(second.items) == ["ns/cm2", "ns/cm3"]
    assert second.items[1].data == {"v": "old"}
    third = store.list_configmaps(ListOptions(limit=2, continue_token=second.continue_token))
    assert names(third.items) == ["ns/cm4"] and third.continue_token is None


def test_remaining_item_count_is_unset_with_a_selector() -> None:
    store = make_store()
    for i in range(4):
        store.create_configmap("ns", f"cm{i}", {"app": "x"})
    page = store.list_configmaps(ListOptions(limit=1, label_selector="app=x"))
    assert page.continue_token is not None and page.remaining_item_count is None


def test_expired_continue_token_is_410_with_an_inconsistent_token() -> None:
    store = make_store()
    for i in range(4):
        store.create_configmap("ns", f"cm{i}")
    first = store.list_configmaps(ListOptions(limit=2))
    assert first.continue_token is not None
    store.create_configmap("ns", "cm9")
    store.compact()
    with pytest.raises(StatusError) as expired:
        store.list_configmaps(ListOptions(limit=2, continue_token=first.continue_token))
    assert (expired.value.code, expired.value.reason) == (410, "Expired")
    token = expired.value.to_status()["metadata"]["continue"]
    # The token in the 410 continues after the same key, from the newest state.
    rest = store.list_configmaps(ListOptions(continue_token=token))
    assert names(rest.items) == ["ns/cm2", "ns/cm3", "ns/cm9"]
    assert rest.resource_version == store.resource_version


def test_resource_version_semantics_for_list() -> None:
    store = make_store()
    store.create_configmap("ns", "a", data={"v": "1"})
    old = store.resource_version
    store.update_configmap("ns", "a", data={"v": "2"})
    now = store.resource_version
    # Set, no limit: not older than -> the newest state.
    assert store.list_configmaps(ListOptions(resource_version=str(old))).resource_version == now
    # Set with a limit (match unset), or Exact: exactly that version.
    exact = store.list_configmaps(ListOptions(resource_version=str(old), limit=10))
    assert exact.resource_version == old and exact.items[0].data == {"v": "1"}
    exact2 = store.list_configmaps(
        ListOptions(resource_version=str(old), resource_version_match="Exact")
    )
    assert exact2.items[0].data == {"v": "1"}
    not_older = store.list_configmaps(
        ListOptions(resource_version=str(old), resource_version_match="NotOlderThan", limit=5)
    )
    assert not_older.resource_version == now
    # "0": any version.
    assert store.list_configmaps(ListOptions(resource_version="0")).items
    store.compact()
    with pytest.raises(StatusError) as gone:
        store.list_configmaps(ListOptions(resource_version=str(old), limit=10))
    assert gone.value.code == 410
    with pytest.raises(ResourceVersionTooLarge) as future:
        store.list_configmaps(ListOptions(resource_version=str(now + 5)))
    assert future.value.code == 504 and future.value.reason == "Timeout"


@pytest.mark.parametrize(
    "options",
    [
        ListOptions(resource_version_match="NotOlderThan"),
        ListOptions(resource_version="0", resource_version_match="Exact"),
        ListOptions(resource_version="1", resource_version_match="Sometime"),
        ListOptions(resource_version="abc"),
        ListOptions(resource_version="-1"),
        ListOptions(continue_token="not-a-token"),
        ListOptions(label_selector="a in ("),
        ListOptions(field_selector="spec.foo=bar"),
    ],
)
def test_invalid_list_options_are_400(options: ListOptions) -> None:
    store = make_store()
    store.create_configmap("ns", "a")
    with pytest.raises(StatusError) as bad:
        store.list_configmaps(options)
    assert (bad.value.code, bad.value.reason) == (400, "BadRequest")


def test_continue_with_resource_version_is_400() -> None:
    store = make_store()
    store.create_configmap("ns", "a")
    store.create_configmap("ns", "b")
    token = store.list_configmaps(ListOptions(limit=1)).continue_token
    with pytest.raises(StatusError) as bad:
        store.list_configmaps(ListOptions(continue_token=token, resource_version="2"))
    assert bad.value.code == 400


write_ops = st.lists(
    st.tuples(st.sampled_from(["put", "delete"]), st.integers(0, 5), st.integers(0, 3)),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=write_ops, limit=st.integers(1, 4))
def test_exact_lists_and_chunks_reproduce_past_states(
    ops: list[tuple[str, int, int]], limit: int
) -> None:
    """Any retained version lists exactly as the store looked then, in any chunking."""
    store = make_store(history_size=1000)
    snapshots: dict[int, list[tuple[str, dict[str, str]]]] = {store.resource_version: []}
    for op, index, value in ops:
        name = f"cm{index}"
        exists = ("ns", name) in {o.key for o in store.objects()}
        if op == "put" and not exists:
            store.create_configmap("ns", name, data={"v": str(value)})
        elif op == "put":
            store.update_configmap("ns", name, data={"v": str(value)})
        elif exists:
            store.delete_configmap("ns", name)
        snapshots[store.resource_version] = [(o.name, dict(o.data)) for o in store.objects()]
    for rv, expected in snapshots.items():
        seen: list[tuple[str, dict[str, str]]] = []
        page = store.list_configmaps(ListOptions(resource_version=str(rv), limit=limit))
        while True:
            assert page.resource_version == rv
            assert len(page.items) <= limit
            seen += [(o.name, dict(o.data)) for o in page.items]
            if page.continue_token is None:
                break
            page = store.list_configmaps(
                ListOptions(limit=limit, continue_token=page.continue_token)
            )
        assert seen == expected


# ------------------------------------------------------------------------ selectors

LABELS = {"app": "web", "tier": "front", "example.com/team": "a"}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app = web", True),
        ("app=db", False),
        ("app!=db", True),
        ("app!=web", False),
        ("missing!=x", True),  # != also selects objects without the label
        ("app in (web, db)", True),
        ("app in (db)", False),
        ("app notin (db,cache)", True),
        ("app notin (web)", False),
        ("missing notin (x)", True),
        ("missing in (x)", False),
        ("app", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("example.com/team=a", True),
        ("app=web,tier=front", True),  # comma is AND
        ("app=web,tier=back", False),
        ("app in (web),!missing,tier", True),
        ("missing=", False),
    ],
)
def test_label_selector_matching(selector: str, expected: bool) -> None:
    assert LabelSelector.parse(selector).matches(LABELS) is expected


def test_empty_value_matches_an_empty_label() -> None:
    assert LabelSelector.parse("flag=").matches({"flag": ""})
    assert not LabelSelector.parse("flag=").matches({"flag": "x"})


@pytest.mark.parametrize(
    "selector",
    [
        "app in",
        "app in ()",
        "app in (a",
        "app in a",
        "app=web=x",
        "=web",
        "app web",
        "!app=web",
        "-app=x",
        "app=-x",
        "app=" + "v" * 64,
        "Bad_Prefix/app=x",
        "/app=x",
        "app>1",
        "app=web,",
        ",app",
    ],
)
def test_invalid_label_selectors_are_400(selector: str) -> None:
    with pytest.raises(StatusError) as bad:
        LabelSelector.parse(selector)
    assert (bad.value.code, bad.value.reason) == (400, "BadRequest")


def test_field_selectors_on_name_and_namespace() -> None:
    store = make_store()
    obj = store.create_configmap("ns1", "a")
    other = store.create_configmap("ns2", "b")
    assert FieldSelector.parse("metadata.name=a").matches(obj)
    assert FieldSelector.parse("metadata.name==a").matches(obj)
    assert not FieldSelector.parse("metadata.name!=a").matches(obj)
    assert FieldSelector.parse("metadata.name!=a").matches(other)
    both = FieldSelector.parse("metadata.namespace=ns2,metadata.name=b")
    assert both.matches(other) and not both.matches(obj)
    assert FieldSelector.parse("").matches(obj)


@pytest.mark.parametrize(
    "selector", ["spec.foo=bar", "data.k=v", "metadata.name", "metadata.labels=x"]
)
def test_unsupported_field_selectors_are_400(selector: str) -> None:
    with pytest.raises(StatusError) as bad:
        FieldSelector.parse(selector)
    assert bad.value.code == 400


def test_selector_namespace_scopes() -> None:
    store = make_store()
    a = store.create_configmap("ns1", "a", {"app": "x"})
    b = store.create_configmap("ns2", "a", {"app": "x"})
    selector = Selector.parse("ns1", "app=x")
    assert selector.matches(a) and not selector.matches(b)


# ------------------------------------------------------------------ watch filtering


def test_filtered_watcher_sees_selector_transitions() -> None:
    store = make_store()
    selector = Selector.parse(None, "app=x")
    base = store.resource_version
    store.create_configmap("ns", "a", {"app": "y"}, {"n": "0"})  # not visible
    store.update_configmap("ns", "a", labels={"app": "x"})  # starts matching -> ADDED
    store.update_configmap("ns", "a", data={"n": "1"})  # MODIFIED
    store.update_configmap("ns", "a", labels={"app": "z"}, data={"n": "2"})  # -> DELETED
    store.update_configmap("ns", "a", data={"n": "3"})  # not visible
    seen = [filter_change(c, selector) for c in store.changes_since(base)]
    kinds = [None if s is None else s[0] for s in seen]
    assert kinds == [None, "ADDED", "MODIFIED", "DELETED", None]
    deleted = seen[3]
    assert deleted is not None
    # DELETED shows the last state that matched, with the version of the change.
    assert deleted[1].labels == {"app": "x"} and deleted[1].data == {"n": "1"}
    assert deleted[1].resource_version == base + 4


def test_deletion_of_unmatched_object_is_invisible() -> None:
    store = make_store()
    obj = store.create_configmap("ns", "a", {"app": "y"})
    gone = store.delete_configmap("ns", "a")
    change = Change("DELETED", gone.resource_version, gone, obj)
    assert filter_change(change, Selector.parse(None, "app=x")) is None
    assert filter_change(change, Selector()) == ("DELETED", gone)


def test_subscription_without_version_starts_with_synthetic_added() -> None:
    store = make_store()
    store.create_configmap("ns", "a", {"app": "x"})
    store.create_configmap("ns", "b", {"app": "y"})
    for rv in (None, "0"):
        sub = store.subscribe(Selector.parse(None, "app=x"), rv)
        assert [(t, o.name) for t, o in sub.next_batch()] == [("ADDED", "a")]
        assert sub.resource_version == store.resource_version
        assert sub.next_batch() == []


def test_subscription_from_a_version_sees_only_later_changes() -> None:
    store = make_store()
    store.create_configmap("ns", "a")
    start = store.resource_version
    store.update_configmap("ns", "a", data={"k": "v"})
    store.delete_configmap("ns", "a")
    sub = store.subscribe(Selector(), str(start))
    assert [t for t, _ in sub.next_batch()] == ["MODIFIED", "DELETED"]
    assert sub.resource_version == store.resource_version


def test_subscription_that_falls_behind_the_history_gets_410() -> None:
    store = make_store(history_size=2)
    sub = store.subscribe(Selector(), None)
    for i in range(3):
        store.create_configmap("ns", f"cm{i}")
    with pytest.raises(StatusError) as gone:
        sub.next_batch()
    assert gone.value.code == 410


async def test_changed_event_wakes_a_waiting_watcher() -> None:
    store = make_store()
    sub = store.subscribe(Selector(), None)
    changed = sub.changed()
    assert not changed.is_set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(changed.wait)
        await trio.testing.wait_all_tasks_blocked()
        store.create_configmap("ns", "a")
    assert changed.is_set()
    assert [t for t, _ in sub.next_batch()] == ["ADDED"]
    restart_seen = sub.changed()
    store.restart()
    assert restart_seen.is_set() and sub.ended_by_restart
