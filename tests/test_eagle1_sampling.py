"""EAGLE-1 at temperature > 0 (`method=eagle`, `sampling_rule: eagle1`, SafeAILab/EAGLE v1): children
sampled from the head without replacement, verified with the multi-candidate rule and the head's q.

(a) the acceptor on fixed distributions: one verification's output follows the target, and broken
    variants (tried siblings left in q, no residual) are caught by the same chi-square test;
(b) the decoder end to end on a tiny model preserves the sampling distribution (full and reduced
    draft vocabulary, top-p), a broken acceptor is caught, and the drafts really are sampled;
(c) greedy is unchanged by the option; the option is validated.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.base import check_method_params
from methods.eagle.template import EagleDecoder
from methods.engine.acceptance import sample_accept
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig, logits_to_probs
from methods.engine.static_trees import StaticTree
from methods.engine.stopping import StopCondition
from methods.engine.tree import Tree
from methods.engine.vocab import DraftVocabulary
from methods.models.heads.eagle import load_eagle_head
from methods.models.specs import ModelSpec
from methods.settings.params import ConfigError
from tests.conftest import tiny_model
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint
from tests.test_tree_methods import write_eagle

# ---------------------------------------------------------------------------------------------
# (a) the acceptor on fixed distributions

V = 5
P = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])  # target after the root
Q = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.05])  # draft after the root: far from P
# after a first token x: the target's P2[x] and the draft's Q2[x]
P2 = torch.softmax(torch.arange(V * V, dtype=torch.float).reshape(V, V).remainder(7) * 0.6, -1)
Q2 = torch.softmax(-torch.arange(V * V, dtype=torch.float).reshape(V, V).remainder(5) * 0.8, -1)
ROOT_CHILDREN, GRANDCHILDREN = 3, 2


def one_step(generator, zero_tried=True, point_mass=False, residual=None) -> tuple[int, int]:
    """Draft EAGLE-1's way (children of each node drawn from q without replacement, in order),
    verify once, and return the first two tokens (the second from the target when the step
    emitted one token only, as the next step would)."""
    kids = torch.multinomial(Q, ROOT_CHILDREN, replacement=False, generator=generator).tolist()
    tokens, parents, rows, probs = [0], [-1], [Q], [P]
    for kid in kids:
        tokens.append(kid)
        parents.append(0)
        rows.append(Q2[kid])
        probs.append(P2[kid])
    for i, kid in enumerate(kids):
        for grandchild in torch.multinomial(Q2[kid], GRANDCHILDREN, replacement=False, generator=generator).tolist():
            tokens.append(grandchild)
            parents.append(i + 1)
            rows.append(torch.zeros(V))
            probs.append(torch.full((V,), 1.0 / V))  # after a grandchild: not looked at
    tree = Tree(torch.tensor(tokens), parents, None if point_mass else torch.stack(rows),
                without_replacement=zero_tried)
    extra = {} if residual is None else {"residual": residual}
    acceptance = sample_accept(tree, torch.stack(probs), generator, **extra)
    emitted = [tokens[n] for n in acceptance.path[1:]] + [acceptance.next_token]
    if len(emitted) == 1:
        emitted.append(int(torch.multinomial(P2[emitted[0]], 1, generator=generator)))
    return emitted[0], emitted[1]


EXPECTED = {(a, b): float(P[a] * P2[a, b]) for a in range(V) for b in range(V)}


def step_samples(n=5000, seed=0, **variant) -> list[tuple[int, int]]:
    generator = torch.Generator().manual_seed(seed)
    return [one_step(generator, **variant) for _ in range(n)]


def test_multi_candidate_step_with_the_drafts_q_preserves_the_target():
    assert chi_square_pvalue(step_samples(), EXPECTED) > 1e-3


def test_step_that_keeps_tried_siblings_in_q_is_caught():
    """Children drawn without replacement but verified as if drawn with replacement (q not updated)."""
    assert chi_square_pvalue(step_samples(zero_tried=False), EXPECTED) < 1e-6


def test_step_without_the_residual_is_caught():
    assert chi_square_pvalue(step_samples(residual=lambda p, q: p), EXPECTED) < 1e-6


def test_first_token_marginal_is_the_target():
    """The first token alone (the quantity one verification decides) against P."""
    samples = [(a,) for a, _ in step_samples(seed=1)]
    assert chi_square_pvalue(samples, {(a,): float(P[a]) for a in range(V)}) > 1e-3
    broken = [(a,) for a, _ in step_samples(seed=1, zero_tried=False)]
    assert chi_square_pvalue(broken, {(a,): float(P[a]) for a in range(V)}) < 1e-6


def test_eagle2_point_mass_rule_is_lossless_on_sampled_children_too():
    """EAGLE-2's rule (q := point mass) is lossless for any draft; the test tells the rules apart
    only by their faults, not by the drafts."""
    assert chi_square_pvalue(step_samples(point_mass=True, seed=2), EXPECTED) > 1e-3


# ---------------------------------------------------------------------------------------------
# (b) the decoder end to end on a 4-token model

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


@pytest.fixture(scope="module")
def tiny_target():
    """A 4-token target flatter than `tiny_vocab_pair`'s (whose first token is nearly certain, so
    that a rule's faults after a rejection barely show)."""
    return tiny_model("llama", seed=30, vocab_size=4, hidden=32, layers=2, init_std=0.3)


