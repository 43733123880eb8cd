"""Build small grpc-go programs against Debian's Go packages, in GOPATH mode.

Used by the benchmark (its Go load generator and reference server) and by the
interop tests (their grpc-go peer). No module proxy is involved: the Go
toolchain, grpc-go and protobuf-go come from Debian packages, which install
their sources under /usr/share/gocode/src. The message and service stubs are
generated from protos/job/job.proto by protoc when a program is built, into
the build directory; nothing generated is kept in the repository.

`build_go_programs` raises `GoBuildError` naming the Debian packages to
install when something is missing (`.ci/install-peers` installs them all),
or with protoc's or go's output when a step fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"
GOCODE = Path("/usr/share/gocode/src")
INSTALL_HINT = "run .ci/install-peers (as root) to install them"


class GoBuildError(RuntimeError):
    """A Go program could not be built (missing packages, or a failing step)."""


def _requirements(gocode: Path) -> tuple[tuple[str, Callable[[], bool]], ...]:
    """What a build needs, as (Debian package, how to tell it is there)."""
    return (
        ("golang-go", lambda: shutil.which("go") is not None),
        ("protobuf-compiler", lambda: shutil.which("protoc") is not None),
        ("protoc-gen-go", lambda: shutil.which("protoc-gen-go") is not None),
        ("protoc-gen-go-grpc", lambda: shutil.which("protoc-gen-go-grpc") is not None),
        ("golang-google-grpc-dev", lambda: (gocode / "google.golang.org/grpc").is_dir()),
        ("golang-google-protobuf-dev", lambda: (gocode / "google.golang.org/protobuf").is_dir()),
        (
            "golang-github-golang-protobuf-1-5-dev",
            lambda: (gocode / "github.com/golang/protobuf/ptypes").is_dir(),
        ),
    )


def missing_go_packages(gocode: Path = GOCODE) -> list[str]:
    """The Debian packages a build needs that are not installed."""
    return [package for package, present in _requirements(gocode) if not present()]


def _run(argv: list[str], env: Mapping[str, str], what: str) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
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
    gocode: Path = GOCODE,
) -> dict[str, Path]:
    """Build each `programs[name]` (a main.go) as `build_dir/bin/name`; their paths.

    The programs import the stubs as `<import_root>/job`, and each of
    `libraries` (a folder of .go files) as `<import_root>/<name>`. `who` names
    the programs in the missing-packages message ("the grpc-go interop peer").
    """
    missing = missing_go_packages(gocode)
    if missing:
        raise GoBuildError(
            f"{who} needs Debian packages that are not installed: {', '.join(missing)};"
            f" {INSTALL_HINT}"
        )
    package_dir = build_dir / "src" / import_root
    package_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": f"{build_dir}:{gocode.parent}",
        "GOFLAGS": "",
        "GOCACHE": os.environ.get("GOCACHE") or str(_go_cache(build_dir)),
    }
    # The proto's own go_package ("/job", ClusterD's) is no import path: map it.
    mapping = f"paths=source_relative,Mjob/job.proto={import_root}/job"
    _run(
        [
            "protoc",
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
    for name, folder in (libraries or {}).items():
        (package_dir / name).mkdir(exist_ok=True)
        for source in folder.glob("*.go"):
            shutil.copy(source, package_dir / name / source.name)
    binaries: dict[str, Path] = {}
    for name, source in programs.items():
        (package_dir / name).mkdir(exist_ok=True)
        shutil.copy(source, package_dir / name / "main.go")
        binary = build_dir / "bin" / name
        _run(["go", "build", "-o", str(binary), f"{import_root}/{name}"], env, f"go build {name}")
        binaries[name] = binary
    return binaries
