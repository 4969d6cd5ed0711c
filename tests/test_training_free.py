"""The training-free drafters: PLD, Lookahead decoding and Token Recycling.

Exactness against AR and `transformers.generate` (fp32), PLD's proposals against `transformers`'
own `PromptLookupCandidateGenerator`, Lookahead's window rows against the paper's mask (each row's
logits equal a plain forward over the chain it sees) and the KV after commits, Token Recycling's
matrix, BFS and persistence, χ² sampling tests with a broken-acceptor counter-test, and the
parameter schemas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.base import check_method_params
from methods.engine.acceptance import greedy_accept_logits
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.static_trees import StaticTree
from methods.engine.stopping import StopCondition
from methods.engine.tree import ExtraRows, Tree
from methods.lookahead import LookaheadDecoder
from methods.loop import DraftVerifyDecoder
from methods.pld import PromptLookupDecoder, lookup_continuations
from methods.recycling import TEMPLATE_2_2_2, TokenRecyclingDecoder
from methods.settings.params import ConfigError
from tests.conftest import decode_state, tiny_model
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint


def random_prompts(vocab, count, seed=0, low=8, high=40):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(low, high, (), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def recycling(target, top_k=8, persist=True, tree=TEMPLATE_2_2_2):
    return TokenRecyclingDecoder(ModelRunner(target), StaticTree.build(tree), top_k=top_k, persist=persist)


# ---------------------------------------------------------------------------------------------
# PLD


def test_pld_proposals_equal_transformers_prompt_lookup():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = torch.Generator().manual_seed(1)
    compared = matched = 0
    for trial in range(300):
        length = int(torch.randint(2, 60, (), generator=gen))
        sequence = torch.randint(0, 6 if trial % 2 else 20, (length,), generator=gen)
        max_ngram, num = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 12, (), generator=gen))
        eos = 3 if trial % 3 == 0 else None
        hf = PromptLookupCandidateGenerator(eos_token_id=None if eos is None else torch.tensor([eos]),
                                            num_output_tokens=num, max_matching_ngram_size=max_ngram, max_length=10_000)
        expected = hf.get_candidates(sequence.view(1, -1))[0][0, length:].tolist()
        found = lookup_continuations(sequence, max_ngram, num, frozenset() if eos is None else {eos})
        assert (found[0] if found else []) == expected, (sequence.tolist(), max_ngram, num, eos)
        compared += 1
        matched += bool(expected)
    assert matched > 100 and compared == 300


def test_pld_branches_merge_further_matches_into_a_trie():
    sequence = torch.tensor([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2])
    assert lookup_continuations(sequence, 2, 3) == [[3, 9, 1]]  # upstream: the leftmost match only
    found = lookup_continuations(sequence, 2, 3, branches=3)
    assert found == [[3, 9, 1], [4, 7, 1], [3, 8, 1]]
    decoder = PromptLookupDecoder(None, max_ngram=2, num_draft=3, branches=3)
    state = decode_state(decoder, sequence.tolist())
    tree = decoder.propose(state, 2, 10)
    # root 2; "3" shared by two continuations; then 9 1 / 8 1, and 4 7 1
    assert tree.tokens.tolist() == [2, 3, 9, 1, 4, 7, 1, 8, 1]
    assert tree.parents == [-1, 0, 1, 2, 0, 4, 5, 1, 7]
    assert max(tree.depths) == 3 and len(decoder.propose(state, 2, 1)) == 3  # the budget cuts each branch


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pld_equals_transformers_prompt_lookup_generate_and_ar(arch):
    target = tiny_model(arch, seed=61, vocab_size=16, layers=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    decoders = [PromptLookupDecoder(ModelRunner(target)),
                PromptLookupDecoder(ModelRunner(target), max_ngram=1, num_draft=4),
                PromptLookupDecoder(ModelRunner(target), branches=4)]
    accepted = {id(d): 0 for d in decoders}
    for prompt in random_prompts(16, 3, seed=2):
        ids = torch.tensor([prompt])
        hf = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                             pad_token_id=0,
                             prompt_lookup_num_tokens=10, max_matching_ngram_size=3)[0, len(prompt):].tolist()
        assert hf == ar.generate(prompt, StopCondition(40)).tokens
        for decoder in decoders:
            out = decoder.generate(prompt, StopCondition(40))
            assert out.tokens == hf
            accepted[id(decoder)] += out.stats.accepted_drafts
            assert 0 < out.stats.extra["match_rate"] <= 1
    assert all(accepted.values())


def assert_stops_on_eos_like_ar(target, decoder) -> None:
    """With the 13th token AR decodes as an EOS, `decoder` stops where AR stops, with AR's tokens."""
    prompt = random_prompts(16, 1, seed=3)[0]
    full = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, StopCondition(40)).tokens
    stop = StopCondition(40, frozenset({full[12]}))
    expected = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    assert decoder.generate(prompt, stop).tokens == expected


