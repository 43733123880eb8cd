"""Embed jobsignal in a trio program: serve the demo cluster, subscribe, print, stop.

Run it with `python examples/embed.py [COUNT]`: it prints the first COUNT job
signals (default 5) that a CCAgent subscriber receives, then shuts the server
down gracefully and exits.
"""

from __future__ import annotations

import sys

import trio

import jobsignal


async def main(count: int) -> None:
    config = jobsignal.configure(listen="127.0.0.1:0", source="demo", log_level="warning")
    async with trio.open_nursery() as nursery:
        server: jobsignal.RunningJobsignal = await nursery.start(jobsignal.serve, config)
        await server.ready.wait()
        options = jobsignal.SubscribeOptions("127.0.0.1", server.port, role="CCAgent")
        async with jobsignal.open_subscription(options) as signals:
            received = 0
            async for signal in signals:
                assert isinstance(signal, jobsignal.JobSummarySignal)
                print(
                    f"{signal.namespace}/{signal.job_name}: {signal.job_status} ({signal.operator})"
                )
                received += 1
                if received == count:
                    break
        server.request_shutdown()


if __name__ == "__main__":
    # Ctrl-C at a checkpoint, never inside asyncio's code (docs/embedding.md).
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    trio.run(main, count, restrict_keyboard_interrupt_to_checkpoints=True)
