"""What a job source is to the rest of a server: the Kubernetes watcher, or a relay.

A source is one long-running task (`run`, started with `nursery.start`). It
feeds an owner of the live jobs' state (the job store, or the relayed jobs:
the broadcaster's `LiveJobs`), hands every step's job events to `Publish`
(`Broadcaster.publish`) before its next checkpoint, and reports readiness and
contact through `SourceStatus`. The broadcaster and the gRPC layer see only
those three, never which source feeds them (docs/architecture.md section 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from jobsignal.store.model import JobSummary

# Where a source hands job events: `Broadcaster.publish` in a server. The second
# argument is when the source saw them (trio's clock), for latency.
Publish = Callable[[Sequence[JobSummary], float], None]


class JobSource(Protocol):
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; starts at once (readiness comes via SourceStatus)."""
        ...
