"""The test data factories: one for job events, one for ClusterD jobs, one for ConfigMaps.

- `make_job`: a job event (the store's JobSummary) whose fields are all
  distinct from each other and from other indexes', so swapped or mixed-up
  fields show up; any field can be set by name;
- `clusterd_job`: a job as ClusterD writes it (its ConfigMaps), for the store,
  the emulator and the watcher (docs/architecture.md section 4);
- `configmap`: a ConfigMap object as the Kubernetes API returns it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.store.model import JobSummary


def rank_table(npus: int, index: int = 0) -> str:
    """A complete hccl.json rank table with `npus` devices, 8 per server."""
    servers = []
    for server in range((npus + 7) // 8):
        devices = [
            {
                "device_id": str(device),
                "device_ip": f"10.{index % 250}.{server % 250}.{device}",
                "rank_id": str(server * 8 + device),
            }
            for device in range(min(8, npus - server * 8))
        ]
        servers.append(
            {
                "device": devices,
                "server_id": f"192.168.{index % 250}.{server % 250}",
                "server_name": f"node-{index}-{server}",
                "server_sn": f"SN{index:04d}{server:04d}",
            }
        )
    table = {
        "status": "complete",
        "server_list": servers,
        "server_count": str(len(servers)),
        "total": npus,
    }
    return json.dumps(table, separators=(",", ":"))


def make_job(
    index: int = 0,
    *,
    status: str = "running",
    operator: str = "add",
    npus: int = 8,
    hccl_json: str | None = None,
    version: int = 0,
    **fields: Any,
) -> JobSummary:
    """Job `index` with every field distinct, so swapped fields show up.

    `fields` replace JobSummary fields by name (e.g. `job_id="a"`).
    """
    job = JobSummary(
        namespace=f"ns-{index % 3}",
        job_id=f"uid-{index:04d}",
        job_name=f"train-{index}",
        framework="pytorch" if index % 2 else "mindspore",
        job_status=status,
        time=str(1_700_000_000 + index),
        total=str(1 + index % 4),
        hccl_json=rank_table(npus, index) if hccl_json is None else hccl_json,
        delete_time=str(1_700_100_000 + index + version) if operator == "delete" else "",
        shared_tor_ip=f"10.254.{index % 250}.{version % 250}",
        master_addr=f"10.253.{index % 250}.1",
        operator=operator,
        sid=f"sid-{index}-{version}",
        npu_count=npus,
    )
    return dataclasses.replace(job, **fields) if fields else job


def clusterd_job(name: str, *, namespace: str = "ns", **options: Any) -> ClusterdJob:
    """ClusterD's job `name` (uid `uid-NAME`); `options` as for ClusterdJob (servers, ...)."""
    return ClusterdJob(namespace, name, f"uid-{name}", **options)


def configmap(
    namespace: str, name: str, data: Mapping[str, str], labels: Mapping[str, str] = JOB_LABELS
) -> dict[str, Any]:
    """A ConfigMap as the API returns it: metadata (namespace, name, labels) and data."""
    return {
        "metadata": {"namespace": namespace, "name": name, "labels": dict(labels)},
        "data": dict(data),
    }
