"""Build small grpc-go programs against Debian's Go sources, in GOPATH mode.

Used by the benchmark (its Go load generator and reference server) and by the
interop tests (their grpc-go peer). No module proxy is involved: the Go
toolchain, grpc-go's and protobuf-go's sources and the protoc Go plugins are
the ones `nox -s peers` installed into .nox/ (bench/toolchains.py; the
sources come from Debian's packages). The message and service stubs are
generated from protos/job/job.proto by protoc (grpcio-tools') when a program
is built, into the build directory; nothing generated is kept in the
repository.

`build_go_programs` raises `GoBuildError` saying what is missing and how to
get it, when the stubs would not be the protobuf API grpc-go needs (an old
protoc-gen-go: grpc-go would fail to compile with "missing ProtoReflect
method"), or with protoc's or go's output when a step fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from bench import toolchains

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"


class GoBuildError(RuntimeError):
    """A Go program could not be built (missing toolchain, or a failing step)."""


def check_protobuf_api(tools: toolchains.GoTools) -> str | None:
    """Why `tools` would not build grpc-go stubs, or None: both the protobuf-go
    runtime and protoc-gen-go must be of the API grpc-go 1.3x imports (APIv2,
    protobuf-go 1.20 and later), not the old github.com/golang/protobuf 1.3."""
    if not (tools.gocode / "google.golang.org/protobuf/reflect/protoreflect").is_dir():
        return f"{tools.gocode} has no google.golang.org/protobuf (protobuf-go APIv2)"
    # github.com/golang/protobuf 1.4 and later wrap APIv2; 1.3 has no registry.go.
    if not (tools.gocode / "github.com/golang/protobuf/proto/registry.go").is_file():
        return f"{tools.gocode}'s github.com/golang/protobuf is older than 1.4 (APIv1)"
    plugin = tools.plugins / "protoc-gen-go"
    try:
        said = subprocess.run(
            [str(plugin), "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
    except OSError as error:
        return f"{plugin} does not run: {error}"
    # APIv2's plugin answers "protoc-gen-go v1.28.1"; the old one knows no --version.
    if not said.startswith("protoc-gen-go v1."):
        return f"{plugin} is not protobuf-go's APIv2 plugin (it says {said.strip()[:80]!r})"
    return None


def _run(argv: list[str], env: Mapping[str, str], what: str) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise GoBuildError(
            f"{what} failed ({done.returncode}): {' '.join(argv)}\n{done.stdout}{done.stderr}"
        )


def _go_cache(build_dir: Path) -> Path:
    """The user's Go build cache (rebuilds take a second), or one in `build_dir`."""
    home = Path.home()
    if os.access(home, os.W_OK):
        return home / ".cache" / "go-build"
    return build_dir / "go-cache"


def build_go_programs(
    build_dir: Path,
    programs: Mapping[str, Path],
    *,
    import_root: str,
    who: str,
    libraries: Mapping[str, Path] | None = None,
    tools: toolchains.GoTools | None = None,
) -> dict[str, Path]:
    """Build each `programs[name]` (a main.go) as `build_dir/bin/name`; their paths.

    The programs import the stubs as `<import_root>/job`, and each of
    `libraries` (a folder of .go files) as `<import_root>/<name>`. `who` names
    the programs in error messages ("the grpc-go interop peer"). Without
    `tools`, the ones `nox -s peers` installed (`toolchains.Missing` when it
    could not).
    """
    tools = tools or toolchains.go_tools()
    if (wrong := check_protobuf_api(tools)) is not None:
        raise GoBuildError(f"{who} cannot be built: {wrong}")
    package_dir = build_dir / "src" / import_root
    package_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PATH": f"{tools.plugins}{os.pathsep}{os.environ.get('PATH', '')}",
        "GO111MODULE": "off",
        "GOPATH": f"{build_dir}{os.pathsep}{tools.gocode.parent}",
        "GOFLAGS": "",
        "GOTOOLCHAIN": "local",
        "GOCACHE": os.environ.get("GOCACHE") or str(_go_cache(build_dir)),
    }
    # The proto's own go_package ("/job", ClusterD's) is no import path: map it.
    mapping = f"paths=source_relative,Mjob/job.proto={import_root}/job"
    _run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--go_out={package_dir}",
            f"--go_opt={mapping}",
            f"--go-grpc_out={package_dir}",
            f"--go-grpc_opt={mapping}",
            "job/job.proto",
        ],
        env,
        "protoc (Go stubs)",
    )
    if "ProtoReflect()" not in (package_dir / "job" / "job.pb.go").read_text():
        raise GoBuildError(f"{who}: protoc-gen-go wrote stubs without ProtoReflect (APIv1)")
    for name, folder in (libraries or {}).items():
        (package_dir / name).mkdir(exist_ok=True)
        for source in folder.glob("*.go"):
            shutil.copy(source, package_dir / name / source.name)
    binaries: dict[str, Path] = {}
    for name, source in programs.items():
        (package_dir / name).mkdir(exist_ok=True)
        shutil.copy(source, package_dir / name / "main.go")
        binary = build_dir / "bin" / name
        _run(
            [str(tools.go), "build", "-o", str(binary), f"{import_root}/{name}"],
            env,
            f"go build {name}",
        )
        binaries[name] = binary
    return binaries
