"""Without their packages the interop peers fail the tests, naming what to install."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from . import peers


def test_a_missing_debian_package_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name: None if name == "protoc-gen-go-grpc" else which(name)
    )
    monkeypatch.setattr(peers, "GOCODE", tmp_path / "gocode")
    with pytest.raises(pytest.fail.Exception) as failed:
        peers.build_go_peer(tmp_path)
    message = str(failed.value)
    for package in ("protoc-gen-go-grpc", "golang-google-grpc-dev", "golang-google-protobuf-dev"):
        assert package in message
    assert "golang-go," not in message and "protobuf-compiler" not in message
    assert ".ci/install-peers" in message


def test_missing_npm_packages_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(peers, "JS_DIR", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"@grpc/grpc-js, @grpc/proto-loader;"):
        peers.js_peer_command()
