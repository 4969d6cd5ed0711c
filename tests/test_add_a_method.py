"""Adding a method is one file and one config: a drafter registered with `@register` runs through the
same path as the suite's own methods (the registry, `harness.running.run`, the shared loop and its
statistics). Done here from a test file, as docs/architecture.md tells a newcomer to do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness.running.results import read_jsonl
from harness.running.run import run
from methods.base import available_methods, check_method_params, register
from methods.engine.tree import Tree
from methods.loop import DraftVerifyDecoder
from methods.settings.params import ConfigError, Settings, integer, setting
from tests.test_harness import config, tiny_overrides


class RepeatDecoder(DraftVerifyDecoder):
    """A toy drafter: guesses that the last token repeats `length` times (a chain)."""

    name = "toy-repeat"

    def __init__(self, target, length: int):
        super().__init__(target)
        self.length = length

    def propose(self, state, root: int, budget: int) -> Tree:
        count = min(self.length, budget)
        return Tree(torch.tensor([root] * (count + 1)), list(range(-1, count)))


@dataclass(frozen=True)
class RepeatSettings(Settings):
    """A toy drafter: the last token, repeated."""

    length: int = setting(3, integer(1), "tokens guessed per step")


@register("toy-repeat", settings=RepeatSettings)
def build(target, settings: RepeatSettings, context) -> RepeatDecoder:
    return RepeatDecoder(target, settings.length)


def test_the_settings_class_gives_the_check_and_the_yaml():
    with pytest.raises(ConfigError, match=r"^method.length=0: valid: an integer >= 1$"):
        check_method_params("toy-repeat", {"name": "toy-repeat", "length": 0})
    text = RepeatSettings.yaml("toy-repeat")  # what conf/method/toy-repeat.yaml would hold
    assert text.startswith("# A toy drafter: the last token, repeated.\n") and "# tokens guessed per step" in text
    assert OmegaConf.to_container(OmegaConf.create(text)) == {"name": "toy-repeat", "length": 3}


def test_a_method_registered_from_a_test_file_runs_through_the_harness(tiny_chat_model_dir, spec_bench_file, tmp_path):
    assert "toy-repeat" in available_methods()
    overrides = tiny_overrides(tiny_chat_model_dir, spec_bench_file, tmp_path, "method=ar", "method.name=toy-repeat",
                               "+method.length=2", "limit=2", "max_new_tokens=10")
    summary = run(config(*overrides))
    folder = Path(summary["results"])
    assert folder.parent == tmp_path / "tiny" / "spec_bench" / "toy-repeat"
    records = read_jsonl(folder / "answers" / "toy-repeat.jsonl")
    assert len(records) == 2
    # the shared loop verified its drafts: greedy fp32 output equals AR's, and it drafted 2 per step
    assert summary["fidelity"]["differing_questions"] == 0
    decoder = summary["decoder"]
    assert decoder["drafted_tokens"] > 0 and len(decoder["acceptance_per_position"]) == 2
