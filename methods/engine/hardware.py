"""What this machine is: its CPU (model, flags, ISA class), or its GPU, and the key under which
its measurements are kept (`profile_dir`). No measurement here: `machine/profile.py` measures; the native
kernels (`native.py`) read the CPU's flags to choose their build."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from pathlib import Path

import torch

from .storage import cache_root


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def l3_bytes() -> int | None:
    """The last-level cache the kernel reports for CPU 0 (sysfs), or None."""
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
                return int(size.rstrip("KMG")) * unit
    except (OSError, ValueError):
        pass
    return None


def cpu_isa(flags: set[str] | None = None) -> str:
    """The CPU class that decides GEMM speed: amx, avx512-bf16, avx512, avx2 or other."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "other"


def native_bf16(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def auto_dtype(device: torch.device, flags: set[str] | None = None) -> tuple[torch.dtype, str]:
    """`dtype=auto`, with the reason recorded beside every result."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA device with bf16 support"
        return torch.float16, "CUDA device without bf16 support"
    if native_bf16(flags):
        return torch.bfloat16, f"CPU with native bf16 matmul ({cpu_isa(flags)})"
    return torch.float32, (f"CPU without native bf16 matmul ({cpu_isa(flags)}): bf16 would be emulated, "
                           "slower and worse with more tokens per forward")


def machine(device: torch.device) -> dict:
    """What a measurement's speed depends on."""
    if device.type == "cuda":
        hw = {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    else:
        hw = {"cpu": cpu_model(), "cpu_isa": cpu_isa(), "cpu_count": os.cpu_count()}
    return {**hw, "torch": torch.__version__, "threads": torch.get_num_threads()}


def machine_key(device: torch.device) -> str:
    info = machine(device)
    name = info.get("gpu") or f"{info['cpu']}-{info['cpu_isa']}"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:48]
    digest = hashlib.sha1(json.dumps(info, sort_keys=True).encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


def config_key(config) -> str:
    """A model's shape, as profile files are named by it: a digest of its `transformers` config."""
    return hashlib.sha1(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:8]


def profile_dir(device: torch.device) -> Path:
    return cache_root() / "profiles" / machine_key(device)
