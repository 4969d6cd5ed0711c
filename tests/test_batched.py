"""Batch > 1 (`methods/loop.py`): each sequence of a batch decodes what it decodes alone.

Greedy tokens equal B = 1's token for token (prompts of different lengths, different stops); the
cache rows of a batch hold each sequence's B = 1 KV; sampled at B = 4 the first tokens follow the
target's distribution (chi-square), and a broken acceptor is caught.
"""

from __future__ import annotations

import functools
import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.base import batchable_methods
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.static_trees import StaticTree
from methods.engine.stopping import StopCondition
from methods.engine.tree import Tree
from methods.jacobi import JacobiDecoder
from methods.models.loading import truncated_copy
from methods.pld import PromptLookupDecoder
from methods.recycling import TEMPLATE_2_2_2, TokenRecyclingDecoder
from methods.rest import RestDecoder, RestSettings, write_datastore
from methods.sam import build_static
from methods.sps import SpeculativeSamplingDecoder
from tests.conftest import tiny_model
from tests.stats_util import PROMPT, TEMPERATURE_1, chi_square_pvalue, exact_joint
from tests.test_retrieval import sam, suffix


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=10, vocab_size=32)  # a small vocabulary: PLD finds matches


DECODERS = {
    "ar": lambda model: AutoregressiveDecoder(ModelRunner(model)),
    "pld": lambda model: PromptLookupDecoder(ModelRunner(model), num_draft=4),
    "sps": lambda model: SpeculativeSamplingDecoder(ModelRunner(model), truncated_copy(model, 2), gamma=3),
}


def prompts_and_stops(batch: int, vocab: int = 32):
    """`batch` prompts of 3 to 30 tokens, each with its own max_new_tokens; one stops at an EOS token."""
    generator = torch.Generator().manual_seed(batch)
    lengths = [3, 30, 11, 19][:batch]
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    limits = [24, 9, 40, 17][:batch]
    stops = [StopCondition(limit) for limit in limits]
    return prompts, stops


