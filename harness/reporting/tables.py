"""`make report`'s tables: the runs a run set holds (`find_runs`), the tables they make (`build_tables`:
runs whose settings and questions agree, a row per method variant), each cell's numbers (`group_table`)
and each metric's table written as Markdown, CSV and LaTeX with its caveats (`write_tables`)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from data_scripts.speed_bench import ENTROPY_TIERS  # SPEED-Bench's throughput categories, low to high
from harness.cluster.jobs import job_status
from harness.reporting.latex import latex_table
from harness.running.results import read_answers
from harness.stats import (  # MIN_INTERVAL_N: below it, a cell shows no interval
    MIN_INTERVAL_N,
    busy_questions,
    caveats,
    compare_outputs,
    decoder_stats,
    speedup_stats,
)
from harness.stats.text import caveat_note
from methods.base import method_settings
from methods.settings.params import ConfigError, Settings

SKIP_DIRS = {".multirun", "perf", "report"}
REFERENCE = "reference"  # results/reference/: the committed run, read only when named
OVERALL = "Overall"
TABLES = ("speedup", "tau", "acceptance", "ttft")


@dataclass
class Run:
    path: Path
    summary: dict
    records: list[dict]
    baseline: list[dict]
    mtime: float = 0.0

    @property
    def settings(self) -> tuple:
        """What must agree for two runs to share a table (the questions are checked per row)."""
        env, s = self.summary.get("environment", {}), self.summary
        return (s["model"], s["dataset"], s.get("hardware"), s.get("dtype"), env.get("torch"), env.get("transformers"),
                s.get("max_new_tokens"), sampling_name(s.get("sampling")), s.get("batch_size", 1),
                env.get("decoding_code") or "unrecorded")

    @property
    def label(self) -> str:
        return method_label(self.summary["method"], self.summary.get("method_config") or {})


# the engine (`decoding_code`, the digest of methods/) too: runs of two engines never share a row
SETTING_NAMES = ("model", "dataset", "hardware", "dtype", "torch", "transformers", "max_new_tokens", "sampling",
                 "batch_size", "engine")


def sampling_name(sampling: dict | None) -> str:
    if not sampling or not sampling.get("temperature"):
        return "greedy"
    parts = [f"T={sampling['temperature']:g}"]
    if sampling.get("top_p", 1.0) < 1.0:
        parts.append(f"top_p={sampling['top_p']:g}")
    if sampling.get("top_k"):
        parts.append(f"top_k={sampling['top_k']}")
    return " ".join(parts)


def method_label(method: str, config: dict) -> str:
    """`sps` with its parameters, e.g. `sps (gamma=4)`; nested values are left out."""
    params = [f"{k}={_short(v)}" for k, v in sorted(config.items())
              if k not in ("method", "lossless") and v is not None and not isinstance(v, dict)]
    label = f"{method} ({', '.join(params)})" if params else method
    return label + (" [lossy]" if config.get("lossless") is False else "")


def _short(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def settings_of(method: str) -> type[Settings]:
    """A method's settings class (its size's setting and label: `Settings.size_in`); the plain
    `Settings` (no size) for a method not registered here, e.g. a plugin's run read elsewhere."""
    try:
        return method_settings(method)
    except ConfigError:
        return Settings


def run_folders(paths: list[Path]) -> list[Path]:
    """The run folders (holding summary.json) that the given paths name: a run folder itself, a
    folder holding runs (the committed reference run is skipped unless named), a sweep folder (its
    jobs' results folders) or a folder of sweeps (`make batch-sweep`: one per method)."""
    found = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no results at {path}")
        jobs = job_status(path) or [
            job for sweep in sorted(path.iterdir()) if sweep.is_dir() for job in job_status(sweep)
        ]
        if jobs:  # a sweep: its jobs' results folders, those that finished (a summary written)
            found += [Path(job["results"]) for job in jobs
                      if job.get("results") and (Path(job["results"]) / "summary.json").is_file()]
            continue
        named_reference = REFERENCE in path.resolve().parts
        for summary_file in sorted(path.rglob("summary.json")):
            parts = summary_file.parent.relative_to(path).parts
            if set(parts) & SKIP_DIRS or (not named_reference and REFERENCE in parts):
                continue
            found.append(summary_file.parent)
    return list(dict.fromkeys(found))