def test_pld_stops_on_eos_like_ar():
    target = tiny_model("llama", seed=62, vocab_size=16)
    assert_stops_on_eos_like_ar(target, PromptLookupDecoder(ModelRunner(target)))


# ---------------------------------------------------------------------------------------------
# Lookahead


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lookahead_greedy_equals_ar(arch):
    target = tiny_model(arch, seed=63, vocab_size=16, layers=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    settings = [dict(), dict(window=4, level=3, guess=3), dict(window=1, level=4, guess=2, pool_from_prompt=True),
                dict(window=5, level=5, guess=0)]
    verified = 0
    for i, setting in enumerate(settings):
        decoder = LookaheadDecoder(ModelRunner(target), **setting)
        for prompt in random_prompts(16, 2, seed=10 + i):
            out = decoder.generate(prompt, StopCondition(37))
            assert out.tokens == ar.generate(prompt, StopCondition(37)).tokens, setting
            level, window = setting.get("level", 5), setting.get("window", 15)
            if setting.get("guess", 15) == 0:
                assert out.stats.drafted_tokens == 0  # the window alone proposes nothing
            else:
                verified += out.stats.accepted_drafts
                # once warm, the window holds (N - 1) W rows with the root
                assert out.stats.extra["window_rows_per_step"] <= (level - 1) * window - 1 + (level - 2) * (level - 1)
    assert verified > 20


def test_lookahead_drops_the_window_where_the_model_has_no_positions_left():
    target = tiny_model("llama", seed=68, vocab_size=16, layers=2, max_position_embeddings=64)
    prompt = random_prompts(16, 1, seed=6, low=20, high=21)[0]
    expected = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, StopCondition(44)).tokens
    out = LookaheadDecoder(ModelRunner(target)).generate(prompt, StopCondition(44))  # 60 window rows
    assert out.tokens == expected
    assert out.stats.extra["window_rows_per_step"] < 59


def drive(decoder, prompt, steps):
    """The shared loop's steps by hand (greedy), leaving the decoder and target mid-generation; returns
    the next root and the sequence's state."""
    decoder.target.reset()
    state = decode_state(decoder, prompt)
    first = decoder.prefill(state)
    root = int(first.logits[-1].argmax())
    state.tokens.append(root)
    state.sequence.append(root)
    decoder.start(state, first)
    for _ in range(steps):
        tree = decoder.propose(state, root, 100)
        prefix = decoder.target.length
        out = decoder.target.verify(tree)
        # as the shared loop accepts: the window's argmax comes back with the acceptance
        acceptance = greedy_accept_logits(tree, out.logits[: len(tree)], out.logits[len(tree):])
        decoder.target.commit(prefix, acceptance.path)
        state.emit(tree.tokens[acceptance.path[1:]].tolist() + [acceptance.next_token], [])
        decoder.advance(state, tree, acceptance, out)
        root = acceptance.next_token
    return root, state


