"""The watcher: LIST then WATCH job-summary ConfigMaps, feeding the job store.

One loop per watched scope (all namespaces, or each configured namespace),
following docs/architecture.md section 5: LIST (paged) and replace the scope's part of
the store, so a relist emits exactly the differences; WATCH from the LIST's
resourceVersion with bookmarks and a server-side timeout; advance the version
on every event and bookmark; after a clean end, WATCH again from there; on
410, relist; on other errors, back off with jitter (honouring Retry-After,
re-reading credentials after a 401) and keep serving the last known state.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio
import trio.lowlevel

from jobsignal.config import LayerSettings, from_setting
from jobsignal.kube.api import (
    ApiError,
    ApiUnavailable,
    BadResponse,
    Gone,
    KubeApi,
    PageTooLarge,
    Throttled,
    Unauthorized,
)
from jobsignal.logs import RateLimitedLog
from jobsignal.source import Publish
from jobsignal.status import SourceStatus
from jobsignal.store import JobStore
from jobsignal.store.configmap import BadConfigMap
from jobsignal.store.jobs import MAX_JOINED_RANK_TABLE_CHARS, Changes
from jobsignal.util.backoff import Backoff
from jobsignal.util.blocks import background_tasks
from jobsignal.util.text import quote

log = logging.getLogger(__name__)

# Work between two checkpoints while a LIST is applied, each at most about
# 5 ms: characters of rank table parsed, ConfigMaps replaced in the store, and
# ConfigMaps' worth of jobs recomputed, whose events (at most one per job, so
# at most that many) are published in the same step.
PARSE_SLICE = 256 * 1024
COMMIT_SLICE = 1000
SETTLE_SLICE = 64


@dataclass(frozen=True)
class WatchSettings(LayerSettings):
    """What and how to watch; the first three are settings (jobsignal/config.py)."""

    label_selector: str = from_setting(lambda c: c.label_selector)
    namespaces: tuple[str, ...] = from_setting(lambda c: c.namespaces)
    watch_timeout: float = from_setting(lambda c: c.watch_timeout)
    page_size: int = 500
    backoff_initial: float = 0.8
    backoff_max: float = 30.0


class Credentials(Protocol):
    """Something that can re-read rotated credentials (kube.credentials.TokenSource)."""

    def invalidate(self) -> None: ...


@dataclass
class _ScopeProgress:
    """Where one scope's watch stands; survives the failures of single watches."""

    # The resourceVersion to watch from; None means a LIST is needed first.
    version: str | None = None
    # 410s in a row with nothing delivered in between.
    gone_streak: int = 0


@dataclass
class WatchCounters:
    lists: int = 0
    relists_after_gone: int = 0
    watches: int = 0
    watch_restarts: int = 0
    events: int = 0
    bookmarks: int = 0
    errors: int = 0
    # Watch events or LISTs whose application to the store failed unexpectedly.
    apply_errors: int = 0
    # Job events served without HcclJson: the rank table joined from the job's
    # ConfigMaps was over the store's cap (only a hostile job comes near it).
    rank_tables_over_cap: int = 0


