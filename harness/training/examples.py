"""Training examples: the target's self-distilled answers (`data/distill/<model>/answers.jsonl`),
its hidden states for the head recipes (computed once, cached on disk), held-out splits."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Example:
    ids: torch.Tensor  # [T] prompt + answer
    answer_start: int
    hidden: torch.Tensor | None = None  # [T, H] target's last hidden state (after the final norm)


def load_examples(file: Path) -> list[Example]:
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [Example(torch.tensor(r["ids"]), r["answer_start"]) for r in rows if len(r["ids"]) > r["answer_start"] + 2]


@torch.no_grad()
def attach_hidden(target, examples: list[Example], cache: Path | None = None, progress: bool = False) -> None:
    """The target's last hidden states of every example (EAGLE and Medusa train on them). With a
    `cache` file they are computed once and reused by the next recipe when the examples match."""
    from tqdm import tqdm

    if cache is not None and cache.is_file():
        stored = torch.load(cache)
        if len(stored["ids"]) == len(examples) and all(torch.equal(a, e.ids) for a, e in zip(stored["ids"], examples)):
            for example, hidden in zip(examples, stored["hidden"]):
                example.hidden = hidden
            return
    for example in tqdm(examples, desc="target hidden states", unit="example", disable=not progress):
        if example.hidden is None:
            example.hidden = target.model(input_ids=example.ids[None]).last_hidden_state[0].float()
    if cache is not None:
        torch.save({"ids": [e.ids for e in examples], "hidden": [e.hidden for e in examples]}, cache)


def split(examples: list[Example], held_out: float, seed: int) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(examples) * held_out)) if len(examples) > 1 else 0
    return [examples[i] for i in order[n_val:]], [examples[i] for i in order[:n_val]]


def feature_spread(examples: list[Example]) -> torch.Tensor:
    """[H] standard deviation of each dimension of the target's hidden states over the examples."""
    return torch.cat([e.hidden for e in examples]).std(0)


def answer_mask(example: Example, offset: int) -> torch.Tensor:
    """[T - offset] bool: position t predicts token t + offset, which belongs to the answer."""
    t = torch.arange(len(example.ids) - offset)
    return t + offset >= example.answer_start
