"""Fixtures of the deploy/ checks: `no_network`, which keeps schema validation offline."""

from __future__ import annotations

import socket
from typing import NoReturn

import pytest


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to resolve or connect fails the test: validation must be offline.

    Only this process's sockets: a subprocess (kubectl kustomize, which reads
    local files) is not affected.
    """

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError(f"network access during schema validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
