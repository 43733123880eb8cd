"""`jobsignal serve --source demo` as a process of its own, with its gRPC and metrics ports.

For tests of what only a whole process shows: signals, the interpreter's
flags (the container image's -OO). Both ports are
ephemeral; they are read from the server's log lines.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

_PORTS = {
    "grpc": re.compile(r"gRPC listening on 127\.0\.0\.1:(\d+)"),
    "metrics": re.compile(r"metrics on http://127\.0\.0\.1:(\d+)"),
}


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    grpc_port: int
    metrics_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def get(self, path: str) -> tuple[int, bytes]:
        """Status and body of an HTTP GET of `path` on the metrics port."""
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as error:
            return int(error.code), error.read()


@contextmanager
def serving_demo(
    *flags: str, env: Mapping[str, str], within: float = 30.0
) -> Iterator[ServeProcess]:
    """`python -m jobsignal serve --source demo` on 127.0.0.1, metrics on, with `flags`
    and exactly `env` as its environment; killed on the way out if still running."""
    command = [sys.executable, "-m", "jobsignal", "serve", "--source", "demo"]
    command += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=dict(env))
    try:
        assert process.stderr is not None
        ports: dict[str, int] = {}
        log: list[str] = []
        deadline = time.monotonic() + within
        while len(ports) < len(_PORTS) and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            log.append(line)
            for name, pattern in _PORTS.items():
                if match := pattern.search(line):
                    ports[name] = int(match.group(1))
        assert len(ports) == len(_PORTS), "the server did not report its ports:\n" + "".join(log)
        yield ServeProcess(process, ports["grpc"], ports["metrics"])
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()
