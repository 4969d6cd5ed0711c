"""What `make perf` and its peers time: the Spec-Bench prompts in a model's chat template, `transformers`'
greedy `generate` as a contender, and contenders timed interleaved on every prompt; and where each
benchmark writes its result (`write_result`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.running.datasets import load_questions
from harness.running.prompts import ChatTemplate, Message
from methods.models.specs import PROJECT_ROOT as REPO


def spec_bench_prompts(template: ChatTemplate, count: int) -> list[list[int]]:
    cfg = OmegaConf.load(REPO / "conf" / "dataset" / "spec_bench.yaml")
    questions = load_questions(cfg, count)
    return [template.prompt_ids([Message("user", q.turns[0])]) for q in questions]


def greedy_generate(model, device, max_new_tokens: int, eos: list[int]):
    """`transformers` `generate`, greedy, as a function prompt ids (+ generate's kwargs) -> new tokens."""
    def run(prompt, **kwargs):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos[0], **kwargs)
        return out[0, len(prompt):].tolist()
    return run


def timed_generations(contenders: dict, prompts: list[list[int]], repeats: int, device) -> tuple[dict, dict]:
    """Every contender (prompt -> new tokens) on every prompt, interleaved per prompt, `repeats`
    times: ({name: [tokens/s per generation]}, {name: {prompt index: tokens}})."""
    tokens_per_second = {name: [] for name in contenders}
    outputs: dict[str, dict[int, list[int]]] = {name: {} for name in contenders}
    rounds, began = max(1, repeats), time.perf_counter()
    for round_ in range(rounds):
        print(f"  round {round_ + 1}/{rounds}: {len(prompts)} prompts x {', '.join(contenders)} "
              f"({time.perf_counter() - began:.0f} s so far)", flush=True)
        for index, prompt in enumerate(prompts):
            for name, run in contenders.items():
                start = time.perf_counter()
                tokens = run(prompt)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                tokens_per_second[name].append(len(tokens) / (time.perf_counter() - start))
                outputs[name][index] = tokens
    return tokens_per_second, outputs


def write_result(folder: Path, name: str, result: dict) -> Path:
    """A benchmark's result as `folder/<name>.json` (the folder made if missing), announced."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path