@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("method", sorted(DECODERS))
def test_greedy_batch_equals_each_prompt_alone(target, method, batch):
    prompts, stops = prompts_and_stops(batch)
    alone = [DECODERS[method](target).generate(p, s) for p, s in zip(prompts, stops)]
    # the first sequence also stops at an EOS token its answer reaches (before its length limit)
    eos = alone[0].tokens[len(alone[0].tokens) // 2]
    stops[0] = StopCondition(stops[0].max_new_tokens, frozenset({eos}))
    alone[0] = DECODERS[method](target).generate(prompts[0], stops[0])
    assert alone[0].stats.stop_reason == "eos"
    outs = DECODERS[method](target).generate_batch(prompts, stops)
    for out, reference in zip(outs, alone):
        assert out.tokens == reference.tokens
        assert out.stats.stop_reason == reference.stats.stop_reason
        assert out.stats.accepted_lengths == reference.stats.accepted_lengths
        assert out.stats.new_tokens == len(out.tokens) == len(out.stats.logit_margins)
    assert len({out.stats.steps for out in outs}) > 1  # sequences left the batch at different steps
    if method != "ar":
        assert sum(out.stats.accepted_drafts for out in outs) > 0  # chains longer than one row were verified


def test_an_auto_draft_is_cut_to_the_verify_budget_at_the_batch_size(target):
    """A draft sized `auto` (its `Sizing` keeps the curve) verifies at most `Sizing.cut(B)` tokens per
    sequence at B > 1, greedy, and decodes the same tokens; sampled, it drafts as alone (seeded: the
    same tokens as alone)."""
    from methods.settings.sizing import Sizing

    curve = {1: 1.0, 4: 1.0, 8: 1.1, 16: 2.0, 64: 8.0}
    prompts, stops = prompts_and_stops(4)
    alone = [DECODERS["pld"](target).generate(p, s) for p, s in zip(prompts, stops)]
    decoder = PromptLookupDecoder(ModelRunner(target), num_draft=Sizing(4, {"num_draft": "auto"}, curve))
    cut = decoder.sizing.cut(4)
    assert cut == 1 and decoder.sizing.cut(2) == 3 and decoder.sizing.cut(1) is None
    assert max(max(out.stats.accepted_lengths) for out in alone) > 2
    drafted = []
    propose = decoder.propose
    decoder.propose = lambda state, root, budget: drafted.append((state.batch, budget)) or propose(state, root, budget)
    outs = decoder.generate_batch(prompts, stops)
    assert [out.tokens for out in outs] == [out.tokens for out in alone]
    assert all(budget <= decoder.sizing.cut(batch) for batch, budget in drafted if batch > 1)
    assert {batch for batch, _ in drafted} >= {4, 2}  # the cut follows the batch as sequences leave
    assert decoder.describe()["sizing"]["batch_draft_tokens"] == {b: decoder.sizing.cut(b) for b in (2, 3, 4)}
    sampling = SamplingConfig(temperature=0.8)
    alone = [DECODERS["pld"](target).generate(p, s, sampling, torch.Generator().manual_seed(b)).tokens
             for b, (p, s) in enumerate(zip(prompts, stops))]
    generators = [torch.Generator().manual_seed(b) for b in range(4)]
    outs = decoder.generate_batch(prompts, stops, sampling, generators)
    assert [out.tokens for out in outs] == alone


def assert_batch_of_three_as_alone(make, statistic: str) -> None:
    """Three prompts (vocabulary 16) decoded together by a fresh `make()` decoder as each alone: greedy
    tokens, accepted lengths and `stats.<statistic>` equal, with drafts accepted; sampled at
    temperature 0.8, the same tokens from generators seeded alike."""
    prompts, stops = prompts_and_stops(3, vocab=16)
    alone = [make().generate(p, s) for p, s in zip(prompts, stops)]
    outs = make().generate_batch(prompts, stops)
    for out, reference in zip(outs, alone):
        assert out.tokens == reference.tokens
        assert out.stats.accepted_lengths == reference.stats.accepted_lengths
        assert getattr(out.stats, statistic) == getattr(reference.stats, statistic)
    assert sum(out.stats.accepted_drafts for out in outs) > 0
    sampling = SamplingConfig(temperature=0.8)
    alone = [make().generate(p, s, sampling, torch.Generator().manual_seed(b)).tokens
             for b, (p, s) in enumerate(zip(prompts, stops))]
    outs = make().generate_batch(prompts, stops, sampling,
                                           [torch.Generator().manual_seed(b) for b in range(3)])
    assert [out.tokens for out in outs] == alone


@pytest.mark.parametrize("method", ["eagle", "eagle2", "eagle2-small", "mcsd"])
def test_tree_methods_batch_equals_each_prompt_alone(method, tmp_path):
    """Trees at B = 3 (EAGLE's static tree, EAGLE-2's dynamic one at 60 and 8 tokens, MCSD's
    multi-candidate tree): padded to the step's largest, each sequence with its own ancestor mask,
    path commit and drafter (the head's cache, the draft LM's): greedy tokens and accepted lengths
    as alone, with drafts accepted; sampled, the same tokens from the same generators."""
    from methods.mcsd import MultiCandidateDecoder
    from tests.test_tree_methods import decoders

    model = tiny_model("llama", seed=45, vocab_size=16)  # a small vocabulary: trees hold the target's choices
    make = (lambda: MultiCandidateDecoder(ModelRunner(model), truncated_copy(model, 2), k_config=(3, 2, 1))) \
        if method == "mcsd" else (lambda: decoders(model, tmp_path)[method])
    assert_batch_of_three_as_alone(make, "position_accepted")


def retrieval_text(model, vocab: int = 32) -> list[list[int]]:
    """Random token sequences and the model's own answers to the batch tests' prompts (so that drafts
    retrieved from them are accepted)."""
    prompts, _ = prompts_and_stops(3, vocab)
    ar = AutoregressiveDecoder(ModelRunner(model))
    rng = random.Random(0)
    text = [[rng.randrange(vocab) for _ in range(30)] for _ in range(40)]
    return text + [p + ar.generate(p, StopCondition(40)).tokens for p in prompts]


def retrieval_corpus(model, folder, vocab: int = 32):
    """SAM's static automaton over `retrieval_text`."""
    return build_static(retrieval_text(model, vocab), eos=0, vocab_size=vocab, log=lambda line: None)


def rest_datastore(model, path, vocab: int = 32):
    """REST's datastore over `retrieval_text`."""
    write_datastore(path, retrieval_text(model, vocab))
    return path


@pytest.mark.parametrize("method", ["sam", "sam-eagle2"])
def test_sam_batch_equals_each_prompt_alone(method, tmp_path):
    """SAM's chains and static trees, and its EAGLE-2 trees, at B = 3: greedy tokens and accepted lengths
    as alone, drafts accepted; sampled, the same tokens from the same generators."""
    from methods.models.heads.eagle import load_eagle_head
    from methods.models.specs import ModelSpec
    from tests.test_tree_methods import write_eagle

    model = tiny_model("llama", seed=45, vocab_size=16)
    static = retrieval_corpus(model, tmp_path, vocab=16)
    write_eagle(tmp_path / "eagle", model)
    head = load_eagle_head(ModelSpec(path=str(tmp_path / "eagle")), model)

    def make():
        if method == "sam":
            return sam(model, static, predicts=8, len_bias=0)
        return sam(model, static, head, predicts=8, len_threshold=2)

    assert_batch_of_three_as_alone(make, "extra")  # extra: the sequence's own drafts, by drafter


def retrieval_decoder(method: str, model, store=None):
    """Suffix Decoding with its shared cache (vLLM's), with a cache per sequence (`persist: false`), or REST
    over the datastore `store`."""
    if method == "rest":
        return RestDecoder(ModelRunner(model), store, RestSettings(num_draft=8))
    return suffix(model, persist=method == "suffix")


@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("method", ["suffix", "suffix-own-cache", "rest"])
def test_suffix_and_rest_greedy_batch_equals_each_prompt_alone(target, method, batch, tmp_path):
    """Suffix Decoding (one request per sequence in the shared cache; or a cache per sequence) and REST at
    B = 2 and 3, prompts of 3, 30 and 11 tokens with their own limits: each prompt's greedy tokens and stop
    as alone, drafts accepted. Alone and the batch each start from a fresh decoder (an empty cache, a fresh
    reader). A cache per sequence drafts as alone: the same accepted lengths and statistics too."""
    store = rest_datastore(target, tmp_path / "rest.idx") if method == "rest" else None
    prompts, stops = prompts_and_stops(batch)
    alone = [retrieval_decoder(method, target, store).generate(p, s) for p, s in zip(prompts, stops)]
    decoder = retrieval_decoder(method, target, store)
    outs = decoder.generate_batch(prompts, stops)
    for out, reference in zip(outs, alone):
        assert out.tokens == reference.tokens
        assert out.stats.stop_reason == reference.stats.stop_reason
        assert out.stats.new_tokens == len(out.tokens) == len(out.stats.logit_margins)
        if method == "suffix-own-cache":
            assert out.stats.accepted_lengths == reference.stats.accepted_lengths
            assert out.stats.extra == reference.stats.extra
    assert sum(out.stats.accepted_drafts for out in outs) > 0
    if method == "suffix":  # every request stopped, every answer kept in the global tree
        assert not decoder.cache.active_requests and len(decoder.cache.cached_requests) == batch
        assert [out.stats.extra["cached_answers_before"] for out in outs] == [0] * batch  # none had finished


def test_suffix_shared_cache_drafts_from_the_answers_beside_it(target):
    """As vLLM's concurrent requests: arctic's `add_active_response` extends the global tree with a running
    answer, so a sequence drafts from the answers decoded beside it. A prompt decoded beside another whose
    prompt is it and the first 8 tokens of its answer (that one decodes the same answer 8 tokens ahead)
    accepts more drafts than alone, from a fresh cache either way; the greedy tokens are the same."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24)
    cache.start_request("a", [1, 2, 3])
    cache.start_request("b", [9, 9, 9])
    cache.add_active_response("a", [4, 5, 6, 7, 8])
    assert cache.speculate("b", [9, 4, 5], max_spec_tokens=4, max_spec_factor=2.0).token_ids == [6, 7, 8]
    prompt = prompts_and_stops(3)[0][2]
    answer = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, StopCondition(40)).tokens
    stops = [StopCondition(32), StopCondition(32)]
    alone = suffix(target).generate(prompt, stops[0])
    outs = suffix(target).generate_batch([prompt, prompt + answer[:8]], stops)
    assert outs[0].tokens == alone.tokens == answer[:32] and outs[1].tokens == answer[8:40]
    assert outs[0].stats.accepted_drafts > alone.stats.accepted_drafts


@pytest.mark.parametrize("decoder", ["auto", "transformers"])
@pytest.mark.parametrize("method", ["pld", "mcsd"])
def test_qwen2_batch_on_the_fused_and_the_stock_forward(decoder, method):
    """Another architecture (q/k/v biases), and the stock `transformers` decoder stack over the same cache
    (MCSD: the draft LM's batch forward too, its tree levels over the draft's tree slots)."""
    from methods.mcsd import MultiCandidateDecoder

    model = tiny_model("qwen2", seed=10, vocab_size=32)
    draft = truncated_copy(model, 1)
    make = {"pld": lambda: PromptLookupDecoder(ModelRunner(model, decoder=decoder)),
            "mcsd": lambda: MultiCandidateDecoder(ModelRunner(model, decoder=decoder), draft,
                                                  k_config=(2, 2, 1))}[method]
    prompts, stops = prompts_and_stops(3)
    alone = [make().generate(p, s) for p, s in zip(prompts, stops)]
    outs = make().generate_batch(prompts, stops)
    assert [out.tokens for out in outs] == [out.tokens for out in alone]
    # the same drafts accepted step by step (a draft from the wrong KV would accept differently)
    assert [out.stats.accepted_lengths for out in outs] == [out.stats.accepted_lengths for out in alone]


@pytest.mark.parametrize("kept", [[0, 2], [2, 0]], ids=["in-order", "reordered"])
@pytest.mark.parametrize("joined", [True, False], ids=["joined", "per-layer"])
def test_batch_cache_rows_hold_each_sequence_alone(target, joined, kept):
    """After a prefill (each prompt alone into its row, no padding) and two verifications of chains of
    different lengths, each accepting its own path, and a sequence leaving the batch, each row of every
    layer's cache holds its sequence's KV as the B = 1 cache holds it; the prefill's last logits are
    the B = 1 prefill's, bit for bit. Joined (`reserve_batch`): every layer's buffers are views of one
    tensor, each commit one gather for all layers; per layer (a cache that grew past them): one gather
    per layer. In order, the rows left move up in place; reordered, the buffers are copied."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    steps = [  # per step: each sequence's chain (root first) and the rows it keeps
        [([3, 4, 5], [0, 1]), ([10], [0]), ([15, 1, 2, 3, 4], [0, 1, 2, 3])],
        [([5, 6], [0, 1]), ([7, 8, 9, 1], [0]), ([4, 5], [0, 1])],
    ]
    batched = ModelRunner(target)
    batched.reserve_batch(len(prompts), 64)
    firsts = batched.prefill_rows([SimpleNamespace(prompt=p) for p in prompts])
    cache = batched.cache
    keys, _ = cache.joined
    assert all(layer.key_buffer.data_ptr() == keys[i].data_ptr() for i, layer in enumerate(cache.layers))
    if not joined:
        cache.regrowths = 1  # as after a layer grew past the joined buffers
    for step in steps:
        start = batched.length
        batched.forward_batch([Tree.chain(torch.tensor(chain)).forward_rows() for chain, _ in step])
        batched.cache.commit_batch(start, [kept for _, kept in step])
    # the middle sequence leaves (and, reordered, the others swap rows): each row then holds the KV of
    # the sequence it now holds (joined: still views of one tensor)
    cache.keep_sequences(kept)
    assert (cache.joined is not None) == joined and len(cache.layers[0].key_buffer) == 2
    for row, b in enumerate(kept):
        prompt = prompts[b]
        alone = ModelRunner(target)
        alone.reserve(64)
        assert torch.equal(firsts[b].logits, alone.prefill(prompt).logits)
        for step in steps:
            chain, path = step[b]
            start = alone.length
            alone.verify(Tree.chain(torch.tensor(chain)))
            alone.commit(start, path)
        length = alone.length
        assert batched.cache.lengths[row] == length
        for mine, theirs in zip(batched.cache.layers, alone.cache.layers):
            torch.testing.assert_close(mine.key_buffer[row, :, :length], theirs.keys[0])
            torch.testing.assert_close(mine.value_buffer[row, :, :length], theirs.values[0])


