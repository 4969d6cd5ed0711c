"""Timing the target's forward by tokens per forward: the latency curve t(n) that decides how large a
draft tree can be before verifying it stops paying (`settings/sizing.py`). These functions time; the
profile (`profile.py`) decides when they run and keeps what they measured."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

# How a curve is measured (`forward_latency`)
CURVE_METHOD = "masked-verify, warm-up, interleaved rounds, the second of two forwards"


class ForwardTimer:
    """Times one forward of n tokens after a `prefix_length`-token prefix, as a verification runs
    it: a forward of n > 1 tokens carries an explicit float mask (here a chain's; the masked
    attention path, not the causal one) and one of 1 token none, as an AR step; the cache is rolled
    back to the prefix after each. `timer(n)` -> seconds of the second of two forwards of n tokens:
    a decoding loop runs forwards of one size back to back (AR's one token after another, a method's
    verifications of its budget), and the first after a forward of another size pays for what that
    one left in the caches (measured on the AVX512 EPYC: t(1) 9.8 ms timed after 64-token forwards
    against 8.9 ms for an AR step, so v(8) read 1.42 where verifying 8 tokens cost 1.55 AR steps).
    `close()` empties the runner."""

    def __init__(self, runner, sizes: Sequence[int], prefix_length: int = 256):
        self.runner, self.prefix_length = runner, prefix_length
        runner.reset()
        runner.reserve(prefix_length + max(sizes))  # as an answer runs: a static cache (and step, graphs.py)
        runner.prefill([0] * prefix_length)
        self.rows = {size: (range(size), torch.ones(size, size, dtype=torch.bool).tril()) for size in sizes}

    def __call__(self, size: int) -> float:
        runner = self.runner
        runner.forward([0] * size, rows=self.rows[size])  # the forward before it, of the same size
        runner.rollback(self.prefix_length)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        runner.forward([0] * size, rows=self.rows[size])
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        runner.rollback(self.prefix_length)
        return elapsed

    def close(self) -> None:
        self.runner.reset()


def forward_latencies(runners: dict, sizes: Sequence[int], prefix_length: int = 256, repeats: int = 5) -> dict:
    """Median seconds of one forward of `size` tokens after a `prefix_length`-token prefix, per
    runner and size (`ForwardTimer`): {name: {size: seconds}}. Every size runs once untimed first
    (lazy initialisation, packing for a new row count), then runners and sizes are interleaved
    round by round, so that the machine's drift reaches all of them alike. Leaves the runners empty."""
    timers = {name: ForwardTimer(runner, sizes, prefix_length) for name, runner in runners.items()}
    for timer in timers.values():
        for size in sizes:
            timer(size)
    samples = {name: {size: [] for size in sizes} for name in runners}
    for _ in range(repeats):
        for size in sizes:
            for name, timer in timers.items():
                samples[name][size].append(timer(size))
    for timer in timers.values():
        timer.close()
    return {name: {size: statistics.median(v) for size, v in by_size.items()} for name, by_size in samples.items()}


def forward_latency(runner, sizes: Sequence[int], prefix_length: int = 256, repeats: int = 5) -> dict[int, float]:
    """One runner's `forward_latencies`: the hardware curve that decides how large a draft tree can
    be before it stops paying."""
    return forward_latencies({"runner": runner}, sizes, prefix_length, repeats)["runner"]
