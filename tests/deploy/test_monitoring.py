"""The alerts (components/prometheus-operator/prometheusrule.yaml) and the Grafana
dashboard (deploy/grafana/jobsignal.json) against what jobsignal really exports.

The exported series come from a real server: the embedded demo cluster served
on 127.0.0.1 with metrics on, scraped once (`/metrics`, parsed by
prometheus_client's own parser). Every expression of every alert, dashboard
panel and dashboard variable names at least one of jobsignal's series and no
series it does not export; its label matchers may use only the labels those series carry
where the scrape shows them, or the target labels Prometheus adds; the reasons
it matches on the two by-reason counters are the server's own (its EndReason
values and connection-close reasons). So a renamed or removed metric, label
or reason fails here, not silently in someone's Prometheus. The rules also
cover what deploy/README.md promises, and the dashboard is laid out and
filtered as Grafana needs.
"""

from __future__ import annotations

import copy
import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import jobsignal
from jobsignal.fanout.subscriber import EndReason
from jobsignal.rpc import connections, guard
from tests.support.manifests import DEPLOY, MANIFESTS, Obj, _validate_monitoring
from tests.support.promql import Selector, metric_names, parse

DASHBOARD = DEPLOY / "grafana" / "jobsignal.json"

# Labels Prometheus puts on every series of a target (ServiceMonitor: namespace,
# pod, service, container, endpoint; every scrape: job, instance).
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
)
# What a server closes connections for (rpc/connections.py, rpc/guard.py).
CLOSE_REASONS = frozenset(
    {
        connections.TOO_MANY_PINGS,
        connections.HANDSHAKE_TIMEOUT,
        connections.WRITE_STALLED,
        connections.KEEPALIVE_TIMEOUT,
        connections.PROTOCOL_ERROR,
        connections.INTERNAL_ERROR,
        connections.MAX_AGE,
        guard.RAPID_RESET,
        guard.CONTROL_FLOOD,
    }
)
REASONS = {
    "jobsignal_stream_ends_total": frozenset(reason.value for reason in EndReason),
    "jobsignal_connections_closed_by_server_total": CLOSE_REASONS,
}
# What deploy/README.md ("Alerts") promises, and how urgent each is.
ALERTS = {
    "JobsignalNotReady": "critical",
    "JobsignalWatchFailing": "warning",
    "JobsignalSubscriptionsRefused": "warning",
    "JobsignalConnectionsRefused": "warning",
    "JobsignalSlowClientsEnded": "warning",
    "JobsignalConnectionsClosedByServer": "warning",
    "JobsignalConnectionsClosedOnInternalError": "warning",
}


@dataclass(frozen=True)
class Exported:
    """The series names a server exports, with the labels its samples show
    (None: no sample in the scrape, so its labels are unknown)."""

    labels: dict[str, frozenset[str] | None]


def _series_of(family: Any) -> Iterator[str]:
    """The series names of a family, with or without samples in this scrape."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
    }.get(family.type, ("",))
    for suffix in suffixes:
        yield family.name + suffix


async def _scrape() -> str:
    config = jobsignal.configure(
        listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", source="demo", drain_delay=0
    )
    async with trio.open_nursery() as nursery:
        server = await nursery.start(jobsignal.serve, config)
        with trio.fail_after(30):
            await server.ready.wait()
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"

        def get() -> str:
            with urllib.request.urlopen(url, timeout=10) as response:
                return str(response.read().decode())

        text = await trio.to_thread.run_sync(get)
        server.request_shutdown()
    return text


@cache
def exported() -> Exported:
    """What a real demo server exports (scraped once per test run)."""
    labels: dict[str, frozenset[str] | None] = {}
    for family in text_string_to_metric_families(trio.run(_scrape)):
        for name in _series_of(family):
            labels.setdefault(name, None)
        for sample in family.samples:
            known = labels.get(sample.name) or frozenset()
            labels[sample.name] = known | frozenset(sample.labels)
    return Exported(labels)


def _rules() -> list[Obj]:
    found = [
        rule
        for manifest in MANIFESTS
        if manifest.kind == "PrometheusRule"
        for group in manifest.body["spec"]["groups"]
        for rule in group["rules"]
    ]
    assert found, "no PrometheusRule under deploy/kubernetes"
    return found


def _dashboard() -> Obj:
    dashboard: Obj = json.loads(DASHBOARD.read_text())
    return dashboard


def _panels(dashboard: Obj) -> list[Obj]:
    """Every panel, those inside collapsed rows included."""
    panels: list[Obj] = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels += panel.get("panels", [])
    return panels


# label_values(<selector>, <label>): Grafana's variable query, not PromQL itself.
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def _variable_query(variable: Obj) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def _expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every alert, panel target and dashboard variable."""
    found = [(f"alert {rule['alert']}", str(rule["expr"])) for rule in _rules()]
    dashboard = _dashboard()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.match(_variable_query(variable))
            assert match, f"variable {variable['name']}: not a label_values query"
            found.append((f"variable {variable['name']}", match.group("selector")))
    return found


