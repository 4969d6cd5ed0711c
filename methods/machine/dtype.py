"""`dtype=auto`: the precision a run loads its target in, and why (recorded beside every result). On a
CPU the flags do not decide: each half precision it can run is timed against fp32, once per machine and
model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..engine import native
from ..engine.hardware import auto_dtype, config_key
from ..engine.runner import ModelRunner
from ..models.loading import DTYPES, PRECISIONS, from_pretrained, load_model, local_folder
from ..models.specs import ModelSpec
from .curves import forward_latencies

BF16_CLEARLY_FASTER = 0.8  # on a CPU, a half precision only where its forward takes at most this share of fp32's
SIZES = (1, 4)  # the forwards timed: a decoding step and a small verification
REPEATS = 9  # rounds: the median of each precision's forwards
# bytes per weight as loaded: bf16w keeps its fp32 tensors beside the bf16 panels the kernel streams
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, native.WEIGHTS_BF16: 6}


def choose_dtype(profile, name: str, spec: ModelSpec | None = None,
                 model_name: str = "model") -> tuple[torch.dtype | str, str]:
    """The precision a run loads its target in (a torch dtype, or `bf16w`: weights-only bf16), and why
    (recorded beside every result).

    `auto`: on CUDA bf16 where supported, else fp16. On a CPU the flags do not decide: the engine's fp32
    path has its own kernels, which also stream weights of bf16 values in half the bytes (`bf16w`), while
    bf16 arithmetic goes through torch's. So the target's forward is timed at 1 and 4 tokens in fp32 and
    in each half precision the CPU can run (`bf16w` where the native kernels build; `bfloat16` too on a
    CPU with native bf16 matmul), loaded together and interleaved round by round (`_time_half`), once
    per machine and model (kept in the hardware profile), and a half
    precision is taken only where it is clearly faster (at most BF16_CLEARLY_FASTER of fp32's time at
    both sizes; the fastest such one): its outputs differ from fp32's at near-ties. Without `spec`
    nothing is timed (the flags' choice); a model whose fp32 weights would fill half the memory
    available is bf16 on a CPU with native bf16."""
    if name != "auto":
        if name not in PRECISIONS:
            raise ValueError(f"unknown dtype {name!r}; valid: auto, {', '.join(PRECISIONS)}")
        return DTYPES.get(name, name), f"dtype={name} asked for"
    device = profile.device
    dtype, reason = auto_dtype(device)
    if device.type != "cpu" or spec is None:
        return dtype, reason
    candidates = [name for name, runs in (("bfloat16", dtype == torch.bfloat16),
                                          (native.WEIGHTS_BF16, native.unavailable_reason() is None)) if runs]
    if not candidates:
        return dtype, f"{reason}; no native kernels here ({native.unavailable_reason()}) to stream bf16 weights"
    config = from_pretrained(AutoConfig, local_folder(spec), "config")
    file = profile.folder / f"dtype-{model_name}-{config_key(config)}.json"  # one per machine and model shape
    ratios = _stored_ratios(profile, file, candidates)
    if ratios is None:
        available, parameters = _available_memory(), _parameter_count(config)
        fp32_bytes = 4 * parameters
        if dtype == torch.bfloat16 and available and fp32_bytes > available / 2:
            return torch.bfloat16, (f"{reason}; fp32 weights ({fp32_bytes / 2**30:.1f} GiB) would fill more than half "
                                    f"the memory available ({available / 2**30:.1f} GiB), so not timed")
        ratios = _time_half(profile, spec, model_name, file, candidates, available, parameters)
    timed = "; ".join(f"{half} {r[1]:.2f}x (1 token), {r[4]:.2f}x (4 tokens)" for half, r in ratios.items())
    timed = f"the target's forward against fp32's: {timed} (timed once per machine and model)"
    clear = {half: max(r.values()) for half, r in ratios.items() if max(r.values()) <= BF16_CLEARLY_FASTER}
    if clear:
        best = min(clear, key=clear.get)
        return DTYPES.get(best, best), f"{reason}; {timed}: {best}, clearly faster"
    return torch.float32, (f"{reason}; {timed}: fp32, since no half precision is clearly faster (needs <= "
                           f"{BF16_CLEARLY_FASTER}x) and they differ from fp32 at near-ties")


def _stored_ratios(profile, file: Path, candidates: list[str]) -> dict[str, dict[int, float]] | None:
    """Each half precision's time over fp32's from the profile, when measured on a quiet machine or by this
    profile for every candidate (else None: measure again), so that a later run decides without loading
    the model again."""
    if not file.is_file():
        return None
    stored = json.loads(file.read_text())
    ratios = stored.get("ratios_by_dtype") or {}
    if (set(ratios) != set(candidates) or stored.get("repeats") != REPEATS  # timed as now: interleaved
            or not profile.usable(file, [stored.get("load")])):
        return None
    profile.use(file, [stored["load"]])
    return {half: {int(n): r for n, r in ratios[half].items()} for half in candidates}


def _time_half(profile, spec: ModelSpec, model_name: str, file: Path, candidates: list[str],
               available: int | None, parameters: int) -> dict[str, dict[int, float]]:
    """The target's forward in each half precision over fp32 at 1 and 4 tokens, kept in `file` with the
    machine's load while measured and how they were timed. Loaded together where fp32 and every half
    precision fit in half the memory available, and timed round by round (`forward_latencies`: a drift of
    the machine's speed reaches all of them alike; timed one after another, a drift between two loads
    decided the choice); else each loaded and timed in turn."""
    names = ["float32", *candidates]
    weights = sum(DTYPE_BYTES[n] for n in names) * parameters
    together = available is None or weights <= available / 2
    how = "together, interleaved round by round" if together else "one after another (too large to load together)"

    def measure() -> dict[str, dict[int, float]]:
        seconds = {}
        for loaded in [names] if together else [[name] for name in names]:
            runners = {name: ModelRunner(load_model(spec, DTYPES.get(name, name), profile.device), profile=profile)
                       for name in loaded}
            seconds.update(forward_latencies(runners, SIZES, repeats=REPEATS))
            del runners
        return {half: {n: seconds[half][n] / seconds["float32"][n] for n in SIZES} for half in candidates}

    ratios, record = profile.measure(file, f"{model_name}'s forward in {', '.join(candidates)} against fp32 "
                                           f"(loaded {how})", measure)
    profile.write(file, {"model": model_name, "load": record, "timed": how, "repeats": REPEATS,
                         "ratios_by_dtype": {half: {str(n): r for n, r in rs.items()} for half, rs in ratios.items()}})
    return ratios


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _parameter_count(config) -> int:
    """Parameters of a model, from its config alone (built on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
