"""The real-path part of the report: headline table, issue 35's targets, plots.

Reads the `real_path_*` sections that bench/real_path.py writes into the
results; one latency-over-time PNG per scenario (`real_path_<key>.png`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMES = {"jobsignal": "jobsignal", "go": "grpc-go (ClusterD's design)", "reference": "grpc.aio"}
ORDER = ("jobsignal", "go", "reference")
COLORS = {"jobsignal": "tab:blue", "go": "tab:green", "reference": "tab:orange"}


def sections(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The real-path scenarios in the results, in the order they ran."""
    return [
        (key, value)
        for key, value in results.items()
        if key.startswith("real_path_") and isinstance(value, dict) and value.get("servers")
    ]


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:,.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs or math.isnan(ours) or math.isnan(theirs):
        return "—"
    return f"{ours / theirs:.2f}x"


def title(section: dict[str, Any]) -> str:
    spec = section["spec"]
    connections = spec["connections"] or spec["subscribers"]
    return (
        f"{spec['subscribers']:,} subscribers on {connections:,} connections,"
        f" {spec['rate']:g} job changes/s ({section['offered_per_s']:,.0f}/s offered),"
        f" rank table {spec['table'] or '?'}"
    )


def figure(section: dict[str, Any], kind: str, name: str) -> float | None:
    value = section["servers"].get(kind, {}).get(name)
    return float(value) if value is not None else None


