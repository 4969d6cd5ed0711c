"""The `Decoder` interface, the registry methods are chosen from by name, and what a method's
factory is handed (`BuildContext`). The loop every method shares is `loop.py`; one sequence's state
and output, `state.py`."""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from .engine.runner import ModelRunner
from .engine.sampling import SamplingConfig
from .engine.static_trees import NAMED_TREES, StaticTree
from .engine.stopping import StopCondition
from .engine.vocab import DraftVocabulary
from .models.specs import ModelSpec
from .settings.params import ConfigError, Settings
from .settings.sizing import VERIFY_BUDGET, Sizing, relative, tree_budget
from .state import DecodeOutput


class Decoder(ABC):
    """A decoding method: `generate_batch` decodes B prompts together (the loop, `loop.py`); `generate`
    is a batch of one."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True  # reproduces AR's greedy tokens and sampling distribution

    def __init__(self, target: ModelRunner, sizing: Sizing | None = None):
        self.target = target
        # its size, settled when built: the value, where it came from, the cut for a batch (`Sizing`)
        self.sizing = sizing or Sizing.fixed(None)

    @abstractmethod
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        stops: Sequence[StopCondition],
        sampling: SamplingConfig = SamplingConfig(),
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> list[DecodeOutput]:
        """One output per prompt, in order; `stops[b]` and `generators[b]` are prompt b's."""

    def generate(
        self,
        prompt: Sequence[int],
        stop: StopCondition,
        sampling: SamplingConfig = SamplingConfig(),
        generator: torch.Generator | None = None,
    ) -> DecodeOutput:
        """One prompt: a batch of one."""
        return self.generate_batch([prompt], [stop], sampling, [generator])[0]

    def reset(self) -> None:
        """Forgets what earlier prompts taught it: a method whose drafts learn across prompts (Suffix
        Decoding's cache, Token Recycling's matrix, REST's reader) starts again as built. Nothing to
        forget for the others."""

    def describe(self) -> dict[str, Any]:
        """Method parameters for the results record."""
        sizing = self.sizing.describe()
        return {"method": self.name, "lossless": self.lossless, **({"sizing": sizing} if sizing else {})}


# ------------------------------------------------------------------------------------------
# Registry: methods are chosen by name


@dataclass
class BuildContext:
    """What a method factory may need besides its own parameters."""

    target_model: Any  # the target's transformers model
    model_name: str
    model_config: dict  # the model's config entry (`drafts`: method kind -> draft spec, ...)
    # the machine profile (`methods/machine/profile.py`) `auto` sizes are read from; None: upstream's fixed sizes
    profile: Any = None

    @property
    def drafts(self) -> dict:
        return self.model_config.get("drafts") or {}

    def draft_spec(self, kind: str, method: str) -> dict:
        spec = (self.drafts or {}).get(kind)
        if not spec:
            have = ", ".join(k for k, v in (self.drafts or {}).items() if v) or "none"
            raise ValueError(
                f"method {method!r} needs a {kind} draft, but model {self.model_name!r} names none "
                f"(drafts it has: {have}); add `drafts.{kind}` to conf/model/{self.model_name}.yaml "
                f"or pass method.draft.path=/path/to/draft"
            )
        return dict(spec)

    def latency_curve(self, target) -> dict[int, float] | None:
        """The target's forward-latency curve from the machine profile (measured once, cached); None
        without a profile."""
        return self.profile.latency_curve(target, self.model_name) if self.profile is not None else None

    def sizing(self, target, what: str, setting: Any, fixed: int) -> Sizing:
        """A size setting, settled: `setting` itself unless it is `auto`; `auto`, the most tokens one
        verification may hold on this machine (root included), with the latency curve it was read from
        (the rule for a batch: `Sizing.cut`); `fixed` (upstream's size, in the same unit) without a
        machine profile. A method chooses its own unit's size within it (`Sizing.choose`)."""
        if setting != "auto":
            return Sizing.fixed(setting)
        curve = self.latency_curve(target)
        if curve is None:
            return Sizing(fixed, {what: "auto", "verify_tokens": fixed, "profile": "none: upstream's size"})
        budget = tree_budget(curve)
        return Sizing(budget, {what: "auto", "verify_tokens": budget, "verify_budget_t1": VERIFY_BUDGET,
                               "curve_t1": {n: round(v, 3) for n, v in relative(curve).items()}}, curve)

    def draft_tokens(self, target, what: str, setting: Any, upstream: int) -> Sizing:
        """A draft size in draft tokens (nodes besides the root): `setting`, or for `auto` the machine's
        verify budget less the root (`upstream` without a machine profile)."""
        sizing = self.sizing(target, what, setting, upstream + 1)
        if setting != "auto":
            return sizing
        return sizing.choose(sizing.value - 1, draft_tokens=sizing.value - 1, chosen=f"{sizing.value - 1} draft tokens")

    def static_tree(self, params: dict, target, published: str, max_depth: int | None = None):
        """`method.tree`: a built-in name or a list of paths; `auto` is the `published` tree (paths
        deeper than `max_depth` left out) cut, in its own order, to this machine's tree budget (whole
        without a machine profile). Returns the tree and its `Sizing` (its nodes besides the root)."""
        tree = params.get("tree", "auto")
        if tree != "auto":
            chosen = StaticTree.build(tree)
            return chosen, Sizing.fixed(len(chosen) - 1)
        paths = [p for p in NAMED_TREES[published] if max_depth is None or len(p) <= max_depth]
        sizing = self.sizing(target, "tree", "auto", len(paths) + 1)
        chosen = StaticTree.build(paths, nodes=sizing.value - 1)
        return chosen, sizing.choose(len(chosen) - 1, chosen=f"{published}, first {len(chosen) - 1} nodes")

    def draft_vocabulary(self, params: dict, projection_rows: int | None = None):
        """The FR-Spec subset a draft proposes from (`engine/vocab.py`), or None for the full vocabulary.
        `method.draft_vocab`: `auto` (the model config's `draft_vocabulary.size` when it names a
        token-frequency file, else the full vocabulary), `full`, or a number of tokens. The model
        config's `draft_vocabulary.dtype: bfloat16` rounds the drafts' copy of those lm_head rows to
        bf16 values in an fp32 run, as the drafts are stored."""
        choice = params.get("draft_vocab", "auto")
        setting = self.model_config.get("draft_vocabulary") or {}
        if choice in (None, "full") or (choice == "auto" and not setting.get("frequencies")):
            return None
        size = setting.get("size") if choice == "auto" else choice
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"method.draft_vocab={choice!r}; valid: auto, full, or a positive number of tokens")
        if not setting.get("frequencies"):
            raise ValueError(f"method.draft_vocab={size}: model {self.model_name!r} names no token-frequency file; "
                             "set model.draft_vocabulary.frequencies=/path/to/frequencies.json or "
                             "method.draft_vocab=full")
        file = ModelSpec.from_mapping({"path": setting["frequencies"]}).path
        config = self.target_model.config
        full = self.target_model.get_output_embeddings().out_features
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        rows_dtype = {None: None, "bfloat16": torch.bfloat16}[setting.get("dtype")]  # checked by the harness
        vocabulary = DraftVocabulary.most_frequent(file, size, full, always=tuple(t for t in eos if t is not None),
                                                   rows_dtype=rows_dtype)
        if projection_rows is not None and projection_rows < full:  # a draft LM with a shorter vocabulary
            vocabulary = vocabulary.subset(vocabulary.ids[vocabulary.ids < projection_rows])
        return vocabulary


