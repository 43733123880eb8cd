"""The orchestrator's side of the child processes: start, talk, measure, stop."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
REPO = Path(__file__).resolve().parents[1]


class ChildError(RuntimeError):
    pass


#: A server's CPUs and its peers' CPUs.
CpuSplit = tuple[frozenset[int], frozenset[int]]


def split_cpus() -> CpuSplit | None:
    """One usable CPU for a server and the others for its peers; None with one CPU.

    The server takes the last CPU: the first is where a VM's timer and device
    interrupts tend to land."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        return None
    return frozenset(usable[-1:]), frozenset(usable[:-1])


@contextlib.contextmanager
def _forking_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """While inside, this thread runs on `cpus`, so a child it forks starts on them
    with every thread it makes (the Go runtime's included: a mask set after the
    start would miss the threads it has already made)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class Child:
    """A benchmark child process speaking JSON lines: `python -m bench.<module>`,
    or the program `executable` (the Go load generator and reference server)."""

    def __init__(
        self,
        name: str,
        module: str,
        args: list[str],
        *,
        env: dict[str, str],
        log_dir: Path,
        executable: Path | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        command = [str(executable)] if executable else [sys.executable, "-m", module]
        with _forking_on(cpus):
            self.proc = subprocess.Popen(
                [*command, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                cwd=REPO,
                env=env,
            )
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.pid = self.proc.pid
        self.ready: dict[str, Any] = {}

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        for line in stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise ChildError(f"{self.name}: no answer within {timeout:g}s") from None
        if not line:
            raise ChildError(
                f"{self.name} exited (code {self.proc.poll()}); see {self.log_path}:\n"
                + self.log_tail()
            )
        reply: dict[str, Any] = json.loads(line)
        return reply

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        self.ready = self._next(timeout)
        return self.ready

    def request(self, command: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write((json.dumps(command) + "\n").encode())
            stdin.flush()
        except BrokenPipeError:
            raise ChildError(f"{self.name} is gone:\n{self.log_tail()}") from None
        reply = self._next(timeout)
        if "error" in reply:
            raise ChildError(f"{self.name}: {reply['error']}")
        return reply

    # -- /proc -------------------------------------------------------------

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process (all its threads) so far."""
        return cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return status_bytes(self.pid, "VmRSS")

    def peak_rss_bytes(self) -> int:
        return status_bytes(self.pid, "VmHWM")

    # -- stopping ----------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> None:
        """Close stdin (the child then stops by itself); kill it if it lingers."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        # The reader ends at the pipe's end; a grandchild still holding the pipe
        # would keep it reading, and closing under it would block.
        self._reader.join(5)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    # Fields 14 and 15 of stat(5) (utime, stime); fields[0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def status_bytes(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise ChildError(f"/proc/{pid}/status has no {key}")


class CpuMeter:
    """CPU used by some processes between `start()` and `stop()`, in cores."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._start: list[float] = []
        self._wall = 0.0

    def start(self) -> None:
        self._wall = time.perf_counter()
        self._start = [cpu_seconds(pid) for pid in self.pids]

    def stop(self) -> list[float]:
        wall = time.perf_counter() - self._wall
        return [
            (cpu_seconds(pid) - before) / wall
            for pid, before in zip(self.pids, self._start, strict=True)
        ]


def wait_for(
    check: Any, what: str, timeout: float, interval: float = 0.2, log: IO[str] | None = None
) -> Any:
    """Poll `check()` until it returns something truthy; ChildError after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise ChildError(f"timed out after {timeout:g}s waiting for {what}")
