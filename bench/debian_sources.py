"""grpc-go's and protobuf-go's sources and protoc's Go plugins from Debian's packages, no root.

The grpc-go peers (tests/interop, the benchmark's Go programs) build in GOPATH
mode against the Go sources Debian ships under /usr/share/gocode/src. Nothing
is installed on the system: `fetch` asks apt which packages those sources
need (the dependency closure of the root packages, Go source packages only),
downloads them with `apt-get download` and unpacks them with `dpkg-deb -x`
into a directory of the project's own (under .nox/), so no package of the
machine is added, upgraded or removed, and whatever protobuf-go the machine
itself has installed (Debian's old golang-goprotobuf-dev, say) cannot mix in.
Where the machine's package lists do not know a package (never updated, or
emptied as container images do), the lists are fetched again into the same
directory, which needs no root either.

Run by `nox -s peers` (bench/toolchains.py); stdlib only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

# What the peers import (grpc-go, protobuf-go's APIv2 and the APIv1 shim grpc-go
# still imports) and the two protoc plugins (static Go programs).
ROOT_PACKAGES = (
    "golang-google-grpc-dev",
    "golang-google-protobuf-dev",
    "golang-github-golang-protobuf-1-5-dev",
    "protoc-gen-go",
    "protoc-gen-go-grpc",
)
# The protoc plugins' own dependencies (libprotobuf, protoc) are not needed:
# protoc comes with grpcio-tools and the plugins are static.
PLUGINS = frozenset({"protoc-gen-go", "protoc-gen-go-grpc"})
GOCODE = Path("usr/share/gocode/src")
BIN = Path("usr/bin")


class Unavailable(Exception):
    """The sources cannot be had now (network, lists); the message says why."""


class NoApt(Unavailable):
    """The machine has no apt (not Debian or Ubuntu): the sources cannot be had here."""


def _is_go_source(record: dict[str, str]) -> bool:
    return record.get("Architecture") == "all" and record["Package"].startswith("golang-")


class _Apt:
    """apt-get and apt-cache, on the machine's package lists or on lists of our own."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.options: list[str] = []

    def run(self, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [tool, "-q", *self.options, *args],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
        )

    def record(self, package: str) -> dict[str, str] | None:
        """The candidate version's control fields, None for an unknown or virtual package."""
        done = self.run("apt-cache", "show", "--no-all-versions", package)
        fields: dict[str, str] = {}
        for line in done.stdout.splitlines():
            if not line.strip():
                break  # the first record is the candidate
            if line[0].isspace() or ":" not in line:
                continue
            name, _, value = line.partition(":")
            fields[name] = value.strip()
        return fields if done.returncode == 0 and "Package" in fields else None

    def use_own_lists(self) -> None:
        """Fetch the package lists of the machine's sources into the cache (no root)."""
        lists = self.cache / "apt" / "lists"
        (lists / "partial").mkdir(parents=True, exist_ok=True)
        archives = self.cache / "apt" / "archives"
        (archives / "partial").mkdir(parents=True, exist_ok=True)
        self.options = [
            f"-o=Dir::State::Lists={lists}",
            f"-o=Dir::Cache={self.cache / 'apt'}",
            f"-o=Dir::Cache::Archives={archives}",
            "-o=Debug::NoLocking=1",
        ]
        done = self.run("apt-get", "update")
        if done.returncode != 0:
            raise Unavailable(f"apt-get update (into {lists}) failed: {done.stderr.strip()}")


def resolve(apt: _Apt, roots: Sequence[str]) -> dict[str, dict[str, str]]:
    """The control records of `roots` and of every Go source package they need.

    Of alternatives (`a | b`), one already chosen wins, else the first apt knows
    that conflicts with nothing chosen: protobuf-go 1.5 (a root) satisfies what
    asks for 1.3 or 1.5, and the two never land in one tree.
    """
    chosen: dict[str, dict[str, str]] = {}
    for package in roots:
        record = apt.record(package)
        if record is None:
            raise Unavailable(f"apt knows no package {package}")
        chosen[package] = record
    queue = [p for p in roots if p not in PLUGINS]
    while queue:
        for clause in _depends(chosen[queue.pop()]):
            if any(name in chosen for name in clause):
                continue
            for name in clause:
                record = apt.record(name)
                if record is None or not _is_go_source(record):
                    continue
                if _conflicts(record, chosen):
                    continue
                chosen[name] = record
                queue.append(name)
                break
    return chosen


def _names(field: str) -> Iterable[list[str]]:
    """Package names of a Depends/Conflicts field, one list per clause of alternatives."""
    for clause in field.split(","):
        names = [alt.strip().split(" ")[0].split(":")[0] for alt in clause.split("|")]
        if names and names[0]:
            yield names


def _depends(record: dict[str, str]) -> Iterable[list[str]]:
    return _names(record.get("Depends", "") + "," + record.get("Pre-Depends", ""))


def _conflicts(record: dict[str, str], chosen: dict[str, dict[str, str]]) -> bool:
    mine = {n for clause in _names(record.get("Conflicts", "")) for n in clause}
    if mine & chosen.keys():
        return True
    name = record["Package"]
    return any(
        name in clause for other in chosen.values() for clause in _names(other.get("Conflicts", ""))
    )


def fetch(cache: Path) -> Path:
    """Unpack the sources and plugins into `cache`/root (once); that root.

    `root/usr/share/gocode/src` is the GOPATH source tree, `root/usr/bin` holds
    the plugins. Raises Unavailable when apt is missing or cannot get them.
    """
    root = cache / "root"
    done_marker = cache / "packages.txt"
    if done_marker.is_file() and (root / GOCODE).is_dir():
        return root
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise NoApt(f"its sources come from Debian's packages and this machine has no {tool}")
    apt = _Apt(cache)
    try:
        packages = resolve(apt, ROOT_PACKAGES)
        debs = _download(apt, cache / "debs", packages)
    except Unavailable:
        apt.use_own_lists()  # stale or emptied lists: fetch them, then once more
        packages = resolve(apt, ROOT_PACKAGES)
        debs = _download(apt, cache / "debs", packages)
    shutil.rmtree(root, ignore_errors=True)
    for deb in debs:
        unpacked = subprocess.run(
            ["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True, check=False
        )
        if unpacked.returncode != 0:
            raise Unavailable(f"dpkg-deb -x {deb.name} failed: {unpacked.stderr.strip()}")
    listing = [f"{name} {record.get('Version', '?')}" for name, record in sorted(packages.items())]
    done_marker.write_text("\n".join(listing) + "\n")
    return root


def _download(apt: _Apt, into: Path, packages: dict[str, dict[str, str]]) -> list[Path]:
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    wanted = [f"{name}={record['Version']}" for name, record in packages.items()]
    done = subprocess.run(
        ["apt-get", "-q", *apt.options, "download", *wanted],
        cwd=into,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "LC_ALL": "C"},
    )
    debs = sorted(into.glob("*.deb"))
    if done.returncode != 0 or len(debs) != len(wanted):
        raise Unavailable(f"apt-get download failed: {done.stderr.strip()[-1000:]}")
    return debs


def versions(cache: Path) -> dict[str, str]:
    """The fetched packages' versions, by name ({} before `fetch`)."""
    marker = cache / "packages.txt"
    if not marker.is_file():
        return {}
    return dict(line.split(" ", 1) for line in marker.read_text().splitlines() if " " in line)
