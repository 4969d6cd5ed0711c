"""Checks of configuration values, and the typed settings of a method, declared once beside what they
configure and run before anything loads.

A check is a callable `check(value) -> bool` with a `valid` text naming what it accepts. A method
declares its settings as one frozen dataclass (a `Settings` subclass beside its drafter), each field
a `setting(default, check, doc)`: its name, type, valid values, default and one line saying what it
does. Everything else follows from that class: the check of a run's `method.*` keys before a model
loads (one line: the key, the bad value and what is valid), the values the method's factory gets,
`conf/method/<name>.yaml` and the settings table of docs/methods.md (both written by
`make docs`, and checked equal by tests/test_settings.py).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar


class ConfigError(ValueError):
    """A configuration value that is not valid: `key=value: valid: ...`."""

    def __init__(self, key: str, value: Any, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"{key}={value!r}: valid: {valid}")


@dataclass(frozen=True)
class Check:
    test: Callable[[Any], bool]
    valid: str

    def __call__(self, value) -> bool:
        try:
            return bool(self.test(value))
        except (TypeError, ValueError):
            return False

    def __or__(self, other: "Check") -> "Check":
        return Check(lambda v: self(v) or other(v), f"{self.valid} or {other.valid}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int | None = None, high: int | None = None) -> Check:
    bounds = (f" >= {low}" if low is not None else "") + (f" <= {high}" if high is not None else "")
    return Check(lambda v: _is_int(v) and (low is None or v >= low) and (high is None or v <= high),
                 f"an integer{bounds}")


def number(low: float | None = None, high: float | None = None, low_open: bool = False) -> Check:
    def test(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        return (low is None or (v > low if low_open else v >= low)) and (high is None or v <= high)
    bounds = (f" {'>' if low_open else '>='} {low}" if low is not None
              else "") + (f" <= {high}" if high is not None else "")
    return Check(test, f"a number{bounds}")


def one_of(*choices) -> Check:
    return Check(lambda v: v in choices, ", ".join(map(str, choices)))


def null() -> Check:
    return Check(lambda v: v is None, "null")


BOOL = Check(lambda v: isinstance(v, bool), "true or false")
ANY = Check(lambda v: True, "anything")


def int_list(low: int = 1) -> Check:
    return Check(lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_int(x) and x >= low for x in v),
                 f"a list of integers >= {low}, e.g. [4, 2, 1]")


def paths() -> Check:
    """A static tree given as a list of paths, e.g. [[0], [1], [0, 0]]."""
    return Check(lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(int_list(0)(p) for p in v),
                 "a list of paths, e.g. [[0], [1], [0, 0]]")


def mapping() -> Check:
    return Check(lambda v: isinstance(v, dict), "a mapping, e.g. {path: ...}")


def check_params(prefix: str, params: dict, schema: dict[str, Check], ignore=("name",)) -> None:
    """Every key of `params` is known and its value valid, else ConfigError."""
    for key, value in params.items():
        if key in ignore:
            continue
        if key not in schema:
            raise ConfigError(f"{prefix}.{key}", value, f"one of the keys {', '.join(sorted(schema))}")
        if not schema[key](value):
            raise ConfigError(f"{prefix}.{key}", value, schema[key].valid)


# ------------------------------------------------------------------------------------------
# A method's settings


def setting(default: Any, check: Check, doc: str) -> Any:
    """One setting of a method: its default, the values it accepts and one line saying what it does.
    A list default is written as a tuple (dataclass defaults are immutable)."""
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """A method without settings (subclasses: one `setting(...)` field per key; the docstring is the
    comment at the top of the method's YAML)."""

    # whether `methods/loop.py` decodes the method at batch_size > 1: its per-call state lives in each
    # sequence's `DecodeState` (`values`, `draft`: `DraftVerifyDecoder.draft_state`); else `batch_problem` says why
    batchable: ClassVar[bool] = False
    # the paper and upstream code the method follows (README's and docs/methods.md's tables)
    paper: ClassVar[str] = ""
    # the model config's `drafts.<kind>` the method drafts with (None: it needs no trained draft);
    # a run whose model names none is refused before anything loads (harness/running/validate.py)
    draft_kind: ClassVar[str | None] = None
    # whether the method reproduces AR's greedy tokens and sampling distribution, in words
    lossless: ClassVar[str] = "yes"
    # the setting that sizes the draft (a chain's length, a tree's size), which `make batch-sweep`
    # sweeps; the key under which a run's recorded config states the size it used (the setting
    # itself, or what `auto` resolved to); and the size's name in tables and figures
    size_setting: ClassVar[str | None] = None
    size_recorded: ClassVar[str | None] = None
    size_label: ClassVar[str] = ""
    # other keys of a recorded config that follow from the size `auto` resolved to (a template cut to
    # the size has its own depth and top-k)
    size_derived: ClassVar[tuple[str, ...]] = ()

    def batch_problem(self) -> str | None:
        """Why these settings cannot be decoded at batch_size > 1; None when they can."""
        return None if self.batchable else "it decodes one sequence at a time"

    def check_model(self, model: dict) -> None:
        """ConfigError when these settings cannot run on this model config (e.g. a datastore it
        lacks), checked before anything loads."""

    @classmethod
    def size_keys(cls) -> set[str]:
        """The keys of a recorded config that state the draft's size."""
        return {key for key in (cls.size_setting, cls.size_recorded) if key}

    @classmethod
    def size_in(cls, config: dict) -> tuple[str, Any] | None:
        """(size_label, the size) that a run's recorded config states, if the method has a size; the
        size is a number, or what the setting holds (`adaptive`, `auto`)."""
        key = next((key for key in (cls.size_recorded, cls.size_setting) if key and key in config), None)
        return (cls.size_label, config[key]) if key else None

    @classmethod
    def schema(cls) -> dict[str, Check]:
        return {f.name: f.metadata["check"] for f in fields(cls)}

    @classmethod
    def from_params(cls, params: dict, prefix: str = "method") -> "Settings":
        """The settings of a config's `method.*` keys (the `name` key aside); ConfigError for an unknown
        key or a bad value, the defaults for the keys not given."""
        check_params(prefix, params, cls.schema())
        return cls(**{key: value for key, value in params.items() if key != "name"})

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: _plain(f.default) for f in fields(cls) if f.default is not MISSING}

    def to_dict(self) -> dict[str, Any]:
        return {key: _plain(value) for key, value in asdict(self).items()}

    @classmethod
    def yaml(cls, name: str) -> str:
        """conf/method/<name>.yaml: the class's docstring as the header, then every setting with its
        default and its line of documentation."""
        header = [f"# {line}".rstrip() for line in inspect.cleandoc(cls.__doc__ or "").splitlines()]
        lines = [f"name: {name}"] + [f"{f.name}: {yaml_value(_plain(f.default))}" for f in fields(cls)]
        width = max(len(line) for line in lines) + 2
        docs = [""] + [f.metadata["doc"] for f in fields(cls)]
        body = [f"{line:<{width}}# {doc}" if doc else line for line, doc in zip(lines, docs)]
        return "\n".join(header + body) + "\n"


def _plain(value: Any) -> Any:
    """Tuples as lists, as YAML and OmegaConf hold them."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def yaml_value(value: Any) -> str:
    """A value as YAML (and OmegaConf) reads it back: a word as it is, anything else as JSON, which
    is YAML (null, true, 3, 0.09, [[0.25, 0.7]], "2.2.2")."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", value) and value.lower() not in YAML_WORDS:
        return value
    return json.dumps(value)


YAML_WORDS = {"null", "true", "false", "yes", "no", "on", "off", "y", "n", "nan", "inf"}


def settings_table(settings: type[Settings]) -> list[dict[str, str]]:
    """One row per setting: its name, default, valid values and line of documentation."""
    return [{"setting": f.name, "default": yaml_value(_plain(f.default)), "valid": f.metadata["check"].valid,
             "what it does": f.metadata["doc"]} for f in fields(settings)]
