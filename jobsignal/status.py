"""What the data source tells the rest of the server: ready, in sync, or out of touch."""

from __future__ import annotations

import trio


class SourceStatus:
    """Shared by the source (writer) and the health service (reader).

    `ready` is set once the first full LIST has been applied: only then is
    the served state the cluster's. `in_sync` turns false while the API
    cannot be reached; the last known state keeps being served meanwhile.
    `lists_applied` counts every full LIST applied (each scope's first and
    every relist), which `wait_list_applied` waits for.
    """

    def __init__(self) -> None:
        self.ready = trio.Event()
        self.in_sync = False
        self.last_sync_time: float | None = None
        self.problem = ""
        self.lists_applied = 0
        self._changed = trio.Event()
        self._listed = trio.Event()

    def mark_synced(self, wall_time: float) -> None:
        self.last_sync_time = wall_time
        if not self.in_sync:
            self.in_sync = True
            self.problem = ""
            self._notify()

    def mark_ready(self, wall_time: float) -> None:
        self.mark_synced(wall_time)
        self.ready.set()

    def mark_list_applied(self) -> None:
        """A full LIST of one scope is applied to the store (a first one or a relist)."""
        self.lists_applied += 1
        self._listed.set()
        self._listed = trio.Event()

    async def wait_list_applied(self) -> None:
        """Until the next full LIST is applied."""
        await self._listed.wait()

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
