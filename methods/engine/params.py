"""Checks of configuration values, declared once beside what they configure, run before anything loads.

A check is a callable `check(value) -> bool` with a `valid` text naming what it accepts; a method
registers a schema `{key: check}` with its factory (`register(name, params=...)`), and the harness
checks the composed config against the schemas before it loads a model, so that a bad value stops
the run in seconds with one line: the key, the bad value and what is valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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
    return Check(lambda v: _is_int(v) and (low is None or v >= low) and (high is None or v <= high), f"an integer{bounds}")


def number(low: float | None = None, high: float | None = None, low_open: bool = False) -> Check:
    def test(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        return (low is None or (v > low if low_open else v >= low)) and (high is None or v <= high)
    bounds = (f" {'>' if low_open else '>='} {low}" if low is not None else "") + (f" <= {high}" if high is not None else "")
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
