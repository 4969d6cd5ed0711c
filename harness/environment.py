"""What a measurement ran on: software versions, CPU/GPU, threads, git commit."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch

from methods.engine.hardware import cpu_isa, cpu_model

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa() if device.type == "cpu" else None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "git": git_commit(),
    }
    return env


def hardware_key(env: dict) -> dict:
    """The fields that must match for two measurements to share a column."""
    return {k: env.get(k) for k in ("cpu", "cpu_isa", "gpu", "device", "torch", "transformers", "torch_threads")}


def hardware_name(env: dict) -> str:
    """The GPU, else the CPU with its ISA class, as tables and figures name a machine."""
    return env.get("gpu") or f"{env.get('cpu')} ({env.get('cpu_isa')})"


def hardware_slug(env: dict) -> str:
    name = env.get("gpu") or " ".join(filter(None, (env.get("cpu"), env.get("cpu_isa")))) or "unknown"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    kind = "gpu" if env.get("gpu") else "cpu"
    return f"{kind}-{slug[:48]}"