def _check_expression(where: str, expr: str, series: Exported) -> None:
    parsed = parse(expr)
    names = {selector.metric for selector in parsed.selectors}
    own = {name for name in names if name.startswith(("jobsignal_", "process_"))}
    assert own, f"{where}: {expr!r} names none of jobsignal's series"
    unknown = sorted(names - series.labels.keys())
    assert not unknown, f"{where}: {unknown} are not exported by jobsignal ({expr!r})"
    seen_labels = set(TARGET_LABELS) | {"le"}
    for selector in parsed.selectors:
        labels = series.labels.get(selector.metric)
        seen_labels |= labels or set()
        if labels is None:
            continue  # no sample in the scrape: its labels are unknown here
        stray = {label for label, _, _ in selector.matchers} - labels - TARGET_LABELS
        assert not stray, f"{where}: {selector.metric} has no label {sorted(stray)}"
    if all(series.labels.get(s.metric) is not None for s in parsed.selectors):
        stray = parsed.grouping_labels - seen_labels
        assert not stray, f"{where}: groups by {sorted(stray)}, which no series carries"
    for selector in parsed.selectors:
        _check_reasons(where, selector)


def _matched_values(op: str, value: str) -> set[str]:
    """The values a matcher names: one, or the alternatives of a plain regex."""
    if op in ("=~", "!~"):
        assert re.fullmatch(r"[\w|]+", value), f"only plain alternatives, not {value!r}"
        return set(value.split("|"))
    return {value}


def _check_reasons(where: str, selector: Selector) -> None:
    known = REASONS.get(selector.metric)
    for label, op, value in selector.matchers:
        if known is not None and label == "reason":
            stray = _matched_values(op, value) - known
            assert not stray, f"{where}: {selector.metric} has no reason {sorted(stray)}"


def test_the_scrape_lists_every_family_sampled_or_not() -> None:
    """The list the checks use is the server's whole: counters without a sample
    yet (no stream has ended) are in it, under the names Prometheus stores."""
    series = exported().labels
    assert series["jobsignal_stream_ends_total"] is None  # no stream ended in the demo
    assert series["jobsignal_kube_requests_total"] == frozenset({"verb"})
    assert {"jobsignal_delivery_latency_seconds_bucket", "process_cpu_seconds_total"} <= set(series)
    assert "jobsignal_stream_ends" not in series and "up" not in series


@pytest.mark.parametrize(("where", "expr"), _expressions(), ids=lambda value: str(value)[:60])
def test_every_expression_names_what_the_server_exports(where: str, expr: str) -> None:
    _check_expression(where, expr, exported())


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("rate(jobsignal_stream_end_total[5m])", "not exported"),
        ('jobsignal_kube_requests_total{method="list"}', "no label"),
        ('increase(jobsignal_stream_ends_total{reason="too_slow"}[5m])', "no reason"),
        (
            'jobsignal_connections_closed_by_server_total{reason=~"rapid_reset|flood"}',
            "no reason",
        ),
        ("sum by (tenant) (jobsignal_kube_requests_total)", "groups by"),
        ("up == 0", "names none"),
        ("jobsignal_jobs > 0 and on (pod) up == 1", "not exported"),
    ],
)
def test_the_expression_check_catches_what_it_is_for(expr: str, error: str) -> None:
    """Not vacuous: a misspelt metric, label or reason, a grouping by a label no
    series has, and a series the server does not export (Prometheus' own `up`)
    are all refused."""
    with pytest.raises(AssertionError, match=error):
        _check_expression("alert Test", expr, exported())


