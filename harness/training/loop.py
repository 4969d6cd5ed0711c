"""One training loop for every recipe (AdamW, warm-up + cosine, gradient clipping, a JSONL loss log),
held-out teacher-forced agreement, and the model card written beside the weights."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from .examples import Example

ROOT = Path(__file__).resolve().parents[2]


def evaluate(recipe, examples: list[Example]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for example in examples:
            _, stats = recipe.loss(example, 0.0, None)
            for key, value in stats.items():
                if key.startswith("acc_"):
                    sums.setdefault(key, [0.0, 0.0])
                    sums[key][0] += float(value.sum())
                    sums[key][1] += value.numel()
    return {k: s / max(n, 1) for k, (s, n) in sorted(sums.items())}


def train(recipe, train_set: list[Example], val_set: list[Example], epochs: float, lr: float, seed: int,
          log_file: Path, batch: int = 8, noise: float = 0.0, progress: bool = True) -> dict:
    from tqdm import tqdm

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    params = recipe.parameters()
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps = max(1, math.ceil(epochs * len(train_set) / batch))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    order_rng = random.Random(seed)
    order: list[int] = []
    losses = []
    started = time.perf_counter()
    with log_file.open("w") as log:
        for step in tqdm(range(steps), desc=f"train {recipe.kind}", unit="step", disable=not progress):
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for _ in range(batch):
                if not order:
                    order = list(range(len(train_set)))
                    order_rng.shuffle(order)
                loss, _ = recipe.loss(train_set[order.pop()], noise, generator)
                (loss / batch).backward()
                step_loss += float(loss.detach()) / batch
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(step_loss)
            log.write(json.dumps({"step": step + 1, "loss": round(step_loss, 5), "lr": schedule.get_last_lr()[0],
                                  "seconds": round(time.perf_counter() - started, 1)}) + "\n")
            log.flush()
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": steps, "batch": batch, "final_loss": sum(tail) / len(tail),
            "seconds": time.perf_counter() - started, "held_out_acceptance": evaluate(recipe, val_set)}


def model_card(out: Path, kind: str, args, data_file: Path, n_train: int, n_val: int, result: dict, before: dict) -> None:
    acc = ", ".join(f"{k.replace('acc_', 'position ')}: {v:.3f}" for k, v in result["held_out_acceptance"].items())
    acc_before = ", ".join(f"{k.replace('acc_', 'position ')}: {v:.3f}" for k, v in before.items())
    text = f"""# {kind} for {args.model}

Trained by `python -m harness.training {kind} --model {args.model} --seed {args.seed}` (`make train-drafts`).

- **Data**: self-distillation. {n_train} training and {n_val} held-out conversations from
  `{data_file.relative_to(ROOT) if data_file.is_relative_to(ROOT) else data_file}`: prompts generated
  by `harness/training/distill.py` from its own templates and from text shipped with Python (the language reference in
  `pydoc_data`, standard-library docstrings), checked disjoint from the Spec-Bench questions; answers
  are the target's own greedy outputs (up to {args.max_new_tokens} new tokens). Loss on answer tokens only.
- **Training**: {result['steps']} steps of {result['batch']} conversations, AdamW lr {args.lr}, cosine schedule,
  seed {args.seed}, {result['seconds'] / 60:.1f} min on {_machine()}. Log: `train_log.jsonl`.
- **Final loss** (mean of the last 10% of steps): {result['final_loss']:.4f}
- **Teacher-forced top-1 agreement with the target** on the held-out answers (the greedy acceptance
  rate of each draft position given a correct prefix): {acc}. Before training: {acc_before}.
- Weights that copy the target's (token embeddings, lm_head) are not in the file; the loader takes
  them from the target.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps({"kind": kind, "args": vars(args) | {"out": str(args.out)},
                                                    "train": n_train, "held_out": n_val, **result,
                                                    "held_out_acceptance_before": before}, indent=2, default=str))


def _machine() -> str:
    from methods.engine.hardware import cpu_isa, cpu_model

    return f"{cpu_model()} {cpu_isa()} ({torch.get_num_threads()} threads), torch {torch.__version__}"
