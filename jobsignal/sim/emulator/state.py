"""The emulator's pure ConfigMap store: objects, resource versions, history, selectors.

No I/O happens here. The store owns what the API server's storage owns: a global,
monotonic integer resourceVersion (sent as a string), objects keyed by
(namespace, name), a bounded history of changes that serves watches and consistent
paginated lists, and the selector rules. Errors are raised as `StatusError`, which
the HTTP layer renders as a `kind: Status` object. Watchers read the history through
a `Subscription` cursor and wait on a `trio.Event` that the next change sets.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import dataclasses
import json
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import trio

from jobsignal.util.uuids import random_uuid

EventType = Literal["ADDED", "MODIFIED", "DELETED"]

_STATUS_REASONS: Mapping[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def default_reason(code: int) -> str:
    """The Status `reason` the API server uses for an HTTP code ("Unknown" otherwise)."""
    return _STATUS_REASONS.get(code, "Unknown")


class StatusError(Exception):
    """An API error; the server sends it as a `kind: Status` object with `code`."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        reason: str | None = None,
        details: Mapping[str, Any] | None = None,
        continue_token: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason if reason is not None else default_reason(code)
        self.details = dict(details) if details is not None else None
        self.continue_token = continue_token

    def to_status(self) -> dict[str, Any]:
        """The `kind: Status` JSON object for this error."""
        metadata: dict[str, Any] = {}
        if self.continue_token is not None:
            metadata["continue"] = self.continue_token
        status: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": metadata,
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            status["details"] = self.details
        return status


class ResourceVersionTooLarge(StatusError):
    """A list asked for a resourceVersion the store has not reached yet.

    The API server waits a few seconds for its cache to catch up before giving up
    with 504; the HTTP layer does that wait, so this is its own type.
    """

    def __init__(self, requested: int, current: int) -> None:
        super().__init__(
            504,
            f"Too large resource version: {requested}, current: {current}",
            reason="Timeout",
            details={
                "causes": [
                    {
                        "reason": "ResourceVersionTooLarge",
                        "message": "Too large resource version",
                    }
                ],
                "retryAfterSeconds": 1,
            },
        )
        self.requested = requested


def _configmap_error(
    code: int, name: str, message: str, *, reason: str | None = None
) -> StatusError:
    """An error about the ConfigMap `name`, with the details the API server gives."""
    return StatusError(code, message, reason=reason, details={"name": name, "kind": "configmaps"})


def _rfc3339(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


# --------------------------------------------------------------------------- objects


@dataclass(frozen=True, slots=True)
class RawJson:
    """JSON text the emulator serves as it is (its encoder splices it in).

    For values deeper than Python's `json` encodes: a writer may set an
    object's `metadata.managedFields`, and the API server's decoder allows
    10,000 levels of nesting there.
    """

    text: str


@dataclass(frozen=True, slots=True)
class ConfigMap:
    """One stored ConfigMap. Mappings are private copies; never mutate them."""

    namespace: str
    name: str
    uid: str
    resource_version: int
    creation_timestamp: str
    labels: Mapping[str, str]
    data: Mapping[str, str]
    # `metadata.managedFields` as a writer set it (not checked, not updated by
    # writes as the API server's field manager would).
    managed_fields: RawJson | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def with_resource_version(self, resource_version: int) -> ConfigMap:
        return dataclasses.replace(self, resource_version=resource_version)

    def to_json(self, *, with_type: bool = True) -> dict[str, Any]:
        """The wire form. List items carry no kind/apiVersion, as the API server's do."""
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "resourceVersion": str(self.resource_version),
            "creationTimestamp": self.creation_timestamp,
        }
        # The API server omits empty maps from its JSON.
        if self.labels:
            metadata["labels"] = dict(self.labels)
        if self.managed_fields is not None:
            metadata["managedFields"] = self.managed_fields
        obj: dict[str, Any] = {}
        if with_type:
            obj["kind"] = "ConfigMap"
            obj["apiVersion"] = "v1"
        obj["metadata"] = metadata
        if self.data:
            obj["data"] = dict(self.data)
        return obj


@dataclass(frozen=True, slots=True)
class Change:
    """One entry of the history: a write at `resource_version`.

    `object` is the state after the write; for DELETED it is the last state with the
    deletion's resourceVersion. `previous` is the state before (None for ADDED); the
    watch filter needs it to turn selector transitions into ADDED/DELETED.
    """

    type: EventType
    resource_version: int
    object: ConfigMap
    previous: ConfigMap | None


