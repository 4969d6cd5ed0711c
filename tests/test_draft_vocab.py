"""Reduced-vocabulary drafting (FR-Spec): drafts propose only the K most frequent tokens, the target
verifies as always, so greedy output stays AR's and sampling keeps the target's distribution."""

from __future__ import annotations

import json

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext
from methods.eagle.dynamic import Eagle2Decoder
from methods.eagle.template import EagleDecoder
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.static_trees import StaticTree
from methods.engine.stopping import StopCondition
from methods.engine.vocab import DraftVocabulary, token_frequencies
from methods.medusa import MedusaDecoder
from methods.models.heads.eagle import load_eagle_head
from methods.models.heads.medusa import load_medusa_heads
from methods.models.loading import truncated_copy
from methods.models.specs import ModelSpec
from methods.sps import SpeculativeSamplingDecoder
from tests.conftest import tiny_model
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint
from tests.test_tree_methods import write_eagle, write_medusa


def frequency_file(tmp_path, ranking, name="freq.json"):
    file = tmp_path / name
    counts = [[token, 1000 - rank] for rank, token in enumerate(ranking)]
    file.write_text(json.dumps({"source": "test", "tokens": sum(c for _, c in counts), "counts": counts}))
    return file


def test_token_frequencies_and_the_most_frequent_subset(tmp_path):
    counts = token_frequencies([[5, 5, 3, 9], [5, 3, 1]], vocab_size=12)
    assert counts == [[5, 3], [3, 2], [1, 1], [9, 1]]
    file = tmp_path / "f.json"
    file.write_text(json.dumps({"tokens": 7, "counts": counts}))
    vocabulary = DraftVocabulary.most_frequent(file, 2, 12, always=(11,))
    assert vocabulary.ids.tolist() == [3, 5, 11] and len(vocabulary) == 3
    weight = torch.randn(12, 4)
    hidden = torch.randn(2, 4)
    logits = vocabulary.project(hidden, weight)
    assert logits.shape == (2, 12)
    torch.testing.assert_close(logits[:, [3, 5, 11]], hidden @ weight[[3, 5, 11]].T)
    assert torch.isinf(logits[:, [0, 1, 2, 4, 6, 7, 8, 9, 10]]).all()
    # fewer tokens seen than asked for: the unseen follow in token-id order (BPE merge order)
    assert DraftVocabulary.most_frequent(file, 6, 12).ids.tolist() == [0, 1, 2, 3, 5, 9]
    with pytest.raises(ValueError, match="positive number"):
        DraftVocabulary.most_frequent(file, 0, 12)


def test_the_drafts_rows_rounded_to_bf16_leave_the_targets_weight_as_it_was(tmp_path):
    """`draft_vocabulary.dtype: bfloat16`: in an fp32 run the draft's copy of the subset's rows holds
    bf16 values (so the native kernel streams it as bf16), the target's weight keeps its own; the
    subset of a shorter draft vocabulary keeps the setting; without it the copy is exact."""
    file = frequency_file(tmp_path, [7, 2, 9, 4])
    weight = torch.randn(12, 8)
    before = weight.clone()
    rounded = DraftVocabulary.most_frequent(file, 3, 12, rows_dtype=torch.bfloat16)
    rows = rounded.head(weight).weight
    assert torch.equal(rows, weight[[2, 7, 9]].bfloat16().float()) and not torch.equal(rows, weight[[2, 7, 9]])
    assert torch.equal(weight, before)
    assert rounded.subset(torch.tensor([2, 7])).rows_dtype == torch.bfloat16
    assert rounded.describe()["rows_dtype"] == "bfloat16"
    assert torch.equal(DraftVocabulary.most_frequent(file, 3, 12).head(weight).weight, weight[[2, 7, 9]])
    half = weight.bfloat16()  # a bf16 run: the rows as the target's, nothing to round
    assert torch.equal(rounded.head(half).weight, half[[2, 7, 9]])


