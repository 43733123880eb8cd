"""Exponential backoff with jitter, timed by whoever sleeps (trio's clock)."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """The n-th delay lies in [d/2, d] with d = initial * 2**n, capped at `maximum`."""

    def __init__(
        self,
        initial: float = 0.8,
        maximum: float = 30.0,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._initial = initial
        self._maximum = maximum
        self._rng = rng
        self._attempt = 0

    def reset(self) -> None:
        self._attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self._maximum, self._initial * 2.0**self._attempt)
        self._attempt = min(self._attempt + 1, 32)
        jitter: float = self._rng()
        return ceiling * (0.5 + 0.5 * jitter)
