"""`make perf`'s draft split (`harness/perf/draft_split.py`): every part of an EAGLE-2/3 draft step and of a
draft-LM token is timed, on real-format heads of a tiny target, and the step is the sum of its parts."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from harness.perf.draft_split import BLOCK_DRAFTERS, HEADLINE_TREES, draft_split, print_split
from methods.base import BuildContext
from methods.engine.runner import ModelRunner
from tests.conftest import tiny_model
from tests.test_dflash import write_dflash
from tests.test_eagle3 import write_eagle3
from tests.test_pard import pard_draft, write_pard
from tests.test_tree_methods import write_eagle

PARTS = {"follow", "inputs", "layer", "lm head", "top-k", "expansion", "rerank"}


def test_the_split_times_every_part_of_a_draft_step(tmp_path, capsys):
    target = tiny_model("llama", seed=5, vocab_size=64, layers=7)  # EAGLE-3 reads layers 2, 3 and 4
    write_eagle(tmp_path / "eagle", target)
    write_eagle3(tmp_path / "eagle3", target, draft_ids=list(range(0, 64, 2)))
    write_dflash(tmp_path / "dflash", target, ids=[1, 4], block=4)
    write_pard(tmp_path / "pard", pard_draft(target))
    context = BuildContext(target, "tiny", {"drafts": {kind: {"path": str(tmp_path / kind)}
                                                       for kind in ("eagle", "eagle3", "dflash", "pard")}})
    config = OmegaConf.create({"drafts": {"sps": {"target_layers": 1}}})
    runner = ModelRunner(target)
    split = draft_split(target, runner, context, config, {1: 1e-3, 8: 1.2e-3, 64: 5e-3}, rounds=2, prompt=[1, 2, 3])
    assert set(split) == {"eagle2", "eagle3", "draft LM", "dflash", "pard"}
    for method in BLOCK_DRAFTERS:  # at most one draft forward a step (none where nothing is left to draft)
        part = split[method]
        assert part["step_seconds"] > 0 and 0.9 <= part["forwards_per_step"] <= 1 and part["tau"] >= 1
    assert split["dflash"]["draft_tokens"] == 3 and split["pard"]["draft_tokens"] == 12  # no profile: upstream's
    for method, settings in HEADLINE_TREES.items():
        part = split[method]
        seconds = part["seconds"]
        assert set(seconds) == PARTS and all(s > 0 for s in seconds.values())
        assert part["step_seconds"] == pytest.approx(seconds["follow"] + seconds["expansion"] + seconds["rerank"])
        assert part["head_forwards"] == settings["depth"] + 1 and part["top_k"] == settings["top_k"]
        assert 0 < part["forward_weight_share"] < 1
    lm = split["draft LM"]
    assert set(lm["seconds"]) == {"forward", "lm head", "top-1"} and all(s > 0 for s in lm["seconds"].values())
    assert lm["token_seconds"] == pytest.approx(sum(lm["seconds"].values()))
    assert lm["draft_vocab"] is None and 0 < lm["weight_share"] <= lm["whole_model_weight_share"] < 1
    print_split(split, 1e-3)
    printed = capsys.readouterr().out
    assert "eagle2, depth 3, top-4" in printed and "eagle3, depth 4, top-4" in printed
    assert "draft LM token (full vocabulary)" in printed
    assert "dflash draft step (3 drafts, one block)" in printed and "pard draft step (12 drafts" in printed