def test_greedy_with_a_reduced_draft_vocabulary_equals_ar(tmp_path):
    """Half of the target's tokens can never be drafted; every method still emits AR's tokens and
    still gets drafts accepted."""
    target = tiny_model("llama", seed=60, vocab_size=16, layers=4)
    vocabulary = DraftVocabulary(torch.arange(0, 16, 2), 16)
    write_medusa(tmp_path / "medusa", target, heads=4, declared=4)
    write_eagle(tmp_path / "eagle", target)
    medusa = load_medusa_heads(ModelSpec(path=str(tmp_path / "medusa")), target)
    head = load_eagle_head(ModelSpec(path=str(tmp_path / "eagle")), target)
    small = StaticTree.build([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    decoders = {
        "sps": SpeculativeSamplingDecoder(ModelRunner(target), truncated_copy(target, 2), gamma=3,
                                          vocabulary=vocabulary),
        "medusa": MedusaDecoder(ModelRunner(target), medusa, small, vocabulary=vocabulary),
        "eagle": EagleDecoder(ModelRunner(target), head, small, vocabulary=vocabulary),
        "eagle2": Eagle2Decoder(ModelRunner(target), head, total_tokens=10, depth=3, top_k=3, vocabulary=vocabulary),
    }
    ar = AutoregressiveDecoder(ModelRunner(target))
    gen = torch.Generator().manual_seed(3)
    accepted = {}
    for name, decoder in decoders.items():
        accepted[name], odd = 0, 0
        for _ in range(3):
            prompt = torch.randint(0, 16, (int(torch.randint(2, 12, (), generator=gen)),), generator=gen).tolist()
            reference = ar.generate(prompt, StopCondition(30)).tokens
            out = decoder.generate(prompt, StopCondition(30))
            assert out.tokens == reference, name
            accepted[name] += out.stats.accepted_drafts
            odd += sum(t % 2 for t in reference)
        assert odd > 0, name  # the target emitted tokens the draft could not propose
        assert decoder.describe()["draft_vocab"] == 8
    assert accepted["sps"] > 5 and sum(accepted.values()) > 10, accepted  # random heads accept little


def test_sps_sampling_with_a_reduced_vocabulary_preserves_the_target_distribution(tiny_vocab_pair):
    """q is zero outside the subset: tokens the draft cannot propose come from the residual."""
    target, draft = tiny_vocab_pair
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_joint(target, PROMPT, 3, sampling)
    decoder = SpeculativeSamplingDecoder(ModelRunner(target), draft, gamma=2,
                                         vocabulary=DraftVocabulary(torch.tensor([0, 2]), 4))
    samples = draw(decoder, 1500, seed=5)
    assert chi_square_pvalue(samples, expected) > 1e-3
    assert any(token in (1, 3) for sample in samples for token in sample)


def test_broken_residual_with_a_reduced_vocabulary_is_caught(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_joint(target, PROMPT, 3, sampling)
    decoder = SpeculativeSamplingDecoder(ModelRunner(target), draft, gamma=2,
                                         vocabulary=DraftVocabulary(torch.tensor([0, 2]), 4))
    decoder.sample_accept = lambda tree, probs, gen, **kw: SpeculativeSamplingDecoder.sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw)
    assert chi_square_pvalue(draw(decoder, 1500, seed=5), expected) < 1e-6


def test_draft_vocab_setting_from_the_model_config(tmp_path):
    target = tiny_model("llama", seed=61, vocab_size=32)
    target.config.eos_token_id = 31
    file = frequency_file(tmp_path, [7, 3, 9, 1, 0])
    context = BuildContext(target, "tiny", {"draft_vocabulary": {"frequencies": str(file), "size": 3}})
    assert context.draft_vocabulary({}).ids.tolist() == [3, 7, 9, 31]  # auto: the model's size, EOS kept
    assert context.draft_vocabulary({"draft_vocab": 2}).ids.tolist() == [3, 7, 31]
    assert context.draft_vocabulary({"draft_vocab": "full"}) is None
    assert BuildContext(target, "tiny", {}).draft_vocabulary({"draft_vocab": "auto"}) is None
    with pytest.raises(ValueError, match="names no token-frequency file"):
        BuildContext(target, "tiny", {}).draft_vocabulary({"draft_vocab": 100})
    with pytest.raises(ValueError, match="valid: auto, full, or a positive number"):
        context.draft_vocabulary({"draft_vocab": "small"})