def test_batch_rejects_a_method_that_decodes_one_sequence(target):
    from methods.lazyllm import LazyLLMDecoder

    assert "lazyllm" not in batchable_methods()
    with pytest.raises(ValueError, match="'lazyllm' does not decode at batch size > 1; methods that do: "
                                         + ", ".join(batchable_methods())):
        LazyLLMDecoder(ModelRunner(target), [(0, 0.5)]).generate_batch([[1, 2], [3]], [StopCondition(4)] * 2)


@pytest.mark.parametrize("method", ["ar", "sps"])
def test_sampled_batch_draws_what_each_prompt_draws_alone(target, method):
    """Each sequence draws from its own generator in the order B = 1 draws: the same tokens."""
    prompts, stops = prompts_and_stops(4)
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    alone = [DECODERS[method](target).generate(p, s, sampling, torch.Generator().manual_seed(b)).tokens
             for b, (p, s) in enumerate(zip(prompts, stops))]
    generators = [torch.Generator().manual_seed(b) for b in range(4)]
    outs = DECODERS[method](target).generate_batch(prompts, stops, sampling, generators)
    assert [out.tokens for out in outs] == alone


# A verify latency curve of a CPU's scale (seconds by tokens): EAGLE-2/3's adaptive size weighs it
# against the drafting's time, which is of the same order on the tiny models (milliseconds)
CPU_CURVE = {1: 0.002, 2: 0.0022, 4: 0.0025, 8: 0.003, 16: 0.004, 32: 0.006, 64: 0.01}