def find_runs(paths, select: str | None = None) -> list[Run]:
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    runs = []
    for folder in run_folders(paths):
        if select and not fnmatch.fnmatch(str(folder), f"*{select}"):
            continue
        summary_file = folder / "summary.json"
        summary = json.loads(summary_file.read_text())
        # records of an older format are read as today's (harness/running/results.py, `upgrade_record`)
        records = read_answers(folder / "answers" / f"{summary['method']}.jsonl")
        baseline = []
        if summary.get("baseline_results"):  # the paired AR answers (in the run's own folder since pairing)
            baseline = read_answers(Path(summary["baseline_results"]) / "answers" / "ar.jsonl")
        runs.append(Run(folder, summary, records, baseline, summary_file.stat().st_mtime))
    return runs


@dataclass
class Row:
    """One method variant: its records and their paired baseline records, joined over its runs."""

    label: str
    method: str
    records: dict = field(default_factory=dict)  # question id -> record
    baseline: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)  # question id -> column name
    config: dict = field(default_factory=dict)
    runs: list = field(default_factory=list)


@dataclass
class Table:
    """Method variants measured with the same settings on the same questions."""

    settings: dict
    rows: dict[str, Row]
    slug: str = ""

    @property
    def questions(self) -> frozenset:
        return frozenset(next(iter(self.rows.values())).records)

    def caption(self) -> str:
        s = self.settings
        runs = {r for row in self.rows.values() for r in row.runs}
        return (
            f"{s['model']} on {s['hardware']}, {s['dtype']}; {s['dataset']}, n = {len(self.questions)} questions, "
            f"max_new_tokens {s['max_new_tokens']}, {s['sampling']}; torch {s['torch']}, "
            f"transformers {s['transformers']}; engine {s['engine']}; {len(runs)} run(s)"
        )


BY_CATEGORY = ("spec_bench", "speed_bench")  # datasets whose tables have a column per category


def by_category(dataset: str) -> bool:
    return dataset in BY_CATEGORY or dataset.startswith("speed_bench_throughput_")


def column_of(summary: dict, record: dict) -> str:
    return record["category"] if by_category(summary["dataset"]) else summary["dataset"]


def column_order(column: str) -> tuple:
    """Columns sort by name, SPEED-Bench's entropy tiers from low to high."""
    return (ENTROPY_TIERS.index(column), "") if column in ENTROPY_TIERS else (-1, column)


def build_tables(runs: list[Run]) -> list[Table]:
    by_settings: dict[tuple, dict[str, Row]] = defaultdict(dict)
    for run in sorted(runs, key=lambda r: r.mtime, reverse=True):  # newest first: its answers win
        if run.summary["method"] == "ar" or not run.baseline:
            continue
        row = by_settings[run.settings].setdefault(
            run.label, Row(run.label, run.summary["method"], config=run.summary.get("method_config", {})))
        base_by_id = {r["question_id"]: r for r in run.baseline}
        added = False
        for record in run.records:
            qid = record["question_id"]
            if qid in base_by_id and qid not in row.records:
                row.records[qid], row.baseline[qid] = record, base_by_id[qid]
                row.columns[qid] = column_of(run.summary, record)
                added = True
        if added:
            row.runs.append(str(run.path))
    tables = []
    for settings, rows in by_settings.items():
        by_questions: dict[frozenset, dict[str, Row]] = defaultdict(dict)
        for label, row in rows.items():
            if row.records:
                by_questions[frozenset(row.records)][label] = row
        for questions, same in by_questions.items():
            tables.append(Table(dict(zip(SETTING_NAMES, settings)), dict(sorted(same.items()))))
    tables.sort(key=lambda t: ([str(v) for v in t.settings.values()], -len(t.questions)))

    def name(table: Table) -> str:
        s = table.settings
        batch = f"-b{s['batch_size']}" if s["batch_size"] > 1 else ""
        return (f"{s['model']}-{s['dataset']}-n{len(table.questions)}-{s['max_new_tokens']}tok-{s['sampling']}{batch}-"
                f"{s['dtype']}-{s['hardware']}")

    # two question sets of one size, or two engines: their hash tells them apart
    name_uniquely(tables, name, lambda table: [sorted(map(str, table.questions)), table.settings["engine"]])
    return tables


