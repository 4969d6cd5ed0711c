"""`MachineProfile`: what the suite measured about this machine, built once per process and handed in.

    profile = MachineProfile(device)                     # measures nothing
    dtype, why = profile.dtype("auto", spec, "smollm2-135m")
    profile.prepare(model, "smollm2-135m")               # the linear plan and the latency curve (logged)
    runner = ModelRunner(model, profile=profile)         # the measured linear plan
    curve = profile.latency_curve(runner, "smollm2-135m")

Measurements that decide how the engine runs (the dtype on a CPU with native bf16, the linear plan,
the target's forward-latency curve) are made once per (machine, torch version, threads, dtype) and
kept in `profile_dir(device)`, so every later run reuses them; each measurement says so in the log
("profiling this machine once: ...") and how long it took. Each keeps the machine's load while it
was measured (`load.py`, the busy check of the answers): one measured beside other work serves this
profile (with a warning) and is measured again by the next process. `used()` names the files a run
used, when and how quietly they were measured (every results folder records it,
`environment.json`'s `engine.profiles`).

Nothing else in the suite times the machine: a `ModelRunner` given no profile runs stock `F.linear`,
and a method built without one (`BuildContext.profile`) takes upstream's fixed sizes for `auto`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch

from ..engine import native
from ..engine.linear import KERNELS, LinearPath, LinearPlan, linear_shapes
from ..engine.runner import STOCK, ModelRunner
from . import load
from .curves import forward_latency
from .identity import config_key, machine, profile_dir
from .plan import measure_plan

# How a curve is measured (`curves.forward_latency`); a cached curve of another method is measured again.
CURVE_METHOD = "masked-verify, warm-up, interleaved rounds"
CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
log = logging.getLogger(__name__)


def candidates() -> list[str]:
    """The kernels a plan chooses among, the native one named by its build."""
    return [f"native-{native.digest()}" if kernel == "native" else kernel for kernel in KERNELS]


class MachineProfile:
    """One machine's measurements, read from its profile folder and measured where missing."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.folder = profile_dir(self.device)
        self._measured_here: set[Path] = set()  # files this profile measured: a busy one is not measured again
        self._used: dict[str, dict] = {}  # file -> when and how quietly it was measured (`used`)
        self._paths: dict[tuple, LinearPath] = {}  # one linear path per dtype, shared by every runner
        self._plan_loads: dict[tuple, list[dict]] = {}  # the load while each part of a plan was measured

    # --------------------------------------------------------------------------------------------
    # Measured on a quiet machine, or measured again

    def measure(self, file: Path, what: str, measure):
        """`measure()`, logged before and after, and the machine's load while it ran; a busy
        measurement gets one warning line."""
        log.info("profiling this machine once: %s (kept in %s for later runs)", what, file.parent)
        before = load.snapshot()
        result = measure()
        record = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **load.state(before, load.snapshot())}
        log.info("profiled %s in %.1f s", what, time.monotonic() - before["wall"])
        self._measured_here.add(file)
        if record["busy"]:
            log.warning("%s was measured beside other work (other processes %.2f cores, steal %.0f%%): this run uses "
                        "it, the next one measures it again (%s)", what, record["other_cores"] or 0,
                        100 * (record["steal"] or 0), file)
        return result, record

    @staticmethod
    def write(file: Path, data) -> None:
        """Write whole or not at all: concurrent jobs of a sweep may write the same profile file."""
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(file)

    def usable(self, file: Path, loads: list) -> bool:
        """A stored measurement is used when all of it was measured on a quiet machine (a file without
        its load is measured again), or by this profile."""
        return file in self._measured_here or (
            bool(loads) and all(isinstance(r, dict) and not load.is_busy(r) for r in loads))

    def use(self, file: Path, loads: list[dict]) -> None:
        self._used[str(file)] = {"measured": loads[-1].get("at"), "quiet": not any(load.is_busy(r) for r in loads),
                                 "max_other_cores": max((r.get("other_cores") or 0.0 for r in loads), default=None)}

    def used(self) -> dict[str, dict]:
        """The profile files this profile used: {file: {measured (UTC, the latest part), quiet, max_other_cores}}."""
        return {file: dict(record) for file, record in self._used.items()}

    # --------------------------------------------------------------------------------------------
    # What the harness asks once per run

    def dtype(self, name: str, spec=None, model_name: str = "model") -> tuple[torch.dtype, str]:
        """The dtype a run loads its target in, and why (`dtype.py`)."""
        from .dtype import choose_dtype  # lazy: model loading (transformers), only where a dtype is chosen

        return choose_dtype(self, name, spec, model_name)

    def prepare(self, model, model_name: str, skinny_gemm: str = "auto") -> None:
        """Everything a run on `model` reads from the profile, measured now where missing: the linear plan
        for its weight shapes and its latency curve (a method's `auto` size reads it). The harness calls it
        once, before building any decoder, so that building them measures nothing of the target."""
        self.latency_curve(ModelRunner(model, skinny_gemm, profile=self), model_name)

    # --------------------------------------------------------------------------------------------
    # The linear plan (one path per dtype; shapes added as models appear)

    def linear_path(self, models) -> LinearPath:
        """The measured linear path for these models (`engine.skinny_gemm=auto`; `off` never asks the
        profile): this machine's plan, measuring (once, cached on disk) the shapes it does not know yet."""
        models = [m for m in models if m is not None]
        param = next(models[0].parameters())
        device, dtype = param.device, param.dtype
        if device.type != "cpu":  # cuBLAS handles skinny GEMMs
            return STOCK
        LinearPath.adopt(*models)
        key = (str(device), str(dtype))
        file = self.folder / f"linear-{str(dtype).replace('torch.', '')}.json"
        path = self._paths.get(key)
        if path is None:
            plan, self._plan_loads[key] = self._load_plan(file)
            path = self._paths[key] = LinearPath(plan)
        shapes = {k: v for k, v in linear_shapes(*models).items() if k not in path.plan.kernels}
        if shapes:
            measured, record = self.measure(file, f"the linear plan for {len(shapes)} weight shape(s)",
                                            lambda: measure_plan(shapes))
            path.plan.kernels.update(measured.kernels)
            path.plan.seconds.update(measured.seconds)
            self._plan_loads[key].append(record)
            self.write(file.parent / "machine.json", machine(device))
            self.write(file, {"candidates": candidates(), "load": self._plan_loads[key], **path.plan.to_dict()})
        if self._plan_loads[key]:
            self.use(file, self._plan_loads[key])
        return path

    def _load_plan(self, file: Path) -> tuple[LinearPlan, list[dict]]:
        """The stored plan and the loads it was measured under, or an empty one: none stored, damaged,
        chosen among other kernels, or measured (in part) beside other work."""
        if file.is_file():
            try:
                data = json.loads(file.read_text())
                if data.get("candidates") == candidates() and self.usable(file, data.get("load")):
                    return LinearPlan.from_dict(data), list(data["load"])
            except (ValueError, KeyError, AttributeError, TypeError):
                pass  # a damaged file is measured again
        return LinearPlan(), []

    # --------------------------------------------------------------------------------------------
    # The target's forward-latency curve, cached

    def latency_curve(self, runner, model_name: str, sizes: Sequence[int] = CURVE_SIZES, prefix: int = 256,
                      repeats: int = 5, refresh: bool = False) -> dict[int, float]:
        """Median seconds of one forward of n tokens after a `prefix`-token prefix, for each n: measured
        once per (machine, model, dtype, linear path) and kept in the profile folder. It decides how
        large a draft tree can be before verifying it stops paying (`auto` sizes, `make perf`)."""
        mode = ("auto" if runner.linear.plan is not None else "off") + ("-fused" if runner.fused else "")
        dtype = str(runner.dtype).replace("torch.", "")
        file = self.folder / f"curve-{model_name}-{config_key(runner.config)}-{dtype}-{mode}.json"
        if file.is_file() and not refresh:
            stored = json.loads(file.read_text())
            if (stored.get("prefix") == prefix and stored.get("method") == CURVE_METHOD
                    and stored.get("kernels") == candidates() and set(map(int, stored["seconds"])) >= set(sizes)
                    and self.usable(file, [stored.get("load")])):
                self.use(file, [stored["load"]])
                return {int(n): s for n, s in stored["seconds"].items() if int(n) in sizes}
        seconds, record = self.measure(
            file, f"{model_name}'s forward latency at {', '.join(map(str, sizes))} tokens",
            lambda: forward_latency(runner, sizes, prefix, repeats))
        self.write(file, {"model": model_name, "method": CURVE_METHOD, "kernels": candidates(), "prefix": prefix,
                          "repeats": repeats, "load": record, "seconds": {str(n): s for n, s in seconds.items()}})
        self.use(file, [record])
        return seconds

    def forward_latency(self, runner, sizes: Sequence[int], what: str, prefix: int = 256,
                        repeats: int = 5) -> dict[int, float]:
        """A forward's latency timed now and not kept (a draft LM's token, EAGLE-2's `total_tokens: auto`),
        logged as profiling like every other measurement."""
        log.info("profiling: %s at %s tokens (not kept)", what, ", ".join(map(str, sizes)))
        return forward_latency(runner, sizes, prefix, repeats)
