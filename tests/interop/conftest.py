"""Session fixtures: the grpc-go peer, built once per test session; the grpc-js peer."""

from __future__ import annotations

from pathlib import Path

import pytest

from .peers import build_go_peer, js_peer_command


@pytest.fixture(scope="session")
def go_peer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_go_peer(tmp_path_factory.mktemp("go-peer"))


@pytest.fixture(scope="session")
def js_peer() -> list[str]:
    return js_peer_command()
