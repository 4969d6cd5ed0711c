"""Training prompts for the suite's own drafts, and the target's answers to them (self-distillation).

The prompts share nothing with any evaluation set: they are generated, seeded, from templates
written here and from text that ships with Python itself (the language reference in
`pydoc_data.topics` and the first lines of standard-library docstrings). They cover the kinds of
requests Spec-Bench asks (open writing, explanation, reasoning, arithmetic word problems, code,
extraction, summarization, question answering over a passage) so a draft sees the target's style on
each, but never a benchmark question. `check_disjoint` proves the last point against a question
file.

The target answers every prompt greedily through its chat template; the token ids of prompt and
answer are the training data (`answer_start` marks where the target's own tokens begin).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from pathlib import Path
from typing import Iterable

import torch

SUBJECTS = [
    "volcanoes", "the water cycle", "honeybees", "the printing press", "black holes", "coral reefs",
    "the Roman aqueducts", "electric cars", "sleep", "jazz music", "the immune system", "glaciers",
    "chess openings", "the Silk Road", "solar panels", "bread baking", "migrating birds", "the moon landing",
    "recycling plastic", "public libraries", "tea ceremonies", "earthquakes", "the human heart", "origami",
    "lighthouses", "desert plants", "the stock market", "vaccines", "rainforests", "ancient Egypt",
    "wind turbines", "meditation", "the periodic table", "submarines", "city parks", "photosynthesis",
    "the Olympic Games", "bicycles", "mushrooms", "the Great Wall", "3D printing", "octopuses",
    "renewable energy", "mountain climbing", "the invention of the telephone", "bats", "classical music",
    "rain gardens", "the Renaissance", "semiconductors", "penguins", "time zones", "the Amazon river",
    "remote work", "compost", "comets", "the violin", "sourdough", "tides", "bridges", "video games",
    "maps", "the metric system", "wolves", "museums", "inflation", "snowflakes", "first aid", "kites",
    "the internet", "dinosaurs", "hot air balloons", "spices", "robots", "trains", "whales", "clocks",
]

OPEN_TEMPLATES = [
    "Write a short blog post about {s}.",
    "Explain {s} to a ten-year-old.",
    "Give three interesting facts about {s}.",
    "Write a poem about {s}.",
    "What are the advantages and disadvantages of {s}?",
    "Describe the history of {s} in a few paragraphs.",
    "Pretend you are a tour guide and introduce {s} to visitors.",
    "Write a persuasive paragraph arguing that everyone should learn about {s}.",
    "Compare {s} and {t}. How are they similar and how are they different?",
    "Write a dialogue between two friends discussing {s}.",
    "What would the world look like without {s}? Answer in a few sentences.",
    "Create a lesson plan for a class about {s}.",
    "List five questions a curious student might ask about {s}, and answer them briefly.",
    "Write a product description for a board game themed around {s}.",
    "Summarize the main ideas a beginner should know about {s}.",
    "Write a short story in which {s} plays an important role.",
    "Why do people find {s} fascinating? Give your reasons step by step.",
    "Draft an email to a colleague proposing a team outing related to {s}.",
]

NAMES = ["Maya", "Tom", "Aiko", "Luis", "Priya", "Ben", "Sofia", "Omar", "Lena", "Kwame"]
ITEMS = ["apples", "notebooks", "marbles", "stickers", "cookies", "pencils", "tickets", "stamps"]


def _math_prompt(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(1, 9)
    kind = rng.randrange(4)
    if kind == 0:
        return (f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack. "
                f"How many {item} does {name} have now? Explain your reasoning.")
    if kind == 1:
        return (f"A store sells {item} for ${c} each. {name} spends ${a * c} on {item} and gives {b} of them "
                f"away. How many {item} are left? Show your work.")
    if kind == 2:
        return f"What is {a} multiplied by {b}, plus {c * 7}? Think step by step."
    return (f"{name} reads {b} pages every day. The book has {a * b + c} pages. "
            f"How many days does {name} need to finish the book?")


def _stdlib_functions() -> list[tuple[str, str]]:
    """(qualified name, first docstring line) of public standard-library functions."""
    found = []
    for module_name in ("string", "textwrap", "statistics", "itertools", "functools", "os.path", "shutil",
                        "json", "math", "random", "bisect", "heapq", "difflib", "fnmatch", "calendar",
                        "base64", "colorsys", "operator", "zlib", "glob", "html", "urllib.parse"):
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            line = doc.strip().splitlines()[0] if doc.strip() else ""
            if 20 <= len(line) <= 160 and not line.startswith(name + "("):
                found.append((f"{module_name}.{name}", line))
    return found


def _passages(min_chars: int = 300, max_chars: int = 1200) -> list[str]:
    """Paragraph groups from the Python language reference that ships with CPython."""
    from pydoc_data.topics import topics

    passages = []
    for text in topics.values():
        chunk = ""
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = " ".join(paragraph.split())
            if len(chunk) + len(paragraph) > max_chars and len(chunk) >= min_chars:
                passages.append(chunk.strip())
                chunk = ""
            chunk += paragraph + "\n"
        if len(chunk) >= min_chars:
            passages.append(chunk.strip()[:max_chars])
    return passages


def training_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` prompts (id, kind, text), seeded, across the kinds listed in the module docstring."""
    rng = random.Random(seed)
    functions, passages = _stdlib_functions(), _passages()
    prompts, seen = [], set()
    kinds = ["open", "open", "open", "math", "code", "summary", "qa", "extract"]
    while len(prompts) < n:
        kind = rng.choice(kinds)
        if kind == "open":
            s, t = rng.sample(SUBJECTS, 2)
            text = rng.choice(OPEN_TEMPLATES).format(s=s, t=t)
        elif kind == "math":
            text = _math_prompt(rng)
        elif kind == "code":
            qualified, line = rng.choice(functions)
            text = (f"Write a Python function that does the following without using `{qualified}`: {line} "
                    f"Include a short docstring.")
        else:
            passage = rng.choice(passages)
            if kind == "summary":
                text = f"Summarize the following text in a few sentences.\n\n{passage}"
            elif kind == "qa":
                text = f"Read the text below and explain its most important rule with an example.\n\n{passage}"
            else:
                text = f"List the technical terms used in the following text, with a one-line definition of each.\n\n{passage}"
        if text not in seen:
            seen.add(text)
            prompts.append({"id": f"p{len(prompts):05d}", "kind": kind, "text": text})
    return prompts


