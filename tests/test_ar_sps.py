"""AR and SpS: token-exact greedy decoding, and sampling that preserves the target distribution."""

from __future__ import annotations

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.engine.acceptance import residual_distribution
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.models.loading import truncated_copy
from methods.sps import SpeculativeSamplingDecoder
from tests.conftest import assert_embedded_greedy, hf_greedy, tiny_model
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_greedy_ar_and_sps_equal_transformers_generate(arch):
    target = tiny_model(arch, seed=10)
    independent_draft = tiny_model(arch, seed=11, layers=1)
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        prompt = torch.randint(0, 256, (int(torch.randint(3, 30, (), generator=gen)),), generator=gen).tolist()
        reference = hf_greedy(target, prompt, 48)
        stop = StopCondition(48)
        assert AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens == reference
        for draft, gamma in [(truncated_copy(target, 2), 4), (independent_draft, 3), (truncated_copy(target, 1), 1)]:
            out = SpeculativeSamplingDecoder(ModelRunner(target), draft, gamma=gamma).generate(prompt, stop)
            assert out.tokens == reference
            assert out.stats.new_tokens == 48
            assert sum(out.stats.accepted_lengths) == 48
            assert out.stats.steps == len(out.stats.accepted_lengths)


def test_sps_stops_where_ar_stops_on_eos():
    target = tiny_model("llama", seed=12, vocab_size=32)
    prompt = [3, 1, 4, 1, 5]
    full = hf_greedy(target, prompt, 40)
    eos = full[17]  # a token the greedy output reaches
    reference = hf_greedy(target, prompt, 40, eos=eos)
    assert reference[-1] == eos and len(reference) <= 18
    stop = StopCondition(40, frozenset({eos}))
    ar = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop)
    sps = SpeculativeSamplingDecoder(ModelRunner(target), truncated_copy(target, 2), gamma=5).generate(prompt, stop)
    assert ar.tokens == reference == sps.tokens
    assert ar.stats.stop_reason == sps.stats.stop_reason == "eos"


def test_stop_strings_cut_every_decoder_at_the_same_token():
    target = tiny_model("llama", seed=13, vocab_size=32)
    prompt = [1, 2, 3]
    decode = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)  # noqa: E731
    full = hf_greedy(target, prompt, 30)
    stop_string = decode(full[10:12])
    stop = StopCondition(30, stop_strings=(stop_string,), decode=decode)
    ar = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop)
    sps = SpeculativeSamplingDecoder(ModelRunner(target), truncated_copy(target, 2), gamma=4).generate(prompt, stop)
    assert ar.tokens == sps.tokens
    assert stop_string in decode(ar.tokens) and stop_string not in decode(ar.tokens[:-1])
    assert ar.stats.stop_reason == "stop_string"
    assert stop.trim_text(decode(ar.tokens)).find(stop_string) == -1


# ---------------------------------------------------------------------------------------------
# The embedded model, fp32, against transformers.generate


def test_embedded_greedy_ar_equals_generate(embedded, embedded_prompts, embedded_reference):
    model, tokenizer = embedded
    decoder = AutoregressiveDecoder(ModelRunner(model))
    stop = StopCondition(64, frozenset({tokenizer.eos_token_id}))
    for prompt, reference in zip(embedded_prompts, embedded_reference):
        assert decoder.generate(prompt, stop).tokens == reference


def test_embedded_greedy_sps_equals_generate(embedded, embedded_decoder, embedded_prompts, embedded_reference):
    """With the suite's trained draft LM (sharing the target's embeddings and lm_head)."""
    assert_embedded_greedy(embedded_decoder("sps", gamma=4), embedded[1], embedded_prompts, embedded_reference)


# ---------------------------------------------------------------------------------------------
# Sampling: the distribution of the generated tokens is the target's


def test_target_and_draft_disagree(tiny_vocab_pair):
    """The sampling tests below are only meaningful if the draft is often rejected."""
    target, draft = tiny_vocab_pair
    with torch.no_grad():
        p = target(input_ids=torch.tensor([PROMPT])).logits[0].softmax(-1)
        q = draft(input_ids=torch.tensor([PROMPT])).logits[0].softmax(-1)
    total_variation = 0.5 * (p - q).abs().sum(-1).mean()
    assert total_variation > 0.2


@pytest.mark.parametrize("sampling",
                         [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)])
def test_ar_sampling_matches_processed_target_distribution(tiny_vocab_pair, sampling):
    target, _ = tiny_vocab_pair
    expected = exact_joint(target, PROMPT, 2, sampling)
    samples = draw(AutoregressiveDecoder(ModelRunner(target)), 1500, length=2, sampling=sampling)
    assert chi_square_pvalue(samples, expected) > 1e-3


@pytest.mark.parametrize("gamma", [1, 2])
def test_sps_sampling_preserves_target_distribution(tiny_vocab_pair, gamma):
    target, draft = tiny_vocab_pair
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_joint(target, PROMPT, 3, sampling)
    decoder = SpeculativeSamplingDecoder(ModelRunner(target), draft, gamma=gamma)
    samples = draw(decoder, 1500, seed=gamma)
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_sps_with_broken_residual_is_caught(tiny_vocab_pair):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection biases the output;
    the same test must reject it, or it would not be evidence of anything."""
    target, draft = tiny_vocab_pair
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_joint(target, PROMPT, 3, sampling)
    decoder = SpeculativeSamplingDecoder(ModelRunner(target), draft, gamma=2)
    decoder.sample_accept = lambda tree, probs, gen, **kw: SpeculativeSamplingDecoder.sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw)
    samples = draw(decoder, 1500, seed=2)
    assert chi_square_pvalue(samples, expected) < 1e-6


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)
