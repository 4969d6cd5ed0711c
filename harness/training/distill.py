"""Training prompts for the suite's own drafts, and the target's answers to them (self-distillation).

The prompts (`methods/models/corpus.py`, `training_prompts`) share nothing with any evaluation set: they are
generated, seeded, from templates written for this suite (`methods/models/corpus_prompts.yaml`) and from text
that ships with Python itself (the language reference in `pydoc_data.topics` and the first lines of
standard-library docstrings). They cover the kinds of
requests Spec-Bench asks (open writing, explanation, reasoning, arithmetic word problems, code,
extraction, summarization, question answering over a passage) so a draft sees the target's style on
each, but never a benchmark question. `check_disjoint` proves the last point against a question
file.

The target answers every prompt greedily through its chat template; the token ids of prompt and
answer are the training data (`answer_start` marks where the target's own tokens begin).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
import zlib
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from harness.running.datasets import FILLER
from harness.running.prompts import ChatTemplate, Message
from harness.running.results import read_jsonl, rewrite_jsonl
from harness.training.loop import ROOT, corpus_manifest, default_corpus, load_target, machine_label
from methods.engine.hardware import native_bf16
from methods.models.corpus import KINDS, training_prompts

NGRAM = 13  # words: the contamination check of GPT-3 and its successors


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def evaluation_texts(question_files: Iterable[Path]) -> list[str]:
    """Every turn (and reference) of the question files that exist, plus the needle set's filler: the
    texts a training prompt must not share."""
    texts = list(FILLER)
    for file in question_files:
        if not file.is_file():
            continue
        for line in file.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                texts += [t for t in row.get("turns", []) if isinstance(t, str)]
                texts += [r for r in (row.get("reference") or []) if isinstance(r, str)] if isinstance(
                    row.get("reference"), list) else []
    return [t for t in texts if len(t.strip()) >= 30]


def check_disjoint(prompts: Iterable[dict], question_file: Path | Iterable[str]) -> None:
    """Raise if a training prompt shares text with an evaluation question: one contains the other,
    or they share a run of 13 words. `question_file`: a question file or the texts themselves."""
    texts = evaluation_texts([question_file]) if isinstance(question_file, Path) else list(question_file)
    turns = [" ".join(t.split()) for t in texts]
    grams: dict[tuple[str, ...], str] = {}
    for turn in turns:
        words = _words(turn)
        for i in range(len(words) - NGRAM + 1):
            grams.setdefault(tuple(words[i:i + NGRAM]), turn)
    for prompt in prompts:
        text = " ".join(prompt["text"].split())
        for turn in turns:
            if turn in text or text in turn:
                raise ValueError(f"training prompt {prompt['id']} overlaps the evaluation question {turn[:80]!r}")
        words = _words(text)
        for i in range(len(words) - NGRAM + 1):
            if (turn := grams.get(tuple(words[i:i + NGRAM]))) is not None:
                raise ValueError(f"training prompt {prompt['id']} shares {NGRAM} words "
                                 f"({' '.join(words[i:i + NGRAM])!r}) with the evaluation question {turn[:80]!r}")


@torch.inference_mode()
def self_distill(model, template, prompts: list[dict], max_new_tokens: int, batch_size: int = 16,
                 progress: bool = True, journal: Path | None = None, seed: int = 0) -> list[dict]:
    """The target's answers: one record per prompt with `ids` (prompt + answer token ids, the answer
    cut where the template's stop condition ends it: an EOS id or a stop string), `answer_start` and
    `mode`: greedy, or sampled at T = 1 (no top-k/top-p) for prompts whose `mode` is "sample", each
    batch seeded from `seed` and its first prompt. With a `journal`, records are appended to it as
    each batch finishes and a rerun answers only the prompts it lacks."""
    pad = template.tokenizer.pad_token_id
    if pad is None:
        pad = template.tokenizer.eos_token_id
    stop = template.stop_condition(max_new_tokens)
    device = next(model.parameters()).device
    encoded = [template.prompt_ids([Message("user", p["text"])]) for p in prompts]
    modes = [p.get("mode", "greedy") for p in prompts]
    # batches of one mode and similar lengths: little padding
    order = sorted(range(len(prompts)), key=lambda i: (modes[i], len(encoded[i])))
    records: list[dict | None] = [None] * len(prompts)
    done = {}
    if journal and journal.is_file():
        rows = read_jsonl(journal)  # a half-written last line (a killed run) is dropped
        rewrite_jsonl(journal, rows)
        done = {row["id"]: row for row in rows}
    for i, prompt in enumerate(prompts):
        if prompt["id"] in done and done[prompt["id"]]["ids"][:len(encoded[i])] == encoded[i]:
            records[i] = done[prompt["id"]]
    order = [i for i in order if records[i] is None]
    batches = []
    for mode in sorted(set(modes[i] for i in order)):
        same = [i for i in order if modes[i] == mode]
        batches += [same[i:i + batch_size] for i in range(0, len(same), batch_size)]
    for batch in tqdm(batches, desc="self-distillation", unit="batch", disable=not progress):
        width = max(len(encoded[i]) for i in batch)
        input_ids = torch.tensor([[pad] * (width - len(encoded[i])) + encoded[i] for i in batch], device=device)
        attention = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in batch],
                                 device=device)
        sample = modes[batch[0]] == "sample"
        if sample:
            torch.manual_seed(zlib.crc32(f"{seed}:{prompts[batch[0]]['id']}".encode()))
        options = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=sorted(stop.eos_token_ids), **options)
        for i, row in zip(batch, out[:, width:].tolist()):
            end = stop.cut(row, 0)
            answer = row[:end[0] if end else len(row)]
            records[i] = {"id": prompts[i]["id"], "kind": prompts[i]["kind"], "mode": modes[i],
                          "ids": encoded[i] + answer, "answer_start": len(encoded[i])}
        if journal:
            with journal.open("a") as f:
                f.write("".join(json.dumps(records[i]) + "\n" for i in batch))
    return records


def question_files(extra: Path | None = None) -> list[Path]:
    """Every evaluation question file the suite ships or has prepared on this machine."""
    files = [*sorted((ROOT / "data").glob("*/questions.jsonl")), *sorted((ROOT / "data").glob("*/question.jsonl"))]
    if extra is not None:
        files.insert(0, extra)
    return [f for f in dict.fromkeys(files) if f.is_file()]


def distill_dtype(choice: str, device: torch.device | str = "cpu") -> torch.dtype:
    if choice == "auto":  # a GPU answers in the drafts' own dtype: fp32 is cheap there
        return torch.bfloat16 if torch.device(device).type == "cpu" and native_bf16() else torch.float32
    return getattr(torch, choice)


def _answer_target(model_name: str, dtype: torch.dtype, device: torch.device | str = "cpu"):
    cfg, target, tokenizer = load_target(model_name, dtype, device)
    if dtype == torch.bfloat16 and target.device.type == "cpu":
        # torch's bf16 attention kernels on CPU are several times slower than its fp32 ones (and than
        # the bf16 GEMMs): attention runs in fp32, the linears in bf16
        use_fp32_attention(target)
    return target, ChatTemplate.for_model(cfg, tokenizer)


def use_fp32_attention(model) -> None:
    """Run `model`'s attention through `_fp32_sdpa`, with SDPA's masks."""
    AttentionInterface.register("fp32_sdpa", _fp32_sdpa)
    AttentionMaskInterface.register("fp32_sdpa", sdpa_mask)
    model.set_attn_implementation("fp32_sdpa")


def _fp32_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function: SDPA in float32 whatever the model's dtype."""
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=attention_mask, scale=scaling, is_causal=causal,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def measure_batches(model_name: str, prompts: list[dict], max_new_tokens: int, sizes=(16, 32, 64, 128),
                    dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """Answer tokens per second of batched self-distillation for each dtype and batch size (the same
    prompts each time: 2 batches of the largest size, drawn across the prompt lengths)."""
    rng = random.Random(0)
    sample = rng.sample(prompts, 2 * max(sizes))
    rows = []
    for dtype in dtypes:
        if dtype == torch.bfloat16 and not native_bf16():
            print("bfloat16 skipped: this CPU has no native bf16 (it would be emulated)")
            continue
        target, template = _answer_target(model_name, dtype)
        for size in sizes:
            started = time.perf_counter()
            records = self_distill(target, template, sample[: 2 * size], max_new_tokens, size, progress=False)
            seconds = time.perf_counter() - started
            tokens = sum(len(r["ids"]) - r["answer_start"] for r in records)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": size, "answer_tokens": tokens,
                         "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def corpus(args, data_file: Path, manifest_file: Path | None = None) -> None:
    """`python -m harness.training data`: the prompts (checked disjoint from every evaluation set on
    this machine), the target's answers (journalled: an interrupted run resumes) and a manifest with
    the recipe and the corpus's checksum (`loop.corpus_manifest`: `drafts/<model>/corpus.json`, or
    `corpus-<name>.json` for `--data data/distill/<model>/<name>/answers.jsonl`; committed, the corpus is not)."""
    prompts_file = getattr(args, "prompts_file", None)
    prompts = read_jsonl(prompts_file) if prompts_file else training_prompts(args.prompts, args.seed)
    files = question_files(args.questions)
    check_disjoint(prompts, evaluation_texts(files))
    print(f"{len(prompts)} prompts, none sharing {NGRAM} words with " + ", ".join(str(f) for f in files)
          + " or the needle set's filler")
    if args.measure:
        measure_batches(args.model, prompts, args.max_new_tokens)
        return
    data_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_copy = data_file.with_name("prompts.jsonl")  # the prompts answered: another machine can answer the same
    if prompts_file is None or Path(prompts_file).resolve() != prompt_copy.resolve():
        prompt_copy.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    if getattr(args, "prompts_only", False):
        print(f"wrote {prompt_copy}: {len(prompts)} prompts (answer them with `data --prompts-file {prompt_copy}`)")
        return
    device = getattr(args, "device", "cpu")
    dtype = distill_dtype(args.distill_dtype, device)
    target, template = _answer_target(args.model, dtype, device)
    journal = data_file.with_suffix(".partial.jsonl")  # survives an interrupted run; a rerun resumes
    started = time.perf_counter()
    records = self_distill(target, template, prompts, args.max_new_tokens, args.distill_batch, journal=journal,
                           seed=args.seed)
    data_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    journal.unlink()
    tokens = sum(len(r["ids"]) - r["answer_start"] for r in records)
    shown = str(data_file.relative_to(ROOT) if data_file.is_relative_to(ROOT) else data_file)
    manifest = {
        "file": shown,
        "sha256": hashlib.sha256(data_file.read_bytes()).hexdigest(),
        "command": f"python -m harness.training data --model {args.model} --prompts {args.prompts} --seed {args.seed} "
                   f"--max-new-tokens {args.max_new_tokens} --distill-batch {args.distill_batch} "
                   f"--distill-dtype {args.distill_dtype}"
                   + (f" --prompts-file {prompts_file}" if prompts_file else "")
                   + ("" if data_file.resolve() == default_corpus(args.model).resolve() else f" --data {shown}"),
        "prompts_sha256": hashlib.sha256(prompt_copy.read_bytes()).hexdigest(),
        "prompts": len(records), "answer_tokens": tokens,
        "prompt_tokens": sum(r["answer_start"] for r in records),
        "kinds": {k: sum(r["kind"] == k for r in records) for k in KINDS},
        "modes": {m: sum(r["mode"] == m for r in records) for m in ("greedy", "sample")},
        "answer_tokens_by_mode": {m: sum(len(r["ids"]) - r["answer_start"] for r in records if r["mode"] == m)
                                  for m in ("greedy", "sample")},
        "dtype": str(dtype).removeprefix("torch."), "machine": machine_label(device),
        "hours_this_run": round((time.perf_counter() - started) / 3600, 2),
        "disjoint_from": [str(f) for f in files] + ["needle filler (harness/running/datasets.py)"],
        "sources": {"templates": "methods/models/corpus_prompts.yaml (this suite, Apache-2.0)",
                    "passages": "the Python language reference shipped as pydoc_data.topics (PSF License)",
                    "code": "first lines of standard-library docstrings (PSF License)"},
    }
    manifest_file = manifest_file or corpus_manifest(args.model, data_file)
    manifest_file.parent.mkdir(parents=True, exist_ok=True)
    manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {data_file}: {len(records)} answers, {tokens} answer tokens; manifest {manifest_file}")
