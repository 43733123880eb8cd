"""The server gives a LIST's freed C heap pages back to the system (jobsignal/process/heap.py).

`release_free_memory` is glibc's `malloc_trim(0)`: the first test shows that
pages freed below a live allocation, which glibc keeps on its own, leave the
process's RSS once it is called. The second shows that a server asked to settle
memory (as the CLI asks) calls it once its first LIST is loaded and again after
every relist (here, after a 410).
"""

from __future__ import annotations

import gc
import platform
from pathlib import Path

import pytest
import trio

from jobsignal import app
from jobsignal.process import heap
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.sim.emulator import ExpireWatch, KubeEmulator
from tests.support.cluster import Cluster
from tests.support.kube_server import open_kube_server, take_fault
from tests.support.waiting import wait_until

MB = 1 << 20


def private_rss() -> int:
    """Bytes of this process's anonymous memory in RAM (RssAnon)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_release_returns_pages_freed_below_a_live_allocation() -> None:
    if platform.libc_ver()[0] != "glibc":
        assert not heap.can_release()
        assert heap.release_free_memory() is False
        return
    assert heap.can_release()
    # 64 MiB in blocks above CPython's small-object limit (512 bytes) and below
    # glibc's mmap threshold: they come from the C heap. The block allocated
    # after them keeps the heap's top in use, so freeing them returns nothing.
    blocks = [bytearray(4096) for _ in range(16 * 1024)]
    pin = bytearray(4096)
    before_free = private_rss()
    del blocks
    kept = private_rss()
    assert kept > before_free - 16 * MB, "glibc already returned the freed pages itself"
    assert heap.release_free_memory() is True
    released = kept - private_rss()
    assert released > 32 * MB, f"only {released / MB:.1f} MiB returned"
    del pin


async def test_a_server_releases_memory_after_its_first_list_and_every_relist(
    emu: KubeEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases = 0

    def release_free_memory() -> bool:
        nonlocal releases
        releases += 1
        return True

    monkeypatch.setattr(app, "release_free_memory", release_free_memory)
    cluster = Cluster(emu.state)
    cluster.write(ClusterdJob("training", "a", "uid-a"), "pending")
    # As `jobsignal serve` runs it: an embedded server settles no memory unless asked.
    async with open_kube_server(emu, tmp_path, ready=True, settle_memory=True) as server:
        status = server._parts.status
        # Once the first LIST is loaded (the task runs right after readiness).
        await wait_until(lambda: releases == 1, what="a release after the first LIST")
        assert status.lists_applied == 1
        # A 410 on the next watch: the watcher lists again.
        await take_fault(emu, ExpireWatch(after_events=1))
        cluster.write(ClusterdJob("training", "b", "uid-b"), "pending")
        await wait_until(lambda: releases == 2, what="a release after the relist")
        assert status.lists_applied == 2
        assert server._parts.watcher.counters.relists_after_gone == 1
        await trio.sleep(0.1)
        assert releases == 2, "released without a LIST"
    gc.unfreeze()  # (the server froze this test process's objects)
