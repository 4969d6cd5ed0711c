"""A static KV cache (issue 35, item 2): the shared loop reserves prompt + max new tokens + ROOM
positions before the prefill, so no KV buffer and no RoPE table moves during an answer (what a
captured CUDA graph needs), with the same tokens as a cache that grows; past its capacity the
cache still grows, counted, and keeps its contents."""

from __future__ import annotations

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.engine import runner as runner_module
from methods.engine.kv_cache import TreeKVCache
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.engine.tree import Tree
from methods.lookahead import LookaheadDecoder
from methods.pld import PromptLookupDecoder
from tests.conftest import tiny_model

PROMPT = [5, 9, 3, 7, 5, 9, 3, 7, 11, 2, 5, 9]


def addresses(runner: ModelRunner) -> tuple:
    layers = runner.cache.layers
    return (tuple(layer.key_buffer.data_ptr() for layer in layers),
            tuple(layer.value_buffer.data_ptr() for layer in layers),
            runner.fused.rope.cos.data_ptr(), runner.fused.rope.sin.data_ptr())


def watched(runner: ModelRunner) -> list:
    """Every forward's buffer addresses, recorded after it ran."""
    seen, forward = [], runner.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(addresses(runner))
        return out

    runner.forward = recording
    return seen


def test_no_buffer_moves_over_a_long_answer_and_tokens_match_a_growing_cache(monkeypatch):
    model = tiny_model("llama", seed=4, vocab_size=32, hidden=32, layers=2)
    stop = StopCondition(max_new_tokens=300)  # past BufferedLayer.min_capacity: a growing cache would move
    for make in (AutoregressiveDecoder, PromptLookupDecoder, lambda r: LookaheadDecoder(r, window=3, level=3, guess=3)):
        runner = ModelRunner(model)
        assert runner.fused is not None
        seen = watched(runner)
        static = make(runner).generate(PROMPT, stop)
        assert len(static.tokens) == 300 and len(seen) > 10 and len(set(seen)) == 1 and runner.cache.regrowths == 0
        room = runner_module.ROOM  # prompt + max new tokens + ROOM, rounded up to a multiple of ROOM
        assert runner.cache.capacity == -(-(len(PROMPT) + 300 + room) // room) * room

        with monkeypatch.context() as patch:  # the same decoder on a cache that grows by doubling
            patch.setattr(ModelRunner, "reserve", lambda self, positions: None)
            growing_runner = ModelRunner(model)
            growing_runner.fused.rope.clear()  # the table is the model's: start it small again
            seen = watched(growing_runner)
            growing = make(growing_runner).generate(PROMPT, stop)
        assert len(set(seen)) > 1  # it did move
        assert growing.tokens == static.tokens


def test_a_cache_past_its_capacity_grows_counted_and_keeps_its_contents():
    cache = TreeKVCache(capacity=6)
    keys = torch.randn(1, 2, 10, 4)
    cache.update(keys[:, :, :4], -keys[:, :, :4], 0)
    first = cache.layers[0].key_buffer
    assert first.shape[-2] == 6 and cache.regrowths == 0
    cache.update(keys[:, :, 4:10], -keys[:, :, 4:10], 0)
    assert cache.regrowths == 1 and cache.layers[0].key_buffer.data_ptr() != first.data_ptr()
    assert torch.equal(cache.layers[0].keys, keys) and torch.equal(cache.layers[0].values, -keys)
    assert TreeKVCache().capacity is None


def test_padded_verification_gives_the_same_tokens_and_logits():
    """Verification padded to a size bucket (padding rows see only themselves, are never accepted
    and their KV goes at the commit) decodes what the unpadded one does, tree methods included."""
    model = tiny_model("llama", seed=5, vocab_size=32, hidden=32, layers=2)
    stop = StopCondition(max_new_tokens=40)
    for make in (AutoregressiveDecoder, PromptLookupDecoder, lambda r: LookaheadDecoder(r, window=3, level=3, guess=3)):
        plain = ModelRunner(model)
        expected = make(plain).generate(PROMPT, stop)
        padded = ModelRunner(model)
        padded.verify_buckets = (4, 16, 64)
        rows = []
        verify = padded.forward
        padded.forward = lambda tokens, **kw: rows.append(len(tokens)) or verify(tokens, **kw)
        got = make(padded).generate(PROMPT, stop)
        assert got.tokens == expected.tokens and set(rows[1:]) <= {4, 16, 64}
        assert got.stats.logit_margins == pytest.approx(expected.stats.logit_margins, abs=1e-4)

    runner = ModelRunner(model)
    runner.prefill(PROMPT)
    tree = Tree(torch.tensor([3, 5, 7, 5]), [-1, 0, 0, 1])
    plain = runner.verify(tree)
    runner.rollback(len(PROMPT))
    runner.verify_buckets = (8,)
    padded = runner.verify(tree)
    assert runner.length == len(PROMPT) + 8 and padded.logits.shape == plain.logits.shape
    assert torch.allclose(padded.logits, plain.logits,
                          atol=1e-5) and torch.allclose(padded.hidden, plain.hidden, atol=1e-5)
    runner.commit(len(PROMPT), [0, 1, 3])
    assert runner.length == len(PROMPT) + 3