def test_lookahead_window_rows_see_their_trajectory_and_the_commit_drops_them():
    """Each window row's logits equal a plain causal forward over the chain the paper's mask lets
    it see (prefix, root, level-0 columns before it, its own column of earlier levels); the
    candidates' logits are those of the tree without the window; after commits the KV cache equals
    a fresh prefill of the text."""
    target = tiny_model("llama", seed=64, vocab_size=32, layers=2)
    decoder = LookaheadDecoder(ModelRunner(target), window=4, level=4, guess=4, pool_from_prompt=True)
    prompt = random_prompts(32, 1, seed=4, low=30, high=31)[0]
    root, state = drive(decoder, prompt, 6)
    assert state.values["levels"][-1] is not None  # warm
    tree = decoder.propose(state, root, 100)
    assert len(tree) > 1 and len(tree.extra_rows) == 3 * 4 - 1
    prefix = state.sequence[:-1]
    assert decoder.target.length == len(prefix)
    # the KV after several commits equals a fresh prefill of the text
    reference = ModelRunner(target)
    reference.prefill(prefix)
    for mine, ref in zip(decoder.target.cache.layers, reference.cache.layers):
        torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-4, atol=1e-5)
    out = decoder.target.verify(tree)
    tokens, depths, visible = tree.forward_rows()
    n = len(tree)
    with torch.no_grad():
        for row in range(n, len(tokens)):
            seen = sorted(torch.nonzero(visible[row]).flatten().tolist(), key=lambda j: depths[j])
            assert [depths[j] for j in seen] == list(range(len(seen)))  # a chain of consecutive positions
            logits = target(input_ids=torch.tensor([prefix + tokens[seen].tolist()])).logits[0, -1]
            torch.testing.assert_close(out.logits[row], logits, rtol=1e-4, atol=1e-4)
    alone = ModelRunner(target)
    alone.prefill(prefix)
    torch.testing.assert_close(out.logits[:n], alone.verify(Tree(tree.tokens, tree.parents)).logits, rtol=1e-4,
                               atol=1e-4)


def test_lookahead_pool_is_an_lru_of_g_ngrams_per_token():
    decoder = LookaheadDecoder(None, window=2, level=3, guess=2)
    state = SimpleNamespace(values={"pool": {}})  # the sequence's pool
    for ngram in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        decoder.remember(state, 7, ngram)
    assert state.values["pool"] == {7: [(1, 2), (5, 6)]}  # (1, 2) refreshed, (3, 4) the oldest evicted
    with pytest.raises(ValueError):
        Tree(torch.tensor([1, 2]), [-1, 0],
             extra_rows=ExtraRows(torch.tensor([3]), [1], torch.ones(1, 2, dtype=torch.bool)))


# ---------------------------------------------------------------------------------------------
# Token Recycling


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_recycling_greedy_equals_ar_and_matrix_persists(arch):
    target = tiny_model(arch, seed=65, vocab_size=64, layers=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    decoder = recycling(target)
    fresh = recycling(target, persist=False)
    accepted = 0
    for i, prompt in enumerate(random_prompts(64, 3, seed=5)):
        expected = ar.generate(prompt, StopCondition(40)).tokens
        out = decoder.generate(prompt, StopCondition(40))
        assert out.tokens == expected == fresh.generate(prompt, StopCondition(40)).tokens
        accepted += out.stats.accepted_drafts
        assert out.stats.extra["adjacency_persists"] is True
        assert (out.stats.extra["adjacency_rows_before"] > 0) == (i > 0)  # carried over from the earlier prompts
        assert len(out.stats.position_proposed) == 6
    assert accepted > 10
    assert fresh.filled.sum() <= decoder.filled.sum()
    decoder.reset()
    assert not decoder.filled.any() and not decoder.adjacency.any()


def test_recycling_matrix_holds_the_targets_top_k_and_bfs_follows_it():
    target = tiny_model("llama", seed=66, vocab_size=64, layers=2)
    decoder = recycling(target)
    logits = torch.randn(4, 64)
    matrix = decoder.answer_matrix()
    decoder.recycle(matrix, torch.tensor([5, 9, 5, 11]), logits)
    # every forwarded token's row is the top-8 after it; a repeated token keeps its last node's
    assert matrix["adjacency"][9].tolist() == torch.topk(logits[1], 8).indices.tolist()
    assert matrix["adjacency"][5].tolist() == torch.topk(logits[2], 8).indices.tolist()
    assert matrix["filled"][:-1].nonzero().flatten().tolist() == [5, 9, 11]  # the last row: the overridden write's
    assert matrix["written"].nonzero().flatten().tolist() == [5, 9, 11, 64]
    assert not decoder.adjacency.any()  # the answer's copy, not the shared matrix
    state = decode_state(decoder, [1, 3])
    adj = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))
    state.values["matrix"] = {**matrix, "adjacency": adj}
    tree = decoder.propose(state, 3, 100)
    assert len(tree) == 81 and max(tree.depths) == 6
    for node, path in enumerate(TEMPLATE_2_2_2, start=1):
        token = 3
        for rank in path:
            token = int(adj[token, rank])
        assert int(tree.tokens[node]) == token
    assert max(decoder.propose(state, 3, 2).depths) == 2


