"""Where the suite keeps what it derives once and reuses: dequantized GGUF models, randomly
initialised heads, machine profiles."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where dequantized copies live: $DECODEBENCH_CACHE, else ~/.cache/decodebench."""
    env = os.environ.get("DECODEBENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "decodebench"