def check_disjoint(prompts: Iterable[dict], question_file: Path) -> None:
    """Raise if any evaluation turn occurs inside a training prompt or vice versa."""
    turns = []
    for line in question_file.read_text().splitlines():
        if line.strip():
            turns += [" ".join(t.split()) for t in json.loads(line).get("turns", []) if len(t.strip()) >= 30]
    for prompt in prompts:
        text = " ".join(prompt["text"].split())
        for turn in turns:
            if turn in text or text in turn:
                raise ValueError(f"training prompt {prompt['id']} overlaps the evaluation question {turn[:80]!r}")


@torch.inference_mode()
def self_distill(model, template, prompts: list[dict], max_new_tokens: int, batch_size: int = 16,
                 progress: bool = True, journal: Path | None = None) -> list[dict]:
    """The target's greedy answers: one record per prompt with `ids` (prompt + answer token ids,
    the answer cut where the template's stop condition ends it: an EOS id or a stop string) and
    `answer_start`. With a `journal`, records are
    appended to it as each batch finishes and a rerun answers only the prompts it lacks."""
    from tqdm import tqdm

    from harness.prompts import Message
    from harness.results import read_jsonl, rewrite_jsonl

    pad = template.tokenizer.pad_token_id
    if pad is None:
        pad = template.tokenizer.eos_token_id
    stop = template.stop_condition(max_new_tokens)
    device = next(model.parameters()).device
    encoded = [template.prompt_ids([Message("user", p["text"])]) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # batches of similar lengths: little padding
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
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc="self-distillation", unit="batch", disable=not progress):
        width = max(len(encoded[i]) for i in batch)
        input_ids = torch.tensor([[pad] * (width - len(encoded[i])) + encoded[i] for i in batch], device=device)
        attention = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in batch], device=device)
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=sorted(stop.eos_token_ids))
        for i, row in zip(batch, out[:, width:].tolist()):
            end = stop.cut(row, 0)
            answer = row[:end[0] if end else len(row)]
            records[i] = {"id": prompts[i]["id"], "kind": prompts[i]["kind"], "ids": encoded[i] + answer,
                          "answer_start": len(encoded[i])}
        if journal:
            with journal.open("a") as f:
                f.write("".join(json.dumps(records[i]) + "\n" for i in batch))
    return records
