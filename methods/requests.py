"""Requests that arrive while a batch decodes (continuous batching, `DraftVerifyDecoder.serve`).

A `Requests` holds every request of a run (bounded) and the concurrency: the most sequences the batch
holds at once. In an open loop each request arrives at its time (seconds after the loop began, a Poisson
schedule: `poisson_arrivals`) and waits for room when the batch is full: the wait counts in its TTFT and
latency. In a closed loop (arrival None) c clients each send a request when their previous one ended: a
request is sent when the batch has room, and its TTFT and latency count from then. The loop takes the
requests due, in order, whenever the batch has room.
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
    # seconds after the loop began (an open loop's arrival: a wait for room counts in its TTFT and latency);
    # None: a closed loop's request, sent when the batch has room (its client's previous request ended)
    arrival: float | None = None


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
        self.order = sorted(range(len(requests)), key=lambda i: (self.due_at(i), i))  # arrival order
        self.taken = 0

    def due_at(self, index: int) -> float:
        """When request `index` may join: its arrival, or at once (a closed loop's, paced by the concurrency)."""
        arrival = self.requests[index].arrival
        return 0.0 if arrival is None else arrival

    def positions(self) -> int:
        """The most positions a request commits (prompt + max new tokens): the cache's reservation."""
        return max(len(r.prompt) + r.stop.max_new_tokens for r in self.requests)

    def due(self, now: float, room: int) -> list[int]:
        """Up to `room` requests (their indices) that arrived by `now`, not taken before, in arrival order."""
        found = []
        while len(found) < room and self.taken < len(self.order) and \
                self.due_at(self.order[self.taken]) <= now:
            found.append(self.order[self.taken])
            self.taken += 1
        return found

    def next_arrival(self) -> float | None:
        """When the next request not yet taken arrives (None: every request was taken)."""
        return self.due_at(self.order[self.taken]) if self.taken < len(self.order) else None


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """`count` arrival times of a Poisson process of `rate` requests per second (seeded), the first at 0."""
    if rate <= 0:
        raise ValueError(f"rate={rate}: requests per second must be positive")
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times
