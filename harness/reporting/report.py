"""`make report`: tables from one explicit set of runs, recomputed from their answer records.

    python -m harness.reporting.report [RUNS ...] [--out DIR] [--select GLOB] [--tables-of RUN ...]

RUNS are results folders, folders holding them, or sweep folders (each job's results folder is
read); by default every run under `results/` except the committed reference run
(`results/reference/`), which is read only when named. The output goes to
`results/report/<run set>/` (`--out` to choose), so no report overwrites another's files; with
`--tables-of`, only the tables holding those runs' answers are written (`make headline`: the tables of
its own runs, never another CPU class's), and report.md indexes every table as its files stand.

Runs land in the same table only when their settings agree: model, dataset, max_new_tokens,
sampling, batch size, dtype, hardware, torch and transformers, and the questions answered: rows are method
variants (a method and its parameters; the runs of one variant over disjoint questions, as a
sweep over categories makes them, are joined, the newest answer of a question winning), and a
variant whose questions differ from the others' gets a table of its own. Columns are the
categories of Spec-Bench and SPEED-Bench (its 11 in the qualitative split, its entropy tiers low to
high in the throughput splits), or else the dataset, each with its n, plus an overall column. Tables: speedup (95%
bootstrap intervals where a cell has at least `MIN_INTERVAL_N` questions), τ, acceptance rate,
TTFT; each as Markdown, CSV and LaTeX, with a caption naming every setting and, per method, a
last column of caveats (`harness.reporting.text.caveat_note`: n, busy questions, outputs that differ from AR's,
a speedup above τ, a wide interval; in the CSV per cell, also as numbers).

Across tables whose settings differ only in batch size (or only in SPEED-Bench's throughput split),
the curves (below, "Curves across tables"): throughput and its speedup over AR at the same batch
size, per batch size (or input length), and the best draft length per batch size, each under
`by-batch-size-…/` (`by-input-length-…/`).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from data_scripts.speed_bench import ENTROPY_TIERS  # SPEED-Bench's throughput categories, low to high
from harness.cluster.jobs import job_status
from harness.reporting import published
from harness.reporting.text import caveat_note, describe_fidelity
from harness.running.results import read_answers
from harness.stats import (  # MIN_INTERVAL_N: below it, a cell shows no interval
    MIN_INTERVAL_N,
    busy_questions,
    caveats,
    compare_outputs,
    decoder_stats,
    decomposition,
    speedup_stats,
)

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


SIZE_KEYS = ("gamma", "num_draft", "k_config", "total_tokens", "tree_nodes", "block_size")  # what size_of reads


def size_of(method: str, config: dict) -> tuple[str, float] | None:
    """The draft length / tree size parameter of a method variant, if it has one."""
    if "gamma" in config:
        return "draft length γ", config["gamma"]
    if "num_draft" in config:  # PLD: the longest draft it copies
        return "draft length γ", config["num_draft"]
    if "k_config" in config:
        nodes, width = 0, 1
        for k in config["k_config"]:
            width *= k
            nodes += width
        return "draft tree nodes", nodes
    if "total_tokens" in config:
        return "tree size (total tokens)", config["total_tokens"]
    if "tree_nodes" in config:
        return "tree size (nodes)", config["tree_nodes"]
    if "block_size" in config:
        return "Jacobi block size n", config["block_size"]
    return None


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


def latex_table(frame: pd.DataFrame, caption: str, column_format: str) -> str:
    """The frame as a booktabs LaTeX table: the first and last columns (labels and notes) and the
    header escaped, the values as written (they may hold LaTeX: `$\\times$`)."""
    escape = lambda text: "".join(LATEX_SPECIAL.get(char, char) for char in str(text))  # noqa: E731
    styled = frame.style.hide(axis="index").format(escape="latex", subset=[frame.columns[0], frame.columns[-1]])
    tex = styled.format_index(escape="latex", axis=1).to_latex(
        column_format=column_format, position="t", position_float="centering", hrules=True, caption=escape(caption))
    return tex.replace("τ", r"$\tau$").replace("α", r"$\alpha$")


LATEX_SPECIAL = {"_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}"}


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


PHASES = ("prefill", "draft", "verify", "accept", "commit", "other")


def breakdown_rows(rows: dict[str, Row], settings: dict | None = None) -> list[dict]:
    """Per method variant over all its questions: speed, fidelity to AR (each divergence of a
    lossless greedy variant classified as a near-tie or a mismatch) and where the time goes."""
    out = []
    settings = settings or {}
    for label, row in sorted(rows.items()):
        keys = list(row.records)
        records, baseline = [row.records[k] for k in keys], [row.baseline[k] for k in keys]
        lossless = row.config.get("lossless", True)
        stats, speed = decoder_stats(records), speedup_stats(records, baseline)
        fid = compare_outputs(records, baseline, settings, lossless)
        base_stats = decoder_stats(baseline)
        explained = decomposition(stats, base_stats)
        busy = busy_questions(records, baseline)
        caveat = caveats(speed, stats["tau"], fid, busy, lossless)
        positions = sorted(d["position"] for d in fid["first_divergence"])
        out.append({
            "method": label, "questions": len(records), "speedup": speed["specbench"],
            "ci_low": speed["specbench_ci95"][0], "ci_high": speed["specbench_ci95"][1], "tau": stats["tau"],
            "tokens_per_second": stats["tokens_per_second"],
            "ar_tokens_per_second": base_stats["tokens_per_second"],
            **{f"step_{k}": (explained or {}).get(k) for k in ("verify", "draft", "other")},
            "predicted": (explained or {}).get("predicted_decode_speedup"),
            "lossless": lossless, "differ_from_ar": fid["differing_questions"],
            "first_divergence_median": positions[len(positions) // 2] if positions else None,
            "near_ties": fid["near_ties"] if fid["classified"] else None,
            "mismatches": fid["mismatches"] if fid["classified"] else None,
            "max_near_tie_gap": fid["max_near_tie_gap"], "fidelity": describe_fidelity(fid, lossless, of=len(records)),
            "busy": len(busy["questions"]) if busy["recorded"] else None, "max_other_cores": busy["max_other_cores"],
            "above_tau": caveat["above_tau"], "interval_wide": caveat["interval_wide"], "caveats": caveat_note(caveat),
            **{phase: stats["time_fractions"].get(phase, 0.0) for phase in PHASES},
        })
    return out


def _per_step(row: dict) -> str:
    if row["step_verify"] is None:
        return "–"
    return " / ".join(f"{row[f'step_{k}']:.2f}" for k in ("verify", "draft", "other"))


def write_breakdown(table: Table, folder: Path) -> list[Path]:
    """`breakdown.md/csv`: one line per method with speedup (flagged when above τ), τ, tokens/s, how
    many questions' outputs differ from AR's (near-ties and mismatches, and the median first
    differing token), how many were measured on a busy machine (and the most cores others used),
    and the time fractions."""
    lines = breakdown_rows(table.rows, table.settings)
    title = (
        f"**Per method: speed, fidelity, time breakdown (% of wall time)** — {table.caption()}. Per step: the cost "
        "of a decoding step's verify, draft and other work in units of AR's mean decoding step; predicted = the "
        "tokens a decoding step adds after the prefill's / their sum (decoding only; the measured speedup also pays "
        "the prefill). Differ from AR: near-tie = both top-2 logit gaps at the first differing token within the "
        "dtype's rounding, mismatch = beyond it (docs/benchmarks.md, fidelity). Busy: questions measured beside "
        "other work (docs/benchmarks.md, reading the busy flag). tok/s: all tokens / all wall time (the speedup, "
        "Spec-Bench's, divides the mean per-question tokens/s: one slow question moves the two apart). Above τ: a "
        "decoding step costs at least one AR step, so a speedup above τ comes from a slower AR measurement or a "
        "cheaper prefill."
    )
    shown = []
    for r in lines:
        differ = f"{r['differ_from_ar']}/{r['questions']}"
        if r["differ_from_ar"]:  # 5/13 differ: 5 near-ties (max gap 0.25), 0 mismatches
            differ = r["fidelity"] + f" (first at token {r['first_divergence_median']}, median)"
        if r["mismatches"]:
            differ = f"**{differ}**"
        interval = f" [{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if r["questions"] >= MIN_INTERVAL_N else ""
        interval += (" **above τ, busy: not to be trusted**" if r["busy"] else " (above τ)") if r["above_tau"] else ""
        busy = "not recorded" if r["busy"] is None else f"{r['busy']}/{r['questions']}"
        busy += f" (others up to {r['max_other_cores']:.1f} cores)" if r["busy"] else ""
        shown.append({
            "method": r["method"], "questions": str(r["questions"]), "speedup": f"{r['speedup']:.2f}×{interval}",
            "τ": f"{r['tau']:.2f}", "verify / draft / other per step": _per_step(r),
            "predicted": "–" if r["predicted"] is None else f"{r['predicted']:.2f}×",
            "tok/s (AR)": f"{r['tokens_per_second']:.1f} ({r['ar_tokens_per_second']:.1f})", "differ from AR": differ,
            "busy": busy, **{f"{p} %": f"{100 * r[p]:.0f}" for p in PHASES}})
    (folder / "breakdown.md").write_text(markdown_table(pd.DataFrame(shown), title))
    pd.DataFrame([table.settings | r for r in lines], dtype=object).to_csv(folder / "breakdown.csv", index=False)
    return [folder / "breakdown.md", folder / "breakdown.csv"]


def report(paths, out: Path, select: str | None = None, tables_of=None) -> dict[str, tuple]:
    """Writes the tables of the run set under `out` (with `tables_of`, run folders: only the tables holding their
    answers and the curves through those; every other table's files stay as they are) and report.md, the index of
    every table and curves of the run set as their files stand; returns table slug -> (columns, cells) of those
    written."""
    tables = build_tables(find_runs(paths, select))
    curves = find_curves(tables)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for table in tables_holding(tables, tables_of):
        columns, cells = group_table(table)
        written[table.slug] = (columns, cells)
        write_tables(table, columns, cells, out)
        write_breakdown(table, out / table.slug)
        beside = published.markdown(table)  # where the table's settings are a published setting
        if beside:
            (out / table.slug / "published.md").write_text(beside + "\n")
        else:  # one an earlier run set left
            (out / table.slug / "published.md").unlink(missing_ok=True)
    for each in curves:
        if any(table.slug in written for table in each.tables):
            write_curves(each, out)
    index = sections(out, [item.slug for item in [*tables, *curves]])
    (out / "report.md").write_text("\n\n".join(index) + "\n" if index else "No runs with a baseline found.\n")
    return written


def tables_holding(tables: list[Table], runs=None) -> list[Table]:
    """The tables holding answers of any of `runs` (run folders): those a new run changed; every table when
    `runs` is None."""
    if runs is None:
        return tables
    wanted = {Path(run).resolve() for run in runs}
    return [table for table in tables
            if any(Path(path).resolve() in wanted for row in table.rows.values() for path in row.runs)]


# report.md's sections of a table's folder, or a set of curves' folder, in this order (those that exist)
SECTIONS = ("breakdown", "speedup", "tau", "published", "throughput_speedup", "throughput", "best_draft_length")


def sections(out: Path, slugs: list[str]) -> list[str]:
    """The Markdown sections of these tables' and curves' folders under `out`, as their files stand."""
    return [path.read_text() for slug in slugs for name in SECTIONS if (path := out / slug / f"{name}.md").is_file()]


def run_set_name(paths: list[Path]) -> str:
    """The folder name of a run set's report and figures: `all` for every run under results/,
    else the named folders' names (`reference`, a sweep's time stamp, a run's folder)."""
    names = []
    for path in map(Path, paths):
        resolved = path.resolve()
        names.append("all" if resolved == Path("results").resolve() else resolved.name)
    return slugify("+".join(names))[:80] or "all"


def run_set_arguments(description: str, argv, out_default: str) -> argparse.Namespace:
    """The command line of `report` and `figures`: run folders, --out, --select."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, default=[Path("results")],
                        help="results folders, folders holding them or sweep folders (default: results/, "
                             "without the committed reference run)")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {out_default}")
    parser.add_argument("--select", help="glob over <model>/<dataset>/<method>/<run> folders")
    parser.add_argument("--tables-of", nargs="+", type=Path, metavar="RUN",
                        help="only the tables (and curves) holding these run folders' answers; the files of the "
                             "run set's other tables are left as they are (`make headline`: its own runs)")
    return parser.parse_args(argv)



# ------------------------------------------------------------------------------------------
# Curves across tables
#
# The curves a serving engineer asks for (issue 36; docs/batching.md), drawn across the report's
# tables by `make report` (tables) and `make figures` (figures) from any run set that holds them
# (`make batch-sweep` makes one):
#
# * over batch size: the tables whose settings differ only in batch size, on the same questions, at
#   two batch sizes or more. Per method variant its throughput (tokens per second summed over the
#   batch) and its speedup over the AR it was paired with (same batch size, same questions, same
#   process); AR's throughput (the AR answers of its table's runs, pooled); and, per method measured
#   at two draft lengths or more at a batch size, the draft length with the highest throughput.
# * over input length: the tables of SPEED-Bench's throughput splits (`speed_bench_throughput_*`)
#   whose settings differ only in the split, two splits or more: the throughput speedup against the
#   mean prompt length (tokens per turn, chat template included).
#
# Every other setting (model, hardware, dtype, max_new_tokens, sampling, torch, transformers, the
# engine; and the batch size over input length) is shared by all points of a set of curves: runs
# that differ in one get curves of their own. Each point names the table (`make report`) with its
# caveats.

THROUGHPUT_SPLITS = "speed_bench_throughput_"  # SPEED-Bench's splits by input length
AXES = ("batch_size", "dataset")  # the setting a set of curves varies
AXIS_NAMES = {"batch_size": "batch size", "dataset": "input length"}
AR = "ar"  # AR's label and method: its paired measurements of a table, pooled


@dataclass
class Point:
    """One method variant (or AR) at one table's settings."""

    label: str
    method: str
    config: dict
    batch_size: int
    dataset: str
    questions: int
    input_length: float  # mean prompt tokens per turn
    throughput: float  # tokens per second summed over the batch
    ar_throughput: float  # its paired AR's (AR's own for AR)
    busy: int  # questions some side of which was measured beside other work
    table: str  # the report's table of these settings, with every caveat

    @property
    def speedup(self) -> float | None:
        return self.throughput / self.ar_throughput if self.ar_throughput else None

    @property
    def size(self) -> float | None:
        """Its draft length / tree size, when it is a number (`report.size_of`)."""
        size = size_of(self.method, self.config)
        return size[1] if size and isinstance(size[1], (int, float)) else None


@dataclass
class Curves:
    """Tables whose settings differ only in `axis`: one point per method variant and table."""

    axis: str
    shared: dict  # the settings every point shares (report.SETTING_NAMES but the axis)
    tables: list[Table]
    slug: str = ""
    points: list[Point] = field(default_factory=list)

    @property
    def rows(self) -> dict[str, Row]:
        """Every method variant (its method and settings: what figures.styles and short_labels read)."""
        return {label: row for table in self.tables for label, row in table.rows.items()}

    @property
    def n(self) -> str:
        """The questions of each point: one number, or one per split."""
        return "/".join(dict.fromkeys(str(len(table.questions)) for table in self.tables))

    @property
    def title_settings(self) -> dict:
        """The shared settings, and the splits over input length, as figures' titles name them."""
        if self.axis == "dataset":  # speed_bench_throughput_{1k,2k}
            splits = dict.fromkeys(t.settings["dataset"].removeprefix(THROUGHPUT_SPLITS) for t in self.tables)
            return {**self.shared, "dataset": f"{THROUGHPUT_SPLITS}{{{','.join(splits)}}}"}
        return self.shared

    def value(self, point: Point):
        """A point's place on the axis: its batch size, or its mean prompt length."""
        return point.batch_size if self.axis == "batch_size" else point.input_length

    def series(self, with_ar: bool = False) -> dict[str, list[Point]]:
        """label -> its points in axis order (AR's too when asked)."""
        out = defaultdict(list)
        for point in sorted(self.points, key=self.value):
            if with_ar or point.method != AR:
                out[point.label].append(point)
        return dict(out)


def find_curves(tables: list[Table]) -> list[Curves]:
    """Every set of curves the tables hold (`make report`'s tables, slugs set)."""
    groups: dict[tuple, list[Table]] = defaultdict(list)
    for table in tables:
        for axis in AXES:
            if axis == "dataset" and not table.settings["dataset"].startswith(THROUGHPUT_SPLITS):
                continue
            shared = tuple((k, v) for k, v in table.settings.items() if k != axis)
            # over batch size the same questions at every point; over input length each split's own
            groups[(axis, shared, table.questions if axis == "batch_size" else None)].append(table)
    found = []
    for (axis, shared, _), same in groups.items():
        if len({table.settings[axis] for table in same}) >= 2:
            curves = Curves(axis, dict(shared), sorted(same, key=lambda t: t.settings[axis]))
            curves.points = [point for table in curves.tables for point in table_points(table)]
            found.append(curves)

    def name(curves: Curves) -> str:
        s = curves.shared
        if curves.axis == "batch_size":
            what = f"{s['dataset']}-n{len(curves.tables[0].questions)}"
        else:
            what = f"{THROUGHPUT_SPLITS}b{s['batch_size']}"
        return (f"by-{AXIS_NAMES[curves.axis]}-{s['model']}-{what}-{s['max_new_tokens']}tok-{s['sampling']}-"
                f"{s['dtype']}-{s['hardware']}")

    name_uniquely(found, name, lambda curves: [curves.axis, [t.slug for t in curves.tables]])
    return found


def table_points(table: Table) -> list[Point]:
    """AR's point (its answers of the table's runs, pooled) and each method variant's."""
    s = table.settings
    base = baseline_records(table)
    lengths = [len(prompt) for record in base for prompt in record["choices"][0]["prompt_ids"]]
    length = statistics.fmean(lengths) if lengths else 0.0

    def point(label, method, config, records, baseline) -> Point:
        return Point(label, method, config, s["batch_size"], s["dataset"], len({r["question_id"] for r in records}),
                     length, decoder_stats(records)["throughput_tokens_per_second"],
                     decoder_stats(baseline)["throughput_tokens_per_second"],
                     len(busy_questions(records, baseline)["questions"]), table.slug)
    return [point(AR, AR, {}, base, base), *(point(label, row.method, row.config, list(row.records.values()),
                                                  list(row.baseline.values())) for label, row in table.rows.items())]


def best_draft_lengths(curves: Curves) -> list[dict]:
    """Per batch size and method variant but its draft length (`setting`: the method with its other
    settings) measured at two draft lengths (or tree sizes) or more: the length with the highest
    throughput, its throughput and its speedup over AR at that batch size."""
    by_setting: dict[tuple, list[Point]] = defaultdict(list)
    for point in curves.points:
        if point.size is not None:
            others = {k: v for k, v in point.config.items() if k not in SIZE_KEYS}
            by_setting[(point.batch_size, method_label(point.method, others))].append(point)
    best = []
    for (batch_size, setting), points in sorted(by_setting.items()):
        if len({p.size for p in points}) >= 2:
            top = max(points, key=lambda p: p.throughput)
            best.append({"batch_size": batch_size, "method": top.method, "setting": setting,
                         "parameter": size_of(top.method, top.config)[0], "best": top.size, "variant": top.label,
                         "throughput": top.throughput, "speedup": top.speedup,
                         "tried": ", ".join(f"{p.size:g}" for p in sorted(points, key=lambda p: p.size))})
    return best


def column_name(curves: Curves, point: Point) -> str:
    if curves.axis == "batch_size":
        return f"B={point.batch_size}"
    return f"{point.dataset} ({point.input_length:.0f} tok, n={point.questions})"


def caption(curves: Curves) -> str:
    s = curves.title_settings
    batch = f", batch size {s['batch_size']}" if curves.axis == "dataset" else ""
    busy = sum(bool(p.busy) for p in curves.points)
    return (f"{s['model']} on {s['hardware']}, {s['dtype']}; {s['dataset']}, n = {curves.n} questions{batch}, "
            f"max_new_tokens {s['max_new_tokens']}, {s['sampling']}; torch {s['torch']}, transformers "
            f"{s['transformers']}; engine {s['engine']}; {'BUSY: ' if busy else ''}{busy} of {len(curves.points)} "
            "points measured partly beside other work; each point's caveats: in its own table of this report "
            "(points.csv names it)")


def write_curves(curves: Curves, out: Path) -> list[Path]:
    """points.csv (every point with its settings), throughput_speedup.md (method × axis),
    throughput.md (AR too) and, over batch size where a method was measured at several draft
    lengths, best_draft_length.md/csv."""
    folder = out / curves.slug
    folder.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(column_name(curves, p) for p in sorted(curves.points, key=curves.value)))
    along = AXIS_NAMES[curves.axis]
    views = {"throughput_speedup": (f"Throughput speedup over AR at the same batch size, by {along}", False,
                                    lambda p: f"{p.speedup:.2f}×" if p.speedup else "–"),
             "throughput": (f"Throughput (tokens/s summed over the batch), by {along}; ar: at each point, the "
                            "AR answers its runs were paired with, pooled", True, lambda p: f"{p.throughput:.1f}")}
    written = []
    for name, (title, with_ar, show) in views.items():
        rows = []
        for label, points in curves.series(with_ar).items():
            cells = {column_name(curves, p): show(p) for p in points}
            rows.append([label, *(cells.get(c, "–") for c in columns)])
        (folder / f"{name}.md").write_text(markdown_table(pd.DataFrame(rows, columns=["method", *columns]),
                                                          f"**{title}** — {caption(curves)}"))
        written.append(folder / f"{name}.md")
    pd.DataFrame([{**curves.shared, "batch_size": p.batch_size, "dataset": p.dataset,
                   "method": p.label, "questions": p.questions, "input_length": p.input_length,
                   "throughput": p.throughput, "ar_throughput": p.ar_throughput, "speedup": p.speedup,
                   "busy": p.busy, "table": p.table} for p in sorted(curves.points, key=curves.value)],
                 dtype=object).to_csv(folder / "points.csv", index=False)
    written.append(folder / "points.csv")
    best = best_draft_lengths(curves) if curves.axis == "batch_size" else []
    if best:
        shown = pd.DataFrame([{"batch size": str(b["batch_size"]), "method": b["setting"],
                               "best": f"{b['parameter']} = {b['best']:g}", "tok/s": f"{b['throughput']:.1f}",
                               "speedup": f"{b['speedup']:.2f}×" if b["speedup"] else "–", "tried": b["tried"]}
                              for b in best])
        (folder / "best_draft_length.md").write_text(markdown_table(
            shown, f"**Best draft length per batch size (highest throughput)** — {caption(curves)}"))
        pd.DataFrame([{**curves.shared, **b} for b in best], dtype=object).to_csv(
            folder / "best_draft_length.csv", index=False
        )
        written += [folder / "best_draft_length.md", folder / "best_draft_length.csv"]
    else:  # none an earlier run set left
        for stale in (folder / "best_draft_length.md", folder / "best_draft_length.csv"):
            stale.unlink(missing_ok=True)
    return written


def main(argv=None) -> int:
    args = run_set_arguments(__doc__, argv, "results/report/<run set>")
    out = args.out or Path("results") / "report" / run_set_name(args.runs)
    tables = report(args.runs, out, args.select, args.tables_of)
    print("\n\n".join(sections(out, list(tables))) if args.tables_of else (out / "report.md").read_text())
    print(f"{len(tables)} table(s) from {', '.join(map(str, args.runs))} written under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
