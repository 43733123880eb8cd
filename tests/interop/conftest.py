"""Session fixtures: the grpc-go peer, built once per test session; the grpc-js peer.

Either is skipped (reported at the end of the run) or failed (CI) when its
toolchain is missing: tests/support/peers_needed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.peers_needed import need

from .peers import build_go_peer, js_peer_command


@pytest.fixture(scope="session")
def go_peer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return need("grpc-go", lambda: build_go_peer(tmp_path_factory.mktemp("go-peer")))


@pytest.fixture(scope="session")
def js_peer() -> list[str]:
    return need("grpc-js", js_peer_command)
