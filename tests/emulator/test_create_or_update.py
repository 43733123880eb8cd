"""`ConfigMapStore.create_or_update_configmap`: how the demo and the bench write a job."""

from __future__ import annotations

import itertools

from jobsignal.sim.emulator.state import ConfigMapStore


def make_store() -> ConfigMapStore:
    uids = (f"uid-{i}" for i in itertools.count())
    return ConfigMapStore(history_size=100, wall_clock=lambda: 0.0, new_uid=lambda: next(uids))


def test_creates_a_missing_configmap_with_its_labels_and_data() -> None:
    store = make_store()
    created = store.create_or_update_configmap("ns", "job-a", {"app": "x"}, {"k": "1"})
    assert (created.labels, created.data, created.uid) == ({"app": "x"}, {"k": "1"}, "uid-0")
    assert store.get("ns", "job-a") == created


def test_replaces_the_data_of_an_existing_one_and_keeps_its_labels_and_uid() -> None:
    store = make_store()
    created = store.create_or_update_configmap("ns", "job-a", {"app": "x"}, {"k": "1"})
    updated = store.create_or_update_configmap("ns", "job-a", {"app": "other"}, {"k": "2"})
    assert updated.data == {"k": "2"}
    assert updated.labels == {"app": "x"}
    assert updated.uid == created.uid
    assert updated.resource_version > created.resource_version


def test_writing_the_same_data_again_changes_nothing() -> None:
    store = make_store()
    created = store.create_or_update_configmap("ns", "job-a", {"app": "x"}, {"k": "1"})
    again = store.create_or_update_configmap("ns", "job-a", {"app": "x"}, {"k": "1"})
    assert again.resource_version == created.resource_version
