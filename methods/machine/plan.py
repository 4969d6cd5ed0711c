"""Timing the linear kernels (`engine/linear.py`) for each weight shape and row bucket: the linear plan.
These functions time; the profile (`profile.py`) decides when they run and keeps the plan."""

from __future__ import annotations

import statistics
import time

import torch

from ..engine.linear import BUCKETS, KERNELS, LinearPlan, choose, kernel_available, prepack, run_kernel


@torch.inference_mode()
def measure_plan(shapes: dict[str, tuple[torch.Tensor, torch.Tensor | None]], kernels=KERNELS,
                 buckets=BUCKETS, rounds: int = 5, cache_bytes: int = 96 << 20, max_copies: int = 64) -> LinearPlan:
    """Time each kernel for each shape and bucket, interleaved in `rounds`, on copies of the
    weight whose total exceeds `cache_bytes` (so every call streams its weight from memory, as in
    a real forward; at most `max_copies`: tiny weights stay in cache in real forwards too); keep
    the kernel with the lowest median."""
    plan = LinearPlan()
    for key, (weight, bias) in shapes.items():
        device = weight.device
        usable = [k for k in kernels if kernel_available(k, weight)]
        copies = min(max_copies, max(2, -(-cache_bytes // (weight.numel() * weight.element_size()))))
        weights = [weight.detach().clone() for _ in range(copies)]
        packed = {k: [prepack(k, w) for w in weights] for k in usable}
        samples: dict[int, dict[str, list[float]]] = {b: {k: [] for k in usable} for b in buckets}
        for _ in range(rounds):
            for bucket in buckets:
                x = torch.randn(bucket, weight.shape[1], dtype=weight.dtype, device=device)
                for kernel in usable:
                    run_kernel(kernel, x, weights[0], bias, packed[kernel][0])  # warm the kernel, not the weights
                    start = time.perf_counter()
                    for w, p in zip(weights, packed[kernel]):
                        run_kernel(kernel, x, w, bias, p)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    samples[bucket][kernel].append((time.perf_counter() - start) / copies)
        plan.seconds[key] = {b: {k: statistics.median(v) for k, v in s.items()} for b, s in samples.items()}
        plan.kernels[key] = {b: choose(s) for b, s in plan.seconds[key].items()}
        del weights, packed
    return plan
