"""Short full garbage collections in the server's own process.

A full (generation 2) collection walks every object the collector tracks and
has not frozen, while the event loop serves nobody. A server's long-lived
objects are mostly its subscribers' state (connection, streams, session,
queue: about 130 tracked objects each), so at 1,000 subscribers a full
collection took 100 to 150 ms, every ten seconds or so under steady traffic,
and one message in a hundred waited for one (docs/architecture.md section 6,
"Pauses of the garbage collector").

`GcPacing` keeps those walks short: after every full collection, whatever
survived it is frozen (`gc.freeze()`, a constant-time move), so the next one
walks only what has come since. Frozen objects are still freed when their
last reference goes; only reference cycles among them wait. So every
`unfreeze_every` seconds everything is unfrozen and collected once, which
takes as long as a full collection used to: one such pause every ten
minutes instead of every ten seconds, and cyclic garbage (a closed
connection's objects) held at most that long.

It acts on the whole process, so only the CLI's `jobsignal serve` runs it
(`run_jobsignal(settle_memory=True)`); an embedding program gets it only if
it asks.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import trio

log = logging.getLogger(__name__)

# Seconds between two collections of everything (frozen objects included).
UNFREEZE_EVERY = 600.0


class GcPacing:
    """Freezes the survivors of each full collection; collects everything now and then."""

    def __init__(self, unfreeze_every: float = UNFREEZE_EVERY) -> None:
        self.unfreeze_every = unfreeze_every
        self.freezes = 0
        self.full_collections = 0  # of everything, frozen objects included
        self._full_done = trio.Event()

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collector: only note it, and let the task act on the next
        # loop turn (the token's run_sync_soon is safe from anywhere).
        if phase == "stop" and info.get("generation") == 2:
            self._token.run_sync_soon(self._full_done.set)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled; the collector's callback is removed on the way out."""
        self._token = trio.lowlevel.current_trio_token()
        gc.callbacks.append(self._on_collection)
        try:
            task_status.started()
            next_unfreeze = trio.current_time() + self.unfreeze_every
            while True:
                with trio.move_on_at(next_unfreeze):
                    await self._full_done.wait()
                    self._full_done = trio.Event()
                    gc.freeze()
                    self.freezes += 1
                    continue
                self.collect_everything()
                next_unfreeze = trio.current_time() + self.unfreeze_every
        finally:
            gc.callbacks.remove(self._on_collection)

    def collect_everything(self) -> None:
        """Unfreeze, collect every generation (the cyclic garbage frozen meanwhile), and
        freeze the survivors again."""
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        collected = gc.collect()
        self._full_done = trio.Event()  # (that collection was ours)
        gc.freeze()
        self.full_collections += 1
        log.debug("collected everything: %d objects were frozen, %d freed", frozen, collected)