@pytest.fixture(scope="module")
def every_batchable(tmp_path_factory):
    """A fresh decoder of each batchable method, on one tiny target (7 layers: EAGLE-3's three feature
    layers differ) with random-init EAGLE and EAGLE-3 heads; EAGLE-2/3 at their default adaptive size."""
    from methods.dflash import DFlashDecoder
    from methods.eagle.eagle3 import Eagle3Decoder
    from methods.eagle.template import EagleDecoder
    from methods.engine.static_trees import StaticTree
    from methods.hydra import HydraDecoder
    from methods.lookahead import LookaheadDecoder
    from methods.mcsd import MultiCandidateDecoder
    from methods.medusa import MedusaDecoder
    from methods.models.heads.dflash import load_dflash_draft
    from methods.models.heads.eagle import load_eagle_head
    from methods.models.heads.eagle3 import load_eagle3_head
    from methods.models.heads.hydra import load_hydra_heads
    from methods.models.heads.medusa import load_medusa_heads
    from methods.models.specs import ModelSpec
    from methods.pard import PardDecoder
    from tests.test_dflash import write_dflash
    from tests.test_eagle3 import LAYERS, write_eagle3
    from tests.test_hydra import SMALL, write_hydra
    from tests.test_pard import pard_draft
    from tests.test_tree_methods import adaptive, write_eagle, write_medusa

    model = tiny_model("llama", seed=45, vocab_size=32, layers=LAYERS)
    folder = tmp_path_factory.mktemp("batch-heads")
    write_eagle(folder / "eagle", model)
    write_eagle3(folder / "eagle3", model, None, seed=2)
    write_medusa(folder / "medusa", model, heads=4, declared=4)
    write_hydra(folder / "hydra", model, "prefix-mlp", seed=3)
    head = load_eagle_head(ModelSpec(path=str(folder / "eagle")), model)
    head3 = load_eagle3_head(ModelSpec(path=str(folder / "eagle3")), model)
    medusa = load_medusa_heads(ModelSpec(path=str(folder / "medusa")), model)
    hydra = load_hydra_heads(ModelSpec(path=str(folder / "hydra")), model)[0]
    draft = truncated_copy(model, 2)
    write_dflash(folder / "dflash", model, ids=[1, 4], seed=2)
    dflash = load_dflash_draft(ModelSpec(path=str(folder / "dflash")), model)
    pard = pard_draft(model)
    static = retrieval_corpus(model, folder)
    store = rest_datastore(model, folder / "rest.idx")
    return {
        **{name: functools.partial(make, model) for name, make in DECODERS.items()},
        "sam": lambda: sam(model, static, predicts=6, len_bias=0),
        # each sequence its own cache (persist: false); the shared one's drafts depend on the batch, as vLLM's:
        # test_suffix_shared_cache_drafts_from_the_answers_beside_it
        "suffix": lambda: suffix(model, persist=False),
        "rest": lambda: RestDecoder(ModelRunner(model), store, RestSettings(num_draft=8)),
        "eagle": lambda: EagleDecoder(ModelRunner(model), head, StaticTree.build("eagle_mc_sim_7b_63")),
        "eagle2": lambda: adaptive(ModelRunner(model), head, CPU_CURVE, depth=5, top_k=10),
        "eagle3": lambda: adaptive(ModelRunner(model), head3, CPU_CURVE, Eagle3Decoder, depth=7, top_k=10),
        "mcsd": lambda: MultiCandidateDecoder(ModelRunner(model), draft, k_config=(3, 2, 1)),
        "medusa": lambda: MedusaDecoder(ModelRunner(model), medusa, StaticTree.build("medusa_mc_sim_7b_63")),
        "hydra": lambda: HydraDecoder(ModelRunner(model), hydra, StaticTree.build(SMALL)),
        "lookahead": lambda: LookaheadDecoder(ModelRunner(model), window=3, level=3, guess=3),
        "jacobi": lambda: JacobiDecoder(ModelRunner(model), block_size=4),
        "recycling": lambda: recycling(model),
        "dflash": lambda: DFlashDecoder(ModelRunner(model), dflash),
        "pard": lambda: PardDecoder(ModelRunner(model), pard, 32, k=4),  # mask: the draft's extra row
    }


