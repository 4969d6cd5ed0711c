"""The tree sampler on the device (`acceptance.tree_decisions`) takes the node-by-node walk's
decisions: given the same uniforms (draws[node, j] tests the node's j-th child), the same accepted
path and the same distribution for the next token, over random trees with repeated sibling tokens,
with and without the draft's q, with and without replacement; and the whole acceptance reads once."""

from __future__ import annotations

import random

import pytest
import torch

from harness.perf.host_reads import counting_host_reads
from methods.engine.acceptance import residual_distribution, sample_accept, tree_decisions
from methods.engine.tree import Tree
from methods.loop import logit_margins


def walk(tree: Tree, probs: torch.Tensor, draws: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The rule as its definition reads (acceptance.py's docstring), one node and one child at a time."""
    tokens, node = tree.tokens.tolist(), 0
    while True:
        p = probs[node]
        q = None if tree.draft_probs is None else tree.draft_probs[node].clone()
        for rank, child in enumerate(tree.children[node]):
            x = tokens[child]
            q_x = 1.0 if q is None else float(q[x])
            if q_x > 0 and float(draws[node, rank]) * q_x < float(p[x]):
                break
            p = residual_distribution(p, torch.zeros_like(p).index_fill_(0, torch.tensor(x), 1.0) if q is None else q)
            if q is not None and tree.without_replacement:
                q[x] = 0
                q = q / q.sum() if q.sum() > 0 else q
        else:
            return tree.path_to(node), p
        node = child


def random_case(rng: random.Random, seed: int, vocab: int = 6):
    n = rng.randint(2, 14)
    parents = [-1] + [rng.randrange(node) for node in range(1, n)]
    if all(parent == node - 1 for node, parent in enumerate(parents)):
        parents[-1] = 0 if n > 2 else parents[-1]  # a tree, not a chain (chains have their own sampler)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([rng.randrange(vocab) for _ in range(n)])  # siblings may repeat a token
    logits = 3 * torch.randn(n, vocab, generator=generator)
    if seed % 2:  # steer the walk deep: each node's target favours one of its children's tokens
        for node in range(n):
            kids = [child for child in range(1, n) if parents[child] == node]
            if kids:
                logits[node, tokens[rng.choice(kids)]] += 4
    probs = torch.softmax(logits, -1)
    q = torch.softmax(3 * torch.randn(n, vocab, generator=generator), -1)
    q[0, rng.randrange(vocab)] = 0  # a token the draft could not have drawn
    q = q / q.sum(-1, keepdim=True)
    draws = torch.rand(n, n, generator=generator)
    return parents, tokens, probs, q, draws


@pytest.mark.parametrize("variant", ["point mass", "with replacement", "without replacement"])
def test_the_batched_decisions_are_the_walks(variant):
    rng = random.Random(variant)
    deep = 0
    for trial in range(200):
        parents, tokens, probs, q, draws = random_case(rng, trial)
        tree = Tree(tokens, parents, None if variant == "point mass" else q,
                    without_replacement=variant == "without replacement")
        if tree.is_chain:
            continue
        path, p = walk(tree, probs, draws)
        on_path, _, final = tree_decisions(tree, probs, draws)
        assert [node for node in range(len(tree)) if on_path[node]] == path
        torch.testing.assert_close(final, p, rtol=1e-6, atol=1e-7)
        deep += len(path) > 2
    assert deep > 25  # the cases reach below the root's children


def test_a_broken_residual_changes_the_decisions():
    """The comparison above can fail: the walk with the residual left out disagrees somewhere."""
    rng, differs = random.Random(1), 0
    for trial in range(100):
        parents, tokens, probs, q, draws = random_case(rng, trial)
        tree = Tree(tokens, parents, q)
        if tree.is_chain:
            continue
        path, p = walk(tree, probs, draws)
        on_path, _, final = tree_decisions(tree, probs, draws, residual=lambda p, q: p)
        differs += [node for node in range(len(tree)) if on_path[node]] != path or not torch.allclose(final, p)
    assert differs > 10


def test_sampling_a_tree_reads_once():
    generator = torch.Generator().manual_seed(0)
    tree = Tree(torch.tensor([0, 1, 2, 3, 1, 4]), [-1, 0, 0, 1, 1, 2],
                torch.softmax(torch.randn(6, 6, generator=generator), -1))
    logits = 2 * torch.randn(6, 6, generator=generator)
    for _ in range(20):
        with counting_host_reads() as reads:
            acceptance = sample_accept(tree, logits.softmax(-1), generator, logits=logits)
        assert reads.total == 1
        assert acceptance.path == tree.path_to(acceptance.path[-1])
        assert acceptance.emitted == tree.tokens[acceptance.path[1:]].tolist() + [acceptance.next_token]
        # each path row's margin for the token it chose, as the loop would compute them with a read of their own
        assert acceptance.margins == logit_margins(logits[acceptance.path], acceptance.emitted)


def test_typical_acceptance_reads_once():
    """Medusa's and Hydra's typical rule (tests/test_faithful.py checks it against upstream's) on
    the device: one read, the path to the node it chose."""
    from methods.engine.acceptance import typical_accept

    generator = torch.Generator().manual_seed(0)
    tree = Tree(torch.tensor([0, 1, 2, 3, 1, 4]), [-1, 0, 0, 1, 1, 2])
    logits = 2 * torch.randn(6, 6, generator=generator)
    logits[0, 1] += 3  # typical: node 1 and then 3 or 4
    with counting_host_reads() as reads:
        acceptance = typical_accept(tree, logits.softmax(-1), logits=logits)
    assert reads.total == 1 and acceptance.path == tree.path_to(acceptance.path[-1]) and len(acceptance.path) > 1
    assert acceptance.emitted == tree.tokens[acceptance.path[1:]].tolist() + [acceptance.next_token]
    assert acceptance.margins == logit_margins(logits[acceptance.path], acceptance.emitted)


def test_a_sampled_chain_reads_once_with_its_margins():
    generator = torch.Generator().manual_seed(3)
    chain = Tree.chain(torch.tensor([0, 2, 2, 5]))
    logits = 2 * torch.randn(4, 6, generator=generator)
    logits[:3, 2] += 2
    lengths = set()
    for _ in range(30):
        with counting_host_reads() as reads:
            acceptance = sample_accept(chain, logits.softmax(-1), generator, logits=logits)
        assert reads.total == 1 and acceptance.path == list(range(len(acceptance.path)))
        assert acceptance.margins == logit_margins(logits[acceptance.path], acceptance.emitted)
        lengths.add(len(acceptance.path))
    assert len(lengths) > 1
