"""What a measurement ran on: software versions, CPU/GPU, threads, git commit, and a digest of
the decoding code (`methods/`: the engine, its native kernels and every method), so that answers
timed on one build of the code are never resumed into a run of another."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from methods.engine.hardware import cpu_isa, cpu_model
from methods.machine import threads
from methods.models.specs import PROJECT_ROOT as REPO

DECODING_CODE = REPO / "methods"


def code_digest(root: Path = DECODING_CODE) -> str:
    """sha1 (12 hex digits) of the decoding code's sources: every .py and .c file under `root`, by
    path and content. Unlike the git commit it ignores docs, tests and the harness, and it sees
    uncommitted edits."""
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".c") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def drafts_digest(model: dict, method: dict, root: Path = REPO) -> str | None:
    """sha1 (12 hex digits) of the local draft files a method that drafts with a trained model may
    read: every folder or file named by the model's `drafts.*.path`, the method's own `head` /
    `draft` path and the draft vocabulary's frequency file, by name and content. None for a method
    without a `head` or `draft` setting (the training-free ones). Hub ids are not local: their names
    are part of the settings already. Retrained drafts at the same path thus never resume answers
    of the old ones."""
    if "head" not in method and "draft" not in method:
        return None
    named = [entry.get("path") for entry in (model.get("drafts") or {}).values() if isinstance(entry, dict)]
    named += [(method.get(key) or {}).get("path") for key in ("head", "draft") if isinstance(method.get(key), dict)]
    named.append((model.get("draft_vocabulary") or {}).get("frequencies"))
    digest = hashlib.sha1()
    for name in sorted({n for n in named if n}):
        path = Path(name).expanduser()
        path = path if path.is_absolute() else root / path
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
        for file in files:
            digest.update(f"{name}/{file.relative_to(path) if path.is_dir() else ''}".encode() + b"\0"
                          + hashlib.sha1(file.read_bytes()).digest())
    return digest.hexdigest()[:12]


# What the suite writes (results, their figures) is not code: a run beside earlier results is still clean.
OUTPUTS = ("results", "plots")


def git_commit() -> dict:
    """The checkout's commit and whether its code differs from it (tracked files changed outside OUTPUTS)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                  *(f":(exclude){path}" for path in OUTPUTS)))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment(device: torch.device) -> dict:
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
        "omp_wait": threads.configure(),  # the policy and why (not in hardware_key: chosen by the load at start)
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "git": git_commit(),
        "decoding_code": code_digest(),
    }
    return env


def hardware_key(env: dict) -> dict:
    """The fields that must match for two measurements to share a column (or a results folder)."""
    return {k: env.get(k)
            for k in ("cpu", "cpu_isa", "gpu", "device", "torch", "transformers", "torch_threads", "decoding_code")}


def hardware_name(env: dict) -> str:
    """The GPU, else the CPU with its ISA class, as tables and figures name a machine."""
    return env.get("gpu") or f"{env.get('cpu')} ({env.get('cpu_isa')})"


def hardware_slug(env: dict) -> str:
    name = env.get("gpu") or " ".join(filter(None, (env.get("cpu"), env.get("cpu_isa")))) or "unknown"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    kind = "gpu" if env.get("gpu") else "cpu"
    return f"{kind}-{slug[:48]}"