# A factory builds a decoder: factory(target: ModelRunner, settings: <the method's Settings>, context: BuildContext)
DecoderFactory = Callable[..., Decoder]
_REGISTRY: dict[str, DecoderFactory] = {}
_SETTINGS: dict[str, type[Settings]] = {}


def register(name: str, settings: type[Settings] = Settings) -> Callable[[DecoderFactory], DecoderFactory]:
    """Register a method's factory by name, with the class of its settings (`settings/params.py`): the
    harness checks a run's `method.*` keys against it before loading any model, and the factory gets
    the checked settings, defaults filled in."""
    def wrap(factory: DecoderFactory) -> DecoderFactory:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} registered twice")
        _REGISTRY[name] = factory
        _SETTINGS[name] = settings
        return factory

    return wrap


def method_settings(name: str) -> type[Settings]:
    """The settings class a method registered with (ConfigError for an unknown method)."""
    methods = available_methods()
    if name not in _REGISTRY:
        raise ConfigError("method", name, ", ".join(methods))
    return _SETTINGS[name]


def check_method_params(name: str, params: dict) -> None:
    """Raise ConfigError naming the key, the bad value and the valid ones (unknown method included)."""
    method_settings(name).from_params(params)


ENTRY_POINTS = "decodebench.methods"  # the entry-point group of methods from other packages


def available_methods() -> list[str]:
    """Every registered method: each module or package beside this one registers the methods it holds
    on import (a method file; a family's package, `eagle/`, whose `__init__` imports its registering
    modules; the shared machinery, `engine/`, `machine/`, `models/` and `settings/`, holds none), and so
    does each module an installed distribution names in the entry-point group `decodebench.methods`."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module.name not in ("base", "loop", "state") and not module.name.startswith("_"):
            importlib.import_module(f"{__package__}.{module.name}")
    for entry in entry_points(group=ENTRY_POINTS):
        try:
            entry.load()
        except Exception as err:
            raise ImportError(
                f"the {ENTRY_POINTS} entry point {entry.name} = {entry.value} "
                f"(from {entry.dist.name if entry.dist else 'an installed package'}) fails to import: {err}"
            ) from err
    return sorted(_REGISTRY)


def method_origin(name: str) -> str:
    """The module a registered method's factory is defined in (`methods.<file>`, or a plugin's)."""
    method_settings(name)  # (ConfigError for an unknown method)
    return _REGISTRY[name].__module__


def unregister(name: str) -> None:
    """Take a registered method off the registry (a plugin's, e.g. once its package is unloaded)."""
    method_settings(name)
    del _REGISTRY[name], _SETTINGS[name]


def batchable_methods() -> list[str]:
    """The registered methods that decode at batch_size > 1 (their default settings)."""
    return [name for name in available_methods() if method_settings(name).batchable]


def get_method(name: str) -> DecoderFactory:
    """The method's factory over a config's `method.*` keys: they are checked and turned into the
    method's settings first."""
    methods = available_methods()
    if name not in _REGISTRY:
        raise KeyError(f"unknown method {name!r}; valid methods: {', '.join(methods)}")
    factory, settings = _REGISTRY[name], _SETTINGS[name]

    def build(target, params: dict | None = None, context: BuildContext | None = None) -> Decoder:
        return factory(target, settings.from_params(params or {}), context or BuildContext(None, "", {}))

    return build
