"""The composed config, checked before anything loads: types, ranges, choices and the method's own
settings (each method's schema, registered with it), so that a bad value stops a run in seconds
with one line naming the key, the bad value and the valid ones (`python -m harness.run` exits 2).

A config group's choice (`method=`, `model=`, `dataset=`, `hydra/launcher=`) is checked on the
command line, before Hydra composes (`check_group_choices`): Hydra's own error is 20-odd lines.

Every key a run accepts, and what it accepts, is in docs/benchmarks.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from hydra import initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from harness.running.environment import git_commit
from harness.running.execution import require_sandbox
from methods.base import batchable_methods, check_method_params, method_settings
from methods.engine.fused import DECODER_MODES
from methods.engine.graphs import COMPILE_MODES, GRAPH_MODES
from methods.engine.runner import SKINNY_GEMM_MODES
from methods.models.loading import PRECISIONS
from methods.models.specs import PROJECT_ROOT as REPO
from methods.settings.params import BOOL, Check, ConfigError, integer, null, number, one_of

CONF = REPO / "conf"

TEXT = Check(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
SCHEMA: dict[str, Check] = {
    "limit": null() | integer(1),
    "max_new_tokens": null() | integer(1),
    "batch_size": integer(1),
    "temperature": number(0),
    "top_p": number(0, 1, low_open=True),
    "top_k": integer(0),
    "seed": integer(),
    "dtype": one_of("auto", *PRECISIONS),
    "device": Check(lambda v: v in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", v) is not None,
                    "auto, cpu, cuda or cuda:N"),
    "threads": null() | integer(1),
    "warmup": integer(0),
    "baseline": BOOL,
    "resume": BOOL,
    "results_dir": TEXT,
    "allow_dirty": BOOL,
    "run_name": null() | Check(lambda v: isinstance(v, str) and v.strip() != "" and "/" not in v, "a folder name"),
    "engine.skinny_gemm": one_of(*SKINNY_GEMM_MODES),
    "engine.decoder": one_of(*DECODER_MODES),
    "engine.cuda_graphs": one_of(*GRAPH_MODES),
    "engine.compile": one_of(*COMPILE_MODES),
    "model.draft_vocabulary.dtype": null() | one_of("bfloat16"),
    "serve.concurrency": Check(lambda v: (isinstance(v, (list, tuple)) or OmegaConf.is_list(v)) and len(v) > 0
                               and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in v),
                               "a non-empty list of integers >= 1, e.g. [1,2,4,8]"),
    "serve.rate": null() | number(0, low_open=True),
    "serve.requests": integer(1),
    "serve.speculate_up_to": null() | integer(0),
    "serve.peer": null() | one_of("llama.cpp"),
}


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first bad value."""
    for key, check in SCHEMA.items():
        value = OmegaConf.select(cfg, key)
        if not check(value):
            raise ConfigError(key, value, check.valid)
    check_compile(cfg)
    check_reference(cfg)
    path = cfg.model.get("path")
    if path and str(path).startswith(("/", "./", "../", "~")) and not Path(str(path)).expanduser().exists():
        raise ConfigError("model.path", path, "an existing local folder (a Hugging Face model, or one holding the "
                          "model's gguf_file) or a Hugging Face Hub id")
    params = OmegaConf.to_container(cfg.method, resolve=True)
    check_method_params(params.get("name"), params)
    check_model(params, OmegaConf.to_container(cfg.model, resolve=True))
    check_batch_size(cfg.batch_size, params)
    quality = OmegaConf.to_container(cfg.dataset.quality, resolve=True) if cfg.dataset.get("quality") else {}
    if "humaneval_pass_at_1" in quality.values():  # runs generated code: only in a sandbox, or opted in

        require_sandbox()


REFERENCE = REPO / "results" / "reference"


