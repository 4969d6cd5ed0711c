"""The hardware profile: what this machine is, the dtype it should run, and what it measured.

Measurements that decide how the engine runs (the linear plan, the target's forward-latency
curve) are made once per (machine, torch version, threads, dtype) and kept in
`cache_root()/profiles/<machine key>/`, so every later run reuses them; `make perf` shows them.
Each keeps the machine's load while it was measured (`load.py`, the busy check of the answers):
one measured beside other work serves the run that measured it (with a warning) and is measured
again by the next run. `profiles_used()` names the files a run used, when and how quietly they
were measured (every results folder records it, `environment.json`'s `engine.profiles`).

The machine key names the CPU model and its ISA class (two machines sold as "AMD EPYC" can differ:
one with AVX2 only, emulating bf16 matmuls; one with AVX512 + AVX512-BF16), or the GPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch

from . import load, native
from .identity import l3_bytes, machine, profile_dir
from .linear import KERNELS, LinearPath, LinearPlan, linear_shapes, measure_plan

SKINNY_GEMM_MODES = ("auto", "off")
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# Measured on a quiet machine, or measured again

_MEASURED_HERE: set[Path] = set()  # profile files this process measured: a busy one is not measured again here
_USED: dict[str, dict] = {}  # profile file -> when and how quietly it was measured (`profiles_used`)


def _measure(file: Path, what: str, measure):
    """`measure()`, and the machine's load while it ran; a busy measurement gets one warning line."""
    before = load.snapshot()
    result = measure()
    record = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **load.state(before, load.snapshot())}
    _MEASURED_HERE.add(file)
    if record["busy"]:
        log.warning("%s was measured beside other work (other processes %.2f cores, steal %.0f%%): this run uses it, "
                    "the next one measures it again (%s)", what, record["other_cores"] or 0,
                    100 * (record["steal"] or 0), file)
    return result, record


def _usable(file: Path, loads: list) -> bool:
    """A stored measurement is used when all of it was measured on a quiet machine (a file without
    its load is measured again), or by this process."""
    return file in _MEASURED_HERE or (bool(loads) and all(isinstance(r, dict) and not load.is_busy(r) for r in loads))


def _used(file: Path, loads: list[dict]) -> None:
    _USED[str(file)] = {"measured": loads[-1]["at"], "quiet": not any(load.is_busy(r) for r in loads),
                        "max_other_cores": max((r.get("other_cores") or 0.0 for r in loads), default=None)}


def profiles_used() -> dict[str, dict]:
    """The profile files this process used: {file: {measured (UTC, the latest part), quiet, max_other_cores}}."""
    return {file: dict(record) for file, record in _USED.items()}


# ------------------------------------------------------------------------------------------------
# The linear plan (one per process, machine and dtype; shapes added as models appear)

_PATHS: dict[tuple, LinearPath] = {}
_PLAN_LOADS: dict[tuple, list[dict]] = {}  # the load while each part of a plan was measured


def linear_path(models, mode: str = "auto") -> LinearPath:
    """The linear path for these models: `off` is stock `F.linear`; `auto` uses the measured
    plan of this machine, measuring (once, cached on disk) the shapes it does not know yet."""
    if mode not in SKINNY_GEMM_MODES:
        raise ValueError(f"engine.skinny_gemm={mode!r}; valid: {', '.join(SKINNY_GEMM_MODES)}")
    models = [m for m in models if m is not None]
    param = next(models[0].parameters())
    device, dtype = param.device, param.dtype
    if mode == "off" or device.type != "cpu":  # cuBLAS handles skinny GEMMs; measure there when a GPU is lent
        return _PATHS.setdefault(("off",), LinearPath(None))
    LinearPath.adopt(*models)
    key = (str(device), str(dtype))
    file = _plan_file(device, dtype)
    path = _PATHS.get(key)
    if path is None:
        plan, _PLAN_LOADS[key] = _load_plan(file)
        path = _PATHS[key] = LinearPath(plan)
    shapes = {k: v for k, v in linear_shapes(*models).items() if k not in path.plan.kernels}
    if shapes:
        log.info("measuring the linear path for %d weight shape(s) (once per machine and dtype, then cached)",
                 len(shapes))
        measured, record = _measure(file, "the linear plan", lambda: measure_plan(shapes))
        path.plan.kernels.update(measured.kernels)
        path.plan.seconds.update(measured.seconds)
        _PLAN_LOADS[key].append(record)
        _write_json(file.parent / "machine.json", machine(device))
        _write_json(file, {"candidates": _candidates(), "load": _PLAN_LOADS[key], **path.plan.to_dict()})
    if _PLAN_LOADS[key]:
        _used(file, _PLAN_LOADS[key])
    return path


