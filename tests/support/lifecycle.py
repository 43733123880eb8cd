"""One stretch of ClusterD's job lifecycle, written to an emulated cluster, and the job
events it must produce: for the tests that compare what two servers send."""

from __future__ import annotations

from dataclasses import dataclass, field

from jobsignal.sim.clusterd import ClusterdJob

from .cluster import Cluster
from .factories import clusterd_job


@dataclass
class Lifecycle:
    """`early` runs before the servers start; `drive` then writes every other change."""

    early: ClusterdJob = field(default_factory=lambda: clusterd_job("early"))
    split: ClusterdJob = field(
        default_factory=lambda: clusterd_job("split", servers=3, servers_per_configmap=2)
    )
    single: ClusterdJob = field(default_factory=lambda: clusterd_job("b"))
    marker: ClusterdJob = field(default_factory=lambda: clusterd_job("m"))

    # (job name, status, operator) of every event, in order, from the early job's first.
    EVENTS = (
        ("early", "running", "add"),
        ("split", "pending", "add"),
        ("split", "running", "add"),
        ("b", "pending", "add"),
        ("early", "complete", "add"),
        ("early", "complete", "delete"),
        ("b", "running", "add"),
        ("b", "running", "delete"),
        ("m", "pending", "add"),
    )

    def before(self, cluster: Cluster) -> None:
        cluster.write(self.early, "running")

    def drive(self, cluster: Cluster) -> None:
        cluster.write(self.split, "pending")
        cluster.write(self.split, "running")  # three ConfigMaps rewritten one by one
        cluster.write(self.single, "pending")
        cluster.write(self.early, "complete")
        cluster.write(self.early, "complete", "delete", 1_700_000_900)  # ClusterD's delete
        cluster.write(self.single, "running")
        cluster.remove(self.single)  # vanished: the server stamps the delete itself
        cluster.write(self.marker, "pending")  # last: its event says the rest arrived
