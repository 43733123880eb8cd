"""The emulator over real HTTP(S) on 127.0.0.1, checked against the documented API.

LIST (whole, chunked, selectors, resourceVersion rules), WATCH (initial state,
resuming, 410, selector transitions, bookmarks, timeouts), CRUD status codes, every
injectable fault, restarts, TLS with client certificates and bearer tokens. Tests
that wait for server timers run in virtual time on `io_clock` (real sockets:
see the clock rule in tests/conftest.py).
"""

from __future__ import annotations

import base64
import functools
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import pytest
import trio
import trio.testing
import trustme

from jobsignal.sim.emulator import (
    BOOKMARK_BEFORE_TIMEOUT,
    Drop,
    ExpireWatch,
    FaultQueue,
    HttpError,
    KubeEmulator,
    MalformedLine,
    RawJson,
    SplitLines,
    Stall,
    open_emulator,
    run_emulator,
)
from tests.support.cluster import TOKEN
from tests.support.tls import client_context, server_context

Json = dict[str, Any]
#: What every request to the `emu` fixture's emulator carries.
AUTHORIZATION = {"Authorization": f"Bearer {TOKEN}"}


def _client_timeout() -> float | None:
    # In virtual time a client timeout would fire while the server waits for a timer;
    # there a hang shows up as a jump to a far deadline instead.
    virtual = isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
    return None if virtual else 5.0


@pytest.fixture
async def client(emu: KubeEmulator) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=emu.url, headers=AUTHORIZATION, timeout=_client_timeout()
    ) as http:
        yield http


