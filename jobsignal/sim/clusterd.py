"""ClusterD's side of the contract: job-summary ConfigMaps as ClusterD writes them.

Used by the demo cluster and the tests to produce realistic input
(docs/architecture.md section 4): names `job-summary-<job>` and `job-summary-<job>-<i>`,
the two labels, the data keys, and a rank table split over several
ConfigMaps, each holding the full header and a slice of `server_list`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

JOB_LABELS = {"outside-job-info": "true", "ring-controller.atlas": "ascend-910"}
_INITIALIZING = json.dumps({"status": "initializing"}, separators=(",", ":"))


@dataclass(frozen=True)
class ClusterdJob:
    namespace: str
    name: str
    uid: str
    framework: str = "pytorch"
    servers: int = 1
    devices_per_server: int = 8
    # ClusterD splits large rank tables; this many servers per ConfigMap.
    servers_per_configmap: int = 1000
    # ClusterD's `time`, the job's start (Unix seconds). Fixed by default, so that the
    # tests' jobs are the same from run to run; the demo cluster gives the real start.
    created: int = 1_700_000_000
    extra_server_keys: dict[str, str] = field(default_factory=dict)
    # Each ConfigMap's hccl.json while the job has servers, built with the job,
    # as ClusterD has its rank table before it writes: a status change rewrites
    # the ConfigMaps with the same table, and building a 40,000-NPU table in
    # Python takes longer than writing it.
    rank_tables: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        servers = self.server_list()
        per = self.servers_per_configmap
        tables = tuple(
            self._rank_table(servers[index * per : (index + 1) * per])
            for index in range(self.configmap_count)
        )
        object.__setattr__(self, "rank_tables", tables)

    @property
    def configmap_count(self) -> int:
        return max(1, -(-self.servers // self.servers_per_configmap))

    def configmap_name(self, index: int) -> str:
        base = f"job-summary-{self.name}"
        return base if index == 0 else f"{base}-{index}"

    def server_list(self) -> list[dict[str, object]]:
        servers: list[dict[str, object]] = []
        for s in range(self.servers):
            devices = [
                {
                    "device_id": str(d),
                    "device_ip": f"10.{s // 250}.{s % 250}.{d + 1}",
                    "rank_id": str(s * self.devices_per_server + d),
                }
                for d in range(self.devices_per_server)
            ]
            servers.append(
                {
                    "device": devices,
                    "server_id": f"192.168.{s // 250}.{s % 250}",
                    "server_name": f"node-{s}",
                    "server_sn": f"SN{s:06d}",
                    **self.extra_server_keys,
                }
            )
        return servers

    def _rank_table(self, servers: list[dict[str, object]]) -> str:
        hccl = {
            "status": "complete",
            "server_list": servers,
            "server_count": str(self.servers),
            "total": self.servers * self.devices_per_server,
        }
        return json.dumps(hccl, separators=(",", ":"))

    def configmaps(
        self, status: str, operator: str = "add", delete_time: int | None = None
    ) -> list[tuple[str, dict[str, str]]]:
        """(name, data) of every ConfigMap of the job in the given state."""
        total = self.configmap_count
        result = []
        for index in range(total):
            if status == "pending":
                hccl = _INITIALIZING
            elif status in ("running", "complete", "failed"):
                hccl = self.rank_tables[index]
            else:
                hccl = self._rank_table([])
            data = {
                "job_id": self.uid,
                "job_name": self.name,
                "framework": self.framework,
                "job_status": status,
                "cm_index": str(index),
                "total": str(total),
                "hccl.json": hccl,
                "operator": operator,
                "time": str(self.created),
                "deleteTime": str(delete_time) if delete_time is not None else "",
                "sid": "",
            }
            if self.framework == "pytorch":
                data["sharedTorIp"] = "[]"
                data["masterAddr"] = "192.168.0.0"
            result.append((self.configmap_name(index), data))
        return result
