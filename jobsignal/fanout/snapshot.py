"""Owed snapshots: what a new consumer is owed, composed in slices by its own task.

`Broadcaster.subscribe` fixes which job states a snapshot holds (the live
jobs at that moment: a list of references to immutable states, cheap) in the
same synchronous step that adds the consumer, so no event falls between the
snapshot and the live stream. Making it (a digest and an encoding per job
not encoded yet, a List subscriber's batches) is left to the consumer's own
task, which does it a slice at a time with a trio checkpoint between slices:
the first List subscriber after a LIST of 10,000 jobs used to hold the loop
for about a quarter of a second (docs/architecture.md section 6, "Owed
snapshots"). Events published meanwhile queue behind the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized
from typing import Generic, TypeVar

from trio.lowlevel import checkpoint

# A slice ends after this many jobs or this many bytes made, whichever comes
# first: about 1 to 3 ms of encoding, as a fan-out slice (fanout/pacing.py).
SLICE_JOBS = 128
SLICE_BYTES = 1 << 20

Item = TypeVar("Item")
Made = TypeVar("Made", bound=Sized)


class OwedSnapshot(Generic[Item, Made]):
    """The items a snapshot holds, fixed when its consumer subscribed, and what
    `make` turns each into (None: left out, e.g. a job that cannot be encoded).

    `made()` works through the items in slices. It may be cancelled between
    two (its consumer's task was) and called again: it goes on where it stopped.
    """

    __slots__ = ("_items", "_made", "_make", "_next")

    def __init__(self, items: list[Item], make: Callable[[Item], Made | None]) -> None:
        self._items = items
        self._make = make
        self._made: list[Made] = []
        self._next = 0

    def __len__(self) -> int:
        """The items it holds (a List snapshot's batches are fewer)."""
        return len(self._items)

    async def made(self) -> list[Made]:
        items, made, make = self._items, self._made, self._make
        while self._next < len(items):
            # One slice: up to SLICE_JOBS items, or fewer once SLICE_BYTES are made.
            end = min(self._next + SLICE_JOBS, len(items))
            size = 0
            for index in range(self._next, end):
                result = make(items[index])
                self._next = index + 1
                if result is not None:
                    made.append(result)
                    size += len(result)
                    if size >= SLICE_BYTES:
                        break
            if self._next < len(items):
                await checkpoint()
        self._items = []  # done: hold the results only
        return made


async def sliced(parts: Iterable[Made]) -> list[Made]:
    """Every part of `parts`, one checkpoint after each (a List snapshot's
    batches: joining 4 MiB of signals is a slice's worth)."""
    collected: list[Made] = []
    for part in parts:
        collected.append(part)
        await checkpoint()
    return collected