# ------------------------------------------------------------------------- selectors

_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SPECIAL = "=!(),<>"


def _bad_selector(text: str, why: str) -> StatusError:
    return StatusError(400, f"unable to parse requirement: {why} (selector {text!r})")


def _validate_label_key(key: str, text: str) -> None:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        raise _bad_selector(text, f"invalid label key prefix {prefix!r}")
    if not name or len(name) > 63 or not _NAME_RE.match(name):
        raise _bad_selector(text, f"invalid label key {key!r}")


def _validate_label_value(value: str, text: str) -> None:
    if value and (len(value) > 63 or not _NAME_RE.match(value)):
        raise _bad_selector(text, f"invalid label value {value!r}")


LabelOperator = Literal["in", "notin", "exists", "doesnotexist"]


@dataclass(frozen=True, slots=True)
class Requirement:
    """One comma-separated term. `=`/`==` are `in` with one value, `!=` is `notin`."""

    key: str
    operator: LabelOperator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "exists":
            return present
        if self.operator == "doesnotexist":
            return not present
        if self.operator == "in":
            return present and labels[self.key] in self.values
        # notin and != also select objects that lack the label entirely.
        return not present or labels[self.key] not in self.values


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "(),":
            tokens.append(ch)
            i += 1
        elif ch in "=!":
            if text.startswith(("==", "!="), i):
                tokens.append(text[i : i + 2])
                i += 2
            else:
                tokens.append(ch)
                i += 1
        elif ch in "<>":
            # gt/lt exist only inside the API server, not in the documented syntax.
            raise _bad_selector(text, f"unsupported operator {ch!r}")
        else:
            j = i
            while j < len(text) and not text[j].isspace() and text[j] not in _SPECIAL:
                j += 1
            tokens.append(text[i:j])
            i = j
    return tokens


