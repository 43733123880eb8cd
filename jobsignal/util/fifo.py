"""`Fifo`: a first-in-first-out queue on one list, lighter than a deque when small.

CPython allocates a `collections.deque`'s first block of 64 slots with it, so
even an empty one costs about 760 bytes; an empty list costs 56. Idle
subscribers and connections hold many queues that are empty almost always
(a subscriber's pending messages, grpclib's and asyncio's per-stream
buffers), so those are `Fifo`s (docs/architecture.md section 8).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Fifo(Generic[T]):
    """A queue: `append` at the back, `popleft` from the front, both O(1) amortized.

    Items taken from the front leave a gap at the head of one list, which is
    cut off once it is half the list, so each item is moved at most a few times.
    """

    __slots__ = ("_head", "_items")

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._items: list[Any] = list(items)
        self._head = 0

    def __len__(self) -> int:
        return len(self._items) - self._head

    def __bool__(self) -> bool:
        return len(self._items) > self._head

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._head, None)

    def __reversed__(self) -> Iterator[T]:
        items = self._items
        return (items[i] for i in range(len(items) - 1, self._head - 1, -1))

    def __repr__(self) -> str:
        return f"Fifo({list(self)!r})"

    def _position(self, index: int) -> int:
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("Fifo index out of range")
        return self._head + index

    def __getitem__(self, index: int) -> T:
        item: T = self._items[self._position(index)]
        return item

    def __setitem__(self, index: int, item: T) -> None:
        self._items[self._position(index)] = item

    def append(self, item: T) -> None:
        self._items.append(item)

    def extend(self, items: Iterable[T]) -> None:
        self._items.extend(items)

    def appendleft(self, item: T) -> None:
        """Put `item` back at the front (into the gap a `popleft` left, if any)."""
        if self._head:
            self._head -= 1
            self._items[self._head] = item
        else:
            self._items.insert(0, item)

    def popleft(self) -> T:
        items, head = self._items, self._head
        if head >= len(items):
            raise IndexError("pop from an empty Fifo")
        item: T = items[head]
        items[head] = None  # the queue no longer keeps it alive
        head += 1
        if 2 * head >= len(items):
            del items[:head]
            head = 0
        self._head = head
        return item

    def remove(self, item: T) -> None:
        """Remove the first occurrence of `item` (ValueError if absent)."""
        del self._items[self._items.index(item, self._head)]

    def take(self, count: int) -> list[T]:
        """Pop up to `count` items from the front at once, in order."""
        items, head = self._items, self._head
        end = min(len(items), head + count)
        taken: list[T] = items[head:end]
        if 2 * end >= len(items):
            del items[:end]
            self._head = 0
        else:
            items[head:end] = [None] * (end - head)  # no longer kept alive here
            self._head = end
        return taken

    def clear(self) -> None:
        self._items.clear()
        self._head = 0
