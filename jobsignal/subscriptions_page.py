"""Who is subscribed, rendered: the terminal table and the metrics port's HTML page.

Both render one page of `/debug/subscriptions` as JSON gives it
(`rpc.subscriptions.SubscriptionPage.as_json`), through the same `cells`,
so `jobsignal clients` and the page show the same columns. Pure: the
command line imports it without the server.

The page is one self-contained document: inline style and script, allowed
by their hashes in its Content-Security-Policy and nothing else (no other
origin, no inline event handlers, no frames). Every value from a client or
a ConfigMap is escaped. Its script fetches the same URL every
`REFRESH_SECONDS` and swaps the table in place; without scripts the page
still shows the rows as they were when it loaded.
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Mapping
from typing import Any

from jobsignal.util.text import cell, human_age, human_bytes

REFRESH_SECONDS = 5

HEADERS = (
    "ID",
    "ROLE",
    "RPC",
    "PEER",
    "CONNECTED",
    "SENT",
    "QUEUED",
    "LAST JOB",
    "LAST SENT",
)
# Columns of numbers (right-aligned on the page) and of identifiers (monospace).
_NUMBERS = frozenset({"SENT", "QUEUED"})
_CODES = frozenset({"ID", "PEER", "LAST JOB"})
RPC_PREFIX = "SubscribeJobSummary"


def _text(value: object) -> str:
    return cell(value) if isinstance(value, str) else "<unknown>"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _age(value: object) -> str:
    seconds = _number(value)
    return "<unknown>" if seconds is None else human_age(seconds)


def _last_job(last: object) -> tuple[str, str]:
    """LAST JOB and LAST SENT of a row's `lastMessage`."""
    if last is None:
        return "<none>", "<none>"
    if not isinstance(last, Mapping):
        return "<unknown>", "<unknown>"
    namespace, job_id = last.get("namespace"), last.get("jobId")
    if namespace is None and job_id is None:
        job = "<snapshot>"  # a List snapshot batch: several jobs
    else:
        job = f"{_text(namespace)}/{_text(job_id)}"
    return job, _age(last.get("ageSeconds"))


def cells(item: Mapping[str, Any]) -> list[str]:
    """One row of the table, in the order of HEADERS, from one JSON item. Any
    field missing or of the wrong type shows as <unknown>: the server may be
    another version."""
    rpc = _text(item.get("rpc"))
    sent, queued = _number(item.get("messagesSent")), _number(item.get("bytesQueued"))
    job, sent_age = _last_job(item.get("lastMessage"))
    return [
        _text(item.get("id")),
        _text(item.get("role")),
        rpc.removeprefix(RPC_PREFIX) or rpc,  # Signal, SignalList
        _text(item.get("peer")),
        _age(item.get("connectedSeconds")),
        "<unknown>" if sent is None else str(int(sent)),
        "<unknown>" if queued is None else human_bytes(int(queued)),
        job,
        sent_age,
    ]


# -- the HTML page -----------------------------------------------------------------------

_STYLE = """
:root { color-scheme: light; font-family: system-ui, -apple-system, "Segoe UI", sans-serif; }
body { margin: 1.5rem 2rem; color: #1f2328; background: #ffffff; }
h1 { font-size: 1.35rem; margin: 0 0 0.25rem; }
p { margin: 0 0 1rem; color: #59636e; }
table { border-collapse: collapse; font-size: 0.9rem; }
th, td { padding: 0.4rem 0.8rem; text-align: left; white-space: nowrap; }
th { font-size: 0.75rem; letter-spacing: 0.04em; color: #59636e; background: #eef1f4; }
td { border-bottom: 1px solid #d1d9e0; }
tbody tr:nth-child(even) { background: #f6f8fa; }
.number { text-align: right; font-variant-numeric: tabular-nums; }
td.code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 0.85rem; }
td.empty { color: #59636e; font-style: italic; }
nav { margin-top: 1rem; }
nav a { margin-right: 1.5rem; color: #0969da; }
#status { color: #d1242f; min-height: 1.2rem; }
"""

_SCRIPT = """
"use strict";
const every = 1000 * Number(document.body.dataset.every);
let refreshes = 0;
async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch(location.href, { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
    const view = fresh.getElementById("view");
    if (view === null) throw new Error("not a subscriptions page");
    document.getElementById("view").replaceWith(view);
    document.title = fresh.title;
    status.textContent = "";
    document.body.dataset.refreshes = String(++refreshes);
  } catch (error) {
    status.textContent = "Could not update (" + error.message + "); trying again.";
  }
  setTimeout(refresh, every);
}
setTimeout(refresh, every);
"""


def _source_hash(source: str) -> str:
    digest = hashlib.sha256(source.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; style-src {_source_hash(_STYLE)}; script-src {_source_hash(_SCRIPT)};"
    " connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HTML_HEADERS = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-store"),
)


def _row(item: Mapping[str, Any]) -> str:
    tds = []
    for header, value in zip(HEADERS, cells(item), strict=True):
        kind = "number" if header in _NUMBERS else "code" if header in _CODES else ""
        attributes = f' class="{kind}"' if kind else ""
        if header == "CONNECTED":
            since = item.get("connectedAt")
            if isinstance(since, str):
                attributes += f' title="since {html.escape(since)}"'
        tds.append(f"<td{attributes}>{html.escape(value)}</td>")
    return "<tr>" + "".join(tds) + "</tr>"


def _count(total: int, shown: int) -> str:
    noun = "subscription" if total == 1 else "subscriptions"
    return f"{total} live {noun}" + ("" if shown == total else f", {shown} on this page")


def render_html(page: Mapping[str, Any], *, first_page: bool = True, version: str = "") -> bytes:
    """The HTML of `page` (a SubscriptionPage's JSON), with links to the first page
    (unless it is `first_page`) and to the next one (if any)."""
    items = page["items"]
    total, limit, token = page["total"], page["limit"], page["continue"]
    rows = "\n".join(_row(item) for item in items)
    if not items:
        rows = f'<tr><td class="empty" colspan="{len(HEADERS)}">No live subscriptions.</td></tr>'
    links = []
    if not first_page:
        links.append(f'<a href="?limit={limit}">First page</a>')
    if token is not None:
        links.append(f'<a href="?limit={limit}&amp;continue={html.escape(token)}">Next page</a>')
    header = "".join(
        f'<th class="number">{name}</th>' if name in _NUMBERS else f"<th>{name}</th>"
        for name in HEADERS
    )
    title = f"jobsignal: {total} subscribed"
    made_by = f"jobsignal {html.escape(version)} · " if version else ""
    document = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{_STYLE}</style>
</head>
<body data-every="{REFRESH_SECONDS}" data-refreshes="0">
<main id="view">
<h1>Who is subscribed</h1>
<p>{_count(total, len(items))} · {made_by}as of {html.escape(page["time"])}\
 · updates every {REFRESH_SECONDS} s</p>
<table>
<thead><tr>{header}</tr></thead>
<tbody>
{rows}
</tbody>
</table>
<nav>{" ".join(links)}</nav>
</main>
<p id="status" role="status"></p>
<script>{_SCRIPT}</script>
</body>
</html>
"""
    return document.encode()
