"""SPEED-Bench (NVIDIA, arXiv 2604.09557; Hub dataset `nvidia/SPEED-Bench`) in the suite's schema.

    python -m data_scripts.prepare speed_bench                   # qualitative: 880 prompts, 11 categories x 80
    python -m data_scripts.prepare speed_bench_throughput_1k     # 1,536 prompts of ~1k tokens (_2k, _8k, _16k, _32k)
    python -m data_scripts.prepare speed_bench_throughput_1k \\
        --local-files <specdec_bench>/data/speed/throughput_1k/test.parquet

Configs (split `test`): `qualitative`, categories coding, humanities, math, multilingual, qa, rag,
reasoning, roleplay, stem, summarization, writing (80 each); `throughput_{1,2,8,16,32}k`, prompts
of that many (o200k) tokens whose `category` is the entropy tier, low_entropy, mixed or
high_entropy (512 each). Every field of a row is kept in the prepared record (question_id,
category, sub_category, turns, source, src_id, difficulty, multiturn), with the config, and for
the throughput splits the tier again as `entropy_tier`. Multi-turn rows keep all their turns: the
harness answers each after the model's own previous answers, as MT-bench's.

Licence: the NVIDIA Evaluation Dataset License Agreement (the dataset's `License.pdf`); each source
dataset keeps its own licence as well (specdec_bench's README lists MIT, Apache 2.0 and CC BY 4.0
ones), and whoever prepares a split checks that these fit their use. The suite ships no SPEED-Bench data:
`data/speed_bench/` is written on the user's machine and is not committed.

Prompts stored by reference. For licence reasons the rows of some sources hold, instead of the
prompt, a turn beginning with `PLACEHOLDER` and point at the source row with `source` (the source
dataset) and `src_id`. The placeholder says the text is to be fetched with specdec_bench, the
measurement framework the card links (NVIDIA/Model-Optimizer, `examples/specdec_bench`: `python
prepare_data.py --dataset speed --config <config>`), which writes the split as parquet with the
turns filled in; pass that file with `--local-files` and it is converted as it stands (a file with
`messages` instead of `turns`, as NeMo-Skills writes, too). From the Hub, this module rebuilds the rows
whose prompt is a source row's own text, or the row's own template (the placeholder turn is
`PLACEHOLDER\\n\\n<template>`) filled with a source row's fields: `REBUILT` (CNN/DailyMail,
LiveCodeBench, CodeContests, OPUS-100, MT-Bench-101, and HLE in the qualitative split). It stops
before reading any source, naming the rows and sources, when a row needs anything else (`NOT_REBUILT`:
BAMBOO, Ada-LEval, RoleBench, CoSER, MMLU-Pro, ChatRAG-Bench, HLE in the throughput splits): their
prompt wording, random choices and o200k token budgets are in specdec_bench's code, and a copy here
could not be checked against it.

Taken from specdec_bench's `specdec_bench/datasets/speed.py`, not from the card, and not checked
against real rows (this suite's machines have no Hub access): the placeholder's wording, which
source each rebuilt row names, how its src_id reads (an id of the source row, or `..._<index>`,
or for OPUS-100 `<x>_<language pair>_<index>`), the source revisions pinned below, and the throughput
category being the entropy tier (AIPerf's SPEED-Bench loader says so too). SPEED-Bench v1.1 changed
the throughput splits' src_id "to allow faster reconstruction": a row whose src_id does not read as
above, or names a row its source lacks, stops preparation with a message naming it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from data_scripts.errors import HubUnavailable

REPO_ID = "nvidia/SPEED-Bench"
CONFIGS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k", "throughput_32k")
CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning", "roleplay", "stem",
              "summarization", "writing")
ENTROPY_TIERS = ("low_entropy", "mixed", "high_entropy")
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
SPECDEC_BENCH = ("NVIDIA's specdec_bench (github.com/NVIDIA/Model-Optimizer, examples/specdec_bench: "
                 "`python prepare_data.py --dataset speed --config {config}`)")


def dataset_name(config: str) -> str:
    """The suite's name of a config: `speed_bench` (qualitative), `speed_bench_throughput_1k`, ..."""
    return "speed_bench" if config == "qualitative" else f"speed_bench_{config}"


def prepared_path(config: str) -> str:
    return f"data/speed_bench/{config}.jsonl"


class Unresolved(SystemExit):
    """Rows whose prompt this module cannot rebuild (or a source that lacks the row named)."""


@dataclass(frozen=True)
class Table:
    """An external dataset rows point into: a Hub dataset (config, split, revision) or json files."""

    repo: str
    config: str | None = None
    split: str = "test"
    revision: str | None = None
    data_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reference:
    table: Table
    key: str | None  # the source row's field that src_id gives; None: src_id gives the row's index
    value: Any


