"""`count_tasks`: how many trio tasks are alive, for tests that a component holds
no task of its own (an idle subscription, a socket) or leaves none behind."""

from __future__ import annotations

import trio


def count_tasks() -> int:
    """Every live task of this trio run, the root task included."""

    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(
            walk(child) for nursery in task.child_nurseries for child in nursery.child_tasks
        )

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return walk(root)
