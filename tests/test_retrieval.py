"""The retrieval drafters: Suffix Decoding (arctic-inference's SuffixDecodingCache, as vLLM drives
it), REST (draftretriever's datastore) and SAM-Decoding (suffix automata, alone and with EAGLE-2).
Upstream's behaviour on token streams, the draft trees, greedy equality with AR (tiny models and the
embedded one), χ² sampling tests at T = 1, the datastore of the embedded model, and the checks before
anything loads."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.base import check_method_params
from methods.eagle.dynamic import Eagle2Decoder
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.models.heads.eagle import load_eagle_head
from methods.models.specs import ModelSpec
from methods.pld import trie
from methods.rest import RestDecoder, RestSettings, retrieve, write_datastore
from methods.sam import SamDecoder, SamSettings, SuffixAutomaton, build_static, chain, count_tree, transfer
from methods.settings.params import ConfigError
from methods.suffix import SuffixDecoder, SuffixSettings, draft_tree
from tests.conftest import decode_state, tiny_model
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint
from tests.test_training_free import assert_stops_on_eos_like_ar, random_prompts
from tests.test_tree_methods import write_eagle


def suffix(target, **settings):
    return SuffixDecoder(ModelRunner(target), SuffixSettings(**settings))


def random_datastore(path, vocab, entries=200, length=40, seed=0, extra=()):
    rng = random.Random(seed)
    rows = [[rng.randrange(vocab) for _ in range(length)] for _ in range(entries)] + [list(e) for e in extra]
    write_datastore(path, rows)
    return path


# ---------------------------------------------------------------------------------------------
# Suffix Decoding: upstream's cache as vLLM calls it


def test_suffix_cache_speculates_from_prompt_and_earlier_answers():
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=64)
    cache.start_request("a", [1, 2, 3, 4, 5, 1, 2, 3])
    cache.add_active_response("a", [4, 5, 1, 2])
    draft = cache.speculate("a", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], max_spec_tokens=8)
    assert (draft.token_ids, draft.parents, draft.match_len, draft.score) == ([3, 4, 5, 1, 2], [-1, 0, 1, 2, 3], 7, 2.5)
    cache.stop_request("a")
    # the answer stays in the global tree: a new prompt that never saw it drafts from it
    cache.start_request("b", [9, 9])
    assert cache.speculate("b", [8, 4, 5, 1], max_spec_tokens=8).token_ids[:1] == [2]
    # speculation length is bounded by max_spec_factor x match length
    assert len(cache.speculate("b", [8, 4, 5, 1], max_spec_tokens=8, max_spec_factor=1.0).token_ids) <= 3


def test_suffix_tree_speculation_becomes_a_tree_rooted_at_the_last_token():
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24)
    cache.start_request(0, [1, 2, 3, 4, 5, 1, 2, 3, 6, 1, 2, 3, 4, 7, 1, 2, 3, 4, 5])
    draft = cache.speculate(0, [9, 1, 2, 3], max_spec_tokens=10, max_spec_factor=4, min_token_prob=0.0,
                            use_tree_spec=True)
    tree = draft_tree(3, draft.token_ids, draft.parents)
    assert len(tree) == len(draft.token_ids) + 1 and not tree.is_chain
    # every node's path from the root is a continuation of "1 2 3" in the prompt
    text = " ".join(map(str, [1, 2, 3, 4, 5, 1, 2, 3, 6, 1, 2, 3, 4, 7, 1, 2, 3, 4, 5]))
    for node in range(1, len(tree)):
        path, n = [], node
        while n > 0:
            path.insert(0, int(tree.tokens[n]))
            n = tree.parents[n]
        assert " ".join(map(str, [1, 2, 3] + path)) in text
    assert draft_tree(7, [5, 6], [-1, -1]).parents == [-1, 0, 0]
    with pytest.raises(ValueError, match="cycle"):
        draft_tree(7, [5, 6], [1, 0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_suffix_greedy_equals_ar_and_the_cache_persists(arch):
    target = tiny_model(arch, seed=71, vocab_size=16, layers=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    decoders = [suffix(target), suffix(target, tree=True), suffix(target, persist=False, num_draft=4)]
    accepted = {id(d): 0 for d in decoders}
    for i, prompt in enumerate(random_prompts(16, 3, seed=7)):
        expected = ar.generate(prompt, StopCondition(40)).tokens
        for decoder in decoders:
            out = decoder.generate(prompt, StopCondition(40))
            assert out.tokens == expected
            accepted[id(decoder)] += out.stats.accepted_drafts
            assert out.stats.extra["cached_answers_before"] == (i if decoder.settings.persist else 0)
            assert not decoder.cache.active_requests  # stopped
    assert all(accepted.values()), accepted
    # every answer went into the global tree whole: it drafts itself back from its start
    decoder = decoders[0]
    decoder.cache.start_request("probe", [0])
    answer = ar.generate(random_prompts(16, 3, seed=7)[-1], StopCondition(40)).tokens
    assert decoder.cache.speculate("probe", answer[:12], max_spec_tokens=4).token_ids
    decoder.reset()
    assert not decoder.cache.cached_requests


def test_suffix_stops_on_eos_like_ar():
    target = tiny_model("llama", seed=72, vocab_size=16)
    assert_stops_on_eos_like_ar(target, suffix(target))


# ---------------------------------------------------------------------------------------------
# REST: draftretriever's datastore


def test_rest_retrieval_is_upstreams_trie_of_continuations(tmp_path):
    path = random_datastore(tmp_path / "d.idx", 20, extra=[[100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110,
                                                            111, 112]])
    import draftretriever

    reader = draftretriever.Reader(str(path))
    # one occurrence: the chain of the `continuation` tokens after it (the library returns every kept prefix)
    # (draftretriever 0.1.1, ADED's build of REST's library, reads 4 tokens after a match whatever `long` says)
    chain = list(range(102, 112))
    for settings in [RestSettings(), RestSettings(continuation=3)]:
        paths = retrieve(reader, [5, 100, 101], settings)
        longest = max(paths, key=len)
        assert longest and all(chain[:len(p)] == p for p in paths)
        assert trie(101, paths).tokens.tolist() == [101] + longest
    assert retrieve(reader, [300, 301], RestSettings()) == []  # no span has a match: an AR step
    # many occurrences: at most num_draft nodes, every path a continuation of the matched suffix
    settings = RestSettings(num_draft=12)
    paths = retrieve(reader, [3, 4], settings)
    assert paths and len({tuple(p[:i + 1]) for p in paths for i in range(len(p))}) <= 24  # a best-effort cut
    decoder = RestDecoder(None, path, settings)
    state = decode_state(decoder, [3, 4])
    tree = decoder.propose(state, 4, 100)
    assert len(tree) - 1 <= 24 and max(tree.depths) <= 10
    assert max(decoder.propose(state, 4, 2).depths) == 2  # the budget cuts each path


def test_rest_longest_span_first(tmp_path):
    # "1 2 3" is followed by 7 once; "2 3" by 9 many times: the 3-token span wins (upstream: longest first)
    path = random_datastore(tmp_path / "d.idx", 50, entries=20, extra=[[1, 2, 3, 7, 7]] + [[2, 3, 9, 9]] * 20)
    import draftretriever

    reader = draftretriever.Reader(str(path))
    assert [7, 7] in retrieve(reader, [1, 2, 3], RestSettings())  # 0.1.1 may add shorter spans' paths
    assert any(p[0] == 9 for p in retrieve(reader, [0, 2, 3], RestSettings()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rest_greedy_equals_ar(arch, tmp_path):
    target = tiny_model(arch, seed=73, vocab_size=16, layers=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    prompts = random_prompts(16, 4, seed=8)
    answers = [ar.generate(p, StopCondition(40)).tokens for p in prompts]
    # the datastore holds random text and the model's answer to another prompt
    path = random_datastore(tmp_path / "d.idx", 16, entries=50, extra=[answers[0]])
    decoders = [RestDecoder(ModelRunner(target), path), RestDecoder(ModelRunner(target), path,
                                                                      RestSettings(num_draft=8, max_token_span=4))]
    accepted = 0
    for prompt, expected in zip(prompts, answers):
        for decoder in decoders:
            out = decoder.generate(prompt, StopCondition(40))
            assert out.tokens == expected
            accepted += out.stats.accepted_drafts
            assert 0 < out.stats.extra["match_rate"] <= 1
    assert accepted > 0


# ---------------------------------------------------------------------------------------------
# SAM-Decoding: upstream's suffix automata and its two drafting rules


def occurrences(text, pattern):
    return [i + len(pattern) for i in range(len(text) - len(pattern) + 1) if text[i:i + len(pattern)] == pattern]


def test_sam_automaton_states_counts_and_longest_match_against_brute_force():
    rng = random.Random(3)
    for _ in range(150):
        text = [rng.randrange(3) for _ in range(rng.randrange(1, 50))]
        automaton = SuffixAutomaton()
        automaton.add(text)
        counts, frozen = automaton.counts(), automaton.freeze()
        for state in range(1, len(automaton.next)):
            length, end = automaton.length[state], automaton.endpos[state]
            ends = occurrences(text, text[end - length:end])
            # upstream's min_endpos is the first occurrence's end; cnt_endpos the number of occurrences
            assert ends[0] == end and len(ends) == counts[state] == frozen.count[state]
            for token, child in automaton.next[state].items():
                assert frozen.child(state, token) == child
            assert frozen.child(state, 7) == -1
        root = rng.randrange(3)
        index, match = automaton.lookup(root)
        # the lookup is the longest suffix of text + root that occurs in the text
        longest = max(n for n in range(len(text) + 2) if n == 0 or occurrences(text, (text + [root])[-n:]))
        assert match == longest and transfer(frozen, *automaton.cursor, root) == (index, match)


def test_sam_drafts_are_upstreams_chain_and_count_tree():
    automaton = SuffixAutomaton()
    text = [1, 2, 3, 4, 5, 6, 9, 1, 2, 7, 1, 2, 3, 8]
    automaton.add(text)
    # "2 3" first ends at position 3: the chain is what follows it there
    index, match = transfer(automaton, *transfer(automaton, 0, 0, 2), 3)
    assert match == 2 and chain(automaton, index, 4) == [4, 5, 6]
    # with too few tokens after the first occurrence, the dynamic automaton climbs to a shorter match
    index, match = transfer(automaton, *transfer(automaton, 0, 0, 3), 8)
    assert match == 2 and chain(automaton, index, 3) == [] and chain(automaton, index, 3, climb=True) == []
    index, _ = transfer(automaton, 0, 0, 9)
    assert chain(automaton, index, 3, climb=True) == [1, 2]
    # the static count tree: best-first by count share, at most k per node and per depth
    frozen = automaton.freeze()
    index, _ = transfer(frozen, 0, 0, 1)  # "1": followed by "2" three times
    tree = count_tree(frozen, index, 1, n=5, k=2, max_depth=10)
    assert tree.tokens.tolist()[:3] == [1, 2, 3] and tree.parents[:3] == [-1, 0, 1]
    assert sorted(tree.tokens.tolist()[3:]) == [4, 7]  # "1 2" -> 3 (2/3) beats 7 (1/3); then 3's children
    assert max(count_tree(frozen, index, 1, n=5, k=2, max_depth=1).depths) == 1


def sam(target, static=None, head=None, predicts=10, **settings):
    """A SAM decoder on `target`: alone, or with EAGLE-2 (8 tokens, depth 3, top-3) from `head`."""
    settings = SamSettings(auxiliary="eagle2" if head is not None else "none", **settings)
    auxiliary = None
    if head is not None:
        auxiliary = Eagle2Decoder(ModelRunner(target), head, total_tokens=8, depth=3, top_k=3)
        runner = auxiliary.target
    else:
        runner = ModelRunner(target)
    return SamDecoder(runner, static, settings, predicts=predicts, auxiliary=auxiliary)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sam_greedy_equals_ar_alone_and_with_eagle2(arch, tmp_path):
    target = tiny_model(arch, seed=74, vocab_size=16, layers=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    prompts = random_prompts(16, 4, seed=9)
    answers = [ar.generate(p, StopCondition(40)).tokens for p in prompts]
    # the static corpus: random text and the model's answer to the first prompt
    rng = random.Random(1)
    static = build_static([[rng.randrange(16) for _ in range(30)] for _ in range(20)] + [prompts[0] + answers[0]],
                          eos=15, vocab_size=16, log=lambda line: None)
    write_eagle(tmp_path / "eagle", target)
    head = load_eagle_head(ModelSpec(path=str(tmp_path / "eagle")), target)
    decoders = {"alone": sam(target, static), "no static": sam(target), "eagle2": sam(target, static, head),
                "eagle2, threshold 2": sam(target, None, head, len_threshold=2)}
    drafts = {name: {} for name in decoders}
    for prompt, expected in zip(prompts, answers):
        for name, decoder in decoders.items():
            out = decoder.generate(prompt, StopCondition(40))
            assert out.tokens == expected, name
            for kind, count in out.stats.extra["drafts_by"].items():
                drafts[name][kind] = drafts[name].get(kind, 0) + count
    assert drafts["alone"]["dynamic"] and drafts["alone"]["static"], drafts
    assert not drafts["no static"]["static"] and not drafts["alone"]["auxiliary"]
    assert drafts["eagle2, threshold 2"]["dynamic"] and drafts["eagle2, threshold 2"]["auxiliary"], drafts


# ---------------------------------------------------------------------------------------------
# Sampling at T = 1: the engine's rejection sampling with the drafts as point masses


def sampling_decoder(method, target, tmp_path):
    if method == "sam":
        static = build_static([[random.Random(i).randrange(4) for _ in range(30)] for i in range(50)], eos=3,
                              vocab_size=4, log=lambda line: None)
        return sam(target, static, len_bias=0, alpha=2.0)
    if method == "suffix":
        return suffix(target, tree=True, min_token_prob=0.0, max_spec_factor=4.0)
    path = random_datastore(tmp_path / "d.idx", 4, entries=100, length=30)
    return RestDecoder(ModelRunner(target), path, RestSettings(num_draft=6, max_token_span=3))


@pytest.mark.parametrize("method", ["suffix", "rest", "sam"])
def test_sampling_preserves_target_distribution(tiny_vocab_pair, method, tmp_path):
    target = tiny_vocab_pair[0]
    expected = exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = sampling_decoder(method, target, tmp_path)
    samples = draw(decoder, 1200, seed=13)
    assert chi_square_pvalue(samples, expected) > 1e-3
    assert decoder.generate(PROMPT, StopCondition(3), SamplingConfig(temperature=1.0),
                            torch.Generator().manual_seed(0)).stats.drafted_tokens > 0


# ---------------------------------------------------------------------------------------------
# Embedded model: 5 Spec-Bench prompts, fp32; REST's datastore built from the suite's corpus


def test_embedded_retrieval_methods_equal_generate(embedded, embedded_decoder, embedded_prompts, embedded_reference):
    _, tokenizer = embedded
    eos = frozenset({tokenizer.eos_token_id})
    runs = [embedded_decoder("suffix"), embedded_decoder("rest"), embedded_decoder("sam"),
            embedded_decoder("sam", auxiliary="eagle2", depth=3, top_k=4)]
    assert runs[1].datastore.is_file() and runs[1].datastore.stat().st_size < 5 * 2**20
    assert runs[2].static is not None and len(runs[2].static) > 100_000  # the corpus's automaton
    accepted = {i: 0 for i in range(len(runs))}
    for prompt, reference in zip(embedded_prompts, embedded_reference):
        for i, decoder in enumerate(runs):
            out = decoder.generate(prompt, StopCondition(48, eos))
            assert out.tokens == reference[:48], decoder.describe()
            accepted[i] += out.stats.accepted_drafts
    assert all(accepted.values()), accepted


# ---------------------------------------------------------------------------------------------
# Parameters and datastores: rejected before any model loads


@pytest.mark.parametrize("method, params", [
    ("suffix", {"max_tree_depth": 0}), ("suffix", {"min_token_prob": 1.5}), ("suffix", {"tree": "yes"}),
    ("suffix", {"max_cached_requests": -2}), ("suffix", {"depth": 3}),
    ("rest", {"num_draft": 0}), ("rest", {"max_token_span": 1}), ("rest", {"datastore": ""}),
    ("rest", {"continuation": 0}),
    ("sam", {"auxiliary": "eagle"}), ("sam", {"n_predicts": 0}), ("sam", {"static": ""}), ("sam", {"alpha": -1}),
])
def test_bad_parameters_are_rejected_before_loading(method, params):
    with pytest.raises(ConfigError, match=f"method.{next(iter(params))}"):
        check_method_params(method, {"name": method, **params})
    check_method_params(method, {"name": method})  # the defaults pass


def test_the_model_configs_datastores_name_the_files_auto_loads(tmp_path):
    """`auto` takes the model config's `datastores.rest` / `datastores.sam` where it names one."""
    from methods.base import BuildContext
    from methods.rest import RestSettings, datastore_path
    from methods.sam import static_automaton

    built = build_static([[1, 2, 3, 1, 2, 4], [2, 3, 1]], eos=0, vocab_size=8)
    built.save(tmp_path / "corpus.npz")
    config = {"datastores": {"sam": str(tmp_path / "corpus.npz"), "rest": str(tmp_path / "store.idx")}}
    loaded = static_automaton(SamSettings(), BuildContext(None, "x", config))
    assert all(np.array_equal(getattr(loaded, name), getattr(built, name)) for name in ("link", "length"))
    assert datastore_path(RestSettings(), "x", config) == tmp_path / "store.idx"


