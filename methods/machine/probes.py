"""The roofline's inputs: how fast this machine streams memory, and how many bytes a forward reads."""

from __future__ import annotations

import time

import torch

from ..engine import native
from ..engine.hardware import l3_bytes


def read_bandwidth(megabytes: int | None = None, repeats: int = 7, device: torch.device | str = "cpu") -> float:
    """Bytes per second of streaming a large tensor of random values, best of `repeats` (as
    STREAM reports). On the CPU every thread torch uses reads its share with independent vector
    accumulators (`native.stream_read`; torch's `sum` where the native kernels do not build): the
    bandwidth a streaming GEMV can reach, which a single reduction chain understates. Random values
    matter: a never-written tensor reads the zero page and fakes speed. The tensor is four times the
    last-level cache and at least 512 MB: memory's bandwidth, not the cache's. On a GPU give it a
    tensor well past the L2 (1 GiB+) and it times with a sync after each sum."""
    device = torch.device(device)
    if megabytes is None:
        megabytes = max(512, 4 * (l3_bytes() or 0) >> 20)
    x = torch.rand(megabytes * (1 << 20) // 4, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    stream = native.stream_read if device.type == "cpu" and native.unavailable_reason() is None else torch.sum
    stream(x)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        stream(x)
        sync()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def streamed_size(param: torch.Tensor) -> int:
    """Bytes per value the engine reads of a parameter: its element size, or 2 for an fp32 weight matrix
    of bf16 values on a CPU with the native kernels (a draft as stored, a bf16w target: streamed as bf16
    panels; vectors such as norms are read as stored)."""
    if (param.dim() >= 2 and param.device.type == "cpu" and native.unavailable_reason() is None
            and native.bf16_exact(param)):
        return 2
    return param.element_size()


def streamed_weights(model) -> tuple[int, int]:
    """(values, bytes) of the weights one forward streams: every parameter once, except an input embedding
    that is not tied to the LM head (its lookup reads a few rows; a tied matrix is read whole by the
    head), each at `streamed_size`."""
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    seen, values, total = set() if tied else {id(embedding)}, 0, 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            values += param.numel()
            total += param.numel() * streamed_size(param)
    return values, total


def weight_bytes(model) -> int:
    """Bytes of weights one forward streams (`streamed_weights`)."""
    return streamed_weights(model)[1]