@pytest.mark.parametrize("method", batchable_methods())
def test_every_batchable_method_decodes_each_prompts_greedy_tokens_at_b2_and_b3(every_batchable, method):
    """Greedy: each prompt decodes at B = 2 and B = 3 (prompts of 3, 30 and 11 tokens; the second
    leaves the batch first) exactly the tokens it decodes alone, which are AR's."""
    make = every_batchable[method]
    prompts = prompts_and_stops(3)[0]
    stops = [StopCondition(24), StopCondition(16), StopCondition(24)]
    alone = [make().generate(p, s).tokens for p, s in zip(prompts, stops)]
    ar = every_batchable["ar"]()
    assert alone == [ar.generate(p, s).tokens for p, s in zip(prompts, stops)]
    for batch in (2, 3):
        outs = make().generate_batch(prompts[:batch], stops[:batch])
        assert [out.tokens for out in outs] == alone[:batch], f"B = {batch}"


# batchable methods whose seeded sampled answer is not reproducible at all (tested instead: greedy batch = alone,
# and the target's distribution at B = 4)
UNSEEDED = {"rest": "draftretriever 0.1.1 drafts from an unseeded random generator (mcts_sub.rs): not even B = 1 "
                    "repeats a seeded sampled answer"}


# batchable methods that refuse sampling, and why: the sampled batch test skips them
GREEDY_ONLY = {"jacobi": "Jacobi decoding is greedy only (it refuses sampling before the prefill: "
                         "test_a_greedy_only_method_refuses_a_sampled_batch_before_the_prefill); its batch is "
                         "tested greedy (test_jacobi_and_recycling_greedy_batch_equals_each_prompt_alone)"}


def sampled_batchable() -> list:
    """The batchable methods, each greedy-only or unseeded one skipped with its reason."""
    skipped = {**GREEDY_ONLY, **UNSEEDED}
    return [pytest.param(m, marks=pytest.mark.skip(reason=skipped[m])) if m in skipped else m
            for m in batchable_methods()]


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.8),
                                      SamplingConfig(temperature=0.8, top_k=8, top_p=0.9)], ids=["T0.8", "top"])
@pytest.mark.parametrize("method", sampled_batchable())
def test_every_batchable_method_samples_each_prompts_own_tokens_at_b2_and_b3(every_batchable, method, sampling):
    """Seeded sampling does not depend on the batch: each prompt decodes at B = 2 and B = 3 the
    tokens it decodes alone from a generator seeded alike (its own draws, in B = 1's order and
    amount). EAGLE-2/3 at the adaptive size: a size chosen from the drafting's wall-clock time
    would change the tree, hence which uniform tests which child, with the batch (and the run)."""
    make = every_batchable[method]
    prompts = [prompt for prompt in prompts_and_stops(3)[0]]  # 3, 30 and 11 tokens
    stops = [StopCondition(24), StopCondition(16), StopCondition(24)]  # the second leaves the batch first
    alone = [make().generate(p, s, sampling, torch.Generator().manual_seed(b)).tokens
             for b, (p, s) in enumerate(zip(prompts, stops))]
    for batch in (2, 3):
        outs = make().generate_batch(prompts[:batch], stops[:batch], sampling,
                                               [torch.Generator().manual_seed(b) for b in range(batch)])
        assert [out.tokens for out in outs] == alone[:batch], f"B = {batch}"


@pytest.mark.parametrize("method", ["eagle", "eagle2", "eagle3"])
def test_eagle_drafts_a_batch_with_one_head_forward_per_level(every_batchable, method):
    """EAGLE-1/2/3 at B = 3 (`batch_draft.py`): each step feeds every sequence's accepted path in one head
    forward and each level of every tree in one more, and each sequence drafts, step by step, the
    trees it drafts alone (sampled: EAGLE-1's children drawn from each sequence's own generator; the
    adaptive size charges no wall-clock drafting time)."""
    prompts = prompts_and_stops(3)[0]
    stops = [StopCondition(24), StopCondition(16), StopCondition(24)]
    sampling = SamplingConfig(temperature=0.8)

    def run(decoder, batched):
        trees, forwards, states = {}, [], []  # (the states kept alive: their ids key their trees)
        layer = decoder.drafter.fused.layer
        forward = layer.forward
        layer.forward = lambda *args, **kw: forwards.append(args[0].shape[:2]) or forward(*args, **kw)
        propose = decoder.propose
        decoder.propose = lambda state, *a: states.append(state) or trees.setdefault(id(state), []).append(
            out := propose(state, *a)) or out
        propose_batch, steps = decoder.propose_batch, []

        def record(batch_states, budgets):
            out = propose_batch(batch_states, budgets)
            steps.append(len(batch_states))
            for state, tree in zip(batch_states, out):
                trees.setdefault(id(state), []).append(tree)
            return out
        decoder.propose_batch = record
        generators = [torch.Generator().manual_seed(b) for b in range(3)]
        if batched:
            decoder.generate_batch(prompts, stops, sampling, generators)
        else:
            for prompt, stop, generator in zip(prompts, stops, generators):
                decoder.generate(prompt, stop, sampling, generator)
        del layer.forward
        return [[(t.tokens.tolist(), list(t.parents)) for t in drafted] for drafted in trees.values()], forwards, steps

    alone, alone_forwards, _ = run(every_batchable[method](), False)
    decoder = every_batchable[method]()
    batch, forwards, steps = run(decoder, True)
    assert batch == alone and sum(len(trees) for trees in batch) > 10
    # each answer's prompt is fed alone at its start; then per step the paths and a forward per level
    assert [shape[0] for shape in forwards[:3]] == [1, 1, 1]
    assert len(forwards) - 3 <= len(steps) * decoder.full_depth()
    assert {shape[0] for shape in forwards[3:]} == set(steps) and max(steps) == 3
    assert len(forwards) < 0.6 * len(alone_forwards)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "T0.8"])
