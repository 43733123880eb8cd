"""`jobsignal clients`: who is subscribed to a server, from its metrics port.

Reads `/debug/subscriptions` over plain HTTP from the metrics address (an
operator's view: the gRPC port never serves it), following the `continue`
token page by page, and prints one table like `kubectl get`, rendered by
`subscriptions_page.cells` as the page is. Imported by `jobsignal.cli` only
when the command runs; it loads no gRPC client.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import httpx
import trio

from jobsignal.config import ConfigError, parse_listen
from jobsignal.subscriptions_page import HEADERS, cells
from jobsignal.terminal import emit, run, tell
from jobsignal.util.text import clip, columns

PATH = "/debug/subscriptions"
METRICS_HINT = "--target is the server's --metrics-listen address, not its gRPC one"
# An answer larger than any page the server writes (500 rows of under 700 bytes).
MAX_PAGE_BYTES = 4 << 20


class AskFailed(Exception):
    """The server could not be asked, or its answer was not a page of subscriptions."""


def _base_url(target: str) -> str:
    try:
        host, port = parse_listen(target)
    except ValueError as error:
        raise ConfigError(f"--target={target!r}: {error}") from None
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _page(client: httpx.AsyncClient, url: str, params: dict[str, str]) -> dict[str, Any]:
    try:
        async with client.stream("GET", url, params=params) as response:
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_PAGE_BYTES:
                    raise AskFailed(f"{url}: answer larger than {MAX_PAGE_BYTES} bytes")
    except httpx.RemoteProtocolError as error:
        raise AskFailed(f"{url} does not answer HTTP/1.1 ({error}): {METRICS_HINT}") from None
    except httpx.HTTPError as error:
        raise AskFailed(f"cannot ask {url}: {error or type(error).__name__}") from None
    if response.status_code != 200:
        text = clip(body.decode("utf-8", "replace").strip(), 200)
        hint = f" ({METRICS_HINT})" if response.status_code == 404 else ""
        raise AskFailed(f"{url} answered {response.status_code}{hint}: {text}")
    try:
        page = json.loads(body)
    except ValueError:
        raise AskFailed(f"{url} answered something other than JSON") from None
    if not (isinstance(page, dict) and isinstance(page.get("items"), list)):
        raise AskFailed(f"{url} answered JSON that is not a page of subscriptions")
    return page


async def fetch_subscriptions(base_url: str, chunk_size: int) -> list[Mapping[str, Any]]:
    """Every live subscription, following the pages of `/debug/subscriptions`."""
    url = base_url + PATH
    items: list[Mapping[str, Any]] = []
    seen_tokens: set[str] = set()
    params = {"limit": str(chunk_size)}
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        while True:
            page = await _page(client, url, params)
            items += [item for item in page["items"] if isinstance(item, Mapping)]
            token = page.get("continue")
            if token is None:
                return items
            if not isinstance(token, str) or token in seen_tokens:
                raise AskFailed(f"{url}: the pages do not end (continue {clip(str(token), 40)})")
            seen_tokens.add(token)
            params = {"limit": str(chunk_size), "continue": token}


def clients_table(items: list[Mapping[str, Any]], headers: bool = True) -> str:
    rows = [list(HEADERS)] if headers else []
    rows += [cells(item) for item in items]
    return columns(rows)


async def print_clients(base_url: str, args: argparse.Namespace) -> int:
    try:
        with trio.fail_after(args.timeout):
            items = await fetch_subscriptions(base_url, args.chunk_size)
    except trio.TooSlowError:
        raise AskFailed(f"no complete list from {base_url} within {args.timeout:g}s") from None
    if not items:
        tell("No subscriptions.")
        return 0
    emit(clients_table(items, headers=not args.no_headers))
    return 0


def run_clients_command(args: argparse.Namespace) -> int:
    """`jobsignal clients`; its exit status (1 when the server cannot be asked)."""
    try:
        status: int = run(print_clients, _base_url(args.target), args)
    except AskFailed as error:
        tell(f"jobsignal clients: {error}")
        return 1
    return status