def headline_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key, section in sections(results):
        for kind in ORDER:
            row = section["servers"].get(kind)
            if not row or "us_per_msg" not in row:
                continue
            rows.append(
                [
                    f"`{key}`: {title(section)}" if kind == ORDER[0] else "",
                    NAMES[kind],
                    _num(row["delivered_per_s"], 0),
                    _num(row["us_per_msg"], 1),
                    _num(row["p50_ms"], 1),
                    _num(row["p99_ms"], 1),
                    _num(row["max_ms"], 1),
                    f"{_num(row['within_10pct'] * 100, 0)} %",
                    _num(row["loadgen_us_per_msg"], 1),
                    f"{_num(row['snapshot_in_window'], 0)} / {_num(row['snapshot_after_live'], 0)}",
                ]
            )
    return rows


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """Issue 35's targets: (what, the figure, met?) for the scenarios that ran."""
    found = dict(sections(results))
    checks: list[tuple[str, str, bool | None]] = []

    def check(
        key: str, what: str, value: Callable[[dict[str, Any]], float | None], goal: float
    ) -> None:
        section = found.get(key)
        if section is None:
            return
        got = value(section)
        if got is None or math.isnan(got):
            checks.append((what, "—", None))
        else:
            checks.append((what, f"{got:,.2f}", got <= goal))

    def cpu_ratio(section: dict[str, Any]) -> float | None:
        ours, go = figure(section, "jobsignal", "us_per_msg"), figure(section, "go", "us_per_msg")
        return ours / go if ours and go else None

    def jobsignal(name: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda section: figure(section, "jobsignal", name)

    def outside_10pct(section: dict[str, Any]) -> float | None:
        share = figure(section, "jobsignal", "within_10pct")
        return None if share is None else (1 - share) * 100

    check("real_path_60k", "60,000/s offered: server µs/msg ≤ 1.3x grpc-go", cpu_ratio, 1.3)
    check("real_path_2k", "100 subscribers: server µs/msg ≤ 1.5x grpc-go", cpu_ratio, 1.5)
    check("real_path_20k", "20,000/s (under capacity): p99 < 50 ms", jobsignal("p99_ms"), 50)
    check("real_path_20k", "20,000/s (under capacity): max < 150 ms", jobsignal("max_ms"), 150)
    check(
        "real_path_60k",
        "60,000/s offered: % of subscribers not within 10 % of the median = 0",
        outside_10pct,
        0,
    )
    check("real_path_60k", "60,000/s offered: p99 < 100 ms", jobsignal("p99_ms"), 100)
    check(
        "real_path_arrive",
        "1,000 FdAgent subscribers arriving at once: the others' p99 < 50 ms",
        jobsignal("p99_ms"),
        50,
    )
    check(
        "real_path_700kb", "700 KB to 1,000 connections: p99 < 1,000 ms", jobsignal("p99_ms"), 1000
    )
    return checks


def markdown(results: dict[str, Any], out: Path) -> list[str]:
    """The "Real path" section of REPORT.md (empty without real-path results)."""
    found = sections(results)
    if not found:
        return []
    lines = [
        "## Real path: ConfigMap write → watch → server → subscriber",
        "",
        "Every server watches the same Kubernetes API emulator (`bench/cluster.py`):"
        " jobsignal with its own watcher, the grpc-go reference (`bench/go/reference`,"
        " written like ClusterD: a goroutine per stream, a channel of 10 per subscriber,"
        " drop when full, marshal per Send) and the grpc.aio reference with a LIST +"
        " WATCH over raw HTTP/1.1. The cluster writes one job's ConfigMaps every 1/rate s,"
        " stamping the write time into `sid`; latency is the Go load generator's receive"
        " time minus that write time (sampled live messages). A quarter of the subscribers"
        " are FdAgent (snapshot of every job first). Medians of the runs (alternating"
        " servers). CPU µs/msg: the server's CPU (/proc) over the window ÷ messages"
        " delivered; loadgen µs/msg: the load generator's own CPU (getrusage) ÷ the same."
        " Within 10 %: the share of subscribers whose live messages in the window are"
        " within 10 % of the median. Late snapshot: snapshot messages of FdAgent streams"
        " received inside the window / after a live message on the same stream (a"
        " ClusterD-style server sends the snapshot before it reports the stream up, and"
        " the window starts later still: both 0).",
        "",
        "| Scenario | Server | delivered msg/s | CPU µs/msg | p50 ms | p99 ms | max ms"
        " | within 10 % | loadgen µs/msg | late snapshot msgs |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in headline_rows(results)),
        "",
    ]
    checks = targets(results)
    if checks:
        quick = (
            " (a --quick run: tiny sizes, the verdicts mean nothing)"
            if results.get("quick")
            else ""
        )
        lines += [f"Issue 35's targets (jobsignal, same runs){quick}:", ""]
        for what, got, met in checks:
            verdict = "not measured" if met is None else ("met" if met else "**not met**")
            lines.append(f"- {what}: {got} — {verdict}")
        lines.append("")
    for key, section in found:
        lines += details(key, section, out)
    return lines


def details(key: str, section: dict[str, Any], out: Path) -> list[str]:
    spec = section["spec"]
    run = section.get("run") or {}
    load = run.get("load_average")
    lines = [
        f"### `{key}`: {title(section)}",
        "",
        f"{spec['jobs']} jobs of {spec['servers']} x 8 NPUs ({spec['per_configmap']} servers"
        f" per ConfigMap), {section['runs']} run(s) per server of {section['window_s']:g} s"
        f" after {section['warmup_s']:g} s of warm-up, one live message in"
        f" {section['sample_every']} per subscriber sampled"
        + (f"; load average at the start {load[0]:.2f}" if load else "")
        + ".",
        "",
        "| Server | run | delivered msg/s | events/s (changes/s) | server cores | µs/msg"
        " | p50 / p99 / max ms (samples) | per subscriber min / median / max (within 10 %)"
        " | loadgen µs/msg | emulator cores | FdAgent snapshot at up: min / median of"
        " jobs | snapshot msgs in window / after live | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ORDER:
        for index, row in enumerate(section["servers"].get(kind, {}).get("runs", [])):
            latency, spread, snap = row["latency"], row["fairness"], row["snapshot"]
            window = row["measured_s"]
            lines.append(
                "| "
                + " | ".join(
                    [
                        NAMES[kind] if index == 0 else "",
                        str(index + 1),
                        _num(row["delivered_per_s"], 0),
                        f"{row['published'] / window:.1f} ({row['changes'] / window:.1f})",
                        _num(row["server_cores"], 2),
                        _num(row["us_per_msg"], 1),
                        f"{_num(latency['p50_ms'], 1)} / {_num(latency['p99_ms'], 1)} /"
                        f" {_num(latency['max_ms'], 1)} ({latency['samples']:,})",
                        f"{spread['min']:,} / {_num(spread['median'], 0)} / {spread['max']:,}"
                        f" ({_num(spread['within_10pct'] * 100, 0)} %)",
                        _num(row["loadgen_us_per_msg"], 1),
                        _num(row["cluster_cores"], 2),
                        f"{snap['at_up_min']} / {_num(snap['at_up_median'], 0)} of {snap['jobs']}",
                        f"{snap['in_window']} / {snap['after_live']}",
                        ", ".join(f"{k} ×{v}" for k, v in row["loadgen_errors"].items()) or "—",
                    ]
                )
                + " |"
            )
    for kind in ORDER:
        arrivals = [
            row["arrivals"]
            for row in section["servers"].get(kind, {}).get("runs", [])
            if row.get("arrivals")
        ]
        if arrivals:
            lines.append(
                f"- {NAMES[kind]}: {arrivals[0]['subscribers']:,} FdAgent subscribers arrive"
                f" {arrivals[0]['at_s']:.1f} s into the window; all up after "
                + ", ".join(
                    "not within the wait" if a["all_up_s"] is None else f"{a['all_up_s']:.2f} s"
                    for a in arrivals
                )
                + "; messages per arriving stream when all were up (min / median): "
                + ", ".join(
                    f"{a['at_up_min']} / {a['at_up_median']:g}"
                    for a in arrivals
                    if "at_up_min" in a
                )
                + f" (the snapshot is {spec['jobs']} jobs, more are live messages)."
            )
    ours, go = figure(section, "jobsignal", "us_per_msg"), figure(section, "go", "us_per_msg")
    aio = figure(section, "reference", "us_per_msg")
    lines += [
        "",
        f"jobsignal ÷ grpc-go: CPU per message {_ratio(ours, go)}, p99"
        f" {_ratio(figure(section, 'jobsignal', 'p99_ms'), figure(section, 'go', 'p99_ms'))};"
        f" jobsignal ÷ grpc.aio: CPU per message {_ratio(ours, aio)}.",
        "",
    ]
    if (out / f"{key}.png").exists():
        lines += [f"![latency over time, {key}]({key}.png)", ""]
    return lines


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """One latency-over-time PNG per real-path scenario: per server, the p50 and the
    max of the samples in each slice of the window, every run."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return []
    written = []
    for key, section in sections(results):
        kinds = [kind for kind in ORDER if section["servers"].get(kind, {}).get("runs")]
        fig, axes = plt.subplots(
            len(kinds), 1, figsize=(10, 2.4 * len(kinds) + 0.6), sharex=True, sharey=True
        )
        axes = list(axes) if len(kinds) > 1 else [axes]
        for axis, kind in zip(axes, kinds, strict=True):
            for index, row in enumerate(section["servers"][kind]["runs"]):
                series = row["timeline"]
                if not series["t_s"]:
                    continue
                alpha = 1.0 if index == 0 else 0.45
                axis.plot(
                    series["t_s"],
                    series["max_ms"],
                    color=COLORS[kind],
                    alpha=alpha,
                    linewidth=0.9,
                    label="max per slice" if index == 0 else None,
                )
                if row.get("arrivals"):
                    axis.axvline(
                        row["arrivals"]["at_s"],
                        color="grey",
                        alpha=alpha,
                        linewidth=0.8,
                        linestyle="--",
                        label="FdAgent subscribers arrive" if index == 0 else None,
                    )
                axis.plot(
                    series["t_s"],
                    series["p50_ms"],
                    color="black",
                    alpha=alpha,
                    linewidth=0.7,
                    linestyle=":",
                    label="p50 per slice" if index == 0 else None,
                )
            row = section["servers"][kind]
            axis.set_title(
                f"{NAMES[kind]}: p50 {_num(row.get('p50_ms'), 1)} ms, p99"
                f" {_num(row.get('p99_ms'), 1)} ms, max {_num(row.get('max_ms'), 1)} ms,"
                f" {_num(row.get('us_per_msg'), 1)} µs/msg",
                fontsize=9,
            )
            axis.set_yscale("log")
            axis.set_ylabel("write → receive, ms")
            axis.grid(True, which="major", linewidth=0.3)
            axis.legend(fontsize=7, loc="upper right")
        axes[-1].set_xlabel(
            "time in the measured window, s (runs after the first fainter;"
            f" slices of {section['servers'][kinds[0]]['runs'][0]['timeline']['bucket_s']:.3f} s)"
        )
        fig.suptitle(f"{key}: {title(section)}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / f"{key}.png", dpi=100)
        plt.close(fig)
        written.append(f"{key}.png")
    return written
