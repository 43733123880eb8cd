"""The Markdown report and PNG plots from the results of one benchmark run."""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import real_path_report
from bench.profiling import ProfileSummary, summarize_cprofile, summarize_speedscope

REPORT_NAME = "REPORT.md"
# The servers of the Python-client scenarios, in the order of their rows.
SERVERS = ("jobsignal", "reference")
FINDINGS = Path(__file__).resolve().parent / "FINDINGS.md"

# The server-bound scenarios (Go load generator), their summary labels, and the
# names of their three servers.
SERVER_BOUND = (
    ("server_fanout", "Server-bound fan-out"),
    ("server_one_conn", "Server-bound, one connection each"),
    ("server_latency", "Server-bound latency under capacity"),
)
# Issue 10's latency target, measured under capacity with the Go load generator.
SERVER_LATENCY_P99_TARGET_MS = 50.0
SERVER_BOUND_NAMES = {
    "jobsignal": "jobsignal",
    "go": "grpc-go (ClusterD's design)",
    "reference": "grpc.aio",
}
# Issue 10: jobsignal's server CPU per delivered message at most this many times
# grpc-go's, and at least this many times below grpc.aio's, in the same run.
GO_CPU_RATIO_TARGET = 2.0
AIO_CPU_RATIO_TARGET = 4.0

# What each attack of the under-attack scenario does (bench/attacker.py), in words.
ATTACK_LABELS = {
    "rapid_reset": "(1) Rapid Reset: HEADERS + RST_STREAM pairs, as fast as it can",
    "settings_flood": "(2) SETTINGS flood",
    "ping_flood": "(3) PING flood",
    "window_update_flood": "(4) WINDOW_UPDATE flood (1 byte each, connection window)",
    "empty_data_flood": "(5) empty DATA flood on one request stream",
    "settings_no_read": "(6) 4 connections flooding SETTINGS, never reading",
    "silent": "(7) 200 connections that never send the preface",
    "stalled_subscriber": "(8) windows opened wide, 20 FdAgent subscriptions, never reading",
    "spread_control_flood": "(9) 500 connections from 127.0.0.2, 450 WINDOW_UPDATEs/s each",
}
# Healthy subscribers' p99 during an attack: one attacking client must not push
# it above about this (issue: "No single input may ... starve jobsignal").
ATTACK_P99_TARGET_MS = 100.0


def _median(values: list[float]) -> float:
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _num(value: float | None, digits: int = 0, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}".rstrip()


def _spread(values: list[float], digits: int = 0, unit: str = "") -> str:
    """median (min–max) of the repetitions."""
    if not values:
        return "—"
    median = _num(_median(values), digits, unit)
    if len(values) == 1:
        return median
    return f"{median} ({_num(min(values), digits)}–{_num(max(values), digits)})"


def _ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs or math.isnan(ours) or math.isnan(theirs):
        return "—"
    return f"{ours / theirs:.2f}x"


def _kb(value: float) -> float:
    return value / 1000


def _mb(value: float) -> float:
    return value / 1e6


def _server_rows(
    cells: Callable[[str, dict[str, Any]], list[str]], section: dict[str, Any], *path: str
) -> list[list[str]]:
    """A table row, `cells(kind, figures)`, for each server with figures in
    `section` (under `path` in the server's entry), jobsignal's first."""
    rows = []
    for kind in SERVERS:
        figures = _get(section, kind, *path)
        if figures:
            rows.append(cells(kind, figures))
    return rows


def _cpus(cpus: list[int]) -> str:
    return ", ".join(str(cpu) for cpu in cpus)


def _latency_cells(row: dict[str, Any]) -> list[str]:
    return [
        f"{row['samples']:,}",
        _num(row["p50_ms"], 2),
        _num(row["p99_ms"], 2),
        _num(row["max_ms"], 2),
    ]


@dataclass
class Target:
    name: str
    measured: str
    met: bool | None  # None: not measured in this run
    margin: str


def _check_at_least(name: str, value: float | None, goal: float, unit: str, digits: int) -> Target:
    if value is None or math.isnan(value):
        return Target(name, "—", None, "not measured")
    met = value >= goal
    margin = (value / goal - 1) * 100
    return Target(name, _num(value, digits, unit), met, f"{margin:+.0f} % vs. {goal:g} {unit}")


def _check_below(name: str, value: float | None, goal: float, unit: str, digits: int) -> Target:
    if value is None or math.isnan(value):
        return Target(name, "—", None, "not measured")
    met = value < goal
    margin = (1 - value / goal) * 100
    word = "headroom" if met else "over"
    return Target(
        name, _num(value, digits, unit), met, f"{abs(margin):.0f} % {word} ({goal:g} {unit})"
    )


def _get(results: dict[str, Any], *path: str) -> Any:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