@pytest.mark.parametrize("method", ["sps", "mcsd"])
def test_the_draft_lm_drafts_a_batch_with_one_forward_per_depth(every_batchable, method, sampling):
    """SpS and MCSD at B = 3 (`BatchDraftLM`): each step feeds every sequence's unseen tokens in one
    draft forward and each depth of every tree in one more, and each sequence drafts, step by step,
    the trees it drafts alone (sampled: its children drawn from its own generator)."""
    prompts = prompts_and_stops(3)[0]
    stops = [StopCondition(24), StopCondition(16), StopCondition(24)]

    def run(decoder, batched):
        trees, states = {}, []
        propose, propose_batch, steps = decoder.propose, decoder.propose_batch, []
        decoder.propose = lambda state, *a: states.append(state) or trees.setdefault(id(state), []).append(
            out := propose(state, *a)) or out

        def record(batch_states, budgets):
            out = propose_batch(batch_states, budgets)
            steps.append(len(batch_states))
            for state, tree in zip(batch_states, out):
                states.append(state)
                trees.setdefault(id(state), []).append(tree)
            return out
        decoder.propose_batch = record
        generators = [torch.Generator().manual_seed(b) for b in range(3)]
        if batched:
            outs = decoder.generate_batch(prompts, stops, sampling, generators)
        else:
            outs = [decoder.generate(p, s, sampling, g) for p, s, g in zip(prompts, stops, generators)]
        drafted = [[(t.tokens.tolist(), list(t.parents)) for t in each] for each in trees.values()]
        probs = [[t.draft_probs for t in each] for each in trees.values()]
        return drafted, probs, [out.tokens for out in outs], steps

    alone, alone_probs, alone_tokens, _ = run(every_batchable[method](), False)
    decoder = every_batchable[method]()
    batch, probs, tokens, steps = run(decoder, True)
    assert tokens == alone_tokens
    assert batch == alone and sum(len(trees) for trees in batch) > 10
    for each, alone_each in zip(probs, alone_probs):  # sampled: each node's q as alone (a batch's GEMM may round
        for q, alone_q in zip(each, alone_each):      # differently in the last bit)
            assert (q is None) == (alone_q is None) and (q is None or torch.allclose(q, alone_q, rtol=0, atol=1e-6))
    # each prompt caught up alone at the batch's first step; then per step at most the catch-up and one
    # forward per fed depth (the last depth is never fed; budgets cut the last steps' trees)
    assert [lane.runner.forward_passes for lane in decoder.lane_drafts] == [1, 1, 1]
    assert len(steps) * (len(decoder.k_config) - 1) < decoder.batch_draft.runner.forward_passes \
        <= len(steps) * len(decoder.k_config) - 1
    assert max(steps) == 3 and min(steps) < 3  # the second sequence left the batch before the others


def largest_batch_trees(make) -> tuple:
    """Three prompts (the second leaves first: B = 3, then 2) decoded greedily alone and then together by
    a fresh decoder; asserts the same tokens. The decoder, and the largest tree
    it drafted at each batch size above 1."""
    prompts, stops = prompts_and_stops(3)[0], [StopCondition(24), StopCondition(16), StopCondition(24)]
    alone = [make().generate(p, s).tokens for p, s in zip(prompts, stops)]
    decoder = make()
    largest, propose_batch = {}, decoder.propose_batch

    def record(states, budgets):
        trees = propose_batch(states, budgets)
        if len(states) > 1:
            largest[len(states)] = max(largest.get(len(states), 0), *(len(tree) for tree in trees))
        return trees
    decoder.propose_batch = record
    outs = decoder.generate_batch(prompts, stops)
    assert [out.tokens for out in outs] == alone
    return decoder, largest


def test_eagle_auto_template_is_cut_at_the_batch_size(every_batchable):
    """EAGLE-1 at `tree: auto`: at B > 1 a greedy step verifies the published tree cut to the verify
    budget at B rows per node (`Sizing.cut`), a smaller prefix of the published order as the batch grows,
    and decodes what each prompt decodes alone; the cuts are recorded. Sampled, the batch-1 tree."""
    from methods.engine.static_trees import NAMED_TREES, StaticTree
    from methods.settings.sizing import Sizing, batch_draft_tokens

    def make():
        decoder = every_batchable["eagle"]()
        tree = StaticTree.build("eagle_mc_sim_7b_63")
        return type(decoder)(ModelRunner(decoder.target.model), decoder.drafter.head, tree,
                             sizing=Sizing(len(tree) - 1, {"tree": "auto"}, CPU_CURVE))
    decoder, largest = largest_batch_trees(make)
    nodes = {b: batch_draft_tokens(CPU_CURVE, b) + 1 for b in (2, 3)}
    assert nodes[3] < nodes[2] < len(decoder.tree)
    assert largest == nodes
    assert decoder.describe()["sizing"]["batch_draft_tokens"] == {b: n - 1 for b, n in nodes.items()}
    published = [tuple(p) for p in NAMED_TREES["eagle_mc_sim_7b_63"]]
    assert set(decoder.tree.cut(nodes[2] - 1).paths) == set(published[:nodes[2] - 1])  # the published order's prefix
    assert decoder.tree.cut(None) is decoder.tree