def _is_identifier(token: str | None) -> bool:
    return token is not None and token not in ("(", ")", ",", "=", "==", "!=", "!")


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A parsed label selector; the empty selector matches everything."""

    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """Parse the documented syntax; raise StatusError(400) when it is invalid."""
        tokens = _tokenize(text)
        if not tokens:
            return cls()
        pos = 0
        requirements: list[Requirement] = []

        def peek() -> str | None:
            return tokens[pos] if pos < len(tokens) else None

        def take() -> str:
            nonlocal pos
            if pos >= len(tokens):
                raise _bad_selector(text, "unexpected end of selector")
            pos += 1
            return tokens[pos - 1]

        while True:
            negate = peek() == "!"
            if negate:
                take()
            key = take()
            if not _is_identifier(key):
                raise _bad_selector(text, f"expected a label key, found {key!r}")
            _validate_label_key(key, text)
            nxt = peek()
            if negate or nxt in (None, ","):
                if negate and nxt not in (None, ","):
                    raise _bad_selector(text, f"unexpected {nxt!r} after '!{key}'")
                requirements.append(Requirement(key, "doesnotexist" if negate else "exists"))
            elif nxt in ("=", "==", "!="):
                op = take()
                value = ""
                if _is_identifier(peek()):
                    value = take()
                _validate_label_value(value, text)
                operator: LabelOperator = "notin" if op == "!=" else "in"
                requirements.append(Requirement(key, operator, frozenset({value})))
            elif nxt in ("in", "notin"):
                op = take()
                if take() != "(":
                    raise _bad_selector(text, f"expected '(' after {op!r}")
                values: set[str] = set()
                while True:
                    value = ""
                    if _is_identifier(peek()):
                        value = take()
                    _validate_label_value(value, text)
                    values.add(value)
                    sep = take()
                    if sep == ")":
                        break
                    if sep != ",":
                        raise _bad_selector(text, f"expected ',' or ')', found {sep!r}")
                if values == {""} and tokens[pos - 2] == "(":
                    raise _bad_selector(text, f"for {op!r} the set of values can't be empty")
                requirements.append(
                    Requirement(key, "in" if op == "in" else "notin", frozenset(values))
                )
            else:
                raise _bad_selector(text, f"unexpected {nxt!r} after label key {key!r}")
            sep_token = peek()
            if sep_token is None:
                break
            if take() != ",":
                raise _bad_selector(text, f"expected ',' found {sep_token!r}")
        return cls(tuple(requirements))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(req.matches(labels) for req in self.requirements)


FIELD_SELECTOR_FIELDS = ("metadata.name", "metadata.namespace")
_FIELD_TERM_RE = re.compile(r"^(?P<field>[^=!]*?)\s*(?P<op>!=|==|=)(?P<value>.*)$", re.DOTALL)


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            current.append(text[i : i + 2])
            i += 2
            continue
        if text[i] == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(text[i])
        i += 1
    parts.append("".join(current))
    return parts


def _unescape_field_value(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


@dataclass(frozen=True, slots=True)
class FieldSelector:
    """A parsed field selector: terms (field, equal?, value) over metadata.name/namespace."""

    terms: tuple[tuple[str, bool, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> FieldSelector:
        if not text.strip():
            return cls()
        terms: list[tuple[str, bool, str]] = []
        for raw in _split_unescaped(text, ","):
            match = _FIELD_TERM_RE.match(raw.strip())
            if match is None:
                raise StatusError(400, f"invalid selector: {text!r}; can't understand {raw!r}")
            field = match["field"].strip()
            if field not in FIELD_SELECTOR_FIELDS:
                raise StatusError(400, f'field label not supported: "{field}"')
            terms.append((field, match["op"] != "!=", _unescape_field_value(match["value"])))
        return cls(tuple(terms))

    def matches(self, obj: ConfigMap) -> bool:
        for field, equal, value in self.terms:
            actual = obj.name if field == "metadata.name" else obj.namespace
            if (actual == value) != equal:
                return False
        return True


@dataclass(frozen=True, slots=True)
class Selector:
    """What a list or watch selects: an optional namespace, labels and fields."""

    namespace: str | None = None
    labels: LabelSelector = LabelSelector()
    fields: FieldSelector = FieldSelector()

    @classmethod
    def parse(
        cls, namespace: str | None = None, label_selector: str = "", field_selector: str = ""
    ) -> Selector:
        return cls(
            namespace, LabelSelector.parse(label_selector), FieldSelector.parse(field_selector)
        )

    @property
    def is_everything(self) -> bool:
        return not self.labels.requirements and not self.fields.terms

    def matches(self, obj: ConfigMap) -> bool:
        if self.namespace is not None and obj.namespace != self.namespace:
            return False
        return self.labels.matches(obj.labels) and self.fields.matches(obj)


def filter_change(change: Change, selector: Selector) -> tuple[EventType, ConfigMap] | None:
    """What a watcher with `selector` sees of `change`, or None.

    An object that starts matching arrives as ADDED, one that stops matching as
    DELETED carrying its last matching state with the change's resourceVersion, as the
    API server's watch cache does.
    """
    now_matches = change.type != "DELETED" and selector.matches(change.object)
    matched_before = change.previous is not None and selector.matches(change.previous)
    if now_matches and matched_before:
        return ("MODIFIED", change.object)
    if now_matches:
        return ("ADDED", change.object)
    if matched_before:
        assert change.previous is not None
        return ("DELETED", change.previous.with_resource_version(change.resource_version))
    return None


# ---------------------------------------------------------------------------- lists


@dataclass(frozen=True, slots=True)
class ListOptions:
    """The list query parameters, still as the client sent them."""

    namespace: str | None = None
    label_selector: str = ""
    field_selector: str = ""
    resource_version: str | None = None
    resource_version_match: str | None = None
    limit: int | None = None
    continue_token: str | None = None


@dataclass(frozen=True, slots=True)
class ListPage:
    """One LIST response (a whole list, or one chunk of it)."""

    resource_version: int
    items: tuple[ConfigMap, ...]
    continue_token: str | None = None
    remaining_item_count: int | None = None

    def to_json(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {"resourceVersion": str(self.resource_version)}
        if self.continue_token is not None:
            metadata["continue"] = self.continue_token
        if self.remaining_item_count is not None:
            metadata["remainingItemCount"] = self.remaining_item_count
        return {
            "kind": "ConfigMapList",
            "apiVersion": "v1",
            "metadata": metadata,
            "items": [item.to_json(with_type=False) for item in self.items],
        }


def encode_continue(resource_version: int, after: tuple[str, str]) -> str:
    """An opaque continue token: the snapshot's version and the last key returned.

    Version 0 means "continue from the newest state", which is what the token that
    comes with a 410 for an expired token does.
    """
    raw = json.dumps({"rv": resource_version, "after": list(after)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, tuple[str, str]]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        decoded = json.loads(raw)
        rv = decoded["rv"]
        namespace, name = decoded["after"]
    except (binascii.Error, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise StatusError(400, "continue key is not valid") from exc
    if not isinstance(rv, int) or not isinstance(namespace, str) or not isinstance(name, str):
        raise StatusError(400, "continue key is not valid")
    return rv, (namespace, name)


def parse_resource_version(text: str) -> int:
    """A resourceVersion parameter as an integer; 400 if it is not one."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or not text.isdigit():
        raise StatusError(400, f"invalid resource version {text!r}")
    return value


