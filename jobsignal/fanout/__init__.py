"""Fan-out: encode each job event once and hand the bytes to every subscriber's queue."""

from jobsignal.fanout.broadcaster import Broadcaster
from jobsignal.fanout.subscriber import EndReason, StreamKind, Subscriber

__all__ = ["Broadcaster", "EndReason", "StreamKind", "Subscriber"]