def test_promql_reading() -> None:
    parsed = parse(
        "sum by (namespace, pod) (increase(jobsignal_stream_ends_total"
        '{reason="refused", pod=~"$pod"}[10m])) > 5 and on (pod) up offset 5m'
    )
    assert parsed.selectors == [
        Selector(
            "jobsignal_stream_ends_total", (("reason", "=", "refused"), ("pod", "=~", "$pod"))
        ),
        Selector("up"),
    ]
    assert parsed.grouping_labels == {"namespace", "pod"}
    assert metric_names(
        "histogram_quantile(0.99, sum(rate(x_bucket[$__rate_interval])) by (le))"
        " / time() - y > bool 0"
    ) == {"x_bucket", "y"}
    with pytest.raises(ValueError, match="cannot read"):
        parse("x @ 5")


def test_the_alerts_are_those_promised() -> None:
    rules = {rule["alert"]: rule for rule in _rules()}
    assert {name: rule["labels"]["severity"] for name, rule in rules.items()} == ALERTS
    for name, rule in rules.items():
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description"}, name
        # Each templated label survives the expression's aggregation.
        grouping = parse(rule["expr"]).grouping_labels
        kept = grouping if grouping else TARGET_LABELS
        for text in annotations.values():
            used = set(re.findall(r"\$labels\.(\w+)", text))
            assert used <= kept, f"{name}: {sorted(used - kept)} are aggregated away"
    # Readiness waits as long as the startup probe does; the rest alert on a trend.
    assert rules["JobsignalNotReady"]["for"] == "15m"
    by_reason = parse(rules["JobsignalConnectionsClosedByServer"]["expr"])
    assert "reason" in by_reason.grouping_labels
    (selector,) = by_reason.selectors
    ((_, op, value),) = selector.matchers
    # Every reason but the ordinary ones (a vanished client, a connection's maximum
    # age) and the one alerted on apart.
    ordinary = {"keepalive_timeout", "max_age", "internal_error"}
    assert _matched_values(op, value) == CLOSE_REASONS - ordinary


def test_the_rule_schema_is_strict() -> None:
    (rule,) = [m for m in MANIFESTS if m.kind == "PrometheusRule"]
    _validate_monitoring(rule.body, "as written")
    breakings: list[tuple[tuple[str | int, ...], str, object]] = [
        (("spec", "groups", 0, "rules", 0), "exprs", "up"),  # misspelt
        (("spec", "groups", 0, "rules", 0), "record", "x"),  # an alert and a record at once
        (("spec", "groups", 0, "rules", 0), "for", "5 minutes"),  # not a duration
        (("spec",), "group", []),  # misspelt
    ]
    for path, field, value in breakings:
        broken = copy.deepcopy(rule.body)
        target: Any = broken
        for part in path:
            target = target[part]
        target[field] = value
        with pytest.raises(pytest.fail.Exception, match="not a valid PrometheusRule"):
            _validate_monitoring(broken, "broken")


def test_the_dashboard_is_laid_out_and_filtered_as_grafana_needs() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "jobsignal" and dashboard["title"] == "jobsignal"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        taken = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not taken & cells, f"{panel['title']!r} overlaps another panel"
        cells |= taken
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["description"], panel["title"]
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            # Every selector follows the namespace and pod chosen at the top.
            for selector in parse(target["expr"]).selectors:
                matchers = set(selector.matchers)
                wanted = {("namespace", "=~", "$namespace"), ("pod", "=~", "$pod")}
                assert wanted <= matchers, f"{panel['title']!r}: {selector.metric} unfiltered"
    # ($__name: Grafana's own, such as $__rate_interval, $__all, ${__field...}.)
    used = {
        name
        for name in re.findall(r"\$\{?(\w+)\}?", DASHBOARD.read_text())
        if not name.startswith("__")
    }
    assert used <= variables.keys(), f"undefined variables {sorted(used - variables.keys())}"
