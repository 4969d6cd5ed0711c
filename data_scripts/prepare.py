"""Prepare benchmark datasets from the Hugging Face Hub into the suite's common local schema.

    python -m data_scripts.prepare <dataset> [--n 80] [--first | --seed 0] [--out data/<dataset>/questions.jsonl]
    python -m data_scripts.prepare all --n 80

Datasets: mt_bench, humaneval, gsm8k, alpaca, cnn_dm, nq, wmt14, longbench, and SPEED-Bench's
speed_bench (qualitative) and speed_bench_throughput_1k / _2k / _8k / _16k / _32k (data_scripts/speed_bench.py:
its licence, and its prompts stored by reference; not in `all`). spec_bench ships with the suite in
data/spec_bench/; `python -m data_scripts.spec_bench` downloads it again. Each writes one JSON line per question:

    {"question_id", "category", "turns": [...] (multi-turn sets) or "fields": {...raw fields...},
     "reference": <answer / reference text(s), or null>}

The prompt wording is not baked in: `conf/dataset/<name>.yaml` builds the turns from the fields
(e.g. Spec-Bench's "Translate German to English: {de}"), so one prepared file serves any wording.

Only the split asked for is read, streamed (WMT14's 800 MB training split is never fetched); a
sample is the first N rows (`--first`, default) or N rows drawn with a seed from a shuffle buffer.
`--local-files` reads the split from files in the Hub's own format (json, jsonl or parquet) instead.
LongBench's loading script no longer works with `datasets` >= 4: its `data.zip` is downloaded and
the task files are read directly. Without Hub access, preparation stops with a message naming the
dataset and what to do.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import random
import sys
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Iterator

from data_scripts import speed_bench
from data_scripts.errors import HubUnavailable

REPO = Path(__file__).resolve().parents[1]

# LongBench English tasks (the Chinese ones need a Chinese tokenizer for their metrics).
LONGBENCH_TASKS = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
    "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)


@dataclass(frozen=True)
class HubSource:
    repo: str
    config: str | None
    split: str


@dataclass(frozen=True)
class Dataset:
    name: str
    source: HubSource
    convert: Callable[[dict, int], dict]  # Hub row, row index -> common schema
    path: str | None = None  # the prepared file, relative to the repo; default data/<name>/questions.jsonl
    # the sampled (index, row) pairs before conversion (SPEED-Bench: prompts stored by reference rebuilt)
    resolve: Callable[[list[tuple[int, dict]]], list[tuple[int, dict]]] | None = None
    in_all: bool = True  # prepared by `all`

    @property
    def out(self) -> str:
        return self.path or f"data/{self.name}/questions.jsonl"


def _mt_bench(row: dict, index: int) -> dict:
    return {"question_id": row["prompt_id"], "category": row["category"], "turns": list(row["prompt"]),
            "reference": row.get("reference") or None}


def _humaneval(row: dict, index: int) -> dict:
    problem = {k: row[k] for k in ("prompt", "test", "entry_point")}  # what pass@1 executes
    return {"question_id": row["task_id"], "category": "humaneval", "fields": {"prompt": row["prompt"]},
            "reference": problem}


def _gsm8k(row: dict, index: int) -> dict:
    return {"question_id": f"gsm8k-{index}", "category": "gsm8k", "fields": {"question": row["question"]},
            "reference": row["answer"]}


def _alpaca(row: dict, index: int) -> dict:
    extra = row.get("input") or ""
    fields = {"instruction": row["instruction"], "input": extra,
              "prompt": row["instruction"] + (f"\n\n{extra}" if extra else "")}
    return {"question_id": f"alpaca-{index}", "category": "alpaca", "fields": fields, "reference": row.get("output")}


def _cnn_dm(row: dict, index: int) -> dict:
    return {"question_id": row["id"], "category": "cnn_dm", "fields": {"article": row["article"]},
            "reference": row["highlights"]}


def _nq(row: dict, index: int) -> dict:
    return {"question_id": f"nq-{index}", "category": "nq", "fields": {"question": row["question"]},
            "reference": list(row["answer"])}


def _wmt14(row: dict, index: int) -> dict:
    pair = row["translation"]
    return {"question_id": f"wmt14-{index}", "category": "wmt14", "fields": {"de": pair["de"]}, "reference": pair["en"]}


def _longbench(row: dict, index: int) -> dict:
    fields = {"input": row["input"], "context": row["context"]}
    reference = {"answers": list(row["answers"]), "all_classes": row.get("all_classes")}
    return {"question_id": row.get("_id") or f"{row['dataset']}-{index}", "category": row["dataset"],
            "fields": fields, "reference": reference, "length": row.get("length")}


DATASETS = {d.name: d for d in [
    Dataset("mt_bench", HubSource("HuggingFaceH4/mt_bench_prompts", None, "train"), _mt_bench),
    Dataset("humaneval", HubSource("openai/openai_humaneval", None, "test"), _humaneval),
    Dataset("gsm8k", HubSource("openai/gsm8k", "main", "test"), _gsm8k),
    Dataset("alpaca", HubSource("tatsu-lab/alpaca", None, "train"), _alpaca),
    Dataset("cnn_dm", HubSource("abisee/cnn_dailymail", "3.0.0", "test"), _cnn_dm),
    Dataset("nq", HubSource("google-research-datasets/nq_open", None, "validation"), _nq),
    Dataset("wmt14", HubSource("wmt/wmt14", "de-en", "test"), _wmt14),
    Dataset("longbench", HubSource("zai-org/LongBench", None, "test"), _longbench),
    *(Dataset(speed_bench.dataset_name(config), HubSource(speed_bench.REPO_ID, config, "test"),
              partial(speed_bench.convert, config=config), speed_bench.prepared_path(config),
              partial(speed_bench.resolve_rows, config=config), in_all=False) for config in speed_bench.CONFIGS),
]}


def _offline(name: str, source: HubSource, err: Exception) -> HubUnavailable:
    out = DATASETS[name].out if name in DATASETS else f"data/{name}/questions.jsonl"
    return HubUnavailable(
        f"{name}: could not read {source.repo} ({source.config or 'default'}, split {source.split}) from the "
        f"Hugging Face Hub: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Run "
        f"`python -m data_scripts.prepare {name}` on a machine with Hub access and copy "
        f"{out} here (or point dataset.path at it)."
    )


def hub_rows(dataset: Dataset, local_files: list[str] | None = None) -> Iterator[dict]:
    """Rows of the split, streamed; `local_files` (json/jsonl/parquet in the Hub's own format)
    replaces the Hub for tests and mirrors."""
    from datasets import load_dataset  # lazy: datasets, slow to import: not for --help or a prepared split

    if local_files:
        builder = "parquet" if local_files[0].endswith(".parquet") else "json"
        return iter(load_dataset(builder, data_files=local_files, split="train", streaming=True))
    from methods.models.specs import hub_reachable  # lazy: methods imports torch: only to reach the Hub

    source = dataset.source
    if not hub_reachable():
        raise _offline(dataset.name, source, ConnectionError("the Hub is not reachable from this machine"))
    try:
        stream = load_dataset(source.repo, source.config, split=source.split, streaming=True)
        return iter(stream)
    except Exception as err:  # the Hub client raises many types
        raise _offline(dataset.name, source, err) from None


def longbench_rows(tasks: Iterable[str], archive: Path | None = None) -> Iterator[dict]:
    """LongBench's task files from its data.zip (downloaded once from the Hub)."""
    if archive is None:
        from methods.models.specs import hub_reachable  # lazy: methods imports torch: only to reach the Hub

        source = DATASETS["longbench"].source
        if not hub_reachable():
            raise _offline("longbench", source, ConnectionError("the Hub is not reachable from this machine"))
        try:
            from huggingface_hub import hf_hub_download  # lazy: the Hub client, only without a local archive

            archive = Path(hf_hub_download(source.repo, "data.zip", repo_type="dataset"))
        except Exception as err:
            raise _offline("longbench", source, err) from None
    with zipfile.ZipFile(archive) as bundle:
        names = set(bundle.namelist())
        for task in tasks:
            member = next((n for n in (f"data/{task}.jsonl", f"{task}.jsonl") if n in names), None)
            if member is None:
                raise SystemExit(f"longbench: task {task!r} not in {archive}; valid: {', '.join(LONGBENCH_TASKS)}")
            with bundle.open(member) as handle:
                for line in io.TextIOWrapper(handle, encoding="utf-8"):
                    if line.strip():
                        yield json.loads(line)


def sample(rows: Iterator[dict], n: int | None, seed: int | None, buffer: int = 10_000) -> list[tuple[int, dict]]:
    """The first n rows, or n rows drawn with `seed` from the first `buffer` rows; (index, row)."""
    indexed = enumerate(rows)
    if seed is None:
        return list(itertools.islice(indexed, n)) if n else list(indexed)
    pool = list(itertools.islice(indexed, buffer))
    chosen = random.Random(seed).sample(pool, min(n or len(pool), len(pool)))
    return sorted(chosen, key=lambda pair: pair[0])


def prepare(name: str, n: int | None = None, seed: int | None = None, out: Path | None = None,
            local_files: list[str] | None = None, tasks: Iterable[str] = LONGBENCH_TASKS,
            archive: Path | None = None) -> Path:
    if name not in DATASETS:
        raise SystemExit(f"unknown dataset {name!r}; valid: {', '.join(sorted(DATASETS))}, spec_bench")
    dataset = DATASETS[name]
    out = out or REPO / dataset.out
    if name == "longbench":  # n per task
        rows = [pair for task in tasks for pair in sample(longbench_rows([task], archive), n, seed)]
    else:
        rows = sample(hub_rows(dataset, local_files), n, seed)
    if dataset.resolve:
        rows = dataset.resolve(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for index, row in rows:
            f.write(json.dumps(dataset.convert(row, index)) + "\n")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", help=f"one of {', '.join(sorted(DATASETS))}, or all")
    parser.add_argument("--n", type=int, default=None, help="questions to keep (per task for longbench); default all")
    parser.add_argument("--seed", type=int, default=None,
                        help="draw the sample with this seed instead of taking the first n")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tasks", default=",".join(LONGBENCH_TASKS), help="longbench tasks, comma-separated")
    parser.add_argument(
        "--local-files",
        nargs="+",
        default=None,
        metavar="FILE",
        help="read the split from these files (json, jsonl or parquet, in the Hub's format) instead of the Hub",
    )
    args = parser.parse_args(argv)
    names = sorted(n for n, d in DATASETS.items() if d.in_all) if args.dataset == "all" else [args.dataset]
    if args.local_files and len(names) > 1:
        parser.error("--local-files holds one dataset's split: name the dataset")
    for name in names:
        path = prepare(name, args.n, args.seed, None if len(names) > 1 else args.out, local_files=args.local_files,
                       tasks=args.tasks.split(","))
        print(f"{name}: wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