def check_reference(cfg: DictConfig) -> None:
    """A run that writes into results/reference/ (the committed reference runs the docs are generated from)
    comes from a clean commit: from a tree whose code has uncommitted changes it refuses, unless
    allow_dirty=true (a development run, recorded as `dirty: true`, which the docs' tests refuse to commit)."""
    target = Path(str(cfg.results_dir)).expanduser()
    target = (target if target.is_absolute() else Path.cwd() / target).resolve()
    if cfg.get("allow_dirty") or not target.is_relative_to(REFERENCE.resolve()):
        return
    if git_commit()["dirty"]:
        raise ConfigError("results_dir", cfg.results_dir,
                          "a folder outside results/reference/ while the code has uncommitted changes "
                          "(commit them first: reference runs come from a clean commit; allow_dirty=true "
                          "for a development run, recorded as dirty)")


def check_compile(cfg: DictConfig) -> None:
    """`engine.compile` other than off compiles the static steps, so it needs them: `engine.cuda_graphs=on`, or auto
    on a GPU (`device` cuda, or auto where CUDA is present)."""
    graphs, device = cfg.engine.cuda_graphs, str(cfg.device)
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    mode = cfg.engine.compile
    if mode != "off" and (graphs == "off" or (graphs == "auto" and not on_gpu)):
        raise ConfigError("engine.compile", mode, f"off; {mode} needs the static steps it compiles: "
                          f"engine.cuda_graphs=on (it is {graphs}; auto is on only on a GPU)")


def models_with_draft(kind: str) -> list[str]:
    """The model configs (conf/model/*.yaml) that name a `drafts.<kind>`."""
    return sorted(path.stem for path in (CONF / "model").glob("*.yaml")
                  if (OmegaConf.load(path).get("drafts") or {}).get(kind))


def check_model(params: dict, model: dict) -> None:
    """What a method needs from the model, before anything loads or downloads: a method that drafts
    with a trained draft (`Settings.draft_kind`) needs the model's `drafts.<kind>` or its own
    `method.draft` / `method.head` (ConfigError naming the models that have one); then the method's
    own needs (`Settings.check_model`: REST's datastore)."""
    settings = method_settings(params.get("name"))
    kind = settings.draft_kind
    if kind and not (params.get("draft") or params.get("head") or (model.get("drafts") or {}).get(kind)):
        key = "draft" if "draft" in settings.schema() else "head"  # a draft LM's setting, or a head's
        raise ConfigError("model", model.get("name"),
                          f"a model with drafts.{kind} (method {params.get('name')} drafts with it): "
                          f"{', '.join(models_with_draft(kind))} (or give method.{key}.path=<hub id or folder>)")
    settings.from_params(params).check_model(model)


def check_batch_size(batch_size: int, params: dict) -> None:
    """batch_size > 1 only for a method that decodes at batch > 1 with these settings (AR, the
    baseline, always does): ConfigError naming the methods that do."""
    if batch_size == 1:
        return
    name = params.get("name")
    problem = method_settings(name).from_params(params).batch_problem()
    if problem:
        raise ConfigError("batch_size", batch_size, f"1 for method {name} ({problem}); batch_size > 1 runs "
                          f"{', '.join(batchable_methods())}")


def check_group_choices(argv: list[str]) -> None:
    """Raise ConfigError for the first command-line choice of a config group that Hydra does not
    know (`method=eagel`; each value of a sweep `method=sps,eagel`), naming the group's options as
    Hydra finds them (conf/<group>/*.yaml and the configs plugins register). Command lines with
    their own config folder (`--config-dir`, `--config-path`) are left to Hydra."""
    args, _ = get_args_parser().parse_known_args(argv)
    if args.config_dir or args.config_path:
        return
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        return  # a malformed override: Hydra's own message says where
    free = (ValueType.GLOB_CHOICE_SWEEP, ValueType.RANGE_SWEEP, ValueType.INTERVAL_SWEEP)
    overrides = [o for o in overrides if not o.is_delete() and "." not in o.key_or_group and o.value_type not in free]
    if not overrides:
        return
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for override in overrides:
            options = loader.get_group_options(override.key_or_group)
            if not options or override.key_or_group == "hydra":
                continue  # a plain key, not a group
            values = override.sweep_string_iterator() if override.is_sweep_override() else [override.value()]
            for value in values:
                if isinstance(value, str) and value not in options:
                    raise ConfigError(override.key_or_group, value, ", ".join(options))
