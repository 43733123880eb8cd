"""Debian's Chromium, headless, as the browser tests run it.

Every run has a fresh profile and loads one page of 127.0.0.1: the flags keep
it from calling home (no background networking, component updates, sync or
QUIC), and its resolver maps every other host name to nothing. Installing it
takes root (Debian's `chromium`; `.ci/run` installs it in CI), so where it is
missing it is a peer this machine does not have (tests/support/peers_needed.py):
its tests are not run locally, and fail in CI.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import trio

from bench.toolchains import Missing
from tests.support.peers_needed import need

REQUIRED_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
LOCAL_ONLY_FLAGS = (
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--no-proxy-server",
    "--disable-extensions",
    "--no-default-browser-check",
    "--mute-audio",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)
RUN_TIMEOUT = 90.0


def _find_chromium() -> tuple[str, str]:
    path = shutil.which("chromium")
    if path is None:
        raise Missing("Debian's chromium is not installed", "`apt-get install chromium` (as root)")
    return path, "Debian chromium"


def chromium_path() -> str:
    return need("chromium", _find_chromium)


async def run_chromium(url: str, workdir: Path, *flags: str) -> bytes:
    """Chromium's standard output for `url` (a 127.0.0.1 page) with `flags`."""
    if not url.startswith("http://127.0.0.1:"):
        raise ValueError(f"only pages of 127.0.0.1 are loaded, not {url!r}")
    home = trio.Path(workdir / "home")
    await home.mkdir(parents=True, exist_ok=False)  # a fresh profile each time
    command = [
        chromium_path(),
        *REQUIRED_FLAGS,
        *LOCAL_ONLY_FLAGS,
        f"--user-data-dir={workdir / 'profile'}",
        *flags,
        url,
    ]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
    }
    with trio.fail_after(RUN_TIMEOUT):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False, env=env
        )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout
