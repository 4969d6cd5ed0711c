"""The drafts' training corpus: prompts seeded, distinct and disjoint from every evaluation set
(substring and 13-word overlap), answers equal to the target's greedy ones or seeded T = 1 samples,
journalled so an interrupted run resumes."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from harness.training.distill import check_disjoint, evaluation_texts, self_distill
from methods.models import corpus
from methods.models.corpus import KINDS, SAMPLED_SHARE, training_prompts
from tests.conftest import SPEC_BENCH, hf_greedy


def test_training_prompts_are_seeded_distinct_mixed_and_disjoint_from_spec_bench(spec_bench_file):
    prompts = training_prompts(2000, seed=3)
    assert prompts == training_prompts(2000, seed=3)
    assert prompts != training_prompts(2000, seed=4)
    assert len({p["text"] for p in prompts}) == 2000
    assert set(Counter(p["kind"] for p in prompts)) == set(KINDS)
    sampled = sum(p["mode"] == "sample" for p in prompts) / len(prompts)
    assert abs(sampled - SAMPLED_SHARE) < 0.03
    check_disjoint(prompts, spec_bench_file)


def test_the_generator_refuses_more_prompts_than_it_can_make_distinct(monkeypatch):

    monkeypatch.setattr(corpus, "KINDS", {"math": 1})
    monkeypatch.setattr(corpus, "_math_prompt", lambda rng: f"What is {rng.randint(1, 3)} plus one?")
    assert len(corpus.training_prompts(3, seed=0)) == 3  # all three there are
    with pytest.raises(ValueError, match="only 3 distinct prompts could be made; asked for 4"):
        corpus.training_prompts(4, seed=0)


def test_check_disjoint_catches_a_question_inside_a_prompt_and_a_shared_run_of_13_words():
    question = json.loads(SPEC_BENCH.read_text().splitlines()[0])
    turn = question["turns"][0]
    with pytest.raises(ValueError, match="overlaps the evaluation question"):
        check_disjoint([{"id": "p1", "text": "Please answer: " + turn}], SPEC_BENCH)
    words = turn.split()
    assert len(words) >= 14
    paraphrase = "Here is something else entirely. " + " ".join(words[1:14]).upper() + " and then we stop."
    with pytest.raises(ValueError, match="shares 13 words"):
        check_disjoint([{"id": "p2", "text": paraphrase}], SPEC_BENCH)
    check_disjoint([{"id": "p3", "text": " ".join(words[1:13]) + " unrelated ending words here"}], SPEC_BENCH)
    # the needle set's filler is an evaluation text too
    from harness.running.datasets import FILLER

    assert any(f in evaluation_texts([]) for f in FILLER)


def test_self_distillation_greedy_answers_equal_the_targets_and_samples_are_seeded(tiny_chat_model_dir, tmp_path):
    from harness.running.prompts import ChatTemplate, Message
    from methods.models.loading import load_model, load_tokenizer
    from methods.models.specs import ModelSpec

    spec = ModelSpec(path=str(tiny_chat_model_dir))
    model, tokenizer = load_model(spec, torch.float32, torch.device("cpu")), load_tokenizer(spec)
    template = ChatTemplate("tokenizer", tokenizer)
    prompts = [dict(p, mode=mode) for p, mode in zip(training_prompts(6, seed=0), ["greedy", "sample"] * 3)]
    journal = tmp_path / "answers.partial.jsonl"
    self_distill(model, template, prompts[:3], max_new_tokens=12, batch_size=2, progress=False, journal=journal, seed=1)
    journal.write_text(journal.read_text() + '{"id": "half-writ')  # a run killed mid-line
    records = self_distill(model, template, prompts, max_new_tokens=12, batch_size=2, progress=False, journal=journal,
                           seed=1)
    assert [r["id"] for r in records] == [p["id"] for p in prompts]
    assert [r["mode"] for r in records] == [p["mode"] for p in prompts]
    # the broken line is gone and the rerun answered only the missing prompts
    assert sorted(json.loads(line)["id"]
                  for line in journal.read_text().splitlines()) == sorted(p["id"] for p in prompts)
    differ = 0
    for prompt, record in zip(prompts, records):
        ids = template.prompt_ids([Message("user", prompt["text"])])
        assert record["ids"][:record["answer_start"]] == ids
        expected = hf_greedy(model, ids, 12, eos=sorted(template.eos_token_ids))
        stop = next((i + 1 for i, t in enumerate(expected) if t in template.eos_token_ids), len(expected))
        if prompt["mode"] == "greedy":
            assert record["ids"][record["answer_start"]:] == expected[:stop]
        else:
            differ += record["ids"][record["answer_start"]:] != expected[:stop]
    assert differ >= 2  # a random tiny model's T = 1 samples are not its greedy answers
    fresh = self_distill(model, template, prompts, max_new_tokens=12, batch_size=2, progress=False, seed=1)
    assert self_distill(model, template, prompts, max_new_tokens=12, batch_size=2, progress=False, seed=1) == fresh
    other = self_distill(model, template, prompts, max_new_tokens=12, batch_size=2, progress=False, seed=2)
    assert [r["ids"] for r in other if r["mode"] == "greedy"] == [r["ids"] for r in fresh if r["mode"] == "greedy"]
    assert [r["ids"] for r in other if r["mode"] == "sample"] != [r["ids"] for r in fresh if r["mode"] == "sample"]


def test_self_distillation_cuts_answers_at_the_templates_stop_string(tiny_chat_model_dir):
    """fschat templates (Vicuna, LLaMA-2) end answers on a stop *string*: the answer keeps the token
    that completes it and nothing after, as the decoders do."""
    from harness.running.prompts import ChatTemplate, Message
    from methods.models.loading import load_model, load_tokenizer
    from methods.models.specs import ModelSpec

    spec = ModelSpec(path=str(tiny_chat_model_dir))
    model, tokenizer = load_model(spec, torch.float32, torch.device("cpu")), load_tokenizer(spec)
    template = ChatTemplate("tokenizer", tokenizer)
    prompt = [dict(training_prompts(1, seed=0)[0], mode="greedy")]
    full = hf_greedy(model, template.prompt_ids([Message("user", prompt[0]["text"])]), 16)
    # the first text the greedy answer produces at its 4th token or later, absent before it
    k = next(k for k in range(3, 16) if (piece := tokenizer.decode(full[k:k + 1]).strip())
             and piece not in tokenizer.decode(full[:k]))
    template.stop_strings = (tokenizer.decode(full[k:k + 1]).strip(),)
    record = self_distill(model, template, prompt, max_new_tokens=16, batch_size=1, progress=False)[0]
    assert record["ids"][record["answer_start"]:] == full[:k + 1]


def test_fp32_attention_of_a_bf16_answerer_is_the_models_own_attention(tiny_chat_model_dir):
    """bf16 answerers run attention through `_fp32_sdpa`; on a float32 model it must reproduce
    the model's own greedy answers, padded batches included."""
    from harness.running.prompts import ChatTemplate, Message
    from harness.training.distill import use_fp32_attention
    from methods.models.loading import load_model, load_tokenizer
    from methods.models.specs import ModelSpec

    spec = ModelSpec(path=str(tiny_chat_model_dir))
    model, tokenizer = load_model(spec, torch.float32, torch.device("cpu")), load_tokenizer(spec)
    template = ChatTemplate("tokenizer", tokenizer)
    prompts = [dict(p, mode="greedy") for p in training_prompts(4, seed=5)]
    expected = [hf_greedy(model, template.prompt_ids([Message("user", p["text"])]), 10) for p in prompts]
    use_fp32_attention(model)
    records = self_distill(model, template, prompts, max_new_tokens=10, batch_size=4, progress=False)
    assert len({r["answer_start"] for r in records}) > 1  # prompts of different lengths: a padded batch
    for record, answer in zip(records, expected):
        got = record["ids"][record["answer_start"]:]
        assert got == answer[:len(got)] and len(got) >= 1


def test_corpus_writes_the_answers_and_a_manifest_with_their_checksum(tiny_chat_model_dir, tmp_path, monkeypatch,
                                                                      capsys):
    import argparse
    import hashlib

    from harness.running.prompts import ChatTemplate
    from harness.training import distill
    from methods.models.loading import load_model, load_tokenizer
    from methods.models.specs import ModelSpec

    spec = ModelSpec(path=str(tiny_chat_model_dir))
    model, tokenizer = load_model(spec, torch.float32, torch.device("cpu")), load_tokenizer(spec)
    monkeypatch.setattr(distill, "_answer_target",
                        lambda name, dtype, device="cpu": (model, ChatTemplate("tokenizer", tokenizer)))
    args = argparse.Namespace(model="tiny", prompts=12, seed=0, max_new_tokens=6, distill_batch=4,
                              distill_dtype="float32",
                              measure=False, questions=SPEC_BENCH)
    data, manifest_file = tmp_path / "answers.jsonl", tmp_path / "corpus.json"
    distill.corpus(args, data, manifest_file)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    manifest = json.loads(manifest_file.read_text())
    assert manifest["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert manifest["prompts"] == len(rows) == 12 and not data.with_suffix(".partial.jsonl").exists()
    assert manifest["answer_tokens"] == sum(len(r["ids"]) - r["answer_start"] for r in rows)
    assert sum(manifest["modes"].values()) == 12 and sum(manifest["kinds"].values()) == 12
    assert str(SPEC_BENCH) in manifest["disjoint_from"] and manifest["dtype"] == "float32"
    assert "--prompts 12 --seed 0" in manifest["command"]
    assert "none sharing 13 words" in capsys.readouterr().out

    # the prompts answered are written beside the answers (their checksum in the manifest): another
    # machine (another Python, whose standard library would make other passages) answers exactly them
    prompts_file = tmp_path / "prompts.jsonl"
    assert [json.loads(line)["id"] for line in prompts_file.read_text().splitlines()] == [r["id"] for r in rows]
    assert manifest["prompts_sha256"] == hashlib.sha256(prompts_file.read_bytes()).hexdigest()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "given.jsonl").write_text("".join(line + "\n" for line in prompts_file.read_text().splitlines()[:5]))
    only = argparse.Namespace(**vars(args), prompts_file=elsewhere / "given.jsonl", prompts_only=True)
    distill.corpus(only, elsewhere / "answers.jsonl", elsewhere / "corpus.json")
    assert (elsewhere / "prompts.jsonl").read_text() == (elsewhere / "given.jsonl").read_text()
    assert not (elsewhere / "answers.jsonl").exists() and not (elsewhere / "corpus.json").exists()
    answered = argparse.Namespace(**vars(args), prompts_file=elsewhere / "prompts.jsonl", prompts_only=False)
    distill.corpus(answered, elsewhere / "answers.jsonl", elsewhere / "corpus.json")
    again = [json.loads(line) for line in (elsewhere / "answers.jsonl").read_text().splitlines()]
    assert [r["id"] for r in again] == [r["id"] for r in rows[:5]]
    assert [r["ids"] for r in again if r["mode"] == "greedy"] == [r["ids"] for r in rows[:5] if r["mode"] == "greedy"]
    assert "--prompts-file" in json.loads((elsewhere / "corpus.json").read_text())["command"]


def test_a_named_corpus_has_its_own_manifest_and_the_drafts_trained_on_it_name_it():
    import argparse

    from harness.training.loop import ROOT, corpus_manifest, default_corpus, recipe_command

    assert corpus_manifest("m", default_corpus("m")) == ROOT / "drafts" / "m" / "corpus.json"
    named = ROOT / "data" / "distill" / "m" / "first-100" / "answers.jsonl"
    assert corpus_manifest("m", named) == ROOT / "drafts" / "m" / "corpus-first-100.json"
    args = argparse.Namespace(kind="pard", model="m", seed=0, epochs=1.0, lr=1e-3, batch=4, para_num=4,
                              mask_token=7, data=named)
    assert "--data data/distill/m/first-100/answers.jsonl" in recipe_command(args)
    assert "--data" not in recipe_command(argparse.Namespace(**(vars(args) | {"data": None})))
    assert "--data" not in recipe_command(argparse.Namespace(**(vars(args) | {"data": default_corpus("m")})))