def name_uniquely(items: list, name, identity) -> None:
    """Sets each item's `slug` to its slugified name, with a digest of its identity (JSON) where
    two items share a name."""
    named = defaultdict(list)
    for item in items:
        named[slugify(name(item))].append(item)
    for slug, same in named.items():
        for item in same:
            digest = hashlib.sha256(json.dumps(identity(item), default=str).encode()).hexdigest()[:6]
            item.slug = slug if len(same) == 1 else f"{slug}-{digest}"


def baseline_records(table: Table) -> list[dict]:
    """The AR answers every row of a table was paired with, each once (runs that share a baseline
    folder share its records): AR's measurements at the table's settings, pooled."""
    measured = {}
    for row in table.rows.values():
        for record in row.baseline.values():
            choice = record["choices"][0]
            measured[
                (record["question_id"], tuple(choice["wall_time"]), *(turn["ttft"] for turn in choice["stats"]))
            ] = record
    return list(measured.values())


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cell_metrics(
    records: list[dict], baseline: list[dict], settings: dict | None = None, lossless: bool = True
) -> dict:
    stats = decoder_stats(records)
    speed = speedup_stats(records, baseline)
    fid = compare_outputs(records, baseline, settings or {}, lossless)
    return {
        "speedup": speed["specbench"], "speedup_ci95": speed["specbench_ci95"], "tau": stats["tau"],
        "acceptance": stats["acceptance_rate"], "ttft": stats["mean_ttft"], "questions": len(records),
        "acceptance_per_position": stats["acceptance_per_position"], "position_tested": stats["position_tested"],
        "position_accepted": stats["position_accepted"],
        "caveats": caveats(speed, stats["tau"], fid, busy_questions(records, baseline), lossless),
    }


def group_table(table: Table) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """Columns (sorted, then Overall) and label -> column -> metrics."""
    rows = table.rows
    columns = sorted({c for row in rows.values() for c in row.columns.values()}, key=column_order)
    cells_by_label = {}
    for label, row in sorted(rows.items()):
        cells = {}
        for column in columns + [OVERALL]:
            keys = [k for k, c in row.columns.items() if column in (c, OVERALL)]
            if keys:
                cells[column] = cell_metrics([row.records[k] for k in keys], [row.baseline[k] for k in keys],
                                             table.settings, row.config.get("lossless", True))
        cells_by_label[label] = cells
    return columns + [OVERALL], cells_by_label


def format_value(metric: str, cell: dict | None, latex: bool = False) -> str:
    if not cell or cell.get(metric) is None:
        return "–"
    value = cell[metric]
    if metric == "speedup":
        times = r"$\times$" if latex else "×"
        if cell["questions"] < MIN_INTERVAL_N:
            return f"{value:.2f}{times}"
        low, high = cell["speedup_ci95"]
        return f"{value:.2f}{times} [{low:.2f}, {high:.2f}]"
    if metric == "ttft":
        return f"{1000 * value:.0f}"
    return f"{value:.2f}"


