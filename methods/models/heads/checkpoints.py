"""Reading head checkpoints: a folder (or Hub id) with a weights file and a config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import load_file

from ..specs import ModelSpec, ModelUnavailableError, hub_reachable, unavailable_error


def checkpoint_folder(spec: ModelSpec, weight_files: tuple[str, ...]) -> Path:
    """A local folder holding the checkpoint: the path itself, or a Hub snapshot."""
    path = Path(spec.path).expanduser()
    if path.is_dir():
        return path
    if str(spec.path).startswith(("/", ".", "~")):
        raise ModelUnavailableError(f"head folder {spec.path!r} does not exist (set {spec.override_hint})")

    patterns = ["config.json", *weight_files]
    try:
        return Path(snapshot_download(spec.path, revision=spec.revision, allow_patterns=patterns,
                                      local_files_only=True))
    except Exception as err:  # not cached
        if not hub_reachable():
            raise unavailable_error(spec, "draft head", err) from None
    try:
        return Path(snapshot_download(spec.path, revision=spec.revision, allow_patterns=patterns))
    except Exception as err:
        raise unavailable_error(spec, "draft head", err) from err


def read_state_dict(folder: Path, weight_files: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], str]:
    """The first weights file present (safetensors or torch pickle); returns (state, file name)."""
    for name in weight_files:
        file = folder / name
        if not file.is_file():
            continue
        if name.endswith(".safetensors"):
            return load_file(str(file)), name
        return torch.load(file, map_location="cpu", weights_only=True), name
    raise ModelUnavailableError(f"{folder} holds none of {', '.join(weight_files)}")


SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_prefixed(folder: Path, prefix: str) -> dict[str, torch.Tensor] | None:
    """The tensors under `prefix` (prefix removed) of a full model saved in `folder` (one weights
    file or shards with an index), read without loading the rest; None when there are none."""
    files = []
    for index in SHARD_INDEXES:
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text())["weight_map"]
            files = sorted({name for key, name in weight_map.items() if key.startswith(prefix)})
            break
    else:
        files = [name for name in ("model.safetensors", "pytorch_model.bin") if (folder / name).is_file()][:1]
    state = {}
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(str(folder / name), framework="pt") as f:
                state.update({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
        else:
            shard = torch.load(folder / name, map_location="cpu", weights_only=True, mmap=True)
            state.update({k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix)})
    return state or None


def place_like_target(head: torch.nn.Module, target_model, shared_embedding=None) -> torch.nn.Module:
    """A loaded head on the target's device and dtype, frozen; parameters only (a rotary inv_freq
    buffer stays fp32 as in the target, integer buffers keep their types). `shared_embedding`: the
    target's embedding module, tied in place of a copy when the checkpoint left it out."""
    param = next(target_model.parameters())
    head = head.to(param.device).eval().requires_grad_(False)
    for weight in head.parameters():
        weight.data = weight.data.to(param.dtype)
    if shared_embedding is not None:
        head.embed_tokens.weight = shared_embedding.weight
    return head


def read_head(spec: ModelSpec, weight_files: tuple[str, ...]) -> tuple[Path, dict[str, torch.Tensor], dict, Path]:
    """A head checkpoint that needs its config.json: its folder, weights, config and the weights' file (for
    messages); a folder without config.json is refused in one line."""
    folder = checkpoint_folder(spec, weight_files)
    state, file = read_state_dict(folder, weight_files)
    config = read_config(folder)
    if not config:
        raise ValueError(f"{folder}: config.json missing")
    return folder, state, config, folder / file


def read_config(folder: Path) -> dict:
    file = folder / "config.json"
    return json.loads(file.read_text()) if file.is_file() else {}
