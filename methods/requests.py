"""Requests that arrive while a batch decodes (continuous batching, `DraftVerifyDecoder.serve`).

A `Requests` holds every request of a run (bounded), each with the time it arrives (seconds after the
loop began: 0 for all of them in a closed loop, whose concurrency alone paces admission; a Poisson
schedule in an open loop, `poisson_arrivals`), and the concurrency: the most sequences the batch holds
at once. The loop takes the requests that have arrived, in arrival order, whenever the batch has room.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from .engine.sampling import SamplingConfig
from .engine.stopping import StopCondition


@dataclass
class Request:
    prompt: list[int]
    stop: StopCondition
    sampling: SamplingConfig = SamplingConfig()
    generator: torch.Generator | None = None
    arrival: float = 0.0  # seconds after the loop began


class Requests:
    """The requests of one serving run, by arrival, and how many may decode at once."""

    def __init__(self, requests: Sequence[Request], concurrency: int, speculate_up_to: int | None = None):
        """`speculate_up_to`: load-aware speculation (arctic-inference's `disable_by_batch_size`): while more
        sequences than this decode together, none drafts (each step verifies its next token alone, as
        AR's); None: always."""
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}: at least 1")
        if speculate_up_to is not None and speculate_up_to < 0:
            raise ValueError(f"speculate_up_to={speculate_up_to}: at least 0, or None")
        if not requests:
            raise ValueError("no request to serve")
        if any(not r.prompt for r in requests):
            raise ValueError("empty prompt")
        self.requests = list(requests)
        self.concurrency = concurrency
        self.speculate_up_to = speculate_up_to
        self.order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))  # arrival order
        self.taken = 0

    def positions(self) -> int:
        """The most positions a request commits (prompt + max new tokens): the cache's reservation."""
        return max(len(r.prompt) + r.stop.max_new_tokens for r in self.requests)

    def due(self, now: float, room: int) -> list[int]:
        """Up to `room` requests (their indices) that arrived by `now`, not taken before, in arrival order."""
        found = []
        while len(found) < room and self.taken < len(self.order) and \
                self.requests[self.order[self.taken]].arrival <= now:
            found.append(self.order[self.taken])
            self.taken += 1
        return found

    def next_arrival(self) -> float | None:
        """When the next request not yet taken arrives (None: every request was taken)."""
        return self.requests[self.order[self.taken]].arrival if self.taken < len(self.order) else None


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """`count` arrival times of a Poisson process of `rate` requests per second (seeded), the first at 0."""
    if rate <= 0:
        raise ValueError(f"rate={rate}: requests per second must be positive")
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times