CAVEATS = "caveats (Overall)"  # the last column of every table: `text.caveat_note` of the row's Overall cell
CAVEAT_FIELDS = ("busy", "differ_from_ar", "near_ties", "mismatches", "above_tau", "interval_wide", "caveats")
TITLES = {"speedup": f"Speedup over AR (Spec-Bench form; bootstrap 95% interval where n >= {MIN_INTERVAL_N})",
          "tau": "τ (mean accepted tokens: new tokens per decoding step, as Spec-Bench counts them)",
          "acceptance": "Acceptance rate α (accepted / proposed draft tokens)", "ttft": "TTFT (ms, mean per turn)"}


def column_counts(table: Table) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for qid, column in next(iter(table.rows.values())).columns.items():
        counts[column] += 1
    return {**counts, OVERALL: len(table.questions)}


def caveat_fields(cell: dict) -> dict:
    """A cell's caveats as CSV columns (CAVEAT_FIELDS)."""
    c = cell["caveats"]
    fid = c["fidelity"] or {}
    return {"busy": c["busy"], "differ_from_ar": fid.get("differing_questions"),
            "near_ties": fid.get("near_ties") if fid.get("classified") else None,
            "mismatches": fid.get("mismatches") if fid.get("classified") else None,
            "above_tau": c["above_tau"], "interval_wide": c["interval_wide"], "caveats": caveat_note(c)}


def markdown_table(frame: pd.DataFrame, title: str) -> str:
    """A title line and the frame as a Markdown (pipe) table, its cells as written."""
    return f"{title}\n\n{frame.to_markdown(index=False, tablefmt='pipe', disable_numparse=True)}\n"


def write_tables(table: Table, columns: list[str], cells_by_label: dict, out: Path) -> list[Path]:
    """Each metric's table as Markdown, CSV and LaTeX; every row ends with its caveats (n, busy
    questions, outputs that differ from AR's, a speedup above τ, a wide interval)."""
    folder = out / table.slug
    folder.mkdir(parents=True, exist_ok=True)
    caption = table.caption()
    counts = column_counts(table)
    written = []
    for metric in TABLES:
        header = ["method", *(f"{c} (n={counts.get(c, 0)})" for c in columns), CAVEATS]
        notes = {label: caveat_note(cells[OVERALL]["caveats"]) for label, cells in cells_by_label.items()}
        for ext, latex in (("md", False), ("tex", True)):
            shown = pd.DataFrame([[label, *(format_value(metric, cells.get(c), latex) for c in columns), notes[label]]
                                  for label, cells in cells_by_label.items()], columns=header)
            text = (markdown_table(shown, f"**{TITLES[metric]}** — {caption}") if not latex else
                    latex_table(shown, f"{TITLES[metric]}. {caption}.", "l" + "c" * len(columns) + "p{5cm}"))
            (folder / f"{metric}.{ext}").write_text(text)
        values = pd.DataFrame([[*table.settings.values(), label, column, cell[metric],
                                *(cell["speedup_ci95"] if metric == "speedup" else (None, None)), cell["questions"],
                                *caveat_fields(cell).values()]
                               for label, cells in cells_by_label.items() for column in columns
                               if (cell := cells.get(column))],
                              columns=[*SETTING_NAMES, "method", "column", metric, "ci_low", "ci_high", "questions",
                                       *CAVEAT_FIELDS], dtype=object)
        values.to_csv(folder / f"{metric}.csv", index=False)
        written += [folder / f"{metric}.{ext}" for ext in ("md", "csv", "tex")]
    return written


def tables_holding(tables: list[Table], runs=None) -> list[Table]:
    """The tables holding answers of any of `runs` (run folders): those a new run changed; every table when
    `runs` is None."""
    if runs is None:
        return tables
    wanted = {Path(run).resolve() for run in runs}
    return [table for table in tables
            if any(Path(path).resolve() in wanted for row in table.rows.values() for path in row.runs)]
