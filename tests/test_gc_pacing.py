"""Full garbage collections stay short: survivors are frozen, everything is collected now and
then (jobsignal/process/gc_pacing.py), in virtual time."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from jobsignal.process.gc_pacing import GcPacing


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """Leave the test process as it was: nothing frozen."""
    yield
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A reference cycle nothing else holds once this returns (only the collector frees it)."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


async def test_the_survivors_of_a_full_collection_are_frozen(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacing = GcPacing(unfreeze_every=600.0)
    kept = [Node() for _ in range(1000)]
    async with trio.open_nursery() as nursery:
        await nursery.start(pacing.run)
        frozen_before = gc.get_freeze_count()
        gc.collect()
        await trio.testing.wait_all_tasks_blocked()
        assert pacing.freezes == 1
        assert gc.get_freeze_count() >= frozen_before + len(kept)
        # A young collection freezes nothing.
        gc.collect(0)
        await trio.testing.wait_all_tasks_blocked()
        assert pacing.freezes == 1
        nursery.cancel_scope.cancel()
    assert pacing._on_collection not in gc.callbacks


async def test_cyclic_garbage_that_was_frozen_is_collected_at_the_next_unfreeze(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacing = GcPacing(unfreeze_every=600.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pacing.run)
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        gc.collect()  # the cycle is alive: it survives, and is frozen
        await trio.testing.wait_all_tasks_blocked()
        del a, b
        gc.collect()
        assert gone() is not None  # frozen cyclic garbage waits
        await trio.sleep(601.0)  # past the pacing's first collection of everything
        assert pacing.full_collections == 1
        assert gone() is None
        # Unfrozen, collected, and what survived is frozen again.
        assert gc.get_freeze_count() > 0
        nursery.cancel_scope.cancel()


async def test_cyclic_garbage_never_frozen_is_collected_as_usual(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(GcPacing().run)
        gone = cycle()
        gc.collect()
        assert gone() is None
        nursery.cancel_scope.cancel()
