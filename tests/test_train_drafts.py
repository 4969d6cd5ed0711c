"""Draft-zoo recipes: each learns and writes a checkpoint its loader reads back (the corpus they
train on: tests/test_corpus.py)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.training.draft_lm import DraftLMRecipe
from harness.training.eagle import EagleRecipe
from harness.training.examples import Example, attach_hidden
from harness.training.loop import evaluate, train
from harness.training.medusa import MedusaRecipe
from tests.conftest import tiny_target_with_answers


@pytest.fixture(scope="module")
def tiny_target_data():
    return tiny_target_with_answers(12)


def _rounded_to_bf16(module):
    import copy

    module = copy.deepcopy(module)
    for param in module.parameters():
        if param.requires_grad:  # trained, stored in bf16; frozen tensors are the target's own
            param.data = param.data.to(torch.bfloat16).float()
    return module


def _trained(recipe, examples, tmp_path):
    before = evaluate(recipe, examples)
    result = train(recipe, examples, examples, epochs=12, lr=3e-3, seed=0, log_file=tmp_path / "log.jsonl",
                   batch=4, progress=False)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(log) == result["steps"] and log[-1]["loss"] < log[0]["loss"]
    assert result["held_out_acceptance"]["acc_1"] > before["acc_1"]
    recipe.save(tmp_path)
    return result


def test_draft_lm_recipe_learns_and_loads_through_load_draft_lm(tiny_target_data, tmp_path):
    from methods.models.loading import load_draft_lm

    target, examples = tiny_target_data
    recipe = DraftLMRecipe(target, layers=1)
    _trained(recipe, examples, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    from safetensors.torch import load_file

    assert not any(k.startswith(("model.embed_tokens", "lm_head"))
                   for k in load_file(str(tmp_path / "model.safetensors")))
    draft = load_draft_lm({"path": str(tmp_path)}, target)
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight  # shared, not copied
    ids = examples[0].ids[None]
    with torch.no_grad():
        expected = _rounded_to_bf16(recipe.model)(input_ids=ids).logits  # the file stores bf16
        assert torch.allclose(draft(input_ids=ids).logits, expected, atol=1e-5)


def test_eagle_recipe_learns_and_loads_through_load_eagle_head(tiny_target_data, tmp_path):
    from methods.models.heads.eagle import load_eagle_head
    from methods.models.specs import ModelSpec

    target, examples = tiny_target_data
    recipe = EagleRecipe(target, seed=0)
    _trained(recipe, examples, tmp_path)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert "embed_tokens.weight" not in state and "fc.bias" in state
    head = load_eagle_head(ModelSpec(path=str(tmp_path)), target)
    example = examples[0]
    n = len(example.ids) - 1
    mask = torch.full((n, n), float("-inf")).triu_(1)[None, None]
    args = (example.ids[1:], example.hidden[:-1], torch.arange(n), mask, None)
    with torch.no_grad():
        assert torch.allclose(head(*args), _rounded_to_bf16(recipe.head)(*args), atol=1e-5)


def test_medusa_recipe_learns_and_loads_through_load_medusa_heads(tiny_target_data, tmp_path):
    from methods.models.heads.medusa import load_medusa_heads
    from methods.models.specs import ModelSpec

    target, examples = tiny_target_data
    recipe = MedusaRecipe(target, heads=3)
    result = _trained(recipe, examples, tmp_path)
    assert set(result["held_out_acceptance"]) == {"acc_1", "acc_2", "acc_3"}
    state = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
    assert sorted(state) == sorted(f"{i}.0.linear.{p}" for i in range(3) for p in ("weight", "bias"))
    heads = load_medusa_heads(ModelSpec(path=str(tmp_path)), target)
    hidden = examples[0].hidden
    with torch.no_grad():
        assert torch.allclose(heads(hidden), _rounded_to_bf16(recipe.heads)(hidden), atol=1e-5)


def test_hidden_state_cache_is_16_bit_memory_mapped_and_reused_only_for_the_same_examples(tiny_target_data, tmp_path):
    target, examples = tiny_target_data
    cache = tmp_path / "hidden_states.pt"
    fresh = [Example(e.ids, e.answer_start) for e in examples]
    attach_hidden(target, fresh, cache, batch_tokens=64)  # several right-padded batches
    assert all(a.hidden.dtype == torch.float16 for a in fresh)
    # batched + float16 = the one-example float32 forward to float16's precision
    assert all(torch.allclose(a.hidden.float(), e.hidden, rtol=2e-3, atol=2e-3) for a, e in zip(fresh, examples))
    assert all(torch.equal(a.top, e.top) for a, e in zip(fresh, examples))
    assert (tmp_path / "hidden_states.pt.bin").stat().st_size == sum(len(e.ids) for e in examples) * 32 * 2
    rows = (tmp_path / "hidden_states.pt.bin").read_bytes()  # marks what comes from the file: example 0's row 0 + 1
    import numpy as np

    data = np.frombuffer(rows, dtype=np.float16).copy()
    data[:32] += 1
    (tmp_path / "hidden_states.pt.bin").write_bytes(data.tobytes())
    again = [Example(e.ids, e.answer_start) for e in examples]
    attach_hidden(target, again, cache)
    assert torch.allclose(again[0].hidden[0].float(), examples[0].hidden[0] + 1, atol=1e-2)
    other = [Example(e.ids, e.answer_start) for e in examples[:-1]]  # other examples: computed afresh
    attach_hidden(target, other, cache)
    assert torch.allclose(other[0].hidden.float(), examples[0].hidden, rtol=2e-3, atol=2e-3)


def test_an_interrupted_cache_computation_resumes_where_it_stopped(tiny_target_data, tmp_path):
    """Computing a corpus's cache takes hours on a CPU: killed mid-way, the next run computes only
    the batches the journal lacks, and the cache equals an uninterrupted one."""
    from harness.training.examples import attach_states, last_hidden

    target, examples = tiny_target_data
    fields = {"hidden": 32}
    whole = tmp_path / "whole.pt"
    attach_states(target, [Example(e.ids, e.answer_start) for e in examples], last_hidden, fields, "hidden",
                  whole, batch_tokens=64)
    calls = []

    def stopping_after(n):
        def compute(model, ids):
            if len(calls) == n:
                raise KeyboardInterrupt
            calls.append(ids.shape)
            return last_hidden(model, ids)
        return compute

    cache = tmp_path / "hidden_states.pt"
    with pytest.raises(KeyboardInterrupt):
        attach_states(target, [Example(e.ids, e.answer_start) for e in examples], stopping_after(3), fields, "hidden",
                      cache, batch_tokens=64)
    assert not cache.exists() and (tmp_path / "hidden_states.pt.partial.0").exists()
    first = len(calls)
    resumed = [Example(e.ids, e.answer_start) for e in examples]
    attach_states(target, resumed, stopping_after(10 ** 6), fields, "hidden", cache, batch_tokens=64)
    total = len(calls)
    fresh_calls = []
    attach_states(target, [Example(e.ids, e.answer_start) for e in examples],
                  lambda m, ids: fresh_calls.append(1) or last_hidden(m, ids), fields, "hidden",
                  tmp_path / "fresh.pt", batch_tokens=64)
    assert first == 3 and total == len(fresh_calls) > 3  # no batch computed twice
    assert (tmp_path / "hidden_states.pt.bin").read_bytes() == (tmp_path / "whole.pt.bin").read_bytes()
    reference = [Example(e.ids, e.answer_start) for e in examples]
    attach_states(target, reference, last_hidden, fields, "hidden", whole)
    for a, b in zip(resumed, reference):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.top, b.top)
    assert sorted(f.name for f in tmp_path.glob("hidden_states.pt*")) == ["hidden_states.pt", "hidden_states.pt.bin"]
    # a journal of other settings (here: batch size) is not resumed from
    with pytest.raises(KeyboardInterrupt):
        attach_states(target, [Example(e.ids, e.answer_start) for e in examples], stopping_after(len(calls) + 2),
                      fields, "hidden", tmp_path / "other.pt", batch_tokens=64)
    before = len(calls)
    attach_states(target, [Example(e.ids, e.answer_start) for e in examples], stopping_after(10 ** 6), fields,
                  "hidden", tmp_path / "other.pt", batch_tokens=48)
    every = []
    attach_states(target, [Example(e.ids, e.answer_start) for e in examples],
                  lambda m, ids: every.append(1) or last_hidden(m, ids), fields, "hidden", tmp_path / "count.pt",
                  batch_tokens=48)
    assert len(calls) - before == len(every)  # all of them again


def test_hidden_state_cache_falls_back_to_bfloat16_beyond_float16s_range(tiny_target_data, tmp_path):
    import copy

    target, examples = tiny_target_data
    loud = copy.deepcopy(target)
    with torch.no_grad():
        loud.model.norm.weight.mul_(1e5)  # hidden states far beyond float16's 65504
    expected = [Example(e.ids, e.answer_start) for e in examples[:4]]
    attach_hidden(loud, expected)
    assert max(float(e.hidden.abs().max()) for e in expected) > 1e5
    cached = [Example(e.ids, e.answer_start) for e in examples[:4]]
    attach_hidden(loud, cached, tmp_path / "hidden_states.pt")
    for a, e in zip(cached, expected):
        assert a.hidden.dtype == torch.bfloat16 and torch.isfinite(a.hidden.float()).all()
        torch.testing.assert_close(a.hidden.float(), e.hidden, rtol=1e-2, atol=1e-2 * float(e.hidden.abs().max()))


def test_the_training_cli_refuses_a_gpu_that_is_not_there_before_loading_anything(monkeypatch):
    from harness.training.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: .*CUDA is not available"):
        main(["eagle3", "--device", "cuda"])


def test_the_model_card_names_the_command_that_trains_the_draft_again():
    import argparse

    from harness.training.__main__ import main
    from harness.training.loop import recipe_command

    args = argparse.Namespace(kind="eagle3", model="smollm2-135m", seed=0, epochs=3.0, lr=0.002, batch=16,
                              train_examples=None, ttt_steps=7, heads=4, layers=2, device="cuda:0")
    command = recipe_command(args)
    assert command == ("python -m harness.training eagle3 --model smollm2-135m --seed 0 --epochs 3 --lr 0.002 "
                       "--batch 16 --ttt-steps 7 --device cuda")
    with pytest.raises(SystemExit) as exit_:  # the CLI parses it (and stops at --help)
        main(command.split()[3:] + ["--help"])
    assert exit_.value.code == 0
