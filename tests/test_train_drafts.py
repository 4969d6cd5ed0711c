"""Draft-zoo recipes: training prompts disjoint from evaluation, self-distillation equal to the
target's greedy answers, and each recipe learns and writes a checkpoint its loader reads back."""

from __future__ import annotations

import json

import pytest
import torch

from harness.training.distill import check_disjoint, self_distill, training_prompts
from harness.training.draft_lm import DraftLMRecipe
from harness.training.eagle import EagleRecipe
from harness.training.examples import Example, attach_hidden
from harness.training.loop import evaluate, train
from harness.training.medusa import MedusaRecipe
from tests.conftest import SPEC_BENCH_SAMPLE, hf_greedy, tiny_model


def test_training_prompts_are_seeded_unique_and_disjoint_from_spec_bench(spec_bench_file):
    prompts = training_prompts(300, seed=3)
    assert prompts == training_prompts(300, seed=3)
    assert prompts != training_prompts(300, seed=4)
    assert len({p["text"] for p in prompts}) == 300
    assert {p["kind"] for p in prompts} == {"open", "math", "code", "summary", "qa", "extract"}
    check_disjoint(prompts, spec_bench_file)


def test_check_disjoint_catches_an_evaluation_question(tmp_path):
    question = json.loads(SPEC_BENCH_SAMPLE.read_text().splitlines()[0])
    leaked = [{"id": "p1", "text": "Please answer: " + question["turns"][0]}]
    with pytest.raises(ValueError, match="overlaps the evaluation question"):
        check_disjoint(leaked, SPEC_BENCH_SAMPLE)


def test_self_distillation_records_the_targets_greedy_answers(tiny_chat_model_dir, tmp_path):
    from methods.models.loading import load_model, load_tokenizer
    from methods.models.specs import ModelSpec
    from harness.prompts import ChatTemplate, Message

    spec = ModelSpec(path=str(tiny_chat_model_dir))
    model, tokenizer = load_model(spec, torch.float32, torch.device("cpu")), load_tokenizer(spec)
    template = ChatTemplate("tokenizer", tokenizer)
    prompts = training_prompts(5, seed=0)
    journal = tmp_path / "answers.partial.jsonl"
    records = self_distill(model, template, prompts[:3], max_new_tokens=12, batch_size=2, progress=False, journal=journal)
    journal.write_text(journal.read_text() + '{"id": "half-writ')  # a run killed mid-line
    records = self_distill(model, template, prompts, max_new_tokens=12, batch_size=2, progress=False, journal=journal)
    assert [r["id"] for r in records] == [p["id"] for p in prompts]
    # the broken line is gone and the rerun answered only the two missing prompts
    assert sorted(json.loads(line)["id"] for line in journal.read_text().splitlines()) == sorted(p["id"] for p in prompts)
    for prompt, record in zip(prompts, records):
        ids = template.prompt_ids([Message("user", prompt["text"])])
        assert record["ids"][:record["answer_start"]] == ids
        expected = hf_greedy(model, ids, 12, eos=sorted(template.eos_token_ids))
        stop = next((i + 1 for i, t in enumerate(expected) if t in template.eos_token_ids), len(expected))
        assert record["ids"][record["answer_start"]:] == expected[:stop]


def test_self_distillation_cuts_answers_at_the_templates_stop_string(tiny_chat_model_dir):
    """fschat templates (Vicuna, LLaMA-2) end answers on a stop *string*: the answer keeps the token
    that completes it and nothing after, as the decoders do."""
    from methods.models.loading import load_model, load_tokenizer
    from methods.models.specs import ModelSpec
    from harness.prompts import ChatTemplate, Message

    spec = ModelSpec(path=str(tiny_chat_model_dir))
    model, tokenizer = load_model(spec, torch.float32, torch.device("cpu")), load_tokenizer(spec)
    template = ChatTemplate("tokenizer", tokenizer)
    prompt = training_prompts(1, seed=0)
    full = hf_greedy(model, template.prompt_ids([Message("user", prompt[0]["text"])]), 16)
    # the first text the greedy answer produces at its 4th token or later, absent before it
    k = next(k for k in range(3, 16) if (piece := tokenizer.decode(full[k:k + 1]).strip())
             and piece not in tokenizer.decode(full[:k]))
    template.stop_strings = (tokenizer.decode(full[k:k + 1]).strip(),)
    record = self_distill(model, template, prompt, max_new_tokens=16, batch_size=1, progress=False)[0]
    assert record["ids"][record["answer_start"]:] == full[:k + 1]


@pytest.fixture(scope="module")
def tiny_target_data():
    """A tiny target (tied embeddings, as SmolLM2) and its own greedy continuations of random prompts."""
    target = tiny_model("llama", seed=5, vocab_size=96, hidden=32, layers=3, tie_word_embeddings=True, init_std=0.3)
    generator = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(12):
        prompt = torch.randint(0, 96, (6,), generator=generator).tolist()
        answer = hf_greedy(target, prompt, 20)
        examples.append(Example(torch.tensor(prompt + answer), len(prompt)))
    attach_hidden(target, examples)
    return target, examples


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

    assert not any(k.startswith(("model.embed_tokens", "lm_head")) for k in load_file(str(tmp_path / "model.safetensors")))
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
        assert torch.allclose(heads(hidden), recipe.heads(hidden), atol=1e-5)


def test_hidden_state_cache_is_reused_only_for_the_same_examples(tiny_target_data, tmp_path):
    target, examples = tiny_target_data
    cache = tmp_path / "hidden_states.pt"
    fresh = [Example(e.ids, e.answer_start) for e in examples]
    attach_hidden(target, fresh, cache)
    assert all(torch.equal(a.hidden, e.hidden) for a, e in zip(fresh, examples))
    stored = torch.load(cache)
    stored["hidden"][0] = stored["hidden"][0] + 1  # marks what comes from the file
    torch.save(stored, cache)
    again = [Example(e.ids, e.answer_start) for e in examples]
    attach_hidden(target, again, cache)
    assert torch.equal(again[0].hidden, examples[0].hidden + 1)
    other = [Example(e.ids, e.answer_start) for e in examples[:-1]]  # other examples: computed afresh
    attach_hidden(target, other, cache)
    assert torch.equal(other[0].hidden, examples[0].hidden)
