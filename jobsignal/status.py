"""What the data source tells the rest of the server: ready, in sync, or out of touch."""

from __future__ import annotations

import trio


class SourceStatus:
    """Shared by the source (writer) and the health service (reader).

    `ready` is set once the first full LIST has been applied: only then is
    the served state the cluster's. `in_sync` turns false while the API
    cannot be reached; the last known state keeps being served meanwhile.
    """

    def __init__(self) -> None:
        self.ready = trio.Event()
        self.in_sync = False
        self.last_sync_time: float | None = None
        self.problem = ""
        self._changed = trio.Event()

    def mark_synced(self, wall_time: float) -> None:
        self.last_sync_time = wall_time
        if not self.in_sync:
            self.in_sync = True
            self.problem = ""
            self._notify()

    def mark_ready(self, wall_time: float) -> None:
        self.mark_synced(wall_time)
        self.ready.set()

    def mark_unreachable(self, problem: str) -> None:
        self.problem = problem
        if self.in_sync:
            self.in_sync = False
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()
