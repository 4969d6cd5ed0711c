"""`MachineProfile`: what the suite measured about this machine, built once per process and handed in.

    profile = MachineProfile(device)                     # measures nothing
    dtype, why = profile.dtype("auto", spec, "smollm2-135m")
    profile.prepare(model, "smollm2-135m")               # the linear plan and the latency curve (logged)
    runner = ModelRunner(model, profile=profile)         # the measured linear plan
    curve = profile.latency_curve(runner, "smollm2-135m")

Measurements that decide how the engine runs (the dtype on a CPU with native bf16, the linear plan)
are made once per (machine, torch version, threads, dtype) and kept in `profile_dir(device)`, so
every later run reuses them; each measurement says so in the log ("profiling this machine once:
...") and how long it took. The target's forward-latency curve is measured by every run ("profiling
this machine for this run: ..."; a few seconds): it moves from hour to hour on a shared machine, and
the sizes of `auto` drafts follow it. Its history is kept beside the others. Each keeps the machine's load while it
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
from ..engine.hardware import config_key, machine, profile_dir
from ..engine.linear import KERNELS, LinearPath, LinearPlan, linear_shapes
from ..engine.runner import STOCK, ModelRunner
from . import load
from .curves import CURVE_METHOD, forward_latency
from .plan import measure_plan

# The sizes a curve is measured at: every size a verification on a CPU holds (its budget: 4 to 12
# rows on the AVX512 EPYC), then coarser up to EAGLE-2's adaptive 64
CURVE_SIZES = (*range(1, 13), 16, 24, 32, 64)
CURVE_HISTORY = 20  # the runs' curves a profile folder keeps per model
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
        self._curves: dict[Path, dict] = {}  # file -> this run's curve ({seconds, load})

    # --------------------------------------------------------------------------------------------
    # Measured on a quiet machine, or measured again

    def measure(self, file: Path, what: str, measure, later_runs: bool = True):
        """`measure()`, logged before and after, and the machine's load while it ran; a busy
        measurement gets one warning line. `later_runs`: whether later runs reuse it (else this run only)."""
        if later_runs:
            log.info("profiling this machine once: %s (kept in %s for later runs)", what, file.parent)
        else:
            log.info("profiling this machine for this run: %s (kept with earlier runs' in %s)", what, file.parent)
        before = load.snapshot()
        result = measure()
        record = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **load.state(before, load.snapshot())}
        log.info("profiled %s in %.1f s", what, time.monotonic() - before["wall"])
        self._measured_here.add(file)
        if record["busy"]:
            log.warning("%s was measured beside other work (other processes %.2f cores, steal %.0f%%): this run uses "
                        "it%s (%s)", what, record["other_cores"] or 0, 100 * (record["steal"] or 0),
                        ", the next one measures it again" if later_runs else "", file)
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
            plan, self._plan_loads[key] = self.load_plan(file)
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

    def load_plan(self, file: Path) -> tuple[LinearPlan, list[dict]]:
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
    # The target's forward-latency curve, measured by every run

    def latency_curve(self, runner, model_name: str, sizes: Sequence[int] = CURVE_SIZES, prefix: int = 256,
                      repeats: int = 5) -> dict[int, float]:
        """Median seconds of one forward of n tokens after a `prefix`-token prefix, for each n: measured
        once per run (this profile), at every size a verification on a CPU holds. It decides how large a
        draft can be before verifying it stops paying (`auto` sizes, EAGLE-2's adaptive size, `make perf`).
        Not reused by later runs: this machine's speed moves with its neighbours' memory traffic, and a
        one-token forward moves most (AVX512 EPYC, 2026-11-27/28: t(1) 14.5 ms and v(8) 1.24 in one hour,
        8.9 ms and 1.55 in another), so a stored curve sized the next runs' drafts for another machine.
        Each run's curve joins the profile folder's history of this model's curves (the last
        `CURVE_HISTORY`), and the log states this run's v(n) beside the spread of the runs before it."""
        mode = ("auto" if runner.linear.plan is not None else "off") + ("-fused" if runner.fused else "")
        file = self.folder / f"curve-{model_name}-{config_key(runner.config)}-{runner.precision}-{mode}.json"
        known = self._curves.get(file)
        if known is not None and set(sizes) <= set(known["seconds"]):
            self.use(file, [known["load"]])
            return {n: known["seconds"][n] for n in sizes}
        seconds, record = self.measure(
            file, f"{model_name}'s forward latency at {', '.join(map(str, sizes))} tokens",
            lambda: forward_latency(runner, sizes, prefix, repeats), later_runs=False)
        history = self._curve_history(file, prefix)
        log.info("%s", curve_log_line(model_name, seconds, history))
        history.append({**record, "seconds": {str(n): s for n, s in seconds.items()}})
        self.write(file, {"model": model_name, "method": CURVE_METHOD, "kernels": candidates(), "prefix": prefix,
                          "repeats": repeats, "runs": history[-CURVE_HISTORY:]})
        self._curves[file] = {"seconds": dict(seconds), "load": record}
        self.use(file, [record])
        return dict(seconds)

    @staticmethod
    def _curve_history(file: Path, prefix: int) -> list[dict]:
        """The curves earlier runs measured the same way (none when the file holds another method's)."""
        try:
            stored = json.loads(file.read_text())
        except (OSError, ValueError):
            return []
        same = stored.get("method") == CURVE_METHOD and stored.get("prefix") == prefix
        return list(stored.get("runs") or []) if same else []

    def forward_latency(self, runner, sizes: Sequence[int], what: str, prefix: int = 256,
                        repeats: int = 5) -> dict[int, float]:
        """A forward's latency timed now and not kept (a draft LM's token, EAGLE-2's `total_tokens: auto`),
        logged as profiling like every other measurement."""
        log.info("profiling: %s at %s tokens (not kept)", what, ", ".join(map(str, sizes)))
        return forward_latency(runner, sizes, prefix, repeats)


def curve_log_line(model_name: str, seconds: dict[int, float], history: list[dict]) -> str:
    """One log line: this run's t(1) and v(n) = t(n) / t(1) at a few sizes, and their range over the runs
    before it on this machine (`history`)."""
    shown = [n for n in (2, 4, 8, 12, 16) if n in seconds]
    one = seconds[min(seconds)]
    line = (f"{model_name}'s latency curve this run: t(1) {one * 1e3:.1f} ms, v(n) = t(n)/t(1): "
            + ", ".join(f"v({n}) {seconds[n] / one:.2f}" for n in shown))
    earlier = [{int(n): s for n, s in run["seconds"].items()} for run in history if run.get("seconds")]
    if not earlier:
        return line + " (the first run measured here)"
    ones = [run[min(run)] * 1e3 for run in earlier]
    spread = [f"t(1) {min(ones):.1f}-{max(ones):.1f} ms"]
    for n in shown:
        ratios = [run[n] / run[min(run)] for run in earlier if n in run]
        if ratios:
            spread.append(f"v({n}) {min(ratios):.2f}-{max(ratios):.2f}")
    return line + f"; the {len(earlier)} run(s) before it here: " + ", ".join(spread)