class _PageFetch:
    """One LIST page asked for in the background. Its `ApiError` is kept and
    raised by `page()` in the listing task, as itself (not in the nursery's
    exception group), so the scope's handlers see a 410 or an outage as ever."""

    def __init__(self) -> None:
        self._done = trio.Event()
        self._page: dict[str, Any] = {}
        self._error: ApiError | None = None

    @classmethod
    async def start(
        cls, nursery: trio.Nursery, api: KubeApi, namespace: str | None, params: dict[str, str]
    ) -> _PageFetch:
        """Ask for the page; returns once the request is under way."""
        fetch = cls()
        await nursery.start(fetch._run, api, namespace, params)
        return fetch

    async def _run(
        self,
        api: KubeApi,
        namespace: str | None,
        params: dict[str, str],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        # `started` only wakes the listing task; this one runs on into the
        # request until the request first waits.
        task_status.started()
        try:
            self._page = await api.list_page(namespace, params)
        except ApiError as error:
            self._error = error
        self._done.set()

    async def page(self) -> dict[str, Any]:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._page


class Watcher:
    def __init__(
        self,
        api: KubeApi,
        store: JobStore,
        publish: Publish,
        status: SourceStatus,
        settings: WatchSettings,
        *,
        credentials: Credentials | None = None,
        wall_clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._api = api
        self._store = store
        self._publish_events = publish
        self._status = status
        self._settings = settings
        self._credentials = credentials
        self._wall_clock = wall_clock
        self._rng = rng
        self.counters = WatchCounters()
        self._scopes: tuple[str | None, ...] = settings.namespaces or (None,)
        self._listed: set[str | None] = set()
        self._faults = RateLimitedLog(log)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch every scope forever. Starts at once: readiness comes via SourceStatus."""
        async with trio.open_nursery() as nursery:
            for scope in self._scopes:
                nursery.start_soon(self._run_scope, scope)
            task_status.started()

    async def _run_scope(self, namespace: str | None) -> None:
        where = f"namespace {namespace}" if namespace else "all namespaces"
        backoff = Backoff(self._settings.backoff_initial, self._settings.backoff_max, self._rng)
        scope = _ScopeProgress()
        while True:
            try:
                if scope.version is None:
                    scope.version = await self._relist(namespace)
                    self._mark_listed(namespace)
                    if not scope.gone_streak:  # a LIST that works ends an outage
                        backoff.reset()
                await self._watch(namespace, scope, backoff)
                self.counters.watch_restarts += 1
                log.info("watch of %s ended cleanly at %s; watching again", where, scope.version)
            except Gone as gone:
                self.counters.relists_after_gone += 1
                scope.version = None
                scope.gone_streak += 1
                # One 410 after a working watch relists at once; 410 after 410 with
                # nothing delivered in between (a lagging watch cache) backs off.
                delay = backoff.next_delay() if scope.gone_streak > 1 else 0.0
                log.info("watch of %s: %s; relisting in %.1fs", where, gone, delay)
                await trio.sleep(delay)
            except ApiError as error:
                self.counters.errors += 1
                self._status.mark_unreachable(str(error))
                delay = backoff.next_delay()
                if isinstance(error, Throttled) and error.retry_after is not None:
                    delay = max(delay, error.retry_after)
                if isinstance(error, Unauthorized) and self._credentials is not None:
                    self._credentials.invalidate()
                log.warning(
                    "Kubernetes API (%s): %s; serving last known state, retry in %.1fs",
                    where,
                    error,
                    delay,
                )
                await trio.sleep(delay)
            except Exception:
                # A fault `kube/api.py` did not foresee (a bug here or in a
                # dependency): the watcher serves every tenant, so it must not
                # end. Counted as a failed call; relist, as its place is unknown.
                self.counters.errors += 1
                scope.version = None
                self._status.mark_unreachable("unexpected error (logged)")
                delay = backoff.next_delay()
                self._faults.error(
                    "unexpected_error",
                    "watch of %s failed unexpectedly; serving last known state, relist in %.1fs",
                    where,
                    delay,
                    exc_info=True,
                )
                await trio.sleep(delay)

    def _mark_listed(self, namespace: str | None) -> None:
        self._listed.add(namespace)
        self._status.mark_list_applied()
        now = self._wall_clock()
        if not self._status.ready.is_set() and self._listed >= set(self._scopes):
            self._status.mark_ready(now)
            log.info("initial LIST applied: %d jobs", self._store.live_job_count())
        else:
            self._status.mark_synced(now)

    def _selector(self) -> dict[str, str]:
        return {"labelSelector": self._settings.label_selector}

    async def _relist(self, namespace: str | None) -> str:
        relist = self._store.relist(namespace)
        params = {**self._selector(), "limit": str(self._settings.page_size)}
        listed = work = 0
        async with background_tasks() as nursery:
            fetch = await _PageFetch.start(nursery, self._api, namespace, params)
            while True:
                try:
                    page = await fetch.page()
                except PageTooLarge as error:
                    # The same page again (the same continue token), half as many
                    # ConfigMaps at a time, for the rest of this LIST.
                    limit = int(params["limit"])
                    if limit <= 1:
                        raise
                    params = {**params, "limit": str(limit // 2)}
                    log.warning(
                        "LIST of %s: %s; asking for %d at a time",
                        namespace or "all namespaces",
                        error,
                        limit // 2,
                    )
                    fetch = await _PageFetch.start(nursery, self._api, namespace, params)
                    continue
                metadata = _mapping(page.get("metadata"))
                token = metadata.get("continue")
                if token:
                    # Ask for the next page before parsing this one: the API
                    # server makes it while this task parses (docs/architecture.md
                    # section 5, "Paging").
                    params = {**params, "continue": str(token)}
                    fetch = await _PageFetch.start(nursery, self._api, namespace, params)
                for item in page.get("items", []):
                    if not isinstance(item, dict):
                        continue
                    listed += 1
                    work += relist.add(item)
                    if work >= PARSE_SLICE:
                        work = 0
                        await trio.lowlevel.checkpoint()
                if not token:
                    break
        version = str(metadata.get("resourceVersion") or "")
        if not version:
            raise BadResponse("LIST response has no metadata.resourceVersion")
        self.counters.lists += 1
        now = self._wall_clock()
        try:
            while not relist.commit(now, COMMIT_SLICE):
                await trio.lowlevel.checkpoint()
        except Exception:
            self._apply_failed("LIST of " + (namespace or "all namespaces"))
        self._publish(Changes(rejected=relist.rejected))
        events = await self._settle()
        log.info(
            "LIST %s: %d ConfigMaps at resourceVersion %s, %d job events",
            namespace or "all namespaces",
            listed,
            version,
            events,
        )
        return version

    async def _settle(self) -> int:
        """Publish the job events a relist left pending, a slice at a time."""
        published = 0
        while self._store.pending:
            try:
                changes = self._store.settle(SETTLE_SLICE)
            except Exception:
                self._apply_failed("settling a LIST")
                continue  # the failing job is no longer pending
            self._publish(changes)
            published += len(changes.events)
            await trio.lowlevel.checkpoint()
        return published

    async def _watch(self, namespace: str | None, scope: _ScopeProgress, backoff: Backoff) -> None:
        """Watch from `scope.version`, advancing it with every event and bookmark.

        The version lives in `scope`, not in this frame, so a watch that breaks
        mid-stream is resumed after the last event it delivered: nothing is
        applied twice and no job goes back to an older state.
        """
        assert scope.version is not None
        params = {
            **self._selector(),
            "resourceVersion": scope.version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(self._settings.watch_timeout)),
        }
        self.counters.watches += 1
        async with self._api.watch(namespace, params) as events:
            self._status.mark_synced(self._wall_clock())
            async for event in events:
                kind = event.get("type")
                obj = event["object"]
                if kind == "ERROR":
                    raise _watch_error(obj)
                new_version = str(_mapping(obj.get("metadata")).get("resourceVersion") or "")
                if kind == "BOOKMARK":
                    self.counters.bookmarks += 1
                else:
                    self.counters.events += 1
                    try:
                        changes = self._store.apply(str(kind), obj, self._wall_clock())
                    except Exception:
                        # Skip this event (its version still counts: it is not replayed).
                        self._apply_failed(f"{kind} event")
                    else:
                        self._publish(changes)
                if new_version:
                    scope.version = new_version
                scope.gone_streak = 0
                backoff.reset()
                self._status.mark_synced(self._wall_clock())

    def _apply_failed(self, what: str) -> None:
        """Log and count an unexpected error applying input (from an `except` block)."""
        self.counters.apply_errors += 1
        self._faults.error("apply_error", "applying a %s failed; skipped", what, exc_info=True)

    def _log_rejection(self, problem: BadConfigMap) -> None:
        if problem.reason == "internal_error" and problem.__cause__ is not None:
            cause = problem.__cause__
            frames = traceback.extract_tb(cause.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            self._faults.error(
                problem.reason, "skipped ConfigMap: %s: %s%s", problem, quote(cause), where
            )
        else:
            self._faults.warning(problem.reason, "skipped ConfigMap: %s", problem)

    def _publish(self, changes: Changes) -> None:
        for problem in changes.rejected:
            self._log_rejection(problem)
        for job in changes.tables_over_cap:
            self.counters.rank_tables_over_cap += 1
            self._faults.warning(
                "rank_table_over_cap",
                "job %s/%s: its rank table, joined from %s ConfigMaps, is over %d characters;"
                " served without HcclJson",
                quote(job.namespace, 80),
                quote(job.job_id, 80),
                job.total,
                MAX_JOINED_RANK_TABLE_CHARS,
            )
        # Every event the store emitted is published before the next
        # checkpoint: snapshots are built from the store's state, so a
        # subscriber arriving in between would get an event its snapshot
        # already holds. One store step emits few events (`SETTLE_SLICE`).
        if changes.events:
            self._publish_events(changes.events, trio.current_time())
        for job in changes.events:
            log.debug(
                "job event: %s/%s %s %s (%d NPUs)",
                job.namespace,
                job.job_name,
                job.job_status,
                job.operator,
                job.npu_count,
            )


def _mapping(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one (a malformed envelope)."""
    return value if isinstance(value, dict) else {}


def _watch_error(status_object: dict[str, Any]) -> ApiError:
    code = status_object.get("code")
    message = str(status_object.get("message") or status_object.get("reason") or "")[:200]
    if code == 410:
        return Gone(f"watch expired (410): {message}")
    if code == 401:
        return Unauthorized(f"watch refused (401): {message}")
    if code == 429:
        return Throttled(f"watch throttled (429): {message}", None)
    return ApiUnavailable(f"watch error {code}: {message}")
