"""The emulated cluster's side: ClusterD's writes, and what a client must end up holding.

- `Cluster` plays ClusterD against the emulator's store (docs/architecture.md
  section 4) and remembers every state each job went through, so a test can
  check that what a client saw is a faithful (possibly relist-compressed)
  replay of it;
- `expected_summary` / `cluster_jobs` compute what a client must hold, from
  the same parsing and assembly rules the store documents;
- `write_kubeconfig` points jobsignal at an emulator, by default with the
  bearer token `TOKEN` the `emu` fixture (tests/conftest.py) requires.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import ConfigMapStore, RawJson, Selector, StatusError
from jobsignal.store import JobKey, JobSummary
from jobsignal.store.configmap import BadConfigMap, Slice, parse_slice
from jobsignal.store.jobs import assemble

from .factories import configmap

#: The label selector ClusterD's ConfigMaps match (jobsignal's default).
SELECTOR = "outside-job-info=true"
#: The bearer token of the `emu` fixture's emulator.
TOKEN = "emulator-bearer-token"


def expected_summary(
    job: ClusterdJob, status: str, operator: str = "add", delete_time: int | None = None
) -> JobSummary:
    """The job event a client must receive for `job` written in this state."""
    slices = [
        parse_slice(configmap(job.namespace, name, data))
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
        managed_fields: RawJson | None = None,
    ) -> None:
        """Create or rewrite every ConfigMap of `job`, as ClusterD does on a change
        (`managed_fields`: set them too, as another writer might have)."""
        for name, data in job.configmaps(status, operator, delete_time):
            try:
                self.state.get(job.namespace, name)
            except StatusError:
                self.state.create_configmap(
                    job.namespace, name, labels, data, managed_fields=managed_fields
                )
            else:
                self.state.update_configmap(
                    job.namespace, name, data=data, managed_fields=managed_fields
                )
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


def hccl(job: JobSummary) -> dict[str, Any]:
    """The job's rank table, decoded."""
    decoded: dict[str, Any] = json.loads(job.hccl_json)
    return decoded


def write_kubeconfig(
    path: Path,
    server: str,
    *,
    user: Mapping[str, Any] | None = None,
    cluster: Mapping[str, Any] | None = None,
) -> Path:
    """A one-context kubeconfig for `server` (an emulator's URL); `user` defaults to the
    bearer token `TOKEN`."""
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "jobsignal", "user": dict({"token": TOKEN} if user is None else user)}],
        "contexts": [
            {"name": "test", "context": {"cluster": "emulator", "user": "jobsignal"}},
        ],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(document))
    return path