def test_a_model_without_a_datastore_is_refused_naming_the_recipe(tmp_path):
    from harness.running.validate import check_model

    with pytest.raises(ConfigError, match="vicuna-7b has no REST datastore.*python -m methods.rest"):
        check_model({"name": "rest"}, {"name": "vicuna-7b", "path": "lmsys/vicuna-7b-v1.3"})
    with pytest.raises(ConfigError, match="no datastore file"):
        check_model({"name": "rest", "datastore": str(tmp_path / "missing.idx")}, {"name": "vicuna-7b"})
    check_model({"name": "rest"}, {"name": "smollm2-135m"})  # the embedded model builds its own
    check_model({"name": "rest"}, {"name": "x", "datastores": {"rest": "file.idx"}})
    check_model({"name": "suffix"}, {"name": "vicuna-7b"})
    # SAM: a static corpus (or static=none), and an EAGLE head for its EAGLE-2 auxiliary
    with pytest.raises(ConfigError, match="vicuna-7b has none; pass method.static=none"):
        check_model({"name": "sam"}, {"name": "vicuna-7b"})
    check_model({"name": "sam", "static": "none"}, {"name": "vicuna-7b"})
    check_model({"name": "sam"}, {"name": "vicuna-7b", "datastores": {"sam": "file.npz"}})  # the config names one
    with pytest.raises(ConfigError, match="method.static=.*an existing file"):
        check_model({"name": "sam", "static": str(tmp_path / "missing.npz")}, {"name": "smollm2-135m"})
    with pytest.raises(ConfigError, match="drafts.eagle for method.auxiliary=eagle2"):
        check_model({"name": "sam", "auxiliary": "eagle2", "static": "none"}, {"name": "x"})
    check_model({"name": "sam", "auxiliary": "eagle2"}, {"name": "smollm2-135m", "drafts": {"eagle": {"path": "h"}}})