def _plan_file(device: torch.device, dtype: torch.dtype) -> Path:
    return profile_dir(device) / f"linear-{str(dtype).replace('torch.', '')}.json"


def _load_plan(file: Path) -> tuple[LinearPlan, list[dict]]:
    """The stored plan and the loads it was measured under, or an empty one: none stored, damaged,
    chosen among other kernels, or measured (in part) beside other work."""
    if file.is_file():
        try:
            data = json.loads(file.read_text())
            if data.get("candidates") == _candidates() and _usable(file, data.get("load")):
                return LinearPlan.from_dict(data), list(data["load"])
        except (ValueError, KeyError, AttributeError, TypeError):
            pass  # a damaged file is measured again
    return LinearPlan(), []


def _candidates() -> list[str]:
    """The kernels a plan chooses among, the native one named by its build."""
    return [f"native-{native.digest()}" if kernel == "native" else kernel for kernel in KERNELS]


def _write_json(file: Path, data) -> None:
    """Write whole or not at all: concurrent jobs of a sweep may write the same profile file."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(file)


# ------------------------------------------------------------------------------------------------
# Memory bandwidth and the roofline


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


# ------------------------------------------------------------------------------------------------
# The target's forward-latency curve, cached


# How a curve is measured (`forward_latency`); a cached curve of another method is measured again.
CURVE_METHOD = "masked-verify, warm-up, interleaved rounds"


class ForwardTimer:
    """Times one forward of n tokens after a `prefix_length`-token prefix, as a verification runs
    it: a forward of n > 1 tokens carries an explicit float mask (here a chain's; the masked
    attention path, not the causal one) and one of 1 token none, as an AR step; the cache is rolled
    back to the prefix after each. `timer(n)` -> seconds; `close()` empties the runner."""

    def __init__(self, runner, sizes: Sequence[int], prefix_length: int = 256):
        self.runner, self.prefix_length = runner, prefix_length
        runner.reset()
        runner.reserve(prefix_length + max(sizes))  # as an answer runs: a static cache (and step, graphs.py)
        runner.prefill([0] * prefix_length)
        self.rows = {size: (range(size), torch.ones(size, size, dtype=torch.bool).tril()) for size in sizes}

    def __call__(self, size: int) -> float:
        runner = self.runner
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


def latency_curve(runner, model_name: str, sizes=(1, 2, 4, 8, 16, 32, 64), prefix: int = 256,
                  repeats: int = 5, refresh: bool = False) -> dict[int, float]:
    """Median seconds of one forward of n tokens after a `prefix`-token prefix, for each n: measured
    once per (machine, model, dtype, linear path) and kept in the profile folder. It decides how
    large a draft tree can be before verifying it stops paying (EAGLE-2 `adaptive`, `make perf`)."""
    mode = runner.skinny_gemm + ("-fused" if runner.fused else "")
    shape = hashlib.sha1(json.dumps(runner.config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:8]
    dtype = str(runner.dtype).replace("torch.", "")
    file = profile_dir(runner.device) / f"curve-{model_name}-{shape}-{dtype}-{mode}.json"
    if file.is_file() and not refresh:
        stored = json.loads(file.read_text())
        if (stored.get("prefix") == prefix and stored.get("method") == CURVE_METHOD
                and stored.get("kernels") == _candidates() and set(map(int, stored["seconds"])) >= set(sizes)
                and _usable(file, [stored.get("load")])):
            _used(file, [stored["load"]])
            return {int(n): s for n, s in stored["seconds"].items() if int(n) in sizes}
    log.info("measuring %s's forward latency at %s tokens (once per machine, model and dtype, then cached)",
             model_name, ", ".join(map(str, sizes)))
    seconds, record = _measure(file, f"{model_name}'s latency curve",
                               lambda: forward_latency(runner, sizes, prefix, repeats))
    _write_json(file, {"model": model_name, "method": CURVE_METHOD, "kernels": _candidates(), "prefix": prefix,
                       "repeats": repeats,
                       "load": record, "seconds": {str(n): s for n, s in seconds.items()}})
    _used(file, [record])
    return seconds
