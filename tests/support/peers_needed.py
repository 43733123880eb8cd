"""Which foreign gRPC peers (grpc-js, grpc-go) this test run had, and which it had not.

A test that needs a peer gets it through `need`. Where `nox -s peers` could
not install the peer's toolchain (bench/toolchains.py says why: no apt-get
for Debian's grpc-go sources, no network, ...), its tests are reported as
not run, and `summary` (printed last by tests/conftest.py) names each
missing peer and the command that gets it; nothing else is ever skipped.
In CI (CI=true) and under `nox -s interop` (JOBSIGNAL_REQUIRE_PEERS=1) a
missing peer fails its tests instead.

Under pytest-xdist each worker learns of its own peers: `news` rides on the
test reports to the controller, which `learn`s it and prints the summary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import pytest

from bench.toolchains import Missing

_T = TypeVar("_T")


def required() -> bool:
    """True where a missing peer is a failure (CI, `nox -s interop`)."""
    flags = (os.environ.get("CI", ""), os.environ.get("JOBSIGNAL_REQUIRE_PEERS", ""))
    return any(flag.lower() not in ("", "0", "false") for flag in flags)


# What this run had: peer -> its versions, or peer -> why it is missing and
# the command that gets it.
_ran: dict[str, str] = {}
_missing: dict[str, str] = {}
# Whether this process learnt something its reports have not carried yet.
_unreported = False


def need(peer: str, provide: Callable[[], tuple[_T, str]]) -> _T:
    """`provide()`'s value (the second item, the peer's versions, is recorded); the
    calling test is skipped, or failed where peers are required, when it raises
    `Missing`."""
    global _unreported
    try:
        value, versions = provide()
    except Missing as error:
        if required():
            pytest.fail(f"{peer}: {error}", pytrace=False)
        _missing[peer] = f"{error.why}; to get it: {error.get}"
        _unreported = True
        pytest.skip(f"{peer} peer not available: {error}")
    _ran[peer] = versions
    _unreported = True
    return value


def news() -> dict[str, dict[str, str]] | None:
    """What this process learnt of the peers since it was last asked (None: nothing)."""
    global _unreported
    if not _unreported:
        return None
    _unreported = False
    return {"ran": dict(_ran), "missing": dict(_missing)}


def learn(news: dict[str, dict[str, str]]) -> None:
    """Take in another process's `news` (a pytest-xdist worker's)."""
    _ran.update(news["ran"])
    _missing.update(news["missing"])


def summary() -> str | None:
    """One line on the peers of this run; None when no test asked for one."""
    if not (_ran or _missing):
        return None
    ran = "".join(f", {peer} ({versions})" for peer, versions in sorted(_ran.items()))
    line = f"interop peers: grpcio{ran} ran"
    for peer, why in sorted(_missing.items()):
        line += f"; {peer} NOT RUN ({why})"
    return line
