"""A paged LIST asks for its next page before it parses the page it has, and a
page's failure still reaches the watcher's handlers as itself.

A stand-in for `KubeApi` records when each page is asked for; the store's
`Relist.add` records when each listed ConfigMap is parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import pytest
import trio

from jobsignal.kube.api import ApiError, Gone, KubeApi
from jobsignal.kube.watcher import Watcher, WatchSettings
from jobsignal.status import SourceStatus
from jobsignal.store import JobStore
from jobsignal.store.jobs import Relist


def configmap(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "jobs", "resourceVersion": "5"}}


# Page by continue token: its ConfigMaps and the token of the page after it.
PAGES: dict[str | None, tuple[list[str], str | None]] = {
    None: (["a", "b"], "t1"),
    "t1": (["c", "d"], "t2"),
    "t2": (["e"], None),
}


class PagedApi:
    def __init__(self, log: list[str], failing: Mapping[str | None, ApiError] = {}) -> None:
        self.log = log
        self.failing = failing

    async def list_page(self, namespace: str | None, params: Mapping[str, str]) -> dict[str, Any]:
        token = params.get("continue")
        self.log.append(f"ask {token}")
        await trio.sleep(0.01)  # the API server's time to make the page
        if token in self.failing:
            raise self.failing[token]
        names, following = PAGES[token]
        metadata = {"resourceVersion": "9", **({"continue": following} if following else {})}
        return {"metadata": metadata, "items": [configmap(name) for name in names]}


def watcher_on(api: PagedApi) -> Watcher:
    def publish(*args: object) -> None:
        pass

    return Watcher(
        cast(KubeApi, api), JobStore(), publish, SourceStatus(), WatchSettings(page_size=2)
    )


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []
    add = Relist.add

    def recording_add(self: Relist, item: Mapping[str, Any]) -> int:
        log.append(f"add {item['metadata']['name']}")
        return add(self, item)

    monkeypatch.setattr(Relist, "add", recording_add)
    return log


async def test_the_next_page_is_asked_for_before_this_one_is_parsed(
    autojump_clock: trio.abc.Clock, parsed: list[str]
) -> None:
    watcher = watcher_on(PagedApi(parsed))
    version = await watcher._relist(None)
    assert version == "9"
    assert parsed == ["ask None", "ask t1", "add a", "add b", "ask t2", "add c", "add d", "add e"]


@pytest.mark.parametrize("error", [Gone("HTTP 410: expired"), ApiError("HTTP 403: forbidden")])
async def test_a_later_page_that_fails_raises_its_own_error(
    autojump_clock: trio.abc.Clock, parsed: list[str], error: ApiError
) -> None:
    watcher = watcher_on(PagedApi(parsed, failing={"t2": error}))
    with pytest.raises(type(error)) as raised:
        await watcher._relist(None)
    assert raised.value is error  # as itself, not inside an exception group
    assert parsed[-1] == "add d"  # the pages before it were parsed; nothing after