class Report:
    def __init__(self, results: dict[str, Any], out: Path) -> None:
        self.r = results
        self.out = out
        self.lines: list[str] = []
        self.quick = bool(results.get("quick"))
        self.errors: dict[str, str] = results.get("errors", {})

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.add("| " + " | ".join(header) + " |", "|" + "---|" * len(header))
        for row in rows:
            self.add("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
        self.add("")

    # -- figures ---------------------------------------------------------------

    def fanout_rate(self, kind: str, count: int) -> float | None:
        rows = _get(self.r, "fanout", kind, str(count))
        return _median(rows["rate"]) if rows else None

    def largest_fanout_at_most(self, count: int) -> int | None:
        sizes = [int(n) for n in self.r.get("sizes", {}).get("fanout", []) if int(n) <= count]
        return max(sizes) if sizes else None

    def worst_attack(self) -> dict[str, Any] | None:
        """The attack during which the healthy subscribers' p99 was highest."""
        rows = [row for row in _get(self.r, "attack", "attacks") or [] if row.get("healthy")]
        measured = [row for row in rows if not math.isnan(row["healthy"]["p99_ms"])]
        return max(measured, key=lambda row: row["healthy"]["p99_ms"]) if measured else None

    def big_phase(self, every: float) -> dict[str, Any] | None:
        for phase in _get(self.r, "big_and_small", "phases") or []:
            if phase["every_s"] == every:
                return dict(phase)
        return None

    def slow_loss(self, kind: str) -> float | None:
        phases = _get(self.r, "slow", kind)
        if not phases:
            return None
        base = _median(phases["all_reading"]["rate"])
        stuck = _median(phases["with_stuck"]["rate"])
        return (1 - stuck / base) * 100 if base else None

    # -- sections ----------------------------------------------------------------

    def build(self) -> str:
        r = self.r
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        mode = (
            "`python -m bench --quick` (tiny sizes: figures are NOT meaningful)"
            if self.quick
            else "`python -m bench` (`nox -s bench`)"
        )
        self.add(
            "# jobsignal benchmark: jobsignal vs. an idiomatic grpc.aio server",
            "",
            f"Generated {when} by {mode} in {r.get('elapsed_seconds', 0):.0f} s.",
            "Regenerate with `nox -s bench` (about ten minutes on two cores) or"
            " `python -m bench --quick` (seconds, for the smoke test).",
            "",
        )
        if self.errors:
            self.add("**Some scenarios failed in this run:**", "")
            for name, error in self.errors.items():
                self.add(f"- scenario failed: `{name}`: {error}")
            self.add("")
        self.machine()
        self.lines += real_path_report.markdown(self.r, self.out)
        self.summary()
        self.targets()
        self.details()
        self.profile()
        self.publish_micro()
        self.method()
        if FINDINGS.exists():
            self.add(FINDINGS.read_text().rstrip(), "")
        return "\n".join(self.lines) + "\n"

    def machine(self) -> None:
        m = self.r.get("machine", {})
        packages = ", ".join(f"{k} {v}" for k, v in m.get("packages", {}).items())
        load_start = m.get("load_average_start", [math.nan] * 3)
        load_end = m.get("load_average_end", [math.nan] * 3)
        dirty = m.get("dirty_jobsignal_files") or []
        source = m.get("commit", "?") + (
            f" with uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)"
        )
        self.add("## Machine", "")
        self.table(
            ["", ""],
            [
                ["CPU", f"{m.get('nproc')} cores usable ({m.get('cpu_model')})"],
                ["Memory", f"{m.get('memory_bytes', 0) / 2**30:.1f} GiB"],
                ["Kernel", str(m.get("kernel"))],
                ["Python", f"{m.get('implementation')} {m.get('python')}"],
                ["Packages", packages],
                ["jobsignal source", source],
                [
                    "Load average (1 min)",
                    f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end"
                    " (the machine is shared: other work competes for the same cores)",
                ],
            ],
        )

        loads = self.r.get("scenario_load")
        if loads:
            self.add("Time and 1-minute load average at the end of each scenario:", "")
            self.table(
                ["Scenario", "Seconds", "Load average"],
                [
                    [name, _num(row["seconds"], 0), _num(row["load_average"][0], 2)]
                    for name, row in loads.items()
                ],
            )

    def summary(self) -> None:
        r = self.r
        self.add(
            "## Summary",
            "",
            "Medians over the repetitions (min–max in the detail tables). The ratio is"
            " jobsignal ÷ reference of the figure in the row: above 1 is better for"
            " throughput, below 1 is better for latency, time and memory.",
            "",
        )
        rows: list[list[str]] = []
        fanout_sizes = [int(n) for n in r.get("sizes", {}).get("fanout", [])]
        for count in fanout_sizes:
            ours, theirs = (
                self.fanout_rate("jobsignal", count),
                self.fanout_rate("reference", count),
            )
            target = "≥ 40,000 msg/s and ≥ 1.0x reference" if count == 1000 else ""
            rows.append(
                [
                    f"Fan-out, {count:,} subscribers",
                    "delivered msg/s (higher is better)",
                    _num(ours, 0),
                    _num(theirs, 0),
                    _ratio(ours, theirs),
                    target,
                ]
            )
            cost_ours = _get(r, "fanout", "jobsignal", str(count), "us_per_msg")
            cost_theirs = _get(r, "fanout", "reference", str(count), "us_per_msg")
            if cost_ours and cost_theirs:
                a, b = _median(cost_ours), _median(cost_theirs)
                rows.append(
                    [
                        f"Fan-out, {count:,} subscribers",
                        "server CPU µs per delivered msg (lower is better)",
                        _num(a, 1),
                        _num(b, 1),
                        _ratio(a, b),
                        "",
                    ]
                )
        if not fanout_sizes:
            rows.append(["Fan-out", "not run", "—", "—", "—", ""])
        lat = r.get("latency", {})
        subs = r.get("sizes", {}).get("latency_subs")
        rate = r.get("sizes", {}).get("latency_rate")
        for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max")):
            ours, theirs = _get(lat, "jobsignal", key), _get(lat, "reference", key)
            rows.append(
                [
                    f"Latency, {subs} subscribers, {rate:g} events/s",
                    f"publish → arrival {label}, ms",
                    _num(ours, 2),
                    _num(theirs, 2),
                    _ratio(ours, theirs),
                    "p99 < 50 ms" if key == "p99_ms" else "",
                ]
            )
        e2e = _get(r, "e2e", "jobsignal") or {}
        for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
            rows.append(
                [
                    f"End to end, {r.get('sizes', {}).get('e2e_subs')} subscribers",
                    f"ConfigMap write → arrival {label}, ms",
                    _num(e2e.get(key), 2),
                    "— (no watcher)",
                    "—",
                    "p50 < 5 ms" if key == "p50_ms" else "",
                ]
            )
        mem = r.get("memory", {})
        ours = _get(mem, "jobsignal", "per_subscriber_bytes")
        theirs = _get(mem, "reference", "per_subscriber_bytes")
        rows.append(
            [
                f"Memory, {r.get('sizes', {}).get('memory_subs', 0):,} idle subscribers",
                "server RSS per subscriber, KB",
                _num(_kb(ours), 1) if ours is not None else "—",
                _num(_kb(theirs), 1) if theirs is not None else "—",
                _ratio(ours, theirs),
                "< 40 KB",
            ]
        )
        large = r.get("large", {})
        e2e_reps = _get(large, "e2e", "reps") or []
        npus = _get(large, "e2e", "npus")
        large_label = f"Large job, {npus:,} NPUs" if npus else "Large job"
        rows.append(
            [
                f"{large_label}, {r.get('sizes', {}).get('large_subs')} subscribers",
                "ConfigMap writes → last subscriber has it, s",
                _num(_median([x["all_delivered_s"] for x in e2e_reps]), 3),
                "— (no watcher)",
                "—",
                "< 1 s",
            ]
        )
        direct = large.get("direct", {})
        ours = _median([x["all_delivered_s"] for x in _get(direct, "jobsignal", "reps") or []])
        theirs = _median([x["all_delivered_s"] for x in _get(direct, "reference", "reps") or []])
        rows.append(
            [
                f"{large_label}, {r.get('sizes', {}).get('large_subs')} subscribers",
                "publish → last subscriber has it, s",
                _num(ours, 3),
                _num(theirs, 3),
                _ratio(ours, theirs),
                "",
            ]
        )
        peak = _get(large, "e2e", "peak_rss_bytes")
        rows.append(
            [
                f"{large_label}",
                "server peak RSS (through the watcher), MB",
                _num(_mb(peak), 0) if peak else "—",
                "—",
                "—",
                "",
            ]
        )
        ingest = r.get("ingest", {})
        rows.append(
            [
                f"Ingest, initial LIST of {ingest.get('configmaps', 0):,} ConfigMaps",
                "start of LIST → store loaded, s",
                _num(_median(ingest.get("list_seconds", [])), 2),
                "— (no watcher)",
                "—",
                "< 2 s",
            ]
        )
        rows.append(
            [
                f"Ingest, {ingest.get('rate_asked', 0):,.0f} ConfigMap changes/s asked",
                "job events published/s (server CPU, cores)",
                f"{_num(_median(ingest.get('events_per_s', [])), 0)}"
                f" ({_num(_median(ingest.get('server_cpu', [])), 2)})",
                "— (no watcher)",
                "—",
                "",
            ]
        )
        stuck = r.get("sizes", {}).get("slow_stuck")
        total = r.get("sizes", {}).get("slow_subs")
        ours, theirs = self.slow_loss("jobsignal"), self.slow_loss("reference")
        rows.append(
            [
                f"Slow clients, {stuck} of {total} stop reading",
                "delivery rate lost by the others, %",
                _num(ours, 1),
                _num(theirs, 1),
                "—",
                "< 10 %",
            ]
        )
        rows += self.attack_summary_rows()
        rows += self.big_summary_rows()
        rows += self.server_bound_summary_rows()
        self.table(["Scenario", "Figure", "jobsignal", "reference", "ratio", "target"], rows)
        self.plots_inline()

    def attack_summary_rows(self) -> list[list[str]]:
        attack = self.r.get("attack") or {}
        worst = self.worst_attack()
        if worst is None:
            return [["Under attack", "not run", "—", "—", "—", ""]]
        label = (
            f"Under attack, {attack['subscribers']} healthy subscribers at"
            f" {attack['rate']:g} events/s"
        )
        name = worst["attack"]
        return [
            [
                label,
                f"healthy p99 during the worst attack ({name}), ms (baseline before it)",
                f"{_num(worst['healthy']['p99_ms'], 1)} ({_num(worst['baseline']['p99_ms'], 1)})",
                "— (not run)",
                "—",
                f"< {ATTACK_P99_TARGET_MS:g} ms",
            ]
        ]

    def big_summary_rows(self) -> list[list[str]]:
        big = self.r.get("big_and_small") or {}
        rounds = [x for phase in big.get("phases", []) for x in phase["rounds"]]
        if not rounds:
            return [["Big and small", "not run", "—", "—", "—", ""]]
        size = _mb(rounds[0]["bytes"])
        label = (
            f"Big and small, {big['big_subscribers']} × {size:.2f} MB events,"
            f" {big['small_subscribers']} small subscribers"
        )
        rows = []
        for every, pace in ((1.0, "one a second"), (0.0, "back to back")):
            phase = self.big_phase(every)
            if phase is None:
                continue
            rows.append(
                [
                    label,
                    f"small events' p99 with big events {pace}, ms (without)",
                    f"{_num(phase['small']['p99_ms'], 1)}"
                    f" ({_num(big['without_big']['p99_ms'], 1)})",
                    "— (not run)",
                    "—",
                    "",
                ]
            )
        rows.append(
            [
                label,
                "publish → last big subscriber has it, s (median)",
                _num(_median([x["all_delivered_s"] for x in rounds]), 3),
                "— (not run)",
                "—",
                "",
            ]
        )
        return rows

    def server_bound_figure(self, key: str, kind: str, figure: str) -> float | None:
        """The median of a server's per-window figure, or its latency percentile."""
        if figure.endswith("_ms"):
            value = _get(self.r, key, "servers", kind, "latency", figure)
            return float(value) if value is not None else None
        values = _get(self.r, key, "servers", kind, figure)
        return _median(values) if values else None

    def server_bound_summary_rows(self) -> list[list[str]]:
        rows = []
        for key, label in SERVER_BOUND:
            section = self.r.get(key) or {}
            if not section.get("servers"):
                rows.append([label, "not run", "—", "—", "—", ""])
                continue
            title = (
                f"{label}, {section['subscribers']:,} subscribers on"
                f" {section['connections']:,} connections, Go load generator"
            )
            second = (
                ("p99_ms", "p99 latency ms (lower is better)", 1, "< 50 ms")
                if key == "server_latency"
                else (
                    "us_per_msg",
                    "server CPU µs per delivered msg (lower is better)",
                    1,
                    f"≤ {GO_CPU_RATIO_TARGET:g}x grpc-go",
                )
            )
            for figure, what, digits, target in (
                ("rate", "delivered msg/s (higher is better)", 0, ""),
                second,
            ):
                ours = self.server_bound_figure(key, "jobsignal", figure)
                go = self.server_bound_figure(key, "go", figure)
                aio = self.server_bound_figure(key, "reference", figure)
                rows.append(
                    [
                        title,
                        what,
                        _num(ours, digits),
                        f"grpc-go {_num(go, digits)}; grpc.aio {_num(aio, digits)}",
                        f"{_ratio(ours, go)} grpc-go; {_ratio(ours, aio)} grpc.aio",
                        target,
                    ]
                )
        return rows

    def targets(self) -> None:
        r = self.r
        checks: list[Target] = []
        at_1000 = 1000 if 1000 in [int(n) for n in r.get("sizes", {}).get("fanout", [])] else None
        ours = self.fanout_rate("jobsignal", at_1000) if at_1000 else None
        theirs = self.fanout_rate("reference", at_1000) if at_1000 else None
        checks.append(
            _check_at_least(
                "Fan-out 1,000 subscribers ≥ 40,000 delivered msg/s", ours, 40_000, "msg/s", 0
            )
        )
        ratio = ours / theirs if ours and theirs else None
        checks.append(
            _check_at_least("Fan-out 1,000 subscribers ≥ 1.0x reference", ratio, 1.0, "x", 2)
        )
        checks.append(
            _check_below(
                "Latency p99 < 50 ms (1,000 subscribers, 20 events/s)",
                _get(r, "latency", "jobsignal", "p99_ms"),
                50,
                "ms",
                2,
            )
        )
        checks.append(
            _check_below("End-to-end p50 < 5 ms", _get(r, "e2e", "jobsignal", "p50_ms"), 5, "ms", 2)
        )
        checks.append(
            _check_below(
                "End-to-end p50 < 3 ms, 100 Go subscribers (issue 10)",
                _get(r, "e2e_go", "jobsignal", "p50_ms"),
                3,
                "ms",
                2,
            )
        )
        per_sub = _get(r, "memory", "jobsignal", "per_subscriber_bytes")
        checks.append(
            _check_below(
                "10,000 idle subscribers < 40 KB RSS each",
                _kb(per_sub) if per_sub is not None else None,
                40,
                "KB",
                1,
            )
        )
        reps = _get(r, "large", "e2e", "reps") or []
        checks.append(
            _check_below(
                "Large job to 20 subscribers < 1 s",
                _median([x["all_delivered_s"] for x in reps]) if reps else None,
                1,
                "s",
                3,
            )
        )
        lists = _get(r, "ingest", "list_seconds") or []
        checks.append(
            _check_below(
                "Initial LIST of 10,000 ConfigMaps applied < 2 s",
                _median(lists) if lists else None,
                2,
                "s",
                2,
            )
        )
        checks.append(
            _check_below(
                "Slow clients cost the others < 10 % of delivery rate",
                self.slow_loss("jobsignal"),
                10,
                "%",
                1,
            )
        )
        worst = self.worst_attack()
        checks.append(
            _check_below(
                f"Healthy p99 < {ATTACK_P99_TARGET_MS:g} ms during every attack",
                worst["healthy"]["p99_ms"] if worst else None,
                ATTACK_P99_TARGET_MS,
                "ms",
                1,
            )
        )
        checks += self.server_bound_targets()
        self.add("## Targets (jobsignal)", "")
        if self.quick:
            self.add("Quick run: sizes are tiny, so the verdicts below mean nothing.", "")
        rows = []
        for check in checks:
            verdict = (
                "not measured" if check.met is None else ("met" if check.met else "**missed**")
            )
            rows.append([check.name, check.measured, verdict, check.margin])
        self.table(["Target", "Measured", "Verdict", "Margin"], rows)

    def server_bound_targets(self) -> list[Target]:
        checks = []
        for key, label in SERVER_BOUND:
            section = self.r.get(key) or {}
            where = f"{section.get('subscribers', 0):,} on {section.get('connections', 0):,}"
            if key == "server_latency":
                p99 = _get(section, "servers", "jobsignal", "latency", "p99_ms")
                checks.append(
                    _check_below(
                        f"{label} ({where}, {section.get('rate', 0):g} events/s): p99 <"
                        f" {SERVER_LATENCY_P99_TARGET_MS:g} ms",
                        p99,
                        SERVER_LATENCY_P99_TARGET_MS,
                        "ms",
                        1,
                    )
                )
                continue
            ours = self.server_bound_figure(key, "jobsignal", "us_per_msg")
            go = self.server_bound_figure(key, "go", "us_per_msg")
            aio = self.server_bound_figure(key, "reference", "us_per_msg")
            checks.append(
                _check_below(
                    f"{label} ({where}): server CPU per delivered msg ≤"
                    f" {GO_CPU_RATIO_TARGET:g}x grpc-go's",
                    ours / go if ours and go else None,
                    GO_CPU_RATIO_TARGET,
                    "x",
                    2,
                )
            )
            if key == "server_fanout":
                checks.append(
                    _check_at_least(
                        f"{label} ({where}): server CPU per delivered msg ≥"
                        f" {AIO_CPU_RATIO_TARGET:g}x below grpc.aio's",
                        aio / ours if ours and aio else None,
                        AIO_CPU_RATIO_TARGET,
                        "x",
                        2,
                    )
                )
                within = _get(section, "servers", "jobsignal", "fairness", "within_10pct")
                checks.append(
                    _check_at_least(
                        f"{label} ({where}): every subscriber within 10 % of the median"
                        " received count",
                        within * 100 if within is not None else None,
                        100,
                        "%",
                        1,
                    )
                )
        return checks

    def server_bound_details(self) -> None:
        for key, label in SERVER_BOUND:
            section = self.r.get(key)
            if not section or not section.get("servers"):
                continue
            self.add(
                f"### {label} (Go load generator; jobsignal, grpc-go and grpc.aio)",
                "",
                f"{section['subscribers']:,} subscribers on {section['connections']:,}"
                f" connections, one grpc-go load generator process (`bench/go/loadgen`),"
                f" {section['rate']:g} events/s offered ({section['offered_per_s']:,.0f}"
                f" deliveries/s), {section['reps']} windows of {section['window_s']:g} s on"
                " the same processes. The load generator counts messages without decoding"
                f" them; one message in {section['sample_every']} of each subscriber is"
                " decoded for its latency (publish time in `sid` to arrival). Per subscriber:"
                " messages received over all windows (min / median / max; starved = got"
                " nothing; the share within 10 % of the median).",
                "",
            )
            self.provenance(section)
            rows = []
            for kind in ("jobsignal", "go", "reference"):
                row = _get(section, "servers", kind)
                if not row:
                    continue
                spread = row["fairness"]
                per_connection = (
                    f"{spread['per_connection_min']:,}–{spread['per_connection_max']:,}"
                    if "per_connection_min" in spread
                    else "—"
                )
                latency = row["latency"]
                rows.append(
                    [
                        SERVER_BOUND_NAMES[kind],
                        f"{_spread(row['rate'])} of {_num(row['offered_per_s'], 0)}",
                        _spread(row["server_cpu"], 2),
                        _spread(row["us_per_msg"], 1),
                        f"{_num(latency['p50_ms'], 1)} / {_num(latency['p99_ms'], 1)}"
                        f" / {_num(latency['max_ms'], 1)} ({latency['samples']:,})",
                        f"{spread['min']:,} / {_num(spread['median'], 0)} / {spread['max']:,}"
                        f" ({spread['starved']} starved,"
                        f" {_num(spread['within_10pct'] * 100, 0)} % within 10 %)",
                        per_connection,
                        f"{_spread(row['loadgen_us_per_msg'], 1)}"
                        f" ({_num(_median(row['loadgen_cpu']), 2)} cores)",
                        _num(_mb(row["rss_bytes"]), 0),
                        str(row["loadgen_ended"]),
                    ]
                )
            self.table(
                [
                    "Server",
                    "Delivered msg/s (offered)",
                    "Server CPU",
                    "Server µs/msg",
                    "p50 / p99 / max ms (samples)",
                    "Per subscriber min / median / max",
                    "Per connection",
                    "Load generator µs/msg (CPU)",
                    "Server RSS MB",
                    "Streams ended",
                ],
                rows,
            )
            ours = self.server_bound_figure(key, "jobsignal", "us_per_msg")
            go = self.server_bound_figure(key, "go", "us_per_msg")
            aio = self.server_bound_figure(key, "reference", "us_per_msg")
            rate = self.server_bound_figure(key, "jobsignal", "rate")
            self.add(
                f"jobsignal ÷ grpc-go: server µs per delivered msg {_ratio(ours, go)},"
                f" delivered {_ratio(rate, self.server_bound_figure(key, 'go', 'rate'))};"
                f" jobsignal ÷ grpc.aio: {_ratio(ours, aio)},"
                f" delivered {_ratio(rate, self.server_bound_figure(key, 'reference', 'rate'))}.",
                "",
            )

    def details(self) -> None:
        self.add("## Details", "")
        self.server_bound_details()
        self.fanout_details()
        self.latency_details()
        self.e2e_details()
        self.e2e_go_details()
        self.memory_details()
        self.large_details()
        self.ingest_details()
        self.slow_details()
        self.attack_details()
        self.big_details()

    def fanout_details(self) -> None:
        r = self.r
        fanout = r.get("fanout")
        if not fanout:
            return
        self.add(
            "### Fan-out",
            "",
            "Events published as fast as the subscribers' queues drain (a batch of"
            f" {r['sizes']['flood_batch']} whenever the 95th percentile of the queues"
            f" holds fewer than {r['sizes']['flood_threshold']}). Delivered = messages"
            " received by the clients per second. CPU in cores (1.0 = one core busy).",
            "",
        )

        def fanout_cells(count: int, kind: str, row: dict[str, Any]) -> list[str]:
            return [
                f"{count:,}",
                kind,
                _spread(row["rate"]),
                _spread(row["server_cpu"], 2),
                _spread(row["us_per_msg"], 1),
                _spread(row["client_cpu"], 2) + f" in {row['clients']}",
                _spread(row["client_us_per_msg"], 1),
                _num(_mb(row["rss_bytes"]), 0),
                str(row.get("coalesced", 0)),
                str(sum(row.get("ended", {}).values())),
            ]

        rows = []
        for count in r["sizes"]["fanout"]:
            rows += _server_rows(functools.partial(fanout_cells, count), fanout, str(count))
        self.table(
            [
                "Subscribers",
                "Server",
                "Delivered msg/s",
                "Server CPU",
                "Server µs/msg",
                "Client CPU (processes)",
                "Client µs/msg",
                "Server RSS MB",
                "Coalesced",
                "Streams ended",
            ],
            rows,
        )

    def latency_details(self) -> None:
        lat = self.r.get("latency")
        if not lat:
            return
        self.add("### Latency (fixed rate)", "")
        rows = _server_rows(
            lambda kind, row: [
                kind,
                *_latency_cells(row),
                ", ".join(_num(x["p99_ms"], 2) for x in row["per_rep"]),
                _spread(row["server_cpu"], 2),
            ],
            lat,
        )
        self.table(
            [
                "Server",
                "Samples",
                "p50 ms",
                "p99 ms",
                "max ms",
                "p99 per repetition",
                "Server CPU",
            ],
            rows,
        )

    def e2e_details(self) -> None:
        r = self.r
        e2e = _get(r, "e2e", "jobsignal")
        if not e2e:
            return
        w = e2e["watch_to_publish"]
        self.add(
            "### End to end (jobsignal only)",
            "",
            "A ConfigMap rewritten in the Kubernetes API emulator (its own process,"
            f" {r['sizes']['e2e_rate']:g} changes/s) travels through the emulator's WATCH,"
            " jobsignal's watcher, job store and broadcaster to each subscriber. The"
            " reference server has no Kubernetes watcher, so it has no figure here.",
            "",
        )
        self.table(
            ["Stage", "Samples", "p50 ms", "p99 ms", "max ms"],
            [
                ["ConfigMap write → subscriber", *_latency_cells(e2e)],
                ["ConfigMap write → broadcaster.publish", *_latency_cells(w)],
            ],
        )
        self.add(
            f"Server CPU {e2e['server_cpu']:.2f} cores, emulator {e2e['cluster_cpu']:.2f}.",
            "",
        )

    def e2e_go_details(self) -> None:
        e2e_go = self.r.get("e2e_go")
        if not e2e_go:
            return
        placement = e2e_go.get("placement")
        if isinstance(placement, dict):
            runs = [
                (
                    f"server on CPU {_cpus(placement['server_cpus'])}, emulator and"
                    f" subscribers on CPU {_cpus(placement['peer_cpus'])}",
                    e2e_go["jobsignal"],
                ),
                ("CPUs shared", e2e_go["shared_cpus"]),
            ]
        else:  # one CPU, or a run from before there were two placements
            runs = [("CPUs shared", e2e_go["jobsignal"])]
        self.add(
            "### End to end with Go subscribers",
            "",
            f"As above, with {e2e_go['subscribers']} Go subscribers on a connection each"
            f" ({e2e_go['rate']:g} changes/s), measured with the server on a CPU of its"
            " own, as beside clients on other machines, and then with every process"
            " where the kernel puts it.",
            "",
        )
        rows = []
        for where, run in runs:
            rows.append([f"{where}: ConfigMap write → subscriber", *_latency_cells(run)])
            rows.append(["… write → broadcaster.publish", *_latency_cells(run["watch_to_publish"])])
            rows.append(["… publish to all subscribers", *_latency_cells(run["publish"])])
        self.table(["Placement and stage", "Samples", "p50 ms", "p99 ms", "max ms"], rows)

    def memory_details(self) -> None:
        mem = self.r.get("memory")
        if not mem:
            return
        self.add(
            "### Memory with idle subscribers",
            "",
            "Each subscriber has its own HTTP/2 connection (as separate client programs"
            " would), so the figure includes the per-connection cost.",
            "",
        )
        rows = _server_rows(
            lambda kind, row: [
                kind,
                f"{row['subscribers']:,}",
                _num(_mb(row["baseline_bytes"]), 1),
                _num(_mb(row["rss_bytes"]), 1),
                _num(_kb(row["per_subscriber_bytes"]), 1),
                _num(row["connect_seconds"], 1),
            ],
            mem,
        )
        self.table(
            [
                "Server",
                "Subscribers",
                "Baseline RSS MB",
                "RSS MB",
                "KB per subscriber",
                "Connect s",
            ],
            rows,
        )

    def large_details(self) -> None:
        large = self.r.get("large")
        if not large:
            return
        self.add("### Large job", "")
        e = large.get("e2e")
        if e:
            rows = [
                [
                    str(i + 1),
                    str(rep["configmaps"]),
                    _num(rep["write_s"], 3),
                    _num(rep["first_delivered_s"], 3),
                    _num(rep["all_delivered_s"], 3),
                ]
                for i, rep in enumerate(e["reps"])
            ]
            self.add(
                f"Through the watcher: a {e['npus']:,}-NPU job's ConfigMaps written in the"
                f" emulator, reassembled by the store, delivered to {e['subscribers']}"
                " subscribers. Times from the first write. Server RSS"
                f" {_num(_mb(e['rss_before_bytes']), 0)} MB before, peak"
                f" {_num(_mb(e['peak_rss_bytes']), 0)} MB.",
                "",
            )
            self.table(
                ["Write", "ConfigMaps", "Writing s", "First subscriber s", "Last subscriber s"],
                rows,
            )
        rows = _server_rows(
            lambda kind, row: [
                kind,
                ", ".join(_num(x["all_delivered_s"], 3) for x in row["reps"]),
                _num(_mb(row["rss_before_bytes"]), 0),
                _num(_mb(row["peak_rss_bytes"]), 0),
            ],
            large.get("direct", {}),
        )
        if rows:
            self.add("Straight from the event source (both servers):", "")
            self.table(
                ["Server", "Last subscriber s, per repetition", "RSS before MB", "Peak RSS MB"],
                rows,
            )

    def ingest_details(self) -> None:
        ingest = self.r.get("ingest")
        if not ingest:
            return
        c = ingest["change_to_publish"]
        self.add(
            "### Ingest (jobsignal only)",
            "",
            f"Initial LIST of {ingest['configmaps']:,} job ConfigMaps (paged, 500 per page)"
            " from the emulator, then a steady stream of ConfigMap changes through WATCH.",
            "",
        )
        lists = ", ".join(_num(x, 2) for x in ingest["list_seconds"])
        replaces = ", ".join(_num(x, 2) for x in ingest["replace_all_seconds"])
        change = f"{_num(c['p50_ms'], 2)} / {_num(c['p99_ms'], 2)}"
        self.table(
            ["Figure", "Value"],
            [
                ["LIST → store loaded, s (per start)", lists],
                ["of which the job store's own work (parse, commit, settle), s", replaces],
                [
                    "changes/s written by the emulator's driver",
                    _spread(ingest["changes_per_s"]),
                ],
                ["job events/s published", _spread(ingest["events_per_s"])],
                ["server CPU, cores", _spread(ingest["server_cpu"], 2)],
                ["emulator CPU, cores", _spread(ingest["cluster_cpu"], 2)],
                ["change → publish p50 / p99 ms", change],
                ["JobStore.apply µs per change", _num(ingest["apply_us"], 0)],
                ["server RSS MB", _num(_mb(ingest["rss_bytes"]), 0)],
            ],
        )

    def slow_details(self) -> None:
        r = self.r
        slow = r.get("slow")
        if not slow:
            return
        stuck = r["sizes"]["slow_stuck"]
        total = r["sizes"]["slow_subs"]
        self.add(
            "### Slow clients",
            "",
            f"{total:,} subscribers; in the second phase {stuck} of them stop reading."
            f" Figures are for the other {total - stuck:,}: delivery rate under flood,"
            f" then latency at {r['sizes']['latency_rate']:g} events/s.",
            "",
        )
        rows = []
        for kind in SERVERS:
            phases = slow.get(kind)
            if not phases:
                continue
            for phase, label in (
                ("all_reading", "all reading"),
                ("with_stuck", f"{stuck} stuck"),
            ):
                row = phases[phase]
                ended = row["server_stats"].get("ended", {})
                rows.append(
                    [
                        kind,
                        label,
                        _spread(row["rate"]),
                        _num(row["latency"]["p50_ms"], 2),
                        _num(row["latency"]["p99_ms"], 2),
                        _spread(row["server_cpu"], 2),
                        _num(_mb(row["rss_bytes"]), 0),
                        ", ".join(f"{k} {v}" for k, v in ended.items() if v) or "none",
                    ]
                )
        self.table(
            [
                "Server",
                "Phase",
                "Others' msg/s",
                "p50 ms",
                "p99 ms",
                "Server CPU",
                "RSS MB",
                "Streams ended",
            ],
            rows,
        )

    def attack_details(self) -> None:
        attack = self.r.get("attack")
        if not attack or not attack.get("attacks"):
            return
        self.add(
            "### Under attack (jobsignal only)",
            "",
            f"{attack['subscribers']} healthy grpcio subscribers receive"
            f" {attack['rate']:g} events/s while a raw HTTP/2 attacker (`bench/attacker.py`, its"
            " own process, frames built with hyperframe and hpack) runs each attack in turn for"
            f" {attack['window_s']:g} s; whenever the server closes its connection it opens a new"
            " one and goes on. Baseline: the same subscribers over the same length of time"
            " just before the attack. The server runs with its production abuse budgets;"
            f" handshake timeout {attack['handshake_timeout_s']:g} s, write-stall timeout"
            f" {attack['write_stall_timeout_s']:g} s (30 s by default, shortened to fit the"
            " window). CPU in cores; the attacker shares the machine's two cores with the"
            " server and the load generators.",
            "",
        )
        self.provenance(attack)
        rows = []
        for row in attack["attacks"]:
            record = row["attacker"]
            close = record.get("to_close_s") or record.get("to_goaway_s")
            rows.append(
                [
                    ATTACK_LABELS.get(row["attack"], row["attack"]),
                    _answer_cell(row),
                    f"{_num(close['median'], 3)} s" if close else "—",
                    f"{record['reconnects']:,} ({record.get('parallel', 1)} at once)",
                    f"{_num(row['healthy']['p50_ms'], 1)} / {_num(row['healthy']['p99_ms'], 1)}",
                    f"{_num(row['baseline']['p50_ms'], 1)} / {_num(row['baseline']['p99_ms'], 1)}",
                    _num(row["healthy"]["max_ms"], 1),
                    _num(row["server_cpu"], 2),
                    _num(row["attacker_cpu"], 2),
                    str(row["healthy_ended"]),
                ]
            )
        self.table(
            [
                "Attack",
                "Server answered (connections)",
                "Until closed (median)",
                "Reconnects (connections at once)",
                "Healthy p50 / p99 ms",
                "Baseline p50 / p99 ms",
                "Healthy max ms",
                "Server CPU",
                "Attacker CPU",
                "Healthy streams ended",
            ],
            rows,
        )
        self.add(
            "“Server answered” is what the attacker saw on each connection, and in brackets"
            " the reasons the server counted for the connections it closed (a peer that does"
            " not read cannot see most GOAWAYs: it only notices the close). “Until closed”"
            " is from connect to close, as the attacker saw it.",
            "",
        )
        rows = [
            [
                row["attack"],
                f"{_num(row['attacker']['frames_per_second'], 0)}",
                f"{_num(_mb(row['attacker']['bytes_sent']), 1)}",
                f"{_num(_mb(row['rss_before_bytes']), 0)} → {_num(_mb(row['rss_after_bytes']), 0)}",
            ]
            for row in attack["attacks"]
        ]
        self.table(["Attack", "Frames written/s", "MB written", "Server RSS MB"], rows)

    def big_details(self) -> None:
        big = self.r.get("big_and_small")
        if not big or not big.get("phases"):
            return
        rounds = [x for phase in big["phases"] for x in phase["rounds"]]
        size = rounds[0]["bytes"] if rounds else 0
        npus = rounds[0]["npus"] if rounds else 0
        limit = " just under gRPC's default 4 MiB receive limit" if size > 2**21 else ""
        self.add(
            "### Big and small (jobsignal only)",
            "",
            f"{big['big_subscribers']} subscribers, each on its own connection, receive a job"
            f" event of {size:,} bytes (a rank table of {npus:,} NPUs{limit}), while"
            f" {big['small_subscribers']} other subscribers receive"
            f" small events (about 1.3 KB) at {big['small_rate']:g} events/s. Each phase lasts"
            f" {big['window_s']:g} s. The big events go to the first group only and the small"
            " ones to the second (a device of the benchmark runner: jobsignal sends every event"
            " to every subscriber), so the small events' latency shows what writing the big"
            " ones costs everyone else on the same event loop.",
            "",
        )
        self.provenance(big)
        rows = [
            [
                "no big events",
                f"{big['without_big']['samples']:,}",
                _num(big["without_big"]["p50_ms"], 1),
                _num(big["without_big"]["p99_ms"], 1),
                _num(big["without_big"]["max_ms"], 1),
                _num(big["server_cpu_without"], 2),
                "—",
                "—",
                "—",
            ]
        ]
        for phase in big["phases"]:
            every = phase["every_s"]
            pace = f"a big event every {every:g} s" if every else "big events back to back"
            firsts = [x["first_delivered_s"] for x in phase["rounds"]]
            lasts = [x["all_delivered_s"] for x in phase["rounds"]]
            rows.append(
                [
                    pace,
                    f"{phase['small']['samples']:,}",
                    _num(phase["small"]["p50_ms"], 1),
                    _num(phase["small"]["p99_ms"], 1),
                    _num(phase["small"]["max_ms"], 1),
                    _num(phase["server_cpu"], 2),
                    str(len(phase["rounds"])),
                    _num(_median(firsts), 3),
                    f"{_num(_median(lasts), 3)} (max {_num(max(lasts, default=math.nan), 3)})",
                ]
            )
        self.table(
            [
                "Phase",
                "Small samples",
                "Small p50 ms",
                "Small p99 ms",
                "Small max ms",
                "Server CPU",
                "Big events",
                "Big: first subscriber s",
                "Big: last subscriber s",
            ],
            rows,
        )
        self.add(f"Server peak RSS {_num(_mb(big['peak_rss_bytes']), 0)} MB.", "")

    def provenance(self, section: dict[str, Any]) -> None:
        """Say so when a section's figures come from another run than the rest."""
        run = section.get("run") or {}
        commit = run.get("commit")
        if not commit or commit == self.r.get("machine", {}).get("commit"):
            return
        dirty = run.get("dirty_jobsignal_files") or []
        source = f"jobsignal {commit}" + (
            f" with uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)"
        )
        how = run.get("how", "another run")
        self.add(
            f"Measured in a separate run of {source}: {how} (its load average is in the"
            " table under Machine).",
            "",
        )

    def plots_inline(self) -> None:
        names = [name for name in PLOTS if (self.out / name).exists()]
        if names:
            self.add(" ".join(f"![{name}]({name})" for name in names), "")

    def profile(self) -> None:
        self.add("## Where the time goes (jobsignal)", "")
        info = self.r.get("profile")
        if not info or "skipped" in info or "file" not in info:
            reason = (info or {}).get("skipped") or self.errors.get("profile", "not run")
            self.add(f"No profile in this run ({reason}).", "")
            return
        self.add(
            f"### Under flood: {info['subscribers']:,} subscribers, events as fast as they drain",
            "",
            f"{_num(info['rate_while_profiling'], 0)} msg/s delivered while profiling (the"
            " profiler slows the server a little).",
            "",
        )
        self.profile_tables(info)
        latency = self.r.get("profile_latency")
        if latency:
            self.add(
                f"### At a fixed rate: {latency['subscribers']:,} subscribers,"
                f" {latency['rate']:g} events/s (the latency scenario)",
                "",
            )
            self.profile_tables(latency)

    def profile_tables(self, info: dict[str, Any]) -> None:
        path = self.out / info["file"]
        summary: ProfileSummary
        if info["tool"] == "py-spy":
            summary = summarize_speedscope(path)
            what = "share of samples"
            note = f"py-spy samples of the server's threads; raw profile `{info['file']}`"
            note += " (open it in speedscope)."
        else:
            summary = summarize_cprofile(path)
            what = "share of profiled time"
            note = f"cProfile (py-spy not installed); raw profile `{info['file']}`."
        self.add(note, "", "Self time (where the CPU is):", "")
        self.table(
            ["Function", what], [[name, f"{share * 100:.1f} %"] for name, share in summary.self_top]
        )
        self.add("Inclusive time (which paths cost most):", "")
        self.table(
            ["Function", what],
            [[name, f"{share * 100:.1f} %"] for name, share in summary.inclusive_top],
        )

    def publish_micro(self) -> None:
        micro = self.r.get("publish")
        if not micro:
            return
        self.add(
            "## Fan-out hot loop: Broadcaster.publish per subscriber push",
            "",
            "`bench/micro.py`, in one process: jobsignal's `Broadcaster.publish` of"
            f" {micro['events']} events, with {micro['heap_objects']:,} long-lived objects on"
            " the heap (a busy server's connections and tasks), with the garbage collector as"
            " configured and with those objects frozen (`gc.freeze()`, as the server does"
            " after its first LIST). Median µs per push (lower is better); before the shared"
            " queue entry (FINDINGS.md) it was 3.4 µs at 1,000 and 3.7 µs at 5,000.",
            "",
        )
        rows = [
            [
                f"{row['subscribers']:,}",
                _num(row.get("publish_gc_us"), 2),
                _num(row.get("publish_frozen_us"), 2),
            ]
            for row in micro["rows"]
        ]
        self.table(["Subscribers", "µs per push", "µs per push, gc frozen"], rows)
        hops = micro.get("hop_us")
        if hops:
            cells = ", ".join(f"{_num(v, 0)} µs with {k} tasks hopping" for k, v in hops.items())
            self.add(
                "One trio → asyncio → trio round trip (`trio_asyncio.aio_as_trio` of an empty"
                f" coroutine), which every batch written to a stream pays: {cells}.",
                "",
            )

    def method(self) -> None:
        self.add(
            "## Method",
            "",
            "- Every server, load generator and the Kubernetes API emulator is a separate"
            " process on 127.0.0.1; the orchestrator (`bench/run.py`) samples their CPU"
            " (utime + stime, all threads) and RSS from `/proc`. Each child stops by itself"
            " when its stdin closes, when its parent dies (`PR_SET_PDEATHSIG`) or at a hard"
            " deadline.",
            "- jobsignal runs its real gRPC server (`run_grpc_server`, grpclib on"
            " trio-asyncio) and, for the watcher scenarios, its real `run_source` against the"
            " emulator (`bench/jobsignal_server.py`). Its per-address connection and request"
            " rate limits are lifted, because every benchmark client comes from 127.0.0.1.",
            "- The reference (`bench/reference_server.py`) is job.Job on grpc.aio with"
            " grpcio-tools stubs generated at run time: one task per stream, an asyncio.Queue"
            " per subscriber (bounded at 1,024; a full queue drops the subscriber), `await"
            " context.write(message)`, so protobuf serialises once per subscriber.",
            "- Both servers publish the same jobs (2 servers x 8 NPUs each, built by ClusterD's"
            " writer and jobsignal's store, about 1.3 KB on the wire) with the publish time in"
            " `sid`; clients (`bench/loadgen.py`, grpc.aio, one channel and TCP connection per"
            " subscriber) subtract it from their arrival time.",
            "- Fan-out is measured at the clients, so on a two-core machine the Python grpcio"
            " clients compete with the server for the same cores: the client cost per message"
            " is reported next to the server's, and server CPU µs per delivered message is the"
            " figure that does not depend on how fast the clients are.",
            "- The server-bound scenarios use a load generator written in Go"
            " (`bench/go/loadgen`, grpc-go's default windows, subscribers sharing a"
            " configurable number of connections) that does not decode most messages and"
            " reports its own CPU (getrusage), a few µs per message, so the server is the"
            " limit. They compare jobsignal and grpc.aio with a grpc-go server written like"
            " ClusterD (`bench/go/reference`: a goroutine per stream, a 10-message channel per"
            " subscriber, a message dropped for a subscriber whose channel is full), all three"
            " publishing the same jobs at the same offered rate. Both Go programs are built"
            " at run time in GOPATH mode from Debian's packages (`bench/gobuild.py`).",
            '- The real-path scenarios (`bench/real_path.py`, section "Real path" above)'
            " have all three servers take their events from the emulator's WATCH: jobsignal"
            " its own watcher, the grpc-go reference `bench/go/kubewatch`, the grpc.aio one"
            " `bench/kube_source.py` (LIST + WATCH over raw HTTP/1.1, a job's slices put back"
            " together, one event per change); latency runs from the ConfigMap write to the"
            " Go load generator's receive; each server is started afresh for each of its"
            " alternating runs, and the medians of the runs are quoted.",
            f"- Repetitions: {self.r.get('sizes', {}).get('reps')} measurement windows per"
            " scenario on the same processes (memory: one measurement); latency percentiles"
            " are over all samples of all windows (nearest rank).",
            "",
        )


PLOTS = ("fanout.png", "latency.png", "memory.png", "slow.png")


def _plots(results: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        # Without matplotlib the plots already in `out` stay (a --report-only
        # rewrite after merging other figures must not lose them).
        return []
    for name in PLOTS:
        (out / name).unlink(missing_ok=True)
    written: list[str] = []
    colors = {"jobsignal": "tab:blue", "reference": "tab:orange"}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    fanout = results.get("fanout")
    if fanout:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for kind in SERVERS:
            sizes = sorted(int(n) for n in fanout.get(kind, {}))
            if not sizes:
                continue
            rates = [fanout[kind][str(n)]["rate"] for n in sizes]
            mids = [_median(x) for x in rates]
            low = [m - min(x) for m, x in zip(mids, rates, strict=True)]
            high = [max(x) - m for m, x in zip(mids, rates, strict=True)]
            left.errorbar(
                sizes, mids, yerr=[low, high], marker="o", label=kind, color=colors[kind], capsize=3
            )
            cost = [_median(fanout[kind][str(n)]["us_per_msg"]) for n in sizes]
            right.plot(sizes, cost, marker="o", label=kind, color=colors[kind])
        left.axhline(40_000, color="grey", linestyle="--", linewidth=1, label="target at 1,000")
        left.set(
            xscale="log",
            xlabel="subscribers",
            ylabel="delivered messages/s",
            title="Fan-out throughput",
        )
        right.set(
            xscale="log",
            yscale="log",
            xlabel="subscribers",
            ylabel="server CPU µs per delivered message",
            title="Server cost per message",
        )
        left.legend()
        right.legend()
        save(fig, "fanout.png")
    latency = results.get("latency")
    if latency:
        fig, axis = plt.subplots(figsize=(7, 4))
        series = [(k, latency.get(k)) for k in SERVERS]
        series.append(("jobsignal end to end", _get(results, "e2e", "jobsignal")))
        for name, row in series:
            if not row or not row.get("histogram_ms", {}).get("counts"):
                continue
            hist = row["histogram_ms"]
            total = sum(hist["counts"]) or 1
            cumulative = []
            running = 0.0
            for count in hist["counts"]:
                running += count
                cumulative.append(running / total)
            axis.plot(hist["edges_ms"][1:], cumulative, label=name)
        axis.axvline(50, color="grey", linestyle="--", linewidth=1, label="50 ms")
        axis.set(
            xscale="log",
            xlabel="latency, ms",
            ylabel="fraction of messages",
            title="Latency CDF (fixed rate)",
        )
        axis.legend()
        save(fig, "latency.png")
    memory = results.get("memory")
    if memory:
        fig, axis = plt.subplots(figsize=(5, 4))
        kinds = [k for k in SERVERS if k in memory]
        values = [memory[k]["per_subscriber_bytes"] / 1000 for k in kinds]
        axis.bar(kinds, values, color=[colors[k] for k in kinds])
        axis.axhline(40, color="grey", linestyle="--", linewidth=1, label="target 40 KB")
        axis.set(ylabel="server RSS per idle subscriber, KB", title="Memory per subscriber")
        axis.legend()
        save(fig, "memory.png")
    slow = results.get("slow")
    if slow:
        fig, axis = plt.subplots(figsize=(6, 4))
        kinds = [k for k in SERVERS if k in slow]
        width = 0.38
        for offset, phase, label in (
            (-width / 2, "all_reading", "all reading"),
            (width / 2, "with_stuck", "some stuck"),
        ):
            values = [_median(slow[k][phase]["rate"]) for k in kinds]
            axis.bar([i + offset for i in range(len(kinds))], values, width, label=label)
        axis.set_xticks(range(len(kinds)), kinds)
        axis.set(ylabel="others' delivered messages/s", title="Slow clients")
        axis.legend()
        save(fig, "slow.png")
    return written


def _answer_cell(row: dict[str, Any]) -> str:
    """What the server answered an attack's connections, for the table."""
    record = row["attacker"]
    answers = sorted(record["answers"].items(), key=lambda item: -item[1])
    text = "; ".join(f"{answer} ×{count:,}" for answer, count in answers) or "nothing"
    resets = record.get("stream_resets") or {}
    if resets:
        text += "; RST_STREAM " + ", ".join(f"{code} ×{n:,}" for code, n in resets.items())
    closed = row.get("server_closed") or {}
    counted = ", ".join(f"{reason} ×{n:,}" for reason, n in closed.items())
    return f"{text} (server: {counted or 'closed none'})"


def write_report(results: dict[str, Any], out: Path) -> Path:
    _plots(results, out)
    real_path_report.plots(results, out)
    text = Report(results, out).build()
    path = out / REPORT_NAME
    path.write_text(text)
    return path


__all__ = ["write_report"]
