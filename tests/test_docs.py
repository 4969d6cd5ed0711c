"""Lists in the docs that name what the code registers: a method, model or method file added without
its line in the docs fails here."""

from __future__ import annotations

import re

from methods.base import _REGISTRY, available_methods
from tests.conftest import REPO

DOCS = REPO / "docs"


def suite_methods() -> set[str]:
    """The registry's methods, less those a test registered (tests/test_add_a_method.py)."""
    return {name for name in available_methods() if _REGISTRY[name].__module__.startswith("methods.")}


def test_benchmarks_md_lists_every_registered_method():
    row = re.search(r"`method=([^`]+)`", (DOCS / "benchmarks.md").read_text()).group(1)
    listed = row.replace("\\|", "|").split("|")
    assert set(listed) == suite_methods() and len(listed) == len(set(listed))


def test_benchmarks_md_lists_every_model_config():
    row = next(line for line in (DOCS / "benchmarks.md").read_text().splitlines() if line.startswith("| `model=…`"))
    listed = {name for name in re.findall(r"`([^`]+)`", row.split("|")[2]) if "/" not in name}
    assert listed == {path.stem for path in (REPO / "conf" / "model").glob("*.yaml")}


def test_architecture_md_lists_every_module_and_no_other():
    """docs/architecture.md has a line for every module of methods/, harness/ and hydra_plugins/ (and
    native.c), and names no module of theirs that is gone."""
    text = (DOCS / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `((?:methods|harness|hydra_plugins)/[\w/]+\.(?:py|c))` \|", text, re.M))
    modules = {str(path.relative_to(REPO)) for folder in ("methods", "harness", "hydra_plugins")
               for path in (REPO / folder).rglob("*") if path.suffix in (".py", ".c")
               and "__pycache__" not in path.parts}
    assert modules - listed == set(), f"modules without their line in docs/architecture.md: {sorted(modules - listed)}"
    assert listed - modules == set(), f"docs/architecture.md lists modules that are gone: {sorted(listed - modules)}"
