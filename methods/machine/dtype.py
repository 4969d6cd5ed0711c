"""`dtype=auto`: the dtype a run loads its target in, and why (recorded beside every result). On a CPU
with native bf16 matmul the flags do not decide: bf16 is timed against fp32, once per machine and model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..engine.hardware import auto_dtype, config_key, cpu_isa
from ..engine.runner import ModelRunner
from ..models.loading import DTYPES, from_pretrained, load_model, local_folder
from ..models.specs import ModelSpec

BF16_CLEARLY_FASTER = 0.8  # on a CPU, bf16 only where its forward takes at most this share of fp32's


def choose_dtype(profile, name: str, spec: ModelSpec | None = None,
                 model_name: str = "model") -> tuple[torch.dtype, str]:
    """The dtype a run loads its target in, and why (recorded beside every result).

    `auto`: on CUDA bf16 where supported, else fp16; on a CPU without native bf16 matmul, fp32
    (bf16 would be emulated). On a CPU with it (AVX512-BF16, AMX) the flags do not decide: the
    engine's fp32 path has its own kernels and bf16 goes through torch's, so the target's forward
    is timed at 1 and 4 tokens in both (once per machine and model, kept in the hardware profile)
    and bf16 is taken only where it is clearly faster (at most BF16_CLEARLY_FASTER of fp32's time,
    at both sizes): bf16 outputs differ from fp32's at near-ties. Without `spec` nothing is timed
    (the flags' choice); a model whose fp32 weights would fill half the memory available is bf16."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; valid: auto, {', '.join(DTYPES)}")
        return DTYPES[name], f"dtype={name} asked for"
    device = profile.device
    dtype, reason = auto_dtype(device)
    if device.type != "cpu" or dtype != torch.bfloat16 or spec is None:
        return dtype, reason
    config = from_pretrained(AutoConfig, local_folder(spec), "config")
    file = profile.folder / f"dtype-{model_name}-{config_key(config)}.json"  # one per machine and model shape
    ratios = _stored_ratios(profile, file)
    if ratios is None:
        available, fp32_bytes = _available_memory(), 4 * _parameter_count(config)
        if available and fp32_bytes > available / 2:
            return torch.bfloat16, (f"{reason}; fp32 weights ({fp32_bytes / 2**30:.1f} GiB) would fill more than half "
                                    f"the memory available ({available / 2**30:.1f} GiB), so not timed")
        ratios = _time_bf16(profile, spec, model_name, file)
    timed = (f"the target's forward in bf16 takes {ratios[1]:.2f}x (1 token) and {ratios[4]:.2f}x (4 tokens) "
             f"fp32's here (timed once per machine and model)")
    if max(ratios.values()) <= BF16_CLEARLY_FASTER:
        return torch.bfloat16, f"CPU with native bf16 matmul ({cpu_isa()}); {timed}: bf16, clearly faster"
    return torch.float32, (f"CPU with native bf16 matmul ({cpu_isa()}), but {timed}: fp32, since bf16 is not "
                           f"clearly faster (needs <= {BF16_CLEARLY_FASTER}x) and differs from fp32 at near-ties")


def _stored_ratios(profile, file: Path) -> dict[int, float] | None:
    """bf16's time over fp32's from the profile, when measured on a quiet machine or by this profile
    (else None: measure again), so that a later run decides without loading the model twice."""
    if not file.is_file():
        return None
    stored = json.loads(file.read_text())
    if not profile.usable(file, [stored.get("load")]):
        return None
    profile.use(file, [stored["load"]])
    return {int(n): r for n, r in stored["ratios"].items()}


def _time_bf16(profile, spec: ModelSpec, model_name: str, file: Path) -> dict[int, float]:
    """The target's forward in bf16 over fp32 at 1 and 4 tokens (their latency curves), kept in `file`
    with the machine's load while measured."""
    def measure() -> dict[int, float]:
        seconds = {}
        for candidate in (torch.float32, torch.bfloat16):
            model = load_model(spec, candidate, profile.device)
            seconds[candidate] = profile.latency_curve(ModelRunner(model, profile=profile), model_name, sizes=(1, 4))
            del model
        return {n: seconds[torch.bfloat16][n] / seconds[torch.float32][n] for n in (1, 4)}

    ratios, record = profile.measure(file, f"{model_name}'s forward in bf16 against fp32 (both loaded)", measure)
    profile.write(file, {"model": model_name, "ratios": {str(n): r for n, r in ratios.items()}, "load": record})
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