@dataclass(frozen=True)
class Rebuild:
    """A source whose rows this module rebuilds: where the row points, and its turns from the source row."""

    source: str  # found in a row's `source`
    refer: Callable[[dict, str], Reference]  # (row, config) -> the source row
    turns: Callable[[dict, dict], list[str]]  # (row, source row) -> turns


def template(row: dict) -> str:
    """The prompt template the placeholder turn carries after the placeholder."""
    head = PLACEHOLDER + "\n\n"
    if not row["turns"][0].startswith(head):
        raise Unresolved(f"SPEED-Bench row {row['question_id']} ({row['source']}): its placeholder turn carries no "
                         "prompt template to fill")
    return row["turns"][0][len(head):]


def _index(src_id: str) -> int:
    return int(src_id.rsplit("_", 1)[1])


LIVECODEBENCH_REVISION = "0fe84c3912ea0c4d4a78037083943e8f0c4dd505"
LIVECODEBENCH = Table("livecodebench/code_generation_lite", data_files=tuple(
    f"https://huggingface.co/datasets/livecodebench/code_generation_lite/resolve/{LIVECODEBENCH_REVISION}/{name}.jsonl"
    for name in ("test", "test2", "test3", "test4", "test5", "test6")))

REBUILT = (
    Rebuild("abisee/cnn_dailymail",
            lambda row, config: Reference(Table("abisee/cnn_dailymail", "3.0.0"), "id", row["src_id"]),
            lambda row, src: [template(row).format(article=src["article"])]),
    Rebuild("livecodebench/code_generation_lite",
            lambda row, config: Reference(LIVECODEBENCH, "question_id", row["src_id"]),
            lambda row, src: [template(row).format(question=src["question_content"],
                                                   starter_code=src["starter_code"])]),
    Rebuild("deepmind/code_contests",
            lambda row, config: Reference(Table("deepmind/code_contests",
                                                revision="802411c3010cb00d1b05bad57ca77365a3c699d6"),
                                          "name", row["src_id"]),
            lambda row, src: [template(row).format(question=src["description"])]),
    Rebuild("Helsinki-NLP/opus-100",  # src_id: <x>_<language pair>_<index>
            lambda row, config: Reference(Table("Helsinki-NLP/opus-100", row["src_id"].split("_")[1],
                                                revision="805090dc28bf78897da9641cdf08b61287580df9"),
                                          None, int(row["src_id"].split("_")[2])),
            lambda row, src: [template(row).format(question=src["translation"])]),
    Rebuild("mtbench101/mt-bench-101",  # `source` is the file's address; the user turns of its history
            lambda row, config: Reference(Table("mtbench101/mt-bench-101", data_files=(row["source"],)), None,
                                          _index(row["src_id"])),
            lambda row, src: [turn["user"] for turn in src["history"]]),
    Rebuild("cais/hle",  # the qualitative split asks the question itself (the throughput one wraps it: NOT_REBUILT)
            lambda row, config: Reference(Table("cais/hle", revision="021a3d71f516a7ac28ceb8d284969902edf1edeb"), "id",
                                          row["src_id"]),
            lambda row, src: [src["question"]]),
)
NOT_REBUILT = ("RUCAIBox/BAMBOO", "AdaLEval/stackselect", "AdaLEval/textsort", "ZenMoore/RoleBench", "Neph0s/CoSER",
               "TIGER-Lab/MMLU-Pro", "nvidia/ChatRAG-Bench")


def is_placeholder(row: dict) -> bool:
    return any(turn.startswith(PLACEHOLDER) for turn in row_turns(row))


def row_turns(row: dict) -> list[str]:
    """A row's user turns: `turns`, or the user messages of a file that stores `messages` (NeMo-Skills')."""
    if row.get("turns") is not None:
        return list(row["turns"])
    return [m["content"] for m in row.get("messages") or [] if m.get("role") == "user"]


def rebuild_for(row: dict, config: str) -> Rebuild | None:
    if "cais/hle" in row["source"] and config != "qualitative":
        return None
    return next((r for r in REBUILT if r.source in row["source"]), None)


def open_table(table: Table) -> Iterable[dict]:
    """A table's rows, streamed from the Hub (or its files)."""
    from datasets import load_dataset  # lazy: datasets, slow to import: only to read a source table

    if table.data_files:
        return load_dataset("json", data_files=list(table.data_files), split="train", streaming=True)
    return load_dataset(table.repo, table.config, split=table.split, revision=table.revision, streaming=True)


def _remedy(config: str) -> str:
    name = dataset_name(config)
    return (f"Prepare the split with {SPECDEC_BENCH.format(config=config)} and pass the file it writes: "
            f"`python -m data_scripts.prepare {name} --local-files <its test.parquet>`")


