"""Developer and CI sessions: tests, lint, typecheck, and protobuf code generation.

`nox` with no arguments runs what CI runs: peers (the interop tests' grpc-go
and grpc-js clients, see .ci/install-peers), tests and typecheck on every
supported Python (3.11, 3.12, 3.13), lint and protos_check once. A missing
interpreter fails the run; `nox --force-python 3.12` runs every session on one.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["peers", "tests", "lint", "typecheck", "protos_check"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PROTO_DIR = ROOT / "protos"
GENERATED_DIR = ROOT / "jobsignal" / "_proto"
# Every supported Python; pyproject.toml's requires-python and classifiers say the same.
PYTHONS = ["3.11", "3.12", "3.13"]
# Sessions whose output must not depend on the interpreter run on the oldest.
PYTHON = PYTHONS[0]

# The compiler pipes its output through ruff, so the generated text depends on
# the exact versions of all three.
CODEGEN_DEPS = ["betterproto2-compiler==0.10.1", "grpcio-tools==1.85.1", "ruff==0.17.6"]
LINT_DEPS = ["ruff==0.17.6", "import-linter==2.17"]
TYPECHECK_DEPS = ["mypy==2.4.1", "types-PyYAML", "nox"]


def _activate_pyenv_pythons() -> None:
    """Let pyenv's shims run every installed supported Python, not only the active ones.

    A pyenv shim such as `python3.12` fails unless that version is active, so
    nox would report the interpreter as missing. Make the newest installed
    patch release of each supported version active too, after the ones already
    active (which stay the default `python3`). Run through a shim, nox itself
    already has PYENV_VERSION set to the version it runs on.
    """
    if shutil.which("pyenv") is None:
        return

    def pyenv(*args: str) -> list[str]:
        done = subprocess.run(["pyenv", *args], capture_output=True, text=True, check=False)
        return done.stdout.split() if done.returncode == 0 else []

    current = os.environ.get("PYENV_VERSION") or ":".join(pyenv("version-name"))
    installed = pyenv("versions", "--bare")

    def newest(minor: str) -> list[str]:
        matches = [
            v for v in installed if v.startswith(minor + ".") and v[len(minor) + 1 :].isdigit()
        ]
        return sorted(matches, key=lambda v: int(v.rsplit(".", 1)[1]))[-1:]

    wanted = [*current.split(":"), *(v for minor in PYTHONS for v in newest(minor))]
    os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys(v for v in wanted if v))


_activate_pyenv_pythons()


def _generate(session: nox.Session, out_dir: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    session.run(
        "python",
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_betterproto2_out={out_dir}",
        "--python_betterproto2_opt=client_generation=async,google_protobuf_descriptors",
        *protos,
    )


def _tree_differs(left: Path, right: Path) -> list[str]:
    comparison = filecmp.dircmp(left, right, ignore=["__pycache__"])
    problems = [f"only in {left}: {n}" for n in comparison.left_only]
    problems += [f"only in {right}: {n}" for n in comparison.right_only]
    problems += [f"differs: {n}" for n in comparison.diff_files]
    for sub in comparison.subdirs.values():
        problems += _tree_differs(Path(sub.left), Path(sub.right))
    return problems


@nox.session(python=False)
def peers(session: nox.Session) -> None:
    """Install the interop tests' grpc-go and grpc-js clients (apt-get as root, npm ci)."""
    session.run(str(ROOT / ".ci" / "install-peers"), external=True)


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Run the whole test suite (unit, integration over loopback, grpcio interop)."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def fast(session: nox.Session) -> None:
    """The inner loop: the suite without the tests marked slow (soak, benchmark, long holds).

    Not part of the default run, which runs everything.
    """
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check (generated code excluded), and the layer contracts
    of pyproject.toml's [tool.importlinter] (read from the source, nothing installed)."""
    session.install(*LINT_DEPS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports", env={"PYTHONPATH": str(ROOT)})


@nox.session(python=PYTHONS)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and this file, against this Python's typeshed."""
    session.install("-e", ".[test]", *TYPECHECK_DEPS)
    session.run("mypy", "--strict", "--python-version", str(session.python))


@nox.session(python=PYTHON)
def protos(session: nox.Session) -> None:
    """Regenerate jobsignal/_proto from protos/ (the committed generated code)."""
    session.install(*CODEGEN_DEPS)
    with tempfile.TemporaryDirectory() as tmp:
        _generate(session, Path(tmp))
        shutil.rmtree(GENERATED_DIR, ignore_errors=True)
        shutil.copytree(tmp, GENERATED_DIR)


@nox.session(python=PYTHON)
def protos_check(session: nox.Session) -> None:
    """Fail when the committed generated code is not what `nox -s protos` produces."""
    session.install(*CODEGEN_DEPS)
    with tempfile.TemporaryDirectory() as tmp:
        _generate(session, Path(tmp))
        problems = _tree_differs(Path(tmp), GENERATED_DIR)
    if problems:
        session.error("generated code is stale, run `nox -s protos`: " + "; ".join(problems))


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks against a grpc.aio reference server; writes bench/results/ (about 10 min).

    `nox -s bench -- --quick` runs the tiny smoke configuration.
    """
    session.install("-e", ".[test]", "matplotlib", "py-spy")
    session.run("python", "-m", "bench", *session.posargs)