# ---------------------------------------------------------------------------- store


class ConfigMapStore:
    """All ConfigMaps of the emulated cluster, with the history of their changes.

    `history_size` bounds the history: once a change falls out, watches and
    consistent list chunks from before it get 410 Expired.
    """

    def __init__(
        self,
        *,
        history_size: int = 1000,
        initial_resource_version: int = 1,
        wall_clock: Callable[[], float] = time.time,
        new_uid: Callable[[], str] = random_uuid,
    ) -> None:
        if history_size < 0:
            raise ValueError("history_size must be >= 0")
        if initial_resource_version < 1:
            # "0" has its own meaning ("any version") on the wire.
            raise ValueError("initial_resource_version must be >= 1")
        self._history_size = history_size
        self._objects: dict[tuple[str, str], ConfigMap] = {}
        self._history: deque[Change] = deque()
        self._resource_version = initial_resource_version
        # Every change with a resourceVersion above this one is still in the history.
        self._oldest = initial_resource_version
        self._epoch = 0
        # (version, objects, keys) of the last snapshot a LIST read: `_objects_at`.
        self._snapshot: tuple[int, list[ConfigMap], list[tuple[str, str]]] | None = None
        self._changed = trio.Event()
        self._wall_clock = wall_clock
        self._new_uid = new_uid

    # -- reading

    @property
    def resource_version(self) -> int:
        """The newest resourceVersion (that of the last write)."""
        return self._resource_version

    @property
    def oldest_resource_version(self) -> int:
        """The oldest version a watch or a consistent list can still start from."""
        return self._oldest

    @property
    def epoch(self) -> int:
        """Counts simulated API server restarts; watches end when it changes."""
        return self._epoch

    @property
    def history(self) -> tuple[Change, ...]:
        return tuple(self._history)

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, namespace: str, name: str) -> ConfigMap:
        try:
            return self._objects[(namespace, name)]
        except KeyError:
            raise _configmap_error(404, name, f'configmaps "{name}" not found') from None

    def objects(self, selector: Selector = Selector()) -> list[ConfigMap]:
        """The current objects that match, in key order (namespace, name)."""
        return [obj for key, obj in sorted(self._objects.items()) if selector.matches(obj)]

    def changed(self) -> trio.Event:
        """An event that the next write (or restart) sets. Take it before reading."""
        return self._changed

    # -- writing

    def create_configmap(
        self,
        namespace: str,
        name: str,
        labels: Mapping[str, str] | None = None,
        data: Mapping[str, str] | None = None,
        *,
        managed_fields: RawJson | None = None,
    ) -> ConfigMap:
        """Create; 409 AlreadyExists if (namespace, name) is taken."""
        if (namespace, name) in self._objects:
            raise _configmap_error(
                409, name, f'configmaps "{name}" already exists', reason="AlreadyExists"
            )
        _check_name(name)
        rv = self._next_version()
        obj = ConfigMap(
            namespace=namespace,
            name=name,
            uid=self._new_uid(),
            resource_version=rv,
            creation_timestamp=_rfc3339(self._wall_clock()),
            labels=_str_map(labels, "labels"),
            data=_str_map(data, "data"),
            managed_fields=managed_fields,
        )
        self._objects[obj.key] = obj
        self._record(Change("ADDED", rv, obj, None))
        return obj

    def update_configmap(
        self,
        namespace: str,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        data: Mapping[str, str] | None = None,
        managed_fields: RawJson | None = None,
        expected_resource_version: int | None = None,
    ) -> ConfigMap:
        """Replace the labels, the data and/or the managedFields (None keeps them).

        An update that changes nothing is a no-op, as in the API server: the
        resourceVersion stays and no watch event is sent. With
        `expected_resource_version`, a stale writer gets 409 Conflict.
        """
        old = self.get(namespace, name)
        if expected_resource_version is not None and expected_resource_version != (
            old.resource_version
        ):
            raise _configmap_error(
                409,
                name,
                f'Operation cannot be fulfilled on configmaps "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )
        new_labels = _str_map(labels, "labels") if labels is not None else old.labels
        new_data = _str_map(data, "data") if data is not None else old.data
        new_fields = managed_fields if managed_fields is not None else old.managed_fields
        if (new_labels, new_data, new_fields) == (old.labels, old.data, old.managed_fields):
            return old
        rv = self._next_version()
        obj = dataclasses.replace(
            old, resource_version=rv, labels=new_labels, data=new_data, managed_fields=new_fields
        )
        self._objects[obj.key] = obj
        self._record(Change("MODIFIED", rv, obj, old))
        return obj

    def create_or_update_configmap(
        self, namespace: str, name: str, labels: Mapping[str, str], data: Mapping[str, str]
    ) -> ConfigMap:
        """Create with `labels` and `data`, or replace the data of the existing one
        (its labels stay): how ClusterD writes a job's ConfigMaps."""
        if (namespace, name) in self._objects:
            return self.update_configmap(namespace, name, data=data)
        return self.create_configmap(namespace, name, labels, data)

    def delete_configmap(self, namespace: str, name: str) -> ConfigMap:
        """Delete; returns the last state, stamped with the deletion's resourceVersion."""
        old = self.get(namespace, name)
        rv = self._next_version()
        del self._objects[old.key]
        gone = old.with_resource_version(rv)
        self._record(Change("DELETED", rv, gone, old))
        return gone

    def compact(self) -> None:
        """Forget all history, as etcd compaction does: older versions get 410."""
        self._history.clear()
        self._oldest = self._resource_version

    def restart(self, *, lose_history: bool = True) -> None:
        """Simulate an API server restart: open watches end; with `lose_history` the
        new server's watch cache starts at the current version, so resuming from an
        older one gets 410."""
        self._epoch += 1
        if lose_history:
            self.compact()
        self._notify()

    # -- lists and watches

    def list_configmaps(self, options: ListOptions) -> ListPage:
        """Serve a LIST per the documented resourceVersion semantics.

        resourceVersion unset: most recent. "0": any version (this store serves the
        newest). Set without limit, or with resourceVersionMatch=NotOlderThan: not
        older than it. Set with limit (match unset), or with Exact: exactly that
        version, 410 if it is gone. continue: the snapshot the token names.
        """
        selector = Selector.parse(options.namespace, options.label_selector, options.field_selector)
        rv_text = options.resource_version or None
        match = options.resource_version_match or None
        limit = options.limit if options.limit is not None and options.limit > 0 else None
        if match not in (None, "NotOlderThan", "Exact"):
            raise StatusError(400, f'resourceVersionMatch: unsupported value "{match}"')
        after: tuple[str, str] | None = None
        if options.continue_token:
            if rv_text is not None and rv_text != "0":
                raise StatusError(
                    400, "specifying resource version is not allowed when using continue"
                )
            if match is not None:
                raise StatusError(400, "resourceVersionMatch is forbidden when continue is set")
            snapshot, after = decode_continue(options.continue_token)
            if snapshot == 0:
                snapshot = self._resource_version
            elif snapshot < self._oldest:
                raise StatusError(
                    410,
                    "The provided continue parameter is too old to display a consistent list "
                    "result. Start a new list without continue, or use the continue token of "
                    "this response for the rest of the list from the newest state (which is "
                    "not consistent with the earlier chunks).",
                    continue_token=encode_continue(0, after),
                )
            elif snapshot > self._resource_version:
                raise StatusError(400, "continue key is not valid")
        elif rv_text is None:
            if match is not None:
                raise StatusError(
                    400, "resourceVersionMatch is forbidden unless resourceVersion is provided"
                )
            snapshot = self._resource_version
        elif rv_text == "0":
            if match == "Exact":
                raise StatusError(400, 'resourceVersionMatch "Exact" is forbidden for "0"')
            snapshot = self._resource_version
        else:
            requested = parse_resource_version(rv_text)
            exact = match == "Exact" or (match is None and limit is not None)
            if requested > self._resource_version:
                raise ResourceVersionTooLarge(requested, self._resource_version)
            if exact:
                if requested < self._oldest:
                    raise StatusError(410, "The resourceVersion for the provided list is too old.")
                snapshot = requested
            else:
                snapshot = self._resource_version
        objects, keys = self._objects_at(snapshot)
        start = 0 if after is None else bisect.bisect_right(keys, after)
        # One more than a page, to know whether another page follows.
        wanted = len(objects) if limit is None else limit + 1
        candidates: list[ConfigMap] = []
        for index in range(start, len(objects)):
            if selector.matches(objects[index]):
                candidates.append(objects[index])
                if len(candidates) == wanted:
                    break
        if limit is None or len(candidates) <= limit:
            return ListPage(snapshot, tuple(candidates))
        page = tuple(candidates[:limit])
        # The API server can only count what is left when nothing is filtered out.
        remaining = len(objects) - start - limit if selector.is_everything else None
        return ListPage(snapshot, page, encode_continue(snapshot, page[-1].key), remaining)

    def changes_since(self, resource_version: int) -> list[Change]:
        """All changes after `resource_version`; 410 Expired if some are forgotten."""
        if resource_version < self._oldest:
            raise StatusError(410, f"too old resource version: {resource_version} ({self._oldest})")
        # The history is ordered, so walk back only over the new part.
        newer: list[Change] = []
        for change in reversed(self._history):
            if change.resource_version <= resource_version:
                break
            newer.append(change)
        newer.reverse()
        return newer

    def subscribe(self, selector: Selector, resource_version: str | None) -> Subscription:
        """Start a watch per the documented semantics.

        Unset or "0": the current matching objects come first as synthetic ADDED
        events, then every change after the current version. A specific version:
        every change after it (410 Expired, from `next_batch`, if it is gone).
        """
        if resource_version in (None, "", "0"):
            initial = self.objects(selector)
            return Subscription(self, selector, self._resource_version, initial)
        return Subscription(self, selector, parse_resource_version(resource_version), [])

    # -- internals

    def _next_version(self) -> int:
        self._resource_version += 1
        return self._resource_version

    def _record(self, change: Change) -> None:
        self._history.append(change)
        while len(self._history) > self._history_size:
            self._oldest = self._history.popleft().resource_version
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _objects_at(self, resource_version: int) -> tuple[list[ConfigMap], list[tuple[str, str]]]:
        """The objects as they were at `resource_version` (which must be retained), in
        key order, and their keys.

        Kept for the last version asked: every page of a LIST reads the snapshot
        its first page did, and what was at a version never changes, so the pages
        after the first neither rebuild nor sort it."""
        if self._snapshot is not None and self._snapshot[0] == resource_version:
            return self._snapshot[1], self._snapshot[2]
        objects = dict(self._objects)
        for change in reversed(self._history):
            if change.resource_version <= resource_version:
                break
            if change.previous is None:
                del objects[change.object.key]
            else:
                objects[change.previous.key] = change.previous
        keys = sorted(objects)
        ordered = [objects[key] for key in keys]
        self._snapshot = (resource_version, ordered, keys)
        return ordered, keys


class Subscription:
    """One watcher's cursor into the store's history.

    It holds no queue of its own: the bounded history is the buffer. A watcher that
    falls further behind than the history gets 410 Expired, which is what the API
    server tells a watcher it could not keep up with.
    """

    def __init__(
        self,
        store: ConfigMapStore,
        selector: Selector,
        resource_version: int,
        initial: Iterable[ConfigMap],
    ) -> None:
        self._store = store
        self.selector = selector
        self._cursor = resource_version
        self._initial = list(initial)
        self._epoch = store.epoch

    @property
    def resource_version(self) -> int:
        """The version this watcher has seen everything up to (what a bookmark says)."""
        return self._cursor

    @property
    def ended_by_restart(self) -> bool:
        return self._store.epoch != self._epoch

    def next_batch(self) -> list[tuple[EventType, ConfigMap]]:
        """The events not delivered yet, in order; moves the cursor past them.

        Raises StatusError(410) when the history no longer reaches the cursor.
        """
        events: list[tuple[EventType, ConfigMap]] = [("ADDED", obj) for obj in self._initial]
        self._initial = []
        for change in self._store.changes_since(self._cursor):
            self._cursor = change.resource_version
            seen = filter_change(change, self.selector)
            if seen is not None:
                events.append(seen)
        return events

    def changed(self) -> trio.Event:
        return self._store.changed()


def _check_name(name: str) -> None:
    # ConfigMap names are DNS subdomains.
    if not name or len(name) > 253 or not _DNS_SUBDOMAIN_RE.match(name):
        raise StatusError(
            422,
            f'ConfigMap "{name}" is invalid: metadata.name: Invalid value: "{name}": a '
            "lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
            "characters, '-' or '.'",
            details={"name": name, "kind": "ConfigMap"},
        )


def _str_map(value: Mapping[str, str] | None, what: str) -> dict[str, str]:
    if value is None:
        return {}
    result: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise StatusError(400, f"{what} must map strings to strings")
        result[key] = item
    return result