def fetch(references: list[Reference], config: str, opener: Callable[[Table], Iterable[dict]] | None) -> dict:
    """The source rows references name, each table streamed once: {(table, key, value): row}."""
    name = dataset_name(config)
    if opener is None:
        from methods.models.specs import hub_reachable  # lazy: methods imports torch: only to reach the Hub

        if not hub_reachable():
            tables = ", ".join(sorted({r.table.repo for r in references}))
            raise HubUnavailable(
                f"{name}: {len(references)} row(s) hold a placeholder for a prompt stored in {tables} (by src_id); "
                f"rebuilding them reads those datasets from the Hugging Face Hub, which is not reachable from this "
                f"machine. Run `python -m data_scripts.prepare {name}` where it is, or: {_remedy(config)}.")
        opener = open_table
    by_table: dict[Table, set] = defaultdict(set)
    for ref in references:
        by_table[ref.table].add((ref.key, ref.value))
    found = {}
    for table, wanted in by_table.items():
        keys, remaining = {key for key, _ in wanted}, set(wanted)
        try:
            for index, row in enumerate(opener(table)):
                for key in keys:
                    pair = (key, index if key is None else row.get(key))
                    if pair in remaining:
                        found[(table, *pair)] = dict(row)
                        remaining.discard(pair)
                if not remaining:
                    break
        except Exception as err:  # the Hub client raises many types (a gated dataset, a missing revision)
            raise HubUnavailable(f"{name}: could not read {table.repo} ({table.config or 'default'}) to rebuild "
                                 f"prompts stored by src_id: {type(err).__name__}: "
                                 f"{str(err).splitlines()[0] if str(err) else ''}. "
                                 f"{_remedy(config)}.") from None
    return found


def _refer(rebuild: Rebuild, row: dict, config: str) -> Reference:
    try:
        return rebuild.refer(row, config)
    except (IndexError, ValueError):
        raise Unresolved(f"{dataset_name(config)}: question_id {row['question_id']}: src_id {row['src_id']!r} does not "
                         f"read as a reference into {rebuild.source}. {_remedy(config)}.") from None


def resolve_rows(rows: list[tuple[int, dict]], config: str,
                 opener: Callable[[Table], Iterable[dict]] | None = None) -> list[tuple[int, dict]]:
    """The rows with every placeholder turn rebuilt from its source (`opener` reads a table; the Hub
    by default). Stops, naming rows and sources, before reading anything when a row cannot be rebuilt."""
    pending = [(index, row, rebuild_for(row, config)) for index, row in rows if is_placeholder(row)]
    missing = Counter(row["source"] for _, row, rebuild in pending if rebuild is None)
    if missing:
        sources = "; ".join(f"{n} from {source}" for source, n in sorted(missing.items()))
        first = next(row["question_id"] for _, row, rebuild in pending if rebuild is None)
        raise Unresolved(
            f"{dataset_name(config)}: {sum(missing.values())} row(s) store their prompt by src_id in sources this "
            f"suite does not rebuild ({sources}; first: question_id {first}): their prompts are built by "
            f"NVIDIA's own code. {_remedy(config)}.")
    if not pending:
        return rows
    references = {row["question_id"]: _refer(rebuild, row, config) for _, row, rebuild in pending}
    found = fetch(list(references.values()), config, opener)
    rebuilt = {}
    for _, row, rebuild in pending:
        ref = references[row["question_id"]]
        source_row = found.get((ref.table, ref.key, ref.value))
        if source_row is None:
            where = f"row {ref.value}" if ref.key is None else f"{ref.key} {ref.value!r}"
            raise Unresolved(f"{dataset_name(config)}: question_id {row['question_id']} points at {where} of "
                             f"{ref.table.repo} (src_id {row['src_id']!r}), which that source does not have. "
                             f"{_remedy(config)}.")
        rebuilt[row["question_id"]] = {**row, "turns": rebuild.turns(row, source_row)}
    return [(index, rebuilt.get(row["question_id"], row)) for index, row in rows]


def convert(row: dict, index: int, config: str) -> dict:
    """A (rebuilt) SPEED-Bench row in the common schema, with all its fields."""
    turns = row_turns(row)
    if not turns or any(not isinstance(t, str) or not t.strip() for t in turns):
        raise Unresolved(f"{dataset_name(config)}: question_id {row['question_id']} has no prompt text")
    if any(t.startswith(PLACEHOLDER) for t in turns):
        raise Unresolved(f"{dataset_name(config)}: question_id {row['question_id']} still holds the placeholder "
                         f"({row.get('source')}). {_remedy(config)}.")
    record = {"question_id": row["question_id"], "category": row["category"], "turns": turns, "reference": None,
              "sub_category": row.get("sub_category"), "difficulty": row.get("difficulty"),
              "source": row.get("source"), "src_id": row.get("src_id"),
              "multiturn": bool(row["multiturn"]) if row.get("multiturn") is not None else len(turns) > 1,
              "config": config}
    if config != "qualitative":
        record["entropy_tier"] = row["category"]
    return record