def test_mcsd_auto_tree_is_chosen_at_the_batch_size(every_batchable):
    """MCSD at `k_config: auto`: at B > 1 a greedy sequence drafts the largest `AUTO_K_CONFIGS` tree whose
    nodes fit the verify budget at B rows per node, smaller as the batch grows, and decodes what it
    decodes alone; the choices are recorded. Sampled, the batch-1 tree."""
    from methods.mcsd import AUTO_K_CONFIGS, MultiCandidateDecoder, tree_nodes
    from methods.settings.sizing import Sizing, batch_draft_tokens

    curve = {1: 1.0, 2: 1.0, 4: 1.02, 8: 1.05, 16: 1.2, 32: 1.6, 64: 3.0}

    def make():
        decoder = every_batchable["mcsd"]()
        return MultiCandidateDecoder(ModelRunner(decoder.target.model), decoder.draft.runner.model,
                                     k_config=Sizing(decoder.k_config, {"k_config": "auto"}, curve))
    decoder, largest = largest_batch_trees(make)
    chosen = {b: tuple(decoder.batch_k_config(n)) for b, n in decoder.sizing.cuts.items()}
    assert tree_nodes(chosen[3]) < tree_nodes(chosen[2]) < tree_nodes(decoder.k_config) == 15
    for b, k in chosen.items():  # the largest configuration that fits the budget at B rows per node
        bigger = AUTO_K_CONFIGS[AUTO_K_CONFIGS.index(k) + 1]
        assert tree_nodes(k) <= batch_draft_tokens(curve, b) < tree_nodes(bigger)
    assert largest == {b: tree_nodes(k) + 1 for b, k in chosen.items()}


def test_every_batchable_method_is_in_the_sampled_batch_test(every_batchable):
    assert sorted(every_batchable) == batchable_methods()
    assert set(GREEDY_ONLY) <= set(batchable_methods())  # a skip names a method that batches


def test_a_greedy_only_method_refuses_a_sampled_batch_before_the_prefill(every_batchable):
    """Jacobi refuses sampling in one line before any prefill, alone and in a batch (why the sampled
    batch test skips it)."""
    prompts, stops = prompts_and_stops(2)
    for method in GREEDY_ONLY:
        decoder = every_batchable[method]()
        prefills = []
        for name in ("prefill", "prefill_rows"):
            real = getattr(decoder.target, name)
            setattr(decoder.target, name, lambda *a, real=real, **kw: prefills.append(1) or real(*a, **kw))
        generators = [torch.Generator().manual_seed(b) for b in range(2)]
        with pytest.raises(ValueError, match="greedy only"):
            decoder.generate_batch(prompts, stops, SamplingConfig(temperature=0.8), generators)
        with pytest.raises(ValueError, match="greedy only"):
            decoder.generate(prompts[0], stops[0], SamplingConfig(temperature=0.8), generators[0])
        assert not prefills


# ---------------------------------------------------------------------------------------------
# Jacobi and Token Recycling: their per-answer state is the sequence's (`DecodeState.values`)


def recycling(model, **kw):
    """Token Recycling with upstream's template cut to its first 20 nodes (depth 3)."""
    return TokenRecyclingDecoder(ModelRunner(model), StaticTree.build(TEMPLATE_2_2_2[:20]), **kw)


@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("method", ["jacobi", "jacobi-repeat", "recycling"])
def test_jacobi_and_recycling_greedy_batch_equals_each_prompt_alone(method, batch):
    """Prompts of 3, 30 and 11 tokens with their own limits (the first also an EOS stop): each prompt
    decodes in the batch the tokens it decodes alone and AR's greedy tokens, with the same accepted
    lengths (the same drafts: Jacobi's random first guesses from the sequence's own generator) and
    the same statistics of its own (Jacobi's iterations per block, the rows of Recycling's matrix)."""
    model = tiny_model("llama", seed=45, vocab_size=16)
    make = {"jacobi": lambda: JacobiDecoder(ModelRunner(model), block_size=5),
            "jacobi-repeat": lambda: JacobiDecoder(ModelRunner(model), block_size=4, initial_guess="repeat"),
            "recycling": lambda: recycling(model)}[method]
    prompts, stops = prompts_and_stops(batch, vocab=16)
    ar = AutoregressiveDecoder(ModelRunner(model))
    eos = ar.generate(prompts[0], stops[0]).tokens[12]
    stops[0] = StopCondition(stops[0].max_new_tokens, frozenset({eos}))
    alone = [make().generate(p, s) for p, s in zip(prompts, stops)]
    assert alone[0].stats.stop_reason == "eos"
    outs = make().generate_batch(prompts, stops)
    for prompt, stop, out, reference in zip(prompts, stops, outs, alone):
        assert out.tokens == reference.tokens == ar.generate(prompt, stop).tokens
        assert out.stats.stop_reason == reference.stats.stop_reason
        assert out.stats.accepted_lengths == reference.stats.accepted_lengths
        assert out.stats.extra == reference.stats.extra and out.stats.extra
    assert len({out.stats.steps for out in outs}) > 1  # sequences left the batch at different steps
    assert sum(out.stats.accepted_drafts for out in outs) > 0


def recording(decoder) -> dict:
    """The drafts `decoder` proposes from now on, by sequence (in the order each first drafts)."""
    drafts, propose = {}, decoder.propose

    def record(state, *args):
        tree = propose(state, *args)
        drafts.setdefault(id(state), []).append(tree.tokens.tolist())
        return tree
    decoder.propose = record
    return drafts


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "T0.8"])
def test_recycling_batch_drafts_from_the_matrix_as_it_stood_at_the_start(target, sampling):
    """A persisting matrix already filled by an earlier answer: each answer of a batch drafts from that
    matrix and its own rows, never another answer's: the drafts, tokens and accepted lengths of each
    prompt alone from the same matrix (sampled: from generators seeded alike)."""
    prompts, stops = prompts_and_stops(3)

    def warm():  # a persisting matrix after one answer
        decoder = recycling(target)
        decoder.generate([5, 6, 7, 8, 5, 6], StopCondition(30))
        return decoder

    def generator(b):
        return None if sampling.greedy else torch.Generator().manual_seed(b)

    alone = []
    for b, (prompt, stop) in enumerate(zip(prompts, stops)):
        decoder = warm()
        drafts = recording(decoder)
        alone.append((decoder.generate(prompt, stop, sampling, generator(b)), *drafts.values()))
    decoder = warm()
    drafts = recording(decoder)
    outs = decoder.generate_batch(prompts, stops, sampling, [generator(b) for b in range(3)])
    for out, (reference, trees), batch_trees in zip(outs, alone, drafts.values()):
        assert out.tokens == reference.tokens
        assert out.stats.accepted_lengths == reference.stats.accepted_lengths
        assert out.stats.extra == reference.stats.extra and out.stats.extra["adjacency_rows_before"] > 0
        assert batch_trees == trees
    assert sum(out.stats.accepted_drafts for out in outs) > 0


