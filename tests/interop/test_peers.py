"""The peers' toolchains: what is missing is named with what gets it, the wrong
protobuf-go API is refused before a build, and Debian's packages are chosen
without a conflict (bench/toolchains.py, bench/gobuild.py, bench/debian_sources.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import debian_sources, gobuild, toolchains
from tests.support import peers_needed


def write_manifest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, found: object) -> None:
    manifest = tmp_path / "peers.json"
    manifest.write_text(json.dumps(found))
    monkeypatch.setattr(toolchains, "MANIFEST", manifest)


def test_peers_never_installed_name_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(toolchains, "MANIFEST", tmp_path / "none.json")
    for find in (toolchains.node, toolchains.go_tools):
        with pytest.raises(toolchains.Missing, match=r"to get it: `nox -s peers`$"):
            find()


def test_a_machine_without_apt_is_told_where_grpc_go_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get, apt-cache, dpkg-deb
    with pytest.raises(debian_sources.NoApt, match="has no apt-get"):
        debian_sources.fetch(tmp_path / "cache")
    write_manifest(
        monkeypatch,
        tmp_path,
        {"grpc-go": {"missing": "no apt-get", "get": "run the tests on Debian or Ubuntu"}},
    )
    with pytest.raises(toolchains.Missing) as missing:
        toolchains.go_tools()
    assert missing.value.why == "no apt-get"
    assert missing.value.get == "run the tests on Debian or Ubuntu"


def test_npm_packages_gone_since_install_are_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    node = tmp_path / "node"
    node.write_text("")
    write_manifest(monkeypatch, tmp_path, {"grpc-js": {"node": str(node), "version": "v"}})
    monkeypatch.setattr(toolchains, "JS_DIR", tmp_path)
    with pytest.raises(toolchains.Missing, match=r"^@grpc/grpc-js, @grpc/proto-loader gone"):
        toolchains.node()


def test_a_missing_peer_is_skipped_locally_failed_in_ci_and_summed_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peers_needed, "_ran", {})
    monkeypatch.setattr(peers_needed, "_missing", {})
    monkeypatch.setattr(peers_needed, "_unreported", False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("JOBSIGNAL_REQUIRE_PEERS", raising=False)

    def missing() -> tuple[str, str]:
        raise toolchains.Missing("no apt-get here", "run it on Debian")

    assert peers_needed.need("grpc-js", lambda: ("node", "node v24")) == "node"
    with pytest.raises(pytest.skip.Exception, match="grpc-go peer not available: no apt-get"):
        peers_needed.need("grpc-go", missing)
    summed_up = (
        "interop peers: grpcio, grpc-js (node v24) ran;"
        " grpc-go NOT RUN (no apt-get here; to get it: run it on Debian)"
    )
    assert peers_needed.summary() == summed_up
    # A pytest-xdist worker's news reaches the controller once, and sums up the same.
    news = peers_needed.news()
    assert news is not None
    assert peers_needed.news() is None
    monkeypatch.setattr(peers_needed, "_ran", {})
    monkeypatch.setattr(peers_needed, "_missing", {})
    peers_needed.learn(news)
    assert peers_needed.summary() == summed_up
    for variable in ("CI", "JOBSIGNAL_REQUIRE_PEERS"):
        with monkeypatch.context() as required:
            required.setenv(variable, "true" if variable == "CI" else "1")
            with pytest.raises(pytest.fail.Exception, match="grpc-go: no apt-get here"):
                peers_needed.need("grpc-go", missing)


def fake_gocode(root: Path, *, registry: bool) -> Path:
    gocode = root / "src"
    (gocode / "google.golang.org/protobuf/reflect/protoreflect").mkdir(parents=True)
    proto = gocode / "github.com/golang/protobuf/proto"
    proto.mkdir(parents=True)
    (proto / ("registry.go" if registry else "lib.go")).write_text("package proto\n")
    return gocode


def fake_plugin(folder: Path, says: str) -> Path:
    folder.mkdir(exist_ok=True)
    plugin = folder / "protoc-gen-go"
    plugin.write_text(f"#!/bin/sh\necho '{says}'\n")
    plugin.chmod(0o755)
    return folder


def test_the_old_protobuf_go_api_is_refused_before_building(tmp_path: Path) -> None:
    go = tmp_path / "go"
    new_plugin = fake_plugin(tmp_path / "new", "protoc-gen-go v1.28.1")
    old_tree = toolchains.GoTools(go, fake_gocode(tmp_path / "old", registry=False), new_plugin, "")
    why = gobuild.check_protobuf_api(old_tree)
    assert why is not None and "older than 1.4" in why
    new_tree = fake_gocode(tmp_path / "v2", registry=True)
    # Debian's protoc-gen-go-1-3 (APIv1) has no --version: it waits for a request.
    old_plugin = fake_plugin(tmp_path / "v1", "")
    why = gobuild.check_protobuf_api(toolchains.GoTools(go, new_tree, old_plugin, ""))
    assert why is not None and "not protobuf-go's APIv2 plugin" in why
    assert gobuild.check_protobuf_api(toolchains.GoTools(go, new_tree, new_plugin, "")) is None
    with pytest.raises(gobuild.GoBuildError, match=r"older than 1\.4"):
        gobuild.build_go_programs(
            tmp_path / "build", {}, import_root="x", who="the peer", tools=old_tree
        )


class FakeApt(debian_sources._Apt):
    """apt-cache's records from a table (Debian 12's, trimmed)."""

    def __init__(self, records: dict[str, dict[str, str]]) -> None:
        super().__init__(Path(os.devnull))
        self.records = records

    def record(self, package: str) -> dict[str, str] | None:
        found = self.records.get(package)
        return None if found is None else {"Package": package, **found}


def test_the_closure_takes_protobuf_go_1_5_and_only_go_sources() -> None:
    go = {"Architecture": "all", "Version": "1"}
    apt = FakeApt(
        {
            "golang-google-grpc-dev": go
            | {
                "Depends": "golang-github-golang-protobuf-1-3-dev"
                " | golang-github-golang-protobuf-1-5-dev, golang-glog-dev"
                " | golang-github-golang-glog-dev, golang-golang-x-net-dev (>= 1:0.0)"
            },
            "golang-github-golang-protobuf-1-3-dev": go
            | {"Conflicts": "golang-github-golang-protobuf-1-5-dev"},
            "golang-github-golang-protobuf-1-5-dev": go
            | {
                "Depends": "golang-google-protobuf-dev",
                "Conflicts": "golang-github-golang-protobuf-1-3-dev,"
                " golang-goprotobuf-dev (<< 1.3.5-1~)",
            },
            "golang-google-protobuf-dev": go,
            "golang-glog-dev": go,
            "golang-golang-x-net-dev": go | {"Depends": "libc6, golang-golang-x-sys-dev"},
            "golang-golang-x-sys-dev": go,
            "libc6": {"Architecture": "amd64", "Version": "2"},
            "protoc-gen-go": {"Architecture": "amd64", "Depends": "libprotobuf-dev"},
            "protoc-gen-go-grpc": {"Architecture": "amd64", "Depends": "protobuf-compiler"},
        }
    )
    chosen = debian_sources.resolve(apt, debian_sources.ROOT_PACKAGES)
    assert sorted(chosen) == [
        "golang-github-golang-protobuf-1-5-dev",
        "golang-glog-dev",
        "golang-golang-x-net-dev",
        "golang-golang-x-sys-dev",
        "golang-google-grpc-dev",
        "golang-google-protobuf-dev",
        "protoc-gen-go",
        "protoc-gen-go-grpc",
    ]
    # Without protobuf-go 1.5 asked for, the first alternative apt knows is taken,
    # and what conflicts with it is not.
    apt.records["golang-google-grpc-dev"]["Depends"] += ", golang-github-golang-protobuf-1-5-dev"
    chosen = debian_sources.resolve(apt, ["golang-google-grpc-dev"])
    assert "golang-github-golang-protobuf-1-3-dev" in chosen
    assert "golang-github-golang-protobuf-1-5-dev" not in chosen
