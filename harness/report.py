"""`make report`: tables from every results folder, recomputed from the answer records.

    python -m harness.report [--results results] [--select GLOB] [--out results/report]
    python -m harness.report --jobs results/.multirun/<sweep>      # status of a sweep's jobs

One table per (model, hardware, dtype, torch, transformers): runs from different hardware or
software never share a column. Rows are method variants (a method and its parameters), columns
are Spec-Bench categories (or datasets) plus an overall column over all questions of the row,
Spec-Bench style. Tables: speedup with its bootstrap 95% interval, τ, acceptance rate, TTFT; each
written as Markdown, CSV and LaTeX.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from harness.metrics import decoder_stats, decomposition, fidelity, speedup_stats
from harness.results import read_jsonl

SKIP_DIRS = {".multirun", "perf", "report"}
OVERALL = "Overall"
TABLES = ("speedup", "tau", "acceptance", "ttft")


@dataclass
class Run:
    path: Path
    summary: dict
    records: list[dict]
    baseline: list[dict]

    @property
    def group(self) -> tuple:
        env = self.summary.get("environment", {})
        return (self.summary["model"], self.summary.get("hardware"), self.summary.get("dtype"),
                env.get("torch"), env.get("transformers"))

    @property
    def label(self) -> str:
        return method_label(self.summary["method"], self.summary.get("method_config") or {})


def method_label(method: str, config: dict) -> str:
    """`sps` with its parameters, e.g. `sps (gamma=4)`; nested values are left out."""
    params = [f"{k}={_short(v)}" for k, v in sorted(config.items())
              if k not in ("method", "lossless") and v is not None and not isinstance(v, dict)]
    label = f"{method} ({', '.join(params)})" if params else method
    return label + (" [lossy]" if config.get("lossless") is False else "")


def _short(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def find_runs(root: Path, select: str | None = None) -> list[Run]:
    runs = []
    for summary_file in sorted(Path(root).rglob("summary.json")):
        relative = summary_file.parent.relative_to(root)
        if set(relative.parts) & SKIP_DIRS:
            continue
        if select and not fnmatch.fnmatch(str(relative), select):
            continue
        summary = json.loads(summary_file.read_text())
        method = summary["method"]
        records = read_jsonl(summary_file.parent / "answers" / f"{method}.jsonl")
        baseline = []
        if summary.get("baseline_results"):
            baseline = read_jsonl(Path(summary["baseline_results"]) / "answers" / "ar.jsonl")
        runs.append(Run(summary_file.parent, summary, records, baseline))
    return runs


@dataclass
class Row:
    """One method variant in one group: its records and its baseline's, merged over runs."""

    label: str
    method: str
    records: dict = field(default_factory=dict)  # question id -> record
    baseline: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)  # question id -> column name
    config: dict = field(default_factory=dict)


def column_of(summary: dict, record: dict) -> str:
    return record["category"] if summary["dataset"] == "spec_bench" else summary["dataset"]


def build_rows(runs: list[Run]) -> dict[tuple, dict[str, Row]]:
    groups: dict[tuple, dict[str, Row]] = defaultdict(dict)
    for run in runs:
        if run.summary["method"] == "ar" or not run.baseline:
            continue
        row = groups[run.group].setdefault(run.label, Row(run.label, run.summary["method"], config=run.summary.get("method_config", {})))
        base_by_id = {r["question_id"]: r for r in run.baseline}
        for record in run.records:
            key = (run.summary["dataset"], record["question_id"])
            if record["question_id"] in base_by_id and key not in row.records:
                row.records[key] = record
                row.baseline[key] = base_by_id[record["question_id"]]
                row.columns[key] = column_of(run.summary, record)
    return groups


def cell_metrics(records: list[dict], baseline: list[dict]) -> dict:
    stats = decoder_stats(records)
    speed = speedup_stats(records, baseline)
    return {
        "speedup": speed["specbench"], "speedup_ci95": speed["specbench_ci95"], "tau": stats["tau"],
        "acceptance": stats["acceptance_rate"], "ttft": stats["mean_ttft"], "questions": len(records),
        "acceptance_per_position": stats["acceptance_per_position"],
    }


def group_table(rows: dict[str, Row]) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """Columns (sorted, then Overall) and label -> column -> metrics."""
    columns = sorted({c for row in rows.values() for c in row.columns.values()})
    table = {}
    for label, row in sorted(rows.items()):
        cells = {}
        for column in columns + [OVERALL]:
            keys = [k for k, c in row.columns.items() if column in (c, OVERALL)]
            if keys:
                cells[column] = cell_metrics([row.records[k] for k in keys], [row.baseline[k] for k in keys])
        table[label] = cells
    return columns + [OVERALL], table