# ---------------------------------------------------------------------------------------------
# Embedded model: 5 Spec-Bench prompts x 64 tokens, fp32


def test_embedded_training_free_methods_equal_generate(embedded, embedded_decoder, embedded_prompts,
                                                       embedded_reference):
    """PLD at its defaults over 64 tokens; Lookahead (N, W, G = 4, 4, 4) and Token Recycling (the
    template's first 16 nodes) over the first 32 tokens: their default sizes (120- and 81-row
    forwards) cost minutes on a CPU and are covered on tiny models."""
    from methods.recycling import TEMPLATE_2_2_2

    _, tokenizer = embedded
    eos = frozenset({tokenizer.eos_token_id})
    runs = [(embedded_decoder("pld"), 64), (embedded_decoder("lookahead", level=4, window=4, guess=4), 32),
            (embedded_decoder("recycling", tree=TEMPLATE_2_2_2[:16]), 32)]
    accepted = {decoder.name: 0 for decoder, _ in runs}
    for prompt, reference in zip(embedded_prompts, embedded_reference):
        for decoder, length in runs:
            out = decoder.generate(prompt, StopCondition(length, eos))
            assert out.tokens == reference[:length], decoder.name
            accepted[decoder.name] += out.stats.accepted_drafts
    assert all(accepted.values()), accepted


# ---------------------------------------------------------------------------------------------
# Sampling: the engine's rejection sampling with the drafts as point masses


def sampling_decoder(method, target):
    if method == "pld":
        return PromptLookupDecoder(ModelRunner(target), max_ngram=2, num_draft=3, branches=2)
    if method == "lookahead":
        return LookaheadDecoder(ModelRunner(target), window=3, level=3, guess=3, pool_from_prompt=True)
    small = [p for p in TEMPLATE_2_2_2 if max(p) < 3]  # a 4-token vocabulary has 4 successors at most
    return recycling(target, top_k=3, tree=small)


@pytest.mark.parametrize("method", ["pld", "lookahead", "recycling"])
def test_sampling_preserves_target_distribution(tiny_vocab_pair, method):
    target = tiny_vocab_pair[0]
    expected = exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = sampling_decoder(method, target)
    samples = draw(decoder, 1200, seed=13)
    assert chi_square_pvalue(samples, expected) > 1e-3
    assert decoder.generate(PROMPT, StopCondition(3), SamplingConfig(temperature=1.0),
                            torch.Generator().manual_seed(0)).stats.drafted_tokens > 0


@pytest.mark.parametrize("method", ["recycling"])
def test_sampling_with_broken_acceptor_is_caught(tiny_vocab_pair, method):
    target = tiny_vocab_pair[0]
    expected = exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = sampling_decoder(method, target)
    decoder.sample_accept = lambda tree, probs, gen, **kw: DraftVerifyDecoder.sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw)  # a rejected draft token may be drawn again
    assert chi_square_pvalue(draw(decoder, 1200, seed=13), expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# Parameters: rejected before any model loads


@pytest.mark.parametrize("method, params", [
    ("pld", {"max_ngram": 0}), ("pld", {"num_draft": "big"}), ("pld", {"num_draft": 0}),
    ("pld", {"branches": 1.5}), ("pld", {"ngram": 3}),
    ("lookahead", {"level": 2}), ("lookahead", {"window": 0}), ("lookahead", {"guess": -1}),
    ("lookahead", {"pool_from_prompt": "yes"}),
    ("recycling", {"tree": "2.2.3"}), ("recycling", {"top_k": 0}), ("recycling", {"persist": 1}),
])
def test_bad_parameters_are_rejected_before_loading(method, params):
    with pytest.raises(ConfigError, match=f"method.{next(iter(params))}"):
        check_method_params(method, {"name": method, **params})
    check_method_params(method, {"name": method})  # the defaults pass


def test_template_needs_enough_successors():
    target = tiny_model("llama", seed=67, vocab_size=16, layers=1)
    with pytest.raises(ValueError, match="top_k=4"):
        recycling(target, top_k=4)
