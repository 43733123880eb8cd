"""Light stand-ins for the deques h2, grpclib and asyncio keep per connection and stream.

CPython allocates a `collections.deque`'s first block of 64 slots with it, so
even an empty one costs about 760 bytes; an idle subscriber's connection and
streams held about twenty of them (docs/architecture.md section 8). The
adapter (`rpc._grpclib`) swaps each, right after its owner made it, for one
of these two, which support exactly the operations their owners perform:

- `SmallDeque`, a list with `popleft`, where only a few items are ever held:
  a setting's current and unacknowledged values in h2, the futures waiting
  on one asyncio Event or Queue. Its `popleft` moves the rest up, so it is
  not for anything a peer can fill.
- `Fifo` (`jobsignal.fifo`, shared with the subscribers' queues), first in
  first out with amortized O(1) ends, for data a peer can fill with many
  small frames: asyncio.Queue's items and grpclib's acknowledged chunks of a
  stream (and `rpc.output`'s waiting streams);
- `NewestFirst`, the same the other way round, for HPACK's dynamic tables:
  an entry is added at index 0 and the oldest evicted from the end.

And `MethodTable` stands in for a dispatch dict of bound methods (h2's frame
handlers, grpclib's event processors: a dozen bound methods and their dict,
about 1.3 KB per connection each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from jobsignal.fifo import Fifo

__all__ = ["Fifo", "MethodTable", "NewestFirst", "SmallDeque"]

T = TypeVar("T")


class SmallDeque(list[T]):
    """A list that also answers `popleft`: the deque operations of a short sequence."""

    __slots__ = ()

    def popleft(self) -> T:
        return self.pop(0)


class NewestFirst(Generic[T]):
    """A deque used as HPACK's dynamic table: `appendleft` the newest entry, `pop` the
    oldest, index and iterate newest first; all O(1) amortized, whatever the size
    a peer allowed the table."""

    __slots__ = ("_oldest_first",)

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._oldest_first: Fifo[T] = Fifo(reversed(list(items)))

    def __len__(self) -> int:
        return len(self._oldest_first)

    def __bool__(self) -> bool:
        return bool(self._oldest_first)

    def __iter__(self) -> Iterator[T]:
        return reversed(self._oldest_first)

    def __repr__(self) -> str:
        return f"NewestFirst({list(self)!r})"

    def __getitem__(self, index: int) -> T:
        # Index 0 (the newest) is the Fifo's last item; -1 (the oldest) its first.
        return self._oldest_first[-1 - index]

    def appendleft(self, item: T) -> None:
        self._oldest_first.append(item)

    def pop(self) -> T:
        return self._oldest_first.popleft()

    def clear(self) -> None:
        self._oldest_first.clear()


class MethodTable:
    """A dispatch table {key: bound method of one owner} that binds on lookup.

    It keeps the owner, a table of method names shared by every owner with the
    same table, and the entries set after it was made (`__setitem__`). Looking
    a key up returns the owner's method of that name as it is then, where the
    dict held the one bound when it was built: the same unless the owner's
    method is replaced on the instance, which no user of these tables does.
    """

    __slots__ = ("_later", "_names", "_owner")
    _shared_names: ClassVar[dict[frozenset[tuple[Any, str]], dict[Any, str]]] = {}

    def __init__(self, owner: object, table: Mapping[Any, Callable[..., Any]]) -> None:
        names: dict[Any, str] = {}
        later: dict[Any, Callable[..., Any]] = {}
        for key, handler in table.items():
            name = getattr(handler, "__name__", "")
            if getattr(handler, "__self__", None) is owner and getattr(owner, name) == handler:
                names[key] = name
            else:  # not one of the owner's own methods: kept as it is
                later[key] = handler
        self._owner = owner
        self._names = self._shared_names.setdefault(frozenset(names.items()), names)
        self._later: dict[Any, Callable[..., Any]] | None = later or None

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        later = self._later
        if later is not None and key in later:
            return later[key]
        handler: Callable[..., Any] = getattr(self._owner, self._names[key])
        return handler

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: Any, handler: Callable[..., Any]) -> None:
        if self._later is None:
            self._later = {}
        self._later[key] = handler

    def __contains__(self, key: object) -> bool:
        return key in self._names or (self._later is not None and key in self._later)

    def __len__(self) -> int:
        return len(self._names.keys() | (self._later or {}).keys())