def format_value(metric: str, cell: dict | None, latex: bool = False) -> str:
    if not cell or cell.get(metric) is None:
        return "–"
    value = cell[metric]
    if metric == "speedup":
        low, high = cell["speedup_ci95"]
        times = r"$\times$" if latex else "×"
        return f"{value:.2f}{times} [{low:.2f}, {high:.2f}]"
    if metric == "ttft":
        return f"{1000 * value:.0f}"
    return f"{value:.2f}"


TITLES = {"speedup": "Speedup over AR (Spec-Bench form, bootstrap 95% CI)", "tau": "τ (tokens per target forward)",
          "acceptance": "Acceptance rate α (accepted / proposed draft tokens)", "ttft": "TTFT (ms, mean per turn)"}


def group_folder(out: Path, group: tuple) -> Path:
    model, hardware, dtype = group[:3]
    return out / re.sub(r"[^a-z0-9]+", "-", f"{model}-{hardware}-{dtype}".lower()).strip("-")


def write_tables(group: tuple, columns: list[str], table: dict, out: Path) -> list[Path]:
    model, hardware, dtype, torch_version, transformers_version = group
    folder = group_folder(out, group)
    folder.mkdir(parents=True, exist_ok=True)
    caption = f"{model} on {hardware}, {dtype}, torch {torch_version}, transformers {transformers_version}"
    written = []
    for metric in TABLES:
        header = ["method", *columns]
        body = [[label, *(format_value(metric, cells.get(c)) for c in columns)] for label, cells in table.items()]
        md = [f"**{TITLES[metric]}** — {caption}", "", "| " + " | ".join(header) + " |",
              "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in body]
        (folder / f"{metric}.md").write_text("\n".join(md) + "\n")
        with open(folder / f"{metric}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["model", "hardware", "dtype", "torch", "transformers", "method", "column", metric,
                             "ci_low", "ci_high", "questions"])
            for label, cells in table.items():
                for column in columns:
                    cell = cells.get(column)
                    if cell:
                        low, high = cell["speedup_ci95"] if metric == "speedup" else (None, None)
                        writer.writerow([*group, label, column, cell[metric], low, high, cell["questions"]])
        esc = lambda text: str(text).replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")  # noqa: E731
        tex = [r"\begin{table}[t]", r"\centering", r"\small",
               r"\begin{tabular}{l" + "c" * len(columns) + "}", r"\toprule",
               " & ".join(esc(h) for h in header) + r" \\", r"\midrule"]
        tex += [" & ".join([esc(label), *(format_value(metric, cells.get(c), latex=True) for c in columns)]) + r" \\"
                for label, cells in table.items()]
        tex += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{esc(TITLES[metric])}. {esc(caption)}.}}", r"\end{table}"]
        (folder / f"{metric}.tex").write_text("\n".join(tex).replace("τ", r"$\tau$").replace("α", r"$\alpha$") + "\n")
        written += [folder / f"{metric}.{ext}" for ext in ("md", "csv", "tex")]
    return written


PHASES = ("prefill", "draft", "verify", "accept", "commit", "other")


