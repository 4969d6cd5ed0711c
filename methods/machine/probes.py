"""The roofline's inputs: how fast this machine streams memory, and how many bytes a forward reads."""

from __future__ import annotations

import statistics
import time

import torch

from ..engine.hardware import l3_bytes


def read_bandwidth(megabytes: int | None = None, repeats: int = 7, device: torch.device | str = "cpu") -> float:
    """Bytes per second of streaming a large tensor of random values (`x.sum()`), median of
    `repeats`. Random values matter: a never-written tensor reads the zero page and fakes speed.
    The tensor is twice the last-level cache (at least 256 MB; some Xeons have 480 MB of L3): memory's
    bandwidth, not the cache's. On a GPU give it a tensor well past the L2 (1 GiB+) and it times
    with a sync after each sum."""
    device = torch.device(device)
    if megabytes is None:
        megabytes = max(256, 2 * (l3_bytes() or 0) >> 20)
    x = torch.rand(megabytes * (1 << 20) // 4, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x.sum()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        sync()
        samples.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(samples)


def weight_bytes(model) -> int:
    """Bytes of weights one forward streams: every parameter once, except an input embedding that
    is not tied to the LM head (its lookup reads a few rows; a tied matrix is read whole by the head)."""
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    seen, total = set() if tied else {id(embedding)}, 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total
