"""Maximum connection age: when a connection is asked to go, and how long its streams get.

As grpc-go's MaxConnectionAge and MaxConnectionAgeGrace (docs/architecture.md
section 3, "Maximum connection age"): `--max-connection-age` after a
connection opened (less or more 10 %, at random, so connections opened
together do not all go together), the server sends a GOAWAY with the highest
stream id HTTP/2 allows and a PING; the client opens its new RPCs on a new
connection, through the Service to any replica. Once the PING is answered (or
after `GOAWAY_PING_TIMEOUT`) a second GOAWAY names the last stream the server
took: later ones are refused with REFUSED_STREAM, which clients retry
transparently. The streams already open go on. With `--max-connection-age-grace`
they get that long: then each subscription ends with UNAVAILABLE, "the
connection reached its maximum age", and the connection closes. Without a grace
(the default, as grpc-go's) they go on until they end for another reason.

A subscription cannot move to another connection: ending it is the only way
to move it, and some of ClusterD's clients never recover from a stream end
(FD-OL v7.x). So the age alone never ends a stream; only the grace does.

`MaxAgePolicy` is the rule alone; `Aging` is one connection's state, driven by
`rpc.connections` on the asyncio loop's timers (trio's clock, under trio-asyncio).
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Callable
from dataclasses import dataclass

from jobsignal.config import LayerSettings, from_setting

# grpc-go's jitter: the age is drawn from [0.9, 1.1) of the setting.
JITTER = 0.1
# The opaque data of the PING sent with the first GOAWAY (any 8 bytes do).
GOAWAY_PING = b"max_age!"
# Seconds to wait for that PING's ACK before the second GOAWAY goes anyway (grpc-go's).
GOAWAY_PING_TIMEOUT = 60.0
# Seconds between checks of a draining connection for streams still open. A
# subscription's end and a stream reset by the client close it at once when
# it was the last; this is for the other calls (a health Watch, a unary call).
DRAIN_POLL = 10.0
# Seconds the streams ended at the end of the grace get to write their status
# before the connection closes anyway (a peer that does not read).
FINAL_WRITE_TIMEOUT = 5.0
# The GOAWAYs' debug data, and the close reason counted.
REASON = "max_age"
# The highest stream id HTTP/2 allows: the first GOAWAY refuses nothing.
MAX_STREAM_ID = 2**31 - 1


@dataclass(frozen=True)
class MaxAgePolicy(LayerSettings):
    """Each field is a setting (jobsignal/config.py); `age` None: connections never age."""

    age: float | None = from_setting(lambda c: c.max_connection_age)
    grace: float | None = from_setting(lambda c: c.max_connection_age_grace)

    def jittered_age(self, draw: Callable[[], float] = random.random) -> float | None:
        """This connection's age: the setting less or more 10 %, `draw()` in [0, 1)."""
        if self.age is None:
            return None
        return self.age * (1.0 + JITTER * (2.0 * draw() - 1.0))


class Stage(enum.Enum):
    YOUNG = "young"  # before its age
    PINGED = "pinged"  # first GOAWAY and its PING sent, waiting for the ACK
    DRAINING = "draining"  # second GOAWAY sent: no new stream, the open ones go on
    ENDING = "ending"  # grace over: its streams are ended, then it closes


class Aging:
    """One connection's progress through its maximum age, and its timers."""

    __slots__ = ("grace_timer", "last_stream_id", "stage", "timer")

    def __init__(self, timer: asyncio.TimerHandle) -> None:
        self.stage = Stage.YOUNG
        # The age timer, then the PING's timeout, then the drain poll.
        self.timer: asyncio.TimerHandle | None = timer
        self.grace_timer: asyncio.TimerHandle | None = None
        # The stream id the second GOAWAY names (None before it).
        self.last_stream_id: int | None = None

    @property
    def refusing(self) -> bool:
        """New streams are refused: the second GOAWAY has gone."""
        return self.last_stream_id is not None

    def set_timer(self, timer: asyncio.TimerHandle | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = timer

    def cancel(self) -> None:
        self.set_timer(None)
        if self.grace_timer is not None:
            self.grace_timer.cancel()
            self.grace_timer = None