class Watch:
    """The lines of one watch response, as parsed JSON."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()

    async def next_line(self) -> str:
        return await anext(self._lines)

    async def next(self) -> Json:
        decoded: Json = json.loads(await self.next_line())
        return decoded

    async def rest(self) -> list[Json]:
        return [json.loads(line) async for line in self._lines]


@asynccontextmanager
async def watch(client: httpx.AsyncClient, path: str, **params: str) -> AsyncIterator[Watch]:
    async with client.stream("GET", path, params={"watch": "true", **params}) as response:
        assert response.status_code == 200
        yield Watch(response)


def kinds_and_names(events: list[Json]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"].get("name", "")) for e in events]


async def raw_get(emu: KubeEmulator, target: str) -> tuple[list[bytes], bool]:
    """GET with a bare h11 client: the chunks of the body, and whether it ended cleanly."""
    url = urlsplit(emu.url)
    assert url.hostname is not None and url.port is not None
    stream = await trio.open_tcp_stream(url.hostname, url.port)
    conn = h11.Connection(h11.CLIENT)
    headers = [("Host", "emulator"), *AUTHORIZATION.items()]
    request = h11.Request(method="GET", target=target, headers=headers)
    await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
    chunks: list[bytes] = []
    current = b""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some())
            elif isinstance(event, h11.Data):
                current += event.data
                if event.chunk_end:
                    chunks.append(current)
                    current = b""
            elif isinstance(event, h11.EndOfMessage):
                return chunks, True
    except h11.RemoteProtocolError:
        if current:
            chunks.append(current)
        return chunks, False
    finally:
        await stream.aclose()


# ---------------------------------------------------------------------------- LIST


async def test_list_all_and_by_namespace(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    emu.state.create_configmap("b", "one", {"app": "x"}, {"k": "v"})
    emu.state.create_configmap("a", "two")
    response = await client.get("/api/v1/configmaps")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["kind"] == "ConfigMapList" and body["apiVersion"] == "v1"
    assert body["metadata"]["resourceVersion"] == str(emu.state.resource_version)
    assert [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in body["items"]] == [
        ("a", "two"),
        ("b", "one"),
    ]
    assert body["items"][1]["data"] == {"k": "v"}
    namespaced = (await client.get("/api/v1/namespaces/b/configmaps")).json()
    assert [i["metadata"]["name"] for i in namespaced["items"]] == ["one"]
    empty = (await client.get("/api/v1/namespaces/none/configmaps")).json()
    assert empty["items"] == []


async def test_chunked_list_is_consistent(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    for i in range(5):
        emu.state.create_configmap("ns", f"cm{i}", data={"v": "old"})
    first = (await client.get("/api/v1/configmaps", params={"limit": "2"})).json()
    assert len(first["items"]) == 2
    assert first["metadata"]["remainingItemCount"] == 3
    token = first["metadata"]["continue"]
    emu.state.update_configmap("ns", "cm2", data={"v": "new"})
    emu.state.create_configmap("ns", "cm9")
    names: list[str] = [i["metadata"]["name"] for i in first["items"]]
    while token:
        page = (
            await client.get("/api/v1/configmaps", params={"limit": "2", "continue": token})
        ).json()
        assert page["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        names += [i["metadata"]["name"] for i in page["items"]]
        if any(i["metadata"]["name"] == "cm2" for i in page["items"]):
            assert next(i for i in page["items"] if i["metadata"]["name"] == "cm2")["data"] == {
                "v": "old"
            }
        token = page["metadata"].get("continue")
    assert names == ["cm0", "cm1", "cm2", "cm3", "cm4"]


async def test_expired_continue_token_is_http_410(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    for i in range(3):
        emu.state.create_configmap("ns", f"cm{i}")
    first = (await client.get("/api/v1/configmaps", params={"limit": "1"})).json()
    emu.state.create_configmap("ns", "cm3")
    emu.state.compact()
    response = await client.get(
        "/api/v1/configmaps", params={"limit": "1", "continue": first["metadata"]["continue"]}
    )
    assert response.status_code == 410
    status = response.json()
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
    rest = await client.get(
        "/api/v1/configmaps", params={"continue": status["metadata"]["continue"]}
    )
    assert [i["metadata"]["name"] for i in rest.json()["items"]] == ["cm1", "cm2", "cm3"]


async def test_exact_list_of_a_compacted_version_is_410(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a", data={"v": "1"})
    old = emu.state.resource_version
    emu.state.update_configmap("ns", "a", data={"v": "2"})
    params = {"resourceVersion": str(old), "resourceVersionMatch": "Exact"}
    exact = (await client.get("/api/v1/configmaps", params=params)).json()
    assert exact["metadata"]["resourceVersion"] == str(old)
    assert exact["items"][0]["data"] == {"v": "1"}
    emu.state.compact()
    gone = await client.get("/api/v1/configmaps", params=params)
    assert gone.status_code == 410 and gone.json()["reason"] == "Expired"


async def test_list_of_a_future_version_waits_then_504(
    io_clock: trio.testing.MockClock, emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    ahead = str(emu.state.resource_version + 1)
    start = trio.current_time()
    response = await client.get("/api/v1/configmaps", params={"resourceVersion": ahead})
    assert trio.current_time() - start == pytest.approx(3.0)
    assert response.status_code == 504
    assert response.headers["retry-after"] == "1"
    assert response.json()["reason"] == "Timeout"

    async def write_soon() -> None:
        await trio.sleep(1)
        emu.state.create_configmap("ns", "late")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_soon)
        start = trio.current_time()
        response = await client.get("/api/v1/configmaps", params={"resourceVersion": ahead})
    assert trio.current_time() - start == pytest.approx(1.0)
    assert response.status_code == 200
    assert response.json()["metadata"]["resourceVersion"] == ahead


async def test_selectors_over_http(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    emu.state.create_configmap("ns1", "a", {"outside-job-info": "true", "tier": "x"})
    emu.state.create_configmap("ns1", "b", {"outside-job-info": "false"})
    emu.state.create_configmap("ns2", "c", {"tier": "y"})

    async def listed(**params: str) -> list[str]:
        response = await client.get("/api/v1/configmaps", params=params)
        assert response.status_code == 200, response.text
        return [i["metadata"]["name"] for i in response.json()["items"]]

    assert await listed(labelSelector="outside-job-info=true") == ["a"]
    assert await listed(labelSelector="outside-job-info!=true") == ["b", "c"]
    assert await listed(labelSelector="tier in (x,y),!outside-job-info") == ["c"]
    assert await listed(labelSelector="tier") == ["a", "c"]
    assert await listed(fieldSelector="metadata.namespace=ns1") == ["a", "b"]
    assert await listed(fieldSelector="metadata.name!=a", labelSelector="tier") == ["c"]
    for params in ({"labelSelector": "tier in (x"}, {"fieldSelector": "data.k=v"}):
        response = await client.get("/api/v1/configmaps", params=params)
        assert response.status_code == 400
        assert response.json()["reason"] == "BadRequest"


# --------------------------------------------------------------------------- CRUD


async def test_crud_status_codes(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    base = "/api/v1/namespaces/ns/configmaps"
    body: Json = {"metadata": {"name": "a", "labels": {"app": "x"}}, "data": {"k": "v"}}
    created = await client.post(base, json=body)
    assert created.status_code == 201
    obj = created.json()
    assert obj["kind"] == "ConfigMap" and obj["metadata"]["namespace"] == "ns"
    assert obj["metadata"]["resourceVersion"] == str(emu.state.resource_version)
    again = await client.post(base, json=body)
    assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"

    got = await client.get(f"{base}/a")
    assert got.status_code == 200 and got.json()["data"] == {"k": "v"}

    replaced = await client.put(f"{base}/a", json={**body, "data": {"k": "w"}})
    assert replaced.status_code == 200
    assert int(replaced.json()["metadata"]["resourceVersion"]) > int(
        obj["metadata"]["resourceVersion"]
    )
    stale = {**body, "metadata": {**body["metadata"], **obj["metadata"]}}
    conflict = await client.put(f"{base}/a", json=stale)
    assert conflict.status_code == 409 and conflict.json()["reason"] == "Conflict"

    patched = await client.patch(
        f"{base}/a",
        json={"metadata": {"labels": {"app": None, "new": "1"}}, "data": {"k2": "v2"}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert patched.status_code == 200
    assert patched.json()["metadata"]["labels"] == {"new": "1"}
    assert patched.json()["data"] == {"k": "w", "k2": "v2"}

    deleted = await client.delete(f"{base}/a")
    assert deleted.status_code == 200
    assert deleted.json()["status"] == "Success"
    missing = await client.get(f"{base}/a")
    assert missing.status_code == 404
    status = missing.json()
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 404, "NotFound")
    assert (await client.delete(f"{base}/a")).status_code == 404
    assert (await client.put(f"{base}/a", json=body)).status_code == 404
    assert (await client.get("/api/v1/pods")).status_code == 404
    assert (await client.delete(base)).status_code == 405


async def test_bodies_nested_too_deeply_are_400_and_the_emulator_goes_on(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    base = "/api/v1/namespaces/ns/configmaps"
    emu.state.create_configmap("ns", "a")
    deep = '{"metadata":{"name":"b"},"x":' + "[" * 20_000 + "]" * 20_000 + "}"
    created = await client.post(base, content=deep)
    patch = '{"x":' * 5000 + "1" + "}" * 5000
    patched = await client.patch(
        f"{base}/a", content=patch, headers={"Content-Type": "application/merge-patch+json"}
    )
    token = base64.urlsafe_b64encode(b"[" * 20_000).decode()
    continued = await client.get(base, params={"limit": "1", "continue": token})
    for answer in (created, patched, continued):
        assert answer.status_code == 400
        assert answer.json()["kind"] == "Status"
    assert (await client.get(f"{base}/a")).status_code == 200


# -------------------------------------------------------------------------- WATCH


@pytest.mark.parametrize("resource_version", [None, "0"])
async def test_watch_without_version_starts_with_current_state(
    emu: KubeEmulator, client: httpx.AsyncClient, resource_version: str | None
) -> None:
    emu.state.create_configmap("ns", "a")
    emu.state.create_configmap("ns", "b")
    params = {} if resource_version is None else {"resourceVersion": resource_version}
    async with watch(client, "/api/v1/configmaps", **params) as w:
        initial = [await w.next(), await w.next()]
        assert kinds_and_names(initial) == [("ADDED", "a"), ("ADDED", "b")]
        assert initial[0]["object"]["kind"] == "ConfigMap"
        emu.state.update_configmap("ns", "a", data={"k": "v"})
        live = await w.next()
        assert kinds_and_names([live]) == [("MODIFIED", "a")]
        assert live["object"]["metadata"]["resourceVersion"] == str(emu.state.resource_version)


async def test_managed_fields_are_served_as_written_however_deep(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    deep = '[{"fieldsV1":' + '{"f:a":' * 5000 + "{}" + "}" * 5001 + "]"
    emu.state.create_configmap("ns", "a", managed_fields=RawJson(deep))
    emu.state.create_configmap("ns", "b", managed_fields=RawJson('[{"manager":"m"}]'))
    listed = await client.get("/api/v1/configmaps")
    assert listed.status_code == 200
    assert f'"managedFields":{deep}}}' in listed.text
    async with watch(client, "/api/v1/configmaps", resourceVersion="0") as w:
        assert f'"managedFields":{deep}}}' in await w.next_line()
        assert (await w.next())["object"]["metadata"]["managedFields"] == [{"manager": "m"}]
        # A write that sets nothing new is no write; new managedFields are one.
        created = emu.state.resource_version
        emu.state.update_configmap("ns", "b", managed_fields=RawJson('[{"manager":"m"}]'))
        emu.state.update_configmap("ns", "b", managed_fields=RawJson("[]"))
        changed = await w.next()
    assert changed["object"]["metadata"]["managedFields"] == []
    assert changed["object"]["metadata"]["resourceVersion"] == str(created + 1)


async def test_watch_from_a_version_streams_every_later_change(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "before")
    start = emu.state.resource_version
    emu.state.create_configmap("ns", "a")
    emu.state.update_configmap("ns", "a", data={"k": "v"})
    async with watch(client, "/api/v1/namespaces/ns/configmaps", resourceVersion=str(start)) as w:
        history = [await w.next(), await w.next()]
        emu.state.delete_configmap("ns", "a")
        deleted = await w.next()
    assert kinds_and_names([*history, deleted]) == [
        ("ADDED", "a"),
        ("MODIFIED", "a"),
        ("DELETED", "a"),
    ]
    assert deleted["object"]["metadata"]["resourceVersion"] == str(emu.state.resource_version)


async def test_watch_from_a_forgotten_version_gets_an_error_event(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a")
    old = emu.state.resource_version
    emu.state.update_configmap("ns", "a", data={"k": "v"})
    emu.state.compact()
    async with watch(client, "/api/v1/configmaps", resourceVersion=str(old - 1)) as w:
        events = await w.rest()
    assert len(events) == 1
    assert events[0]["type"] == "ERROR"
    status = events[0]["object"]
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")


async def test_label_changes_turn_into_added_and_deleted(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a", {"outside-job-info": "false"})
    rv = str(emu.state.resource_version)
    async with watch(
        client, "/api/v1/configmaps", resourceVersion=rv, labelSelector="outside-job-info=true"
    ) as w:
        emu.state.update_configmap("ns", "a", labels={"outside-job-info": "true"})
        added = await w.next()
        emu.state.update_configmap("ns", "a", labels={"outside-job-info": "false"})
        deleted = await w.next()
    assert kinds_and_names([added, deleted]) == [("ADDED", "a"), ("DELETED", "a")]
    assert deleted["object"]["metadata"]["labels"] == {"outside-job-info": "true"}
    assert emu.state.get("ns", "a").labels == {"outside-job-info": "false"}


async def test_watch_one_object_by_field_selector(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a")
    emu.state.create_configmap("other", "a")
    async with watch(
        client, "/api/v1/namespaces/ns/configmaps", fieldSelector="metadata.name=a"
    ) as w:
        assert kinds_and_names([await w.next()]) == [("ADDED", "a")]
        emu.state.create_configmap("ns", "b")
        emu.state.update_configmap("other", "a", data={"k": "other"})
        emu.state.update_configmap("ns", "a", data={"k": "mine"})
        event = await w.next()
    assert event["type"] == "MODIFIED"
    assert event["object"]["metadata"]["namespace"] == "ns"
    assert event["object"]["data"] == {"k": "mine"}


async def test_bookmarks_carry_only_the_version_and_cover_filtered_changes(
    io_clock: trio.testing.MockClock, emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    start = trio.current_time()
    async with watch(
        client,
        "/api/v1/configmaps",
        resourceVersion=str(emu.state.resource_version),
        labelSelector="app=mine",
        allowWatchBookmarks="true",
    ) as w:
        # Changes this watcher does not see still move its bookmark forward.
        emu.state.create_configmap("ns", "other", {"app": "theirs"})
        emu.state.update_configmap("ns", "other", data={"k": "v"})
        first = await w.next()
        at_first = trio.current_time() - start
        second = await w.next()
        at_second = trio.current_time() - start
    assert first == {
        "type": "BOOKMARK",
        "object": {
            "kind": "ConfigMap",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(emu.state.resource_version)},
        },
    }
    assert second["type"] == "BOOKMARK"
    assert at_first == pytest.approx(60.0, abs=0.01)
    assert at_second == pytest.approx(120.0, abs=0.01)


async def test_no_bookmarks_unless_asked(
    io_clock: trio.testing.MockClock, emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    async with watch(client, "/api/v1/configmaps", timeoutSeconds="600") as w:
        events = await w.rest()
    assert events == []


async def test_watch_times_out_cleanly_after_a_last_bookmark(
    io_clock: trio.testing.MockClock, emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    start = trio.current_time()
    seen: list[tuple[str, float]] = []
    async with watch(
        client, "/api/v1/configmaps", timeoutSeconds="10", allowWatchBookmarks="true"
    ) as w:
        async for line in w.response.aiter_lines():
            seen.append((json.loads(line)["type"], trio.current_time() - start))
    ended = trio.current_time() - start
    assert [kind for kind, _ in seen] == ["BOOKMARK"]
    assert seen[0][1] == pytest.approx(10.0 - BOOKMARK_BEFORE_TIMEOUT, abs=0.01)
    assert ended == pytest.approx(10.0, abs=0.01)
    # The stream ended with a proper last chunk: the connection is reused.
    assert (await client.get("/api/v1/configmaps")).status_code == 200
    assert emu.stats.connections == 1


async def test_server_default_watch_timeout(io_clock: trio.testing.MockClock) -> None:
    async with (
        open_emulator(default_watch_timeout=300.0, bookmark_interval=60.0) as emu,
        httpx.AsyncClient(base_url=emu.url, timeout=None) as client,
    ):
        start = trio.current_time()
        times: list[float] = []
        async with watch(client, "/api/v1/configmaps", allowWatchBookmarks="1") as w:
            async for _ in w.response.aiter_lines():
                times.append(round(trio.current_time() - start, 2))
        assert times == [60.0, 120.0, 180.0, 240.0, 298.0]
        assert trio.current_time() - start == pytest.approx(300.0, abs=0.01)


async def test_invalid_watch_parameters(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    bad_bool = await client.get("/api/v1/configmaps", params={"watch": "yes"})
    assert bad_bool.status_code == 400
    initial_events = await client.get(
        "/api/v1/configmaps", params={"watch": "1", "sendInitialEvents": "true"}
    )
    assert initial_events.status_code == 422
    bad_rv = await client.get("/api/v1/configmaps", params={"watch": "1", "resourceVersion": "x"})
    assert bad_rv.status_code == 400


async def test_hang_up_ends_the_watch_without_waiting_for_a_send(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(5):
        async with watch(client, "/api/v1/configmaps"):
            await emu.wait_open_watches(1)
        await emu.wait_open_watches(0)
    assert emu.stats.watch_requests == 1


# -------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    ("status", "reason"),
    [(500, "InternalError"), (410, "Expired"), (401, "Unauthorized"), (503, "ServiceUnavailable")],
)
async def test_http_error_fault_hits_the_next_list_once(
    emu: KubeEmulator, client: httpx.AsyncClient, status: int, reason: str
) -> None:
    emu.faults.push(HttpError(status))
    failed = await client.get("/api/v1/configmaps")
    assert failed.status_code == status
    assert (failed.json()["code"], failed.json()["reason"]) == (status, reason)
    assert (await client.get("/api/v1/configmaps")).status_code == 200
    assert len(emu.faults) == 0 and emu.stats.faults_applied == 1


async def test_429_carries_retry_after(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    emu.faults.push(HttpError(429, retry_after=7))
    response = await client.get("/api/v1/configmaps", params={"watch": "true"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert response.json()["details"]["retryAfterSeconds"] == 7


async def test_faults_wait_for_the_request_kind_they_target(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.faults.push(HttpError(500, target="watch"))
    assert (await client.get("/api/v1/configmaps")).status_code == 200
    assert len(emu.faults) == 1
    watched = await client.get("/api/v1/configmaps", params={"watch": "1"})
    assert watched.status_code == 500
    assert len(emu.faults) == 0


async def test_drop_after_events(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    emu.state.create_configmap("ns", "a")
    emu.state.create_configmap("ns", "b")
    emu.faults.push(Drop(after_events=1))
    async with watch(client, "/api/v1/configmaps") as w:
        assert kinds_and_names([await w.next()]) == [("ADDED", "a")]
        with pytest.raises(httpx.RemoteProtocolError):
            await w.next()
    # The next watch is not affected.
    async with watch(client, "/api/v1/configmaps") as w:
        assert kinds_and_names([await w.next(), await w.next()]) == [
            ("ADDED", "a"),
            ("ADDED", "b"),
        ]


async def test_drop_in_the_middle_of_a_line(emu: KubeEmulator) -> None:
    emu.state.create_configmap("ns", "a")
    emu.state.create_configmap("ns", "b")
    emu.faults.push(Drop(after_events=1, mid_line=True))
    chunks, clean = await raw_get(emu, "/api/v1/configmaps?watch=1")
    assert not clean
    body = b"".join(chunks)
    first, _, partial = body.partition(b"\n")
    assert json.loads(first)["object"]["metadata"]["name"] == "a"
    assert partial and not partial.endswith(b"\n")
    with pytest.raises(ValueError):
        json.loads(partial)
    assert partial.startswith(b'{"type":"ADDED"')


async def test_drop_in_the_middle_of_a_list_body(emu: KubeEmulator) -> None:
    emu.state.create_configmap("ns", "a")
    emu.faults.push(Drop(target="list"))
    chunks, clean = await raw_get(emu, "/api/v1/configmaps")
    assert not clean
    assert chunks and b'"ConfigMapList"' in b"".join(chunks)


async def test_stalled_list_body(
    io_clock: trio.testing.MockClock, emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a")
    emu.faults.push(Stall(target="list"))
    async with client.stream("GET", "/api/v1/configmaps") as response:
        assert response.status_code == 200
        with trio.move_on_after(600) as silence:
            await response.aread()
        assert silence.cancelled_caught
    # The client hung up; the stalled connection notices and goes away.
    with trio.fail_after(3600):  # virtual time: a hang jumps here and fails
        await emu.wait_for(lambda: emu.stats.open_connections == 0)


async def test_split_lines_straddle_chunks(
    io_clock: trio.testing.MockClock, emu: KubeEmulator
) -> None:
    emu.state.create_configmap("ns", "a")
    emu.faults.push(SplitLines())
    chunks, clean = await raw_get(emu, "/api/v1/configmaps?watch=1&timeoutSeconds=5")
    assert clean
    assert len(chunks) == 2
    assert not chunks[0].endswith(b"\n") and chunks[1].endswith(b"\n")
    assert json.loads(chunks[0] + chunks[1])["type"] == "ADDED"


async def test_stall_keeps_the_connection_silent(
    io_clock: trio.testing.MockClock, emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a")
    emu.faults.push(Stall(after_events=1))
    async with watch(client, "/api/v1/configmaps", allowWatchBookmarks="true") as w:
        assert kinds_and_names([await w.next()]) == [("ADDED", "a")]
        emu.state.create_configmap("ns", "b")
        with trio.move_on_after(600) as silence:
            await w.next_line()
        assert silence.cancelled_caught
        assert emu.stats.open_watches == 1
    with trio.fail_after(3600):
        await emu.wait_open_watches(0)


async def test_expire_mid_watch(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    emu.state.create_configmap("ns", "a")
    emu.state.create_configmap("ns", "b")
    emu.faults.push(ExpireWatch(after_events=1))
    async with watch(client, "/api/v1/configmaps") as w:
        events = await w.rest()
    assert [e["type"] for e in events] == ["ADDED", "ERROR"]
    assert (events[1]["object"]["code"], events[1]["object"]["reason"]) == (410, "Expired")


async def test_malformed_line_then_normal_events(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a")
    emu.state.create_configmap("ns", "b")
    emu.faults.push(MalformedLine(after_events=1))
    async with watch(client, "/api/v1/configmaps") as w:
        assert (await w.next())["object"]["metadata"]["name"] == "a"
        with pytest.raises(ValueError):
            json.loads(await w.next_line())
        assert (await w.next())["object"]["metadata"]["name"] == "b"


def test_stream_faults_cannot_target_lists() -> None:
    with pytest.raises(ValueError):
        FaultQueue().push(ExpireWatch(target="list"))
    with pytest.raises(ValueError):
        FaultQueue().push(MalformedLine(target="list"))


# ------------------------------------------------------------------------- restart


async def test_restart_ends_watches_and_loses_history(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.state.create_configmap("ns", "a")
    before = emu.state.resource_version
    async with watch(client, "/api/v1/configmaps", resourceVersion=str(before)) as w:
        await emu.wait_open_watches(1)
        emu.state.create_configmap("ns", "b")
        assert kinds_and_names([await w.next()]) == [("ADDED", "b")]
        connections = emu.stats.connections
        emu.restart()
        assert await w.rest() == []
    await emu.wait_open_watches(0)
    # The restarted server closed the old connection after ending the watch.
    assert (await client.get("/api/v1/configmaps")).status_code == 200
    assert emu.stats.connections == connections + 1
    async with watch(client, "/api/v1/configmaps", resourceVersion=str(before)) as w:
        events = await w.rest()
    assert [(e["type"], e["object"]["code"]) for e in events] == [("ERROR", 410)]
    # Resuming from the newest version is fine after the restart.
    async with watch(
        client, "/api/v1/configmaps", resourceVersion=str(emu.state.resource_version)
    ) as w:
        emu.state.create_configmap("ns", "c")
        assert kinds_and_names([await w.next()]) == [("ADDED", "c")]


async def test_restart_closes_idle_connections(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    assert (await client.get("/api/v1/configmaps")).status_code == 200
    assert emu.stats.open_connections == 1
    emu.restart()
    with trio.fail_after(5):
        await emu.wait_for(lambda: emu.stats.open_connections == 0)
    assert (await client.get("/api/v1/configmaps")).status_code == 200
    assert emu.stats.connections == 2


async def test_a_request_arriving_as_the_server_restarts_is_dropped_and_takes_no_fault(
    emu: KubeEmulator,
) -> None:
    # A memory stream, so the request is delivered and the restart made before
    # the connection's task has run: the order a socket leaves to chance.
    client, server_end = trio.testing.memory_stream_pair()
    emu.faults.push(ExpireWatch())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(emu._serve_connection, server_end)
        await trio.testing.wait_all_tasks_blocked()  # waiting for a request: idle
        request = b"GET /api/v1/configmaps?watch=1 HTTP/1.1\r\nHost: api\r\n"
        await client.send_all(request + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
        emu.restart(lose_history=False)
        with trio.fail_after(5):
            assert await client.receive_some() == b""  # closed unanswered
    assert emu.stats.faults_applied == 0
    assert emu.faults.take("watch") == ExpireWatch()  # still there for the next watch


async def test_restart_can_drop_connections(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    async with watch(client, "/api/v1/configmaps") as w:
        await emu.wait_open_watches(1)
        emu.restart(drop_connections=True)
        with pytest.raises(httpx.RemoteProtocolError):
            await w.next_line()


async def test_restart_releases_a_stalled_watch(
    emu: KubeEmulator, client: httpx.AsyncClient
) -> None:
    emu.faults.push(Stall())
    async with watch(client, "/api/v1/configmaps") as w:
        await emu.wait_open_watches(1)
        emu.restart()
        assert await w.rest() == []


# ------------------------------------------------------------------- auth and TLS


async def test_bearer_token_and_rotation(io_clock: trio.testing.MockClock) -> None:
    async with open_emulator(token="first") as emu:

        def client_with(token: str | None) -> httpx.AsyncClient:
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            return httpx.AsyncClient(base_url=emu.url, headers=headers, timeout=None)

        async with client_with(None) as anonymous, client_with("wrong") as wrong:
            for http in (anonymous, wrong):
                response = await http.get("/api/v1/configmaps")
                assert response.status_code == 401
                assert (response.json()["kind"], response.json()["reason"]) == (
                    "Status",
                    "Unauthorized",
                )
        assert emu.stats.unauthorized == 2
        async with client_with("first") as old, client_with("second") as new:
            assert (await old.get("/api/v1/configmaps")).status_code == 200
            async with watch(old, "/api/v1/configmaps") as w:
                emu.set_token("second")
                assert (await old.get("/api/v1/configmaps")).status_code == 401
                assert (await new.get("/api/v1/configmaps")).status_code == 200
                # A watch opened with the old token keeps streaming.
                emu.state.create_configmap("ns", "a")
                assert kinds_and_names([await w.next()]) == [("ADDED", "a")]
            emu.set_token("third", also_accept=["second"])
            assert (await new.get("/api/v1/configmaps")).status_code == 200
        assert emu.requests[-1].authorization == "Bearer second"


async def test_https(ca: trustme.CA) -> None:
    async with open_emulator(ssl_context=server_context(ca, client_certs=False)) as emu:
        assert emu.url.startswith("https://127.0.0.1:")
        emu.state.create_configmap("ns", "a")
        verify = client_context(ca, with_cert=False)
        async with httpx.AsyncClient(base_url=emu.url, verify=verify, timeout=5) as client:
            response = await client.get("/api/v1/configmaps")
            assert [i["metadata"]["name"] for i in response.json()["items"]] == ["a"]
            async with watch(client, "/api/v1/configmaps") as w:
                assert (await w.next())["type"] == "ADDED"
        untrusted = ssl.create_default_context()
        async with httpx.AsyncClient(base_url=emu.url, verify=untrusted, timeout=5) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get("/api/v1/configmaps")


async def test_client_certificate_required(ca: trustme.CA) -> None:
    async with open_emulator(ssl_context=server_context(ca, client_certs=True)) as emu:
        with_cert = client_context(ca, with_cert=True)
        async with httpx.AsyncClient(base_url=emu.url, verify=with_cert, timeout=5) as client:
            assert (await client.get("/api/v1/configmaps")).status_code == 200
        without = client_context(ca, with_cert=False)
        async with httpx.AsyncClient(base_url=emu.url, verify=without, timeout=5) as client:
            with pytest.raises(httpx.TransportError):
                await client.get("/api/v1/configmaps")
        with trio.fail_after(5):
            await emu.wait_for(lambda: emu.stats.tls_handshake_failures == 1)


# ---------------------------------------------------------------- entry and counters


async def test_run_emulator_with_nursery_start() -> None:
    async with trio.open_nursery() as nursery:
        emu: KubeEmulator = await nursery.start(functools.partial(run_emulator, token="t"))
        async with httpx.AsyncClient(
            base_url=emu.url, headers={"Authorization": "Bearer t"}, timeout=5
        ) as client:
            assert (await client.get("/version")).status_code == 200
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "example.com"])
async def test_only_loopback_binds(host: str) -> None:
    with pytest.raises(ValueError):
        async with open_emulator(host=host):
            pass


async def test_exceptions_from_the_block_are_not_wrapped() -> None:
    with pytest.raises(KeyError):
        async with open_emulator():
            raise KeyError("mine")


async def test_requests_are_recorded(emu: KubeEmulator, client: httpx.AsyncClient) -> None:
    await client.get("/api/v1/namespaces/ns/configmaps", params={"labelSelector": "a=b"})
    async with watch(client, "/api/v1/configmaps", resourceVersion="1"):
        await emu.wait_open_watches(1)
    await emu.wait_requests(2)
    listed, watched = list(emu.requests)
    assert (listed.kind, listed.path, listed.query) == (
        "list",
        "/api/v1/namespaces/ns/configmaps",
        {"labelSelector": "a=b"},
    )
    assert watched.kind == "watch" and watched.query["resourceVersion"] == "1"
    assert (emu.stats.requests, emu.stats.list_requests, emu.stats.watch_requests) == (2, 1, 1)
