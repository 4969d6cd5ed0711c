"""MCSD, Jacobi/CLLM and LazyLLM."""

from __future__ import annotations

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.jacobi import JacobiDecoder
from methods.lazyllm import LazyLLMDecoder, LazyRunner, resolve_schedule
from methods.mcsd import MultiCandidateDecoder, parse_k_config
from methods.models.loading import truncated_copy
from tests.conftest import tiny_model
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint


def random_prompts(vocab, count, seed=0, low=3, high=30):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(low, high, (), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# MCSD


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mcsd_greedy_equals_ar(arch):
    target = tiny_model(arch, seed=50, vocab_size=16, layers=4)
    ar = AutoregressiveDecoder(ModelRunner(target))
    accepted = 0
    for k_config, replacement in [((4, 2, 1), False), ((2, 2, 2, 2), True), ((3,), False)]:
        decoder = MultiCandidateDecoder(ModelRunner(target), truncated_copy(target, 2), k_config, replacement)
        for prompt in random_prompts(16, 3, seed=len(k_config)):
            out = decoder.generate(prompt, StopCondition(40))
            assert out.tokens == ar.generate(prompt, StopCondition(40)).tokens
            accepted += out.stats.accepted_drafts
            assert len(out.stats.position_proposed) == len(k_config)
    assert accepted > 20  # multi-token paths were committed in both caches


def test_mcsd_draft_cache_keeps_only_the_accepted_path():
    target = tiny_model("llama", seed=51, vocab_size=16, layers=4)
    draft = truncated_copy(target, 2)
    decoder = MultiCandidateDecoder(ModelRunner(target), draft, (3, 2, 2), replacement=False)
    prompt = [1, 4, 2, 8, 5, 7]
    out = decoder.generate(prompt, StopCondition(30))
    assert out.stats.accepted_drafts > 0
    fed = decoder.draft.fed
    assert fed == (prompt + out.tokens)[: len(fed)]  # the draft cache holds a prefix of the sequence
    reference = ModelRunner(draft)
    reference.prefill(fed)
    for mine, ref in zip(decoder.draft.runner.cache.layers, reference.cache.layers):
        torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, rtol=1e-4, atol=1e-5)


def test_k_config_parsing_and_errors():
    assert parse_k_config("4,2,1") == (4, 2, 1) == parse_k_config([4, 2, 1])
    assert parse_k_config(3) == (3,)
    with pytest.raises(ValueError, match="k_config must look like"):
        parse_k_config("4,x")
    target = tiny_model("llama", seed=52, vocab_size=16)
    with pytest.raises(ValueError, match="positive integers"):
        MultiCandidateDecoder(ModelRunner(target), truncated_copy(target, 1), (2, 0))


@pytest.mark.parametrize("replacement", [True, False])
def test_mcsd_sampling_preserves_target_distribution(tiny_vocab_pair, replacement):
    target, draft = tiny_vocab_pair
    expected = exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = MultiCandidateDecoder(ModelRunner(target), draft, (3, 2), replacement=replacement)
    assert chi_square_pvalue(draw(decoder, 1200, seed=11), expected) > 1e-3


@pytest.mark.parametrize("replacement", [True, False])
def test_mcsd_with_broken_residual_is_caught(tiny_vocab_pair, replacement):
    target, draft = tiny_vocab_pair
    expected = exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = MultiCandidateDecoder(ModelRunner(target), draft, (2, 2), replacement=replacement)
    decoder.sample_accept = lambda tree, probs, gen, **kw: MultiCandidateDecoder.sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw)
    if replacement:
        assert chi_square_pvalue(draw(decoder, 1200, seed=11), expected) < 1e-6  # 1e-119..1e-136 over seeds
    else:  # the q update hides most of the bias: at 3600 draws 4e-17..7e-6 over seeds, at 1200 up to 0.3
        # (tests/test_tree_sampling.py catches this fault on the acceptor itself, draw by draw)
        assert chi_square_pvalue(draw(decoder, 3600, seed=11), expected) < 1e-4


