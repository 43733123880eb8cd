"""The process's limit of open files, against what the connection limits need.

Every gRPC connection, metrics connection and Kubernetes API connection holds
a file descriptor, and so do the listeners, the event loop and the files the
server reads (tokens, certificates). Service managers and container runtimes
often start a process with a soft limit of 1,024 (systemd's default) and a
far higher hard limit; Go programs raise the soft limit to the hard one as they start, and
`jobsignal serve` does the same (`raise_open_file_limit`). Past the limit,
accepting fails and the port stops accepting for a second at a time
(`rpc.loop_faults`), so `run_jobsignal` warns at start when the limit is
lower than the connection limits need (`shortfall`; docs/architecture.md
section 7, "File descriptors"). It also names the errors `accept()` fails
with past a limit, which both ports answer by pausing.
"""

from __future__ import annotations

import errno

# The errors accept() fails with for want of descriptors or memory: a port pauses
# accepting and tries again (any other error is a bug, not a condition).
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_ERRORS = tuple(sorted(errno.errorcode[number] for number in ACCEPT_CAPACITY_ERRNOS))
WHY_ACCEPT_FAILED = {
    "EMFILE": "the process has as many files open as it may (ulimit -n)",
    "ENFILE": "the system has as many files open as it may (fs.file-max)",
    "ENOBUFS": "the kernel is out of socket buffers",
    "ENOMEM": "the kernel is out of memory",
}

# Descriptors besides the connections: listeners, the event loop's own, the
# Kubernetes API's connections, files read while serving, standard streams.
RESERVED_FILES = 64


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise the soft limit of open files to the hard limit; the soft limit before and
    after, or None where there is no such limit (not POSIX)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft  # a sandbox that refuses it: the soft limit stands
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_file_limit() -> int | None:
    """The soft limit of open files; None when unlimited or not POSIX."""
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def shortfall(connections: int, limit: int | None) -> str | None:
    """Why `limit` open files are too few for `connections` at once, or None."""
    needed = connections + RESERVED_FILES
    if limit is None or limit >= needed:
        return None
    return (
        f"this process may open {limit} files (ulimit -n), fewer than the {needed} its"
        f" connection limits may need ({connections} connections and {RESERVED_FILES} more):"
        " past the limit the gRPC port stops accepting for a second at a time; raise"
        " the limit (LimitNOFILE, ulimit -n) or lower --max-connections"
    )