@pytest.fixture(scope="module")
def tiny_head(tiny_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle1")
    write_eagle(folder, tiny_target, seed=1)
    return load_eagle_head(ModelSpec(path=str(folder)), tiny_target)


def decoder_for(target, head, rule="eagle1", vocabulary=None, tree=TREE) -> EagleDecoder:
    return EagleDecoder(ModelRunner(target), head, StaticTree.build(tree), vocabulary=vocabulary, sampling_rule=rule)


def recording(decoder):
    """Keep each proposed tree with the head's q at its root."""
    trees = []
    propose = decoder.propose

    def wrapped(state, root, budget):
        tree = propose(state, root, budget)
        trees.append((tree, state.draft.root_logits.clone()))
        return tree

    decoder.propose = wrapped
    return trees


def test_eagle1_decoder_preserves_the_target_distribution_and_samples_its_drafts(tiny_target, tiny_head):
    sampling = SamplingConfig(temperature=1.0)
    decoder = decoder_for(tiny_target, tiny_head)
    trees = recording(decoder)
    samples = draw(decoder, 1200, seed=7, sampling=sampling)
    assert chi_square_pvalue(samples, exact_joint(tiny_target, PROMPT, 3, sampling)) > 1e-3
    trees = [(tree, logits) for tree, logits in trees if len(tree) > 1]  # the last step may draft nothing
    not_top1 = 0
    for tree, root_logits in trees:
        q = logits_to_probs(root_logits, sampling)
        assert tree.without_replacement and torch.allclose(tree.draft_probs[0], q)
        siblings = tree.tokens[tree.children[0]].tolist()
        assert len(set(siblings)) == len(siblings) == 3 and all(q[t] > 0 for t in siblings)
        not_top1 += siblings[0] != int(q.argmax())
    # drawn, not ranked: the first child is not always the head's argmax (top-k would always give it)
    assert 0.05 * len(trees) < not_top1 < 0.95 * len(trees), (not_top1, len(trees))
    assert decoder.describe()["sampling_rule"] == "eagle1"


def test_eagle1_decoder_with_a_broken_acceptor_is_caught(tiny_target, tiny_head):
    """The same decoder verifying as if the siblings were drawn with replacement."""
    sampling = SamplingConfig(temperature=1.0)
    decoder = decoder_for(tiny_target, tiny_head)
    decoder.sample_accept = lambda tree, probs, gen, **kw: sample_accept(replace(tree, without_replacement=False),
                                                                         probs, gen, **kw)
    # 3000 draws: at 1200 the fault's p-value ranged over 1e-7..0.1 with the seed; at 3000, 1e-10..1e-15
    samples = draw(decoder, 3000, seed=7, sampling=sampling)
    assert chi_square_pvalue(samples, exact_joint(tiny_target, PROMPT, 3, sampling)) < 1e-6


def test_top_k_children_verified_with_the_drafts_q_are_caught(tiny_target, tiny_head, monkeypatch):
    """The two rules mixed (ranked children, EAGLE-1's verification with q) are not lossless: the
    distribution test depends on the children really being drawn from q."""
    import methods.eagle.template

    sampling = SamplingConfig(temperature=1.0)
    decoder = decoder_for(tiny_target, tiny_head)
    monkeypatch.setattr(methods.eagle.template, "draw_children",
                        lambda q, k, without_replacement, generator: torch.topk(q, k).indices)
    samples = draw(decoder, 1200, seed=7, sampling=sampling)
    assert chi_square_pvalue(samples, exact_joint(tiny_target, PROMPT, 3, sampling)) < 1e-6


def test_eagle1_with_a_draft_vocabulary_smaller_than_the_siblings_and_top_p(tiny_target, tiny_head):
    """Two draftable tokens for three root children: the third child holds a token q cannot give
    (the tree keeps its shape: nothing is read back while drafting), drawn last and never accepted;
    tokens the head cannot propose come from the residual. Top-p processes q as p."""
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    decoder = decoder_for(tiny_target, tiny_head, vocabulary=DraftVocabulary(torch.tensor([0, 2]), 4))
    trees = recording(decoder)
    accepted = []
    accept = decoder.accept
    decoder.accept = lambda state, tree, logits, extra=None: accepted.append(
        (tree, accept(state, tree, logits, extra))) or accepted[-1][1]
    samples = draw(decoder, 1200, seed=3, sampling=sampling)
    assert chi_square_pvalue(samples, exact_joint(tiny_target, PROMPT, 3, sampling)) > 1e-3
    assert any(token in (1, 3) for sample in samples for token in sample)
    impossible = 0
    for tree, _ in trees:
        for node in tree.children[0]:
            drawable = float(tree.draft_probs[0, tree.tokens[node]]) > 0
            impossible += not drawable
            # the drawable children come first, in draw order
            assert drawable or all(float(tree.draft_probs[0, tree.tokens[later]]) == 0 for later in tree.children[0]
                                   if later > node)
    assert impossible > 0
    for tree, acceptance in accepted:
        for parent, node in zip(acceptance.path, acceptance.path[1:]):
            assert float(tree.draft_probs[parent, tree.tokens[node]]) > 0  # a child q could not give is never accepted


def test_eagle2_rule_keeps_top_k_drafts(tiny_target, tiny_head):
    sampling = SamplingConfig(temperature=1.0)
    decoder = decoder_for(tiny_target, tiny_head, rule="eagle2")
    trees = recording(decoder)
    draw(decoder, 20, length=6, seed=1, sampling=sampling)
    assert any(len(tree) == len(TREE) + 1 for tree, _ in trees)
    for tree, root_logits in trees:
        assert tree.draft_probs is None
        if len(tree) > 1:
            assert tree.tokens[tree.children[0]].tolist() == torch.topk(root_logits, 3).indices.tolist()


def test_eagle1_sampling_is_reproducible_from_the_seed(tiny_target, tiny_head):
    decoder = decoder_for(tiny_target, tiny_head)
    runs = [draw(decoder, 30, length=6, seed=11) for _ in range(2)]
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


# ---------------------------------------------------------------------------------------------
# (c) greedy unchanged; the option validated


def test_greedy_is_the_same_under_both_rules_and_equals_ar(tmp_path):
    target = tiny_model("llama", seed=46, vocab_size=64)
    write_eagle(tmp_path, target, seed=2)
    head = load_eagle_head(ModelSpec(path=str(tmp_path)), target)
    ar = AutoregressiveDecoder(ModelRunner(target))
    tree = "eagle_mc_sim_7b_63"
    for prompt in ([1, 5, 9, 2], [7, 7, 3, 30, 41, 2, 9]):
        reference = ar.generate(prompt, StopCondition(24)).tokens
        outputs = [decoder_for(target, head, rule, tree=tree).generate(prompt, StopCondition(24))
                   for rule in ("eagle1", "eagle2")]
        assert [o.tokens for o in outputs] == [reference, reference]
        assert outputs[0].stats.accepted_lengths == outputs[1].stats.accepted_lengths


def test_sampling_rule_is_validated():
    check_method_params("eagle", {"name": "eagle", "sampling_rule": "eagle1"})
    check_method_params("eagle", {"name": "eagle", "sampling_rule": "eagle2"})
    with pytest.raises(ConfigError) as bad:
        check_method_params("eagle", {"name": "eagle", "sampling_rule": "specinfer"})
    assert str(bad.value) == "method.sampling_rule='specinfer': valid: eagle1, eagle2"
    with pytest.raises(ConfigError):  # EAGLE-2 / EAGLE-3 keep their rule: no such key there
        check_method_params("eagle2", {"name": "eagle2", "sampling_rule": "eagle1"})
    with pytest.raises(ValueError, match="valid: eagle1, eagle2"):
        EagleDecoder(None, None, StaticTree.build(TREE), sampling_rule="greedy")


def test_config_file_default_is_eagle1():
    from pathlib import Path

    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf/method/eagle.yaml"))
    assert cfg["sampling_rule"] == "eagle1"
    check_method_params("eagle", cfg)
