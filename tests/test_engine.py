"""The target side of the engine: tree verification in one forward, and KV commit/rollback."""

from __future__ import annotations

import random

import pytest
import torch

from methods.engine.runner import ModelRunner
from methods.engine.tree import Tree, ancestor_matrix
from tests.conftest import tiny_model

ARCHES = ["llama", "qwen2", "mistral"]


def random_tree(rng: random.Random, size: int, vocab: int, repeat_tokens: bool = True) -> Tree:
    parents = [-1] + [rng.randrange(node) for node in range(1, size)]
    tokens = [rng.randrange(vocab) for _ in range(size)]
    if repeat_tokens and size > 3:  # siblings sharing a token must still be handled per node
        tokens[2] = tokens[1]
    return Tree(torch.tensor(tokens), parents)


def sequential(model, tokens: list[int]):
    """Reference: decode `tokens` one by one from an empty cache with plain transformers."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        for i, token in enumerate(tokens):
            out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[i]]),
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return torch.stack(logits), cache


def test_ancestor_matrix_and_paths():
    tree = Tree(torch.tensor([5, 6, 7, 8, 9]), [-1, 0, 0, 1, 3])
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_matrix(tree.parents), expected)
    assert tree.depths == [0, 1, 1, 2, 3]
    assert tree.children == [[1, 2], [3], [], [4], []]
    assert sorted(tree.paths()) == [[0, 1, 3, 4], [0, 2]]
    with pytest.raises(ValueError, match="parents must precede"):
        Tree(torch.tensor([1, 2]), [-1, 1])


@pytest.mark.parametrize("arch", ARCHES)
def test_tree_logits_equal_sequential_decoding_of_each_path(arch):
    model = tiny_model(arch, seed=1)
    rng = random.Random(arch)
    runner = ModelRunner(model)
    for trial in range(3):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 12))]
        tree = random_tree(rng, rng.randrange(2, 16), 256)
        runner.reset()
        runner.prefill(prompt)
        verified = runner.verify(tree)
        tokens = tree.tokens.tolist()
        for node in range(len(tree)):
            path_tokens = [tokens[n] for n in tree.path_to(node)]
            reference, _ = sequential(model, prompt + path_tokens)
            torch.testing.assert_close(verified.logits[node], reference[-1], rtol=1e-4, atol=1e-4)


def cache_tensors(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("arch", ARCHES)
def test_commit_leaves_the_cache_of_the_accepted_path(arch):
    model = tiny_model(arch, seed=2)
    rng = random.Random(f"commit-{arch}")
    runner = ModelRunner(model)
    for trial in range(4):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(2, 10))]
        tree = random_tree(rng, rng.randrange(3, 14), 256)
        runner.reset()
        runner.prefill(prompt)
        start = runner.length
        runner.verify(tree)
        path = rng.choice(tree.paths())
        path = path[: rng.randrange(1, len(path) + 1)]  # any prefix of a root-to-leaf path
        runner.commit(start, path)
        assert runner.length == len(prompt) + len(path)
        tokens = tree.tokens.tolist()
        _, reference = sequential(model, prompt + [tokens[n] for n in path])
        for (keys, values), ref_layer in zip(cache_tensors(runner.cache), reference.layers):
            torch.testing.assert_close(keys, ref_layer.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(values, ref_layer.values, rtol=1e-5, atol=1e-5)
        # decoding continues correctly from the committed cache
        nxt = rng.randrange(256)
        out = runner.forward([nxt])
        reference_logits, _ = sequential(model, prompt + [tokens[n] for n in path] + [nxt])
        torch.testing.assert_close(out.logits[-1], reference_logits[-1], rtol=1e-4, atol=1e-4)


def test_rollback_and_cache_growth():
    model = tiny_model("llama", seed=3)
    runner = ModelRunner(model)
    prompt = [i % 256 for i in range(1, 300)]  # beyond the initial buffer capacity (256)
    runner.prefill(prompt)
    runner.forward([7, 8, 9])
    runner.rollback(len(prompt))
    assert runner.length == len(prompt)
    out = runner.forward([5])
    reference, cache = sequential(model, prompt + [5])
    torch.testing.assert_close(out.logits[-1], reference[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.cache.layers[0].keys, cache.layers[0].keys, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot roll back"):
        runner.rollback(10_000)


def test_per_position_counts_of_one_step():
    from methods.engine.acceptance import Acceptance
    from methods.loop import DraftVerifyDecoder
    from methods.state import DecodeStats

    tree = Tree(torch.tensor([5, 6, 7, 8, 9]), [-1, 0, 0, 1, 3])  # depths 0, 1, 1, 2, 3
    stats = DecodeStats()
    DraftVerifyDecoder.count_acceptance(stats, tree, Acceptance([0, 1, 3], next_token=4))
    assert (stats.position_proposed, stats.position_tested,
            stats.position_accepted) == ([1, 1, 1], [1, 1, 1], [1, 1, 0])
    DraftVerifyDecoder.count_acceptance(stats, tree, Acceptance([0, 2], next_token=4))  # node 2 is a leaf
    assert (stats.position_proposed, stats.position_tested,
            stats.position_accepted) == ([2, 2, 2], [2, 1, 1], [2, 1, 0])
    assert (stats.drafted_tokens, stats.accepted_drafts) == (8, 3)
