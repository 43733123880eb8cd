"""Print job transitions as they happen, in-process: no gRPC server, no sockets to itself.

Run it with `python examples/job_transitions.py [COUNT] [KUBECONFIG]`: it
watches the cluster the kubeconfig names (default: the embedded demo cluster)
and prints the first COUNT transitions (default 10), one line each, then stops
the watcher and exits.
"""

from __future__ import annotations

import sys

import trio

import jobsignal


def describe(event: jobsignal.JobEvent, before: str | None) -> str:
    job = event.job
    where = f"{job.namespace}/{job.job_name}"
    if event.kind is jobsignal.EventKind.ADDED:
        change = f"added {job.job_status}"
    elif event.kind is jobsignal.EventKind.DELETED:
        change = f"deleted ({job.job_status})"
    else:
        change = f"{before} -> {job.job_status}"
    table = event.rank_table()  # parsed only here, when the line needs it
    npus = f", {table.npu_count} NPUs" if table is not None and table.npu_count else ""
    return f"{where}: {change}{npus} [event {event.uuid[:8]}]"


async def main(count: int, kubeconfig: str | None) -> None:
    if kubeconfig:
        config = jobsignal.configure(source="kubernetes", kubeconfig=kubeconfig)
    else:
        config = jobsignal.configure(source="demo")
    status: dict[tuple[str, str], str] = {}
    async with jobsignal.watch_jobs(config) as events:
        printed = 0
        async for event in events:
            print(describe(event, status.get(event.job.key)), flush=True)
            if event.kind is jobsignal.EventKind.DELETED:
                status.pop(event.job.key, None)
            else:
                status[event.job.key] = event.job.job_status
            printed += 1
            if printed == count:
                break


if __name__ == "__main__":
    trio.run(
        main,
        int(sys.argv[1]) if len(sys.argv) > 1 else 10,
        sys.argv[2] if len(sys.argv) > 2 else None,
    )
