"""Methods from outside the repository: a distribution that names a module in the entry-point group
`decodebench.methods` adds the methods that module registers. Tested with a real (temporary)
distribution on sys.path: a package and its `.dist-info` with `entry_points.txt`."""

from __future__ import annotations

import sys
import textwrap

import pytest

from methods.ar import AutoregressiveDecoder
from methods.base import (
    ENTRY_POINTS,
    available_methods,
    check_method_params,
    get_method,
    method_origin,
    unregister,
)
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.settings.params import ConfigError
from tests.conftest import tiny_model

PLUGIN = '''
from dataclasses import dataclass

import torch

from methods.base import register
from methods.loop import DraftVerifyDecoder
from methods.settings.params import Settings, integer, setting
from methods.engine.tree import Tree


@dataclass(frozen=True)
class EchoSettings(Settings):
    """Echo: guesses that the last token repeats (a method from another package)."""

    length: int = setting(2, integer(1), "tokens guessed per step")


class EchoDecoder(DraftVerifyDecoder):
    name = "echo-plugin"

    def __init__(self, target, length):
        super().__init__(target)
        self.length = length

    def propose(self, state, root, budget):
        count = min(self.length, budget)
        return Tree(torch.tensor([root] * (count + 1)), list(range(-1, count)))


@register("echo-plugin", settings=EchoSettings)
def build(target, settings, context):
    return EchoDecoder(target, settings.length)
'''


@pytest.fixture
def plugin_distribution(tmp_path, monkeypatch):
    """`echo_methods` 0.1: a module and its .dist-info (METADATA, entry_points.txt), put on sys.path."""
    (tmp_path / "echo_methods.py").write_text(PLUGIN)
    info = tmp_path / "echo_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [{ENTRY_POINTS}]
        echo = echo_methods
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in available_methods() if method_origin(n) == "echo_methods"]:
        unregister(name)
    sys.modules.pop("echo_methods", None)


def test_a_method_from_an_installed_distribution_is_registered_and_decodes_as_ar(plugin_distribution):
    assert "echo-plugin" in available_methods()
    with pytest.raises(ConfigError, match=r"^method.length=0: valid: an integer >= 1$"):
        check_method_params("echo-plugin", {"name": "echo-plugin", "length": 0})
    target = tiny_model("llama", seed=3, vocab_size=8, layers=2)
    decoder = get_method("echo-plugin")(ModelRunner(target), {"name": "echo-plugin", "length": 3})
    prompt, stop = [1, 2, 3, 2, 2], StopCondition(16)
    out = decoder.generate(prompt, stop)
    assert out.tokens == AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    assert decoder.length == 3 and out.stats.drafted_tokens > 0


def test_a_plugin_that_fails_to_import_names_its_entry_point(tmp_path, monkeypatch):
    info = tmp_path / "broken_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINTS}]\nbroken = no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError,
                       match=r"decodebench.methods entry point broken = no_such_module_here \(from broken-methods\)"):
        available_methods()
