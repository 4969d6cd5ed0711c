"""Faithful to upstream: CLLM prompts, Jacobi's first guesses, Spec-Bench's SpS γ schedule, the
Medusa-2 checkpoint layout. Each test fails on the suite's behaviour before it followed upstream."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from harness.running.prompts import ChatTemplate, Message
from methods.ar import AutoregressiveDecoder
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.jacobi import JacobiDecoder
from methods.models.heads.medusa import load_medusa_heads
from methods.models.loading import truncated_copy
from methods.models.specs import ModelSpec, model_config
from methods.sps import HEURISTIC_START, SpeculativeSamplingDecoder
from tests.conftest import tiny_model
from tests.test_tree_methods import reference_medusa_logits, write_medusa

QUESTION = "How many singers are there?"
# The prompts upstream's scripts build (hao-ai-lab/Consistency_LLM: cllm/utils.py for spider and
# python, eval/gsm8k/speedup.py for math, fastchat's vicuna template in eval/mt-bench for ShareGPT)
CLLM_PROMPTS = {
    "cllm-7b-spider": "### Instruction:\nCould you translate the following question into SQL. Please only generate "
    f"SQL, don't include explanation in the answer.\n{QUESTION}\n### Response:\n",
    "cllm-7b-codesearchnet": f"### Instruction:\nPlease generate code based on the following doc:\n{QUESTION}\n"
    "### Response:\n",
    "cllm-7b-math": f"Question:\n{QUESTION}\nAnswer:\nLet's think step by step.\n",
    "cllm-7b-sharegpt48k": "A chat between a curious user and an artificial intelligence assistant. The assistant "
    f"gives helpful, detailed, and polite answers to the user's questions. USER: {QUESTION} ASSISTANT:",
}


@pytest.mark.parametrize("model", sorted(CLLM_PROMPTS))
def test_cllm_configs_prompt_as_upstream(model, embedded):
    _, tokenizer = embedded
    template = ChatTemplate.for_model(model_config(model), tokenizer)
    assert template.prompt_ids([Message("user", QUESTION)]) == list(tokenizer(CLLM_PROMPTS[model]).input_ids)


def test_jacobi_first_guesses_come_from_prompt_and_output():
    """`sequence` (the default, as upstream): a new block's guesses are drawn from the prompt and
    the tokens generated so far; `prompt`: from the prompt only."""
    target = tiny_model("llama", seed=61, vocab_size=32)
    prompt = [0] * 12  # one token the output will (almost) never repeat
    seen = {}
    for mode in ("sequence", "prompt"):
        decoder = JacobiDecoder(ModelRunner(target), block_size=4, initial_guess=mode)
        guesses = []
        new_block = decoder.new_block

        def recording(state, root, new_block=new_block, guesses=guesses):
            new_block(state, root)
            guesses.append((state.values["guess"].tolist(), set(state.sequence)))

        decoder.new_block = recording
        out = decoder.generate(prompt, StopCondition(40))
        assert out.tokens == AutoregressiveDecoder(ModelRunner(target)).generate(prompt, StopCondition(40)).tokens
        assert all(set(guess) <= pool for guess, pool in guesses)
        seen[mode] = {t for guess, _ in guesses for t in guess}
    assert seen["prompt"] == {0} and seen["sequence"] - {0}


def test_sps_heuristic_gamma_follows_spec_benchs_schedule():
    """γ starts at 5 in every generate call, +2 after a step whose γ drafts were all accepted,
    -1 (to at least 1) otherwise; greedy output unchanged."""
    target = tiny_model("llama", seed=62, vocab_size=16, layers=3)
    decoder = SpeculativeSamplingDecoder(ModelRunner(target), truncated_copy(target, 2), gamma="heuristic")
    steps = []
    advance = decoder.advance

    def recording(state, tree, acceptance, verified):
        gamma = state.values["gamma"]
        advance(state, tree, acceptance, verified)
        steps.append((gamma, len(tree) - 1, acceptance.accepted_drafts, state.values["gamma"]))

    decoder.advance = recording
    ar = AutoregressiveDecoder(ModelRunner(target))
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        steps.clear()
        assert decoder.generate(prompt, StopCondition(60)).tokens == ar.generate(prompt, StopCondition(60)).tokens
        assert steps[0][0] == HEURISTIC_START
        for (gamma, drafted, accepted, following), nxt in zip(steps, steps[1:] + [None]):
            assert following == (gamma + 2 if accepted == gamma else max(1, gamma - 1))
            if nxt is not None:
                assert nxt[0] == following
        assert {g for g, *_ in steps} != {HEURISTIC_START}  # it moved
    assert decoder.describe()["gamma"] == "heuristic" and decoder.describe()["sizing"]["steps_by_gamma"]


@pytest.mark.parametrize("sharded", [False, True])
def test_medusa2_full_model_checkpoints_load_their_heads(tmp_path, sharded):
    """Medusa-2 saves the whole model with its heads under `medusa_head.*` (one file, or shards
    with an index): the loader reads the same heads as from the Medusa-1 head file."""
    target = tiny_model("llama", seed=63, vocab_size=64)
    heads_state = write_medusa(tmp_path / "medusa1", target, heads=3, declared=3, safetensors=True)
    full = {**{k: v.contiguous() for k, v in target.state_dict().items()},
            **{f"medusa_head.{k}": v for k, v in heads_state.items()}}
    folder = tmp_path / "medusa2"
    folder.mkdir()
    if sharded:
        keys = sorted(full)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for name, names in shards.items():
            save_file({k: full[k] for k in names}, str(folder / name))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}))
    else:
        save_file(full, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**target.config.to_dict(), "medusa_num_heads": 3,
                                                    "medusa_num_layers": 1}))
    heads = load_medusa_heads(ModelSpec(path=str(folder)), target)
    assert len(heads) == 3
    hidden = torch.randn(2, target.config.hidden_size)
    for i in range(3):
        torch.testing.assert_close(heads[i](hidden), reference_medusa_logits(heads_state, hidden, i), rtol=1e-4,
                                   atol=1e-4)


def test_medusa_typical_acceptance_follows_upstreams_rule():
    """A fixed fixture, its expected outcome worked out by hand from upstream's rule
    (FasterDecoding/Medusa `evaluate_posterior`, fast path): threshold min(0.09, 0.3 exp(-H)) with
    H from log(p + 1e-5); equally deep accepted paths -> the most likely; next token = argmax."""
    from methods.engine.acceptance import typical_accept
    from methods.engine.tree import Tree

    # root -> {5 (node 1), 6 (node 2)}; node 1 -> 7 (node 3); node 2 -> 8 (node 4)
    tree = Tree(torch.tensor([0, 5, 6, 7, 8]), [-1, 0, 0, 1, 2])
    vocab = 4000
    root = torch.full((vocab,), 0.0)
    root[5], root[6] = 0.3, 0.5
    root[9:vocab] = 0.2 / (vocab - 9)  # a long tail: log(p + 1e-5) and log p give different entropies
    # after node 1 (path likelihood 0.3) and node 2 (0.5) the depth-2 tokens have the same
    # probability 0.6: both paths are accepted to depth 2, and the tie goes to node 2's, the more
    # likely one, though node 3 comes first in tree order
    node1, node2 = torch.zeros(vocab), torch.zeros(vocab)
    node1[7], node1[3] = 0.6, 0.4
    node2[8], node2[3] = 0.6, 0.4
    leaf = torch.zeros(vocab)
    leaf[11], leaf[12] = 0.45, 0.55  # argmax 12 (sampling would pick 11 45% of the time)
    probs = torch.stack([root, node1, node2, leaf, leaf])

    def threshold(p):  # upstream's arithmetic, written out
        entropy = -(p * torch.log(p + 1e-5)).sum()
        return min(0.09, 0.3 * float(torch.exp(-entropy)))

    assert probs[0, 5] > threshold(probs[0]) and probs[0, 6] > threshold(probs[0])
    assert probs[1, 7] > threshold(probs[1]) and probs[2, 8] > threshold(probs[2])
    for _ in range(5):
        result = typical_accept(tree, probs)
        assert result.path == [0, 2, 4] and result.next_token == 12

    # the +1e-5 matters: H from log(p + 1e-5) is lower than from log p, so upstream's threshold is
    # higher; a token whose probability lies between the two is rejected upstream (and was accepted
    # with the exact entropy)
    def distribution(x):
        p = torch.full((vocab,), 0.6 / (vocab - 2), dtype=torch.float64)
        p[1], p[2] = 0.4 - x, x
        return p

    def exact_threshold(p):
        return min(0.09, 0.3 * float(torch.exp((p * torch.log(p)).sum())))

    between = [x for x in torch.linspace(1e-4, 0.09, 2000).tolist()
               if exact_threshold(distribution(x)) < x < threshold(distribution(x))]
    assert between
    p = distribution(between[len(between) // 2]).float()
    assert typical_accept(Tree(torch.tensor([0, 2]), [-1, 0]), torch.stack([p, p])).path == [0]
