"""parse_slice with the slice of the version a ConfigMap replaces: an unchanged
rank table is taken from it instead of parsed again, and the result is the slice
a fresh parse makes, whatever else changed."""

from __future__ import annotations

from typing import Any

import pytest

from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.store import configmap as configmap_module
from jobsignal.store.configmap import BadConfigMap, parse_slice
from jobsignal.store.jobs import ADDED, MODIFIED, JobStore
from tests.support.factories import configmap


def versions(total: int) -> dict[str, dict[str, str]]:
    """ConfigMap data of one job's first ConfigMap in several states."""
    job = ClusterdJob("ns", "big", "uid-big", servers=3, servers_per_configmap=3 // total + 1)
    other = ClusterdJob("ns", "big", "uid-big", servers=4, servers_per_configmap=4 // total + 1)
    return {
        "running": job.configmaps("running")[0][1],
        "complete": job.configmaps("complete", delete_time=5)[0][1],
        "pending": job.configmaps("pending")[0][1],
        "rescaled": other.configmaps("running")[0][1],
        "blank": {**job.configmaps("running")[0][1], "hccl.json": " "},
        "unsplit": {**job.configmaps("running")[0][1], "total": "1", "cm_index": "0"},
    }


@pytest.mark.parametrize("total", [1, 2])
def test_a_slice_made_with_the_previous_one_equals_a_fresh_parse(total: int) -> None:
    data = versions(total)
    for before in data.values():
        previous = parse_slice(configmap("ns", "job-summary-big", before))
        for after in data.values():
            fresh = parse_slice(configmap("ns", "job-summary-big", after))
            assert parse_slice(configmap("ns", "job-summary-big", after), previous) == fresh


def test_an_unchanged_rank_table_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    data = versions(2)
    previous = parse_slice(configmap("ns", "job-summary-big", data["running"]))
    expected = parse_slice(configmap("ns", "job-summary-big", data["complete"]))

    def not_again(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("parsed again")

    monkeypatch.setattr(configmap_module, "_parse_rank_table", not_again)
    piece = parse_slice(configmap("ns", "job-summary-big", data["complete"]), previous)
    assert piece == expected
    assert piece.hccl_raw is previous.hccl_raw and piece.servers is previous.servers


def test_a_changed_rank_table_is_checked_as_ever() -> None:
    data = versions(2)
    previous = parse_slice(configmap("ns", "job-summary-big", data["running"]))
    poisoned = {**data["running"], "hccl.json": data["running"]["hccl.json"][:-1] + ',"x":NaN}'}
    with pytest.raises(BadConfigMap) as rejected:
        parse_slice(configmap("ns", "job-summary-big", poisoned), previous)
    assert rejected.value.reason == "hccl_json_not_strict"


def test_the_store_reuses_the_table_of_the_version_it_replaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A status rewrite (watch or LIST) parses no rank table again; a new table is parsed."""
    parsed: list[str] = []
    real = configmap_module._parse_rank_table

    def counting(ref: Any, raw: str, *, split: bool) -> Any:
        parsed.append(raw)
        return real(ref, raw, split=split)

    monkeypatch.setattr(configmap_module, "_parse_rank_table", counting)
    store = JobStore()
    job = ClusterdJob("ns", "big", "uid-big", servers=3)
    [(name, running)] = job.configmaps("running")
    store.apply(ADDED, configmap("ns", name, running), 1.0)
    [(_, complete)] = job.configmaps("complete")
    [event] = store.apply(MODIFIED, configmap("ns", name, complete), 2.0).events
    assert event.job_status == "complete"
    store.replace_all([configmap("ns", name, running)], 3.0)
    assert len(parsed) == 1
    rescaled = ClusterdJob("ns", "big", "uid-big", servers=4).configmaps("running")[0][1]
    store.apply(MODIFIED, configmap("ns", name, rescaled), 4.0)
    assert len(parsed) == 2