def test_recycling_merges_each_answers_rows_into_the_shared_matrix(target):
    """After a batch the shared matrix holds every answer's rows, each as the answer wrote it (a row
    several wrote: the last to finish's, at the same step the later of the batch), and the rows none
    wrote as before; the next answer starts from it."""
    decoder = recycling(target)
    decoder.generate([5, 6, 7, 8, 5, 6], StopCondition(30))  # rows from an earlier answer
    expected, filled = decoder.adjacency.clone(), decoder.filled.clone()
    finished, finish = [], decoder.finish

    def record(state):
        matrix = state.values["matrix"]
        finished.append((state.stats.steps, state.index, matrix["written"].clone(), matrix["adjacency"].clone()))
        finish(state)
    decoder.finish = record
    prompts, stops = prompts_and_stops(3)
    decoder.generate_batch(prompts, stops)
    assert [(steps, b) for steps, b, *_ in finished] == sorted((steps, b) for steps, b, *_ in finished)
    assert len({steps for steps, *_ in finished}) > 1  # they finished at different steps
    for _, _, written, adjacency in finished:
        expected = torch.where(written[:, None], adjacency, expected)
        filled |= written
    assert torch.equal(decoder.adjacency, expected) and torch.equal(decoder.filled, filled)
    # each answer wrote rows no other did (a merge left out fails), and two wrote a row differently (the order counts)
    counts = sum(written.long() for _, _, written, _ in finished)
    assert all((written & (counts == 1)).any() for _, _, written, _ in finished)
    assert any((wi & wj & (ai != aj).any(dim=1)).any()
               for (_, _, wi, ai), (_, _, wj, aj) in itertools.combinations(finished, 2))
    out = recycling(target).generate(prompts[0], stops[0])
    assert decoder.generate(prompts[0], stops[0]).stats.extra["adjacency_rows_before"] == int(filled[:-1].sum())
    assert out.stats.extra["adjacency_rows_before"] == 0


# ---------------------------------------------------------------------------------------------
# Sampling at B = 4: three sequences continue PROMPT, a fourth a longer prompt (padding in the cache)

OTHER = [3, 2, 1, 0, 1, 2, 3, 0, 1]


def draw_batched(decoder, n: int, length: int = 3, seed: int = 0) -> list[tuple]:
    """n samples of the first `length` tokens after PROMPT, three per batch of four."""
    generators = [torch.Generator().manual_seed(seed * 4 + b) for b in range(4)]
    prompts, stops = [PROMPT, OTHER, PROMPT, PROMPT], [StopCondition(length),
                                                       StopCondition(2 * length)] + [StopCondition(length)] * 2
    samples = []
    while len(samples) < n:
        outs = decoder.generate_batch(prompts, stops, TEMPERATURE_1, generators)
        samples += [tuple(outs[b].tokens) for b in (0, 2, 3)]
    return samples[:n]


def test_ar_batch_sampling_matches_target_distribution(tiny_vocab_pair):
    target, _ = tiny_vocab_pair
    expected = exact_joint(target, PROMPT, 3, TEMPERATURE_1)
    samples = draw_batched(AutoregressiveDecoder(ModelRunner(target)), 1500)
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_sps_batch_sampling_preserves_target_distribution(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    expected = exact_joint(target, PROMPT, 3, TEMPERATURE_1)
    samples = draw_batched(SpeculativeSamplingDecoder(ModelRunner(target), draft, gamma=2), 1500,
                           seed=1)
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_sps_batch_with_broken_residual_is_caught(tiny_vocab_pair):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection biases the output; the
    batched test must reject it."""
    target, draft = tiny_vocab_pair
    expected = exact_joint(target, PROMPT, 3, TEMPERATURE_1)
    sps = SpeculativeSamplingDecoder(ModelRunner(target), draft, gamma=2)
    sps.sample_pending = functools.partial(type(sps).sample_pending, residual=lambda p, q: p)
    decoder = sps
    samples = draw_batched(decoder, 1500, seed=1)
    assert chi_square_pvalue(samples, expected) < 1e-6


@pytest.mark.parametrize("method", ["suffix", "rest"])
def test_suffix_and_rest_batch_sampling_preserves_target_distribution(tiny_vocab_pair, method, tmp_path):
    """At B = 4 a sequence's drafts depend on its batch (Suffix Decoding's shared cache takes the answers beside
    it; REST's reader adds every query to its table and drafts at random): its samples still follow the
    target's distribution."""
    from tests.test_retrieval import sampling_decoder

    target = tiny_vocab_pair[0]
    expected = exact_joint(target, PROMPT, 3, TEMPERATURE_1)
    decoder = sampling_decoder(method, target, tmp_path)
    samples = draw_batched(decoder, 1500, seed=2)
    assert chi_square_pvalue(samples, expected) > 1e-3
    outs = decoder.generate_batch([PROMPT] * 4, [StopCondition(3)] * 4, TEMPERATURE_1,
                                  [torch.Generator().manual_seed(b) for b in range(4)])
    assert sum(out.stats.drafted_tokens for out in outs) > 0