def test_without_replacement_update_matters(tiny_vocab_pair):
    """Verifying candidates drawn without replacement as if drawn with replacement is biased."""
    target, draft = tiny_vocab_pair
    expected = exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = MultiCandidateDecoder(ModelRunner(target), draft, (2, 2), replacement=False)
    original = decoder.draft.draft_tree

    def mislabelled(*args, **kwargs):
        tree = original(*args, **kwargs)
        tree.without_replacement = False  # drop the q update of the verification
        return tree

    decoder.draft.draft_tree = mislabelled
    assert chi_square_pvalue(draw(decoder, 1200, seed=12), expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# Jacobi


@pytest.mark.parametrize("block_size, initial_guess",
                         [(2, "prompt"), (4, "repeat"), (16, "sequence"), (7, "pad"), (5, "sequence")])
def test_jacobi_equals_greedy_ar_and_terminates(block_size, initial_guess):
    target = tiny_model("llama", seed=53, vocab_size=16, layers=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    decoder = JacobiDecoder(ModelRunner(target), block_size=block_size, initial_guess=initial_guess)
    for prompt in random_prompts(16, 4, seed=block_size):
        out = decoder.generate(prompt, StopCondition(37))
        assert out.tokens == ar.generate(prompt, StopCondition(37)).tokens
        assert out.stats.tau >= 1 and all(n >= 1 for n in out.stats.accepted_lengths)
        blocks = out.stats.extra["iterations_per_block"]
        assert blocks and all(1 <= it <= block_size for it in blocks)
        assert sum(blocks) == out.stats.steps - 1  # every iteration after the prefill belongs to a block


def test_jacobi_stops_on_eos_and_rejects_sampling():
    target = tiny_model("llama", seed=54, vocab_size=16)
    prompt = [1, 2, 3]
    full = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, StopCondition(30)).tokens
    stop = StopCondition(30, frozenset({full[9]}))
    reference = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    decoder = JacobiDecoder(ModelRunner(target), block_size=8)
    assert decoder.generate(prompt, stop).tokens == reference
    with pytest.raises(ValueError, match="greedy only"):
        decoder.generate(prompt, stop, SamplingConfig(temperature=0.7))


def test_embedded_jacobi_and_mcsd_equal_generate(embedded, embedded_decoder, embedded_prompts, embedded_reference):
    model, tokenizer = embedded
    stop = StopCondition(64, frozenset({tokenizer.eos_token_id}))
    decoders = [JacobiDecoder(ModelRunner(model), block_size=8),
                embedded_decoder("mcsd", k_config=[4, 2, 1], replacement=False)]  # the trained draft LM
    for prompt, reference in zip(embedded_prompts, embedded_reference):
        for decoder in decoders:
            out = decoder.generate(prompt, stop)
            assert out.tokens == reference, decoder.name
            assert out.stats.tau >= 1


# ---------------------------------------------------------------------------------------------
# LazyLLM


def test_lazyllm_without_pruning_equals_ar():
    target = tiny_model("llama", seed=55, vocab_size=64, layers=4)
    ar = AutoregressiveDecoder(ModelRunner(target))
    decoder = LazyLLMDecoder(ModelRunner(target), [(1, 1.0), (2, 1.0)])
    for prompt in random_prompts(64, 3, seed=3, low=10, high=60):
        out = decoder.generate(prompt, StopCondition(25))
        assert out.tokens == ar.generate(prompt, StopCondition(25)).tokens
        assert out.stats.extra["layer_token_fraction"] == [1.0] * 4


def test_lazyllm_prefill_really_processes_fewer_tokens():
    target = tiny_model("llama", seed=56, vocab_size=64, layers=6)
    prompt = random_prompts(64, 1, seed=4, low=80, high=81)[0]
    runner = LazyRunner(target, [(1, 0.5), (3, 0.25)])
    runner.prefill(prompt)
    n = len(prompt)
    # layers 0-1 see every token; layers 2-3 half; layers 4-5 a quarter (the last token included)
    assert runner.prompt_computed == [n, n, n // 2, n // 2, n // 4, n // 4]
    assert [runner.cache.layers[i].get_seq_length() for i in range(6)] == runner.prompt_computed
    assert int(runner.last_layer[n - 1]) == 5
    # the pruned forward's first-token logits differ from the full prefill's (it is lossy)
    full = ModelRunner(target).prefill(prompt).logits[-1]
    pruned = LazyRunner(target, [(1, 0.5), (3, 0.25)]).prefill(prompt).logits[-1]
    assert not torch.allclose(full, pruned)


def test_lazyllm_aux_cache_and_revival_match_full_computation():
    """A token pruned at the first pruning layer has, in the Aux Cache, exactly the hidden state
    the full model computes for it there; revived, its KV at the next layer equals the full
    model's when every token before it is present there (the earliest pruned token)."""
    target = tiny_model("llama", seed=57, vocab_size=64, layers=4)
    prompt = random_prompts(64, 1, seed=5, low=40, high=41)[0]
    runner = LazyRunner(target, [(1, 0.5)])
    runner.prefill(prompt)
    pruned = torch.nonzero(runner.last_layer == 1).flatten()
    assert pruned.numel() > 0
    with torch.no_grad():
        full = target(input_ids=torch.tensor([prompt]), output_hidden_states=True, use_cache=True)
    # hidden_states[2] is the output of layer 1
    torch.testing.assert_close(runner.aux_hidden[pruned], full.hidden_states[2][0, pruned], rtol=1e-4, atol=1e-5)
    first = int(pruned.min())
    with torch.inference_mode():
        runner.aux_hidden[first] = runner.run_layer(2, runner.aux_hidden[first : first + 1], torch.tensor([first]))[0]
    keys = runner.cache.layers[2].keys[0, :, -1]  # the revived entry, appended last
    torch.testing.assert_close(keys, full.past_key_values.layers[2].keys[0, :, first], rtol=1e-4, atol=1e-5)


def test_lazyllm_never_computes_more_than_full_prefill_and_revives():
    target = tiny_model("llama", seed=58, vocab_size=64, layers=6)
    prompt = random_prompts(64, 1, seed=6, low=60, high=61)[0]
    decoder = LazyLLMDecoder(ModelRunner(target), [(1, 0.6), (3, 0.3)])
    out = decoder.generate(prompt, StopCondition(40))
    runner = decoder.target
    assert sum(runner.revived) > 0  # decoding steps selected pruned tokens again
    assert all(count <= len(prompt) for count in runner.prompt_computed)  # each (token, layer) at most once
    assert sum(runner.prompt_computed) <= len(prompt) * 6
    prefill = out.stats.extra["prefill_layer_token_fraction"]
    assert prefill[0] == 1.0 and prefill[-1] < 0.35  # the pruned prefill (what TTFT measures)
    assert all(a <= b <= 1.0 for a, b in zip(prefill, out.stats.extra["layer_token_fraction"]))


def test_lazyllm_schedule_validation():
    assert resolve_schedule([(0.25, 0.7), (0.5, 0.5)], 32) == {8: 0.7, 16: 0.5}
    with pytest.raises(ValueError, match="must not increase"):
        resolve_schedule([(2, 0.3), (4, 0.6)], 8)
    with pytest.raises(ValueError, match="outside"):
        resolve_schedule([(9, 0.5)], 8)