def breakdown_rows(rows: dict[str, Row]) -> list[dict]:
    """Per method variant over all its questions: speed, fidelity to AR and where the time goes."""
    out = []
    for label, row in sorted(rows.items()):
        keys = list(row.records)
        records, baseline = [row.records[k] for k in keys], [row.baseline[k] for k in keys]
        stats, speed, fid = decoder_stats(records), speedup_stats(records, baseline), fidelity(records, baseline)
        base_stats = decoder_stats(baseline)
        explained = decomposition(stats, base_stats)
        positions = sorted(d["position"] for d in fid["first_divergence"])
        out.append({
            "method": label, "questions": len(records), "speedup": speed["specbench"],
            "ci_low": speed["specbench_ci95"][0], "ci_high": speed["specbench_ci95"][1], "tau": stats["tau"],
            "tokens_per_second": stats["tokens_per_second"],
            "ar_tokens_per_second": base_stats["tokens_per_second"],
            **{f"step_{k}": (explained or {}).get(k) for k in ("verify", "draft", "other")},
            "predicted": (explained or {}).get("predicted_decode_speedup"),
            "lossless": row.config.get("lossless", True), "differ_from_ar": fid["differing_questions"],
            "first_divergence_median": positions[len(positions) // 2] if positions else None,
            **{phase: stats["time_fractions"].get(phase, 0.0) for phase in PHASES},
        })
    return out


def _per_step(row: dict) -> str:
    if row["step_verify"] is None:
        return "–"
    return " / ".join(f"{row[f'step_{k}']:.2f}" for k in ("verify", "draft", "other"))


def write_breakdown(group: tuple, rows: dict[str, Row], folder: Path) -> list[Path]:
    """`breakdown.md/csv`: one line per method with speedup, τ, tokens/s, how many questions'
    outputs differ from AR's (and the median first differing token), and the time fractions."""
    model, hardware, dtype, torch_version, transformers_version = group
    lines = breakdown_rows(rows)
    header = ["method", "questions", "speedup", "τ", "verify / draft / other per step", "predicted", "tok/s (AR)",
              "differ from AR", *[f"{p} %" for p in PHASES]]
    md = [f"**Per method: speed, fidelity, time breakdown (% of wall time)** — {model} on {hardware}, {dtype}, "
          f"torch {torch_version}, transformers {transformers_version}. Per step: the cost of a decoding step's "
          "verify, draft and other work in units of AR's mean decoding step; predicted = τ / their sum "
          "(decoding only; the measured speedup also pays the prefill).", "",
          "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in lines:
        differ = f"{r['differ_from_ar']}/{r['questions']}"
        if r["differ_from_ar"]:
            differ += f" (first at token {r['first_divergence_median']}, median)"
        if not r["lossless"]:
            differ += " lossy"
        md.append("| " + " | ".join([
            r["method"], str(r["questions"]), f"{r['speedup']:.2f}× [{r['ci_low']:.2f}, {r['ci_high']:.2f}]",
            f"{r['tau']:.2f}", _per_step(r), "–" if r["predicted"] is None else f"{r['predicted']:.2f}×",
            f"{r['tokens_per_second']:.1f} ({r['ar_tokens_per_second']:.1f})", differ,
            *[f"{100 * r[p]:.0f}" for p in PHASES]]) + " |")
    (folder / "breakdown.md").write_text("\n".join(md) + "\n")
    with open(folder / "breakdown.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "hardware", "dtype", "torch", "transformers", *lines[0]])
        writer.writeheader()
        for r in lines:
            writer.writerow(dict(zip(writer.fieldnames, group)) | r)
    return [folder / "breakdown.md", folder / "breakdown.csv"]


def report(root: Path, out: Path, select: str | None = None) -> dict:
    groups = build_rows(find_runs(root, select))
    out.mkdir(parents=True, exist_ok=True)
    index, tables = [], {}
    for group, rows in sorted(groups.items(), key=lambda kv: [str(x) for x in kv[0]]):
        columns, table = group_table(rows)
        tables[group] = (columns, table)
        write_tables(group, columns, table, out)
        folder = group_folder(out, group)
        write_breakdown(group, rows, folder)
        for name in ("breakdown", "speedup", "tau"):
            index.append((folder / f"{name}.md").read_text())
    (out / "report.md").write_text("\n\n".join(index) + "\n" if index else "No runs with a baseline found.\n")
    return tables


def job_status(sweep_dir: Path) -> list[dict]:
    jobs = [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob("*/job.json"))]
    return sorted(jobs, key=lambda j: j.get("job", 0))


def print_jobs(sweep_dir: Path) -> int:
    jobs = job_status(sweep_dir)
    failed = [j for j in jobs if j["status"] != "ok"]
    print(f"{len(jobs)} jobs in {sweep_dir}: {len(jobs) - len(failed)} ok, {len(failed)} failed")
    for job in jobs:
        overrides = " ".join(job["overrides"])
        if job["status"] == "ok":
            speed = "-" if job.get("speedup") is None else f"{job['speedup']:.2f}x"
            print(f"  #{job['job']} ok      {overrides}  speedup {speed}  τ {job['tau']:.2f}  {job['results']}")
        else:
            print(f"  #{job['job']} FAILED  {overrides}  {job['error']}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out", type=Path, default=Path("results/report"))
    parser.add_argument("--select", help="glob over <model>/<dataset>/<method>/<run> folders")
    parser.add_argument("--jobs", type=Path, help="print the status of the jobs of a sweep folder instead")
    args = parser.parse_args(argv)
    if args.jobs:
        return print_jobs(args.jobs)
    tables = report(args.results, args.out, args.select)
    text = (args.out / "report.md").read_text()
    print(text)
    print(f"{len(tables)} table group(s) written under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
