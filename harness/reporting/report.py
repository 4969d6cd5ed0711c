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
last column of caveats (`harness.stats.text.caveat_note`: n, busy questions, outputs that differ from AR's,
a speedup above τ, a wide interval; in the CSV per cell, also as numbers).

Across tables whose settings differ only in batch size (or only in SPEED-Bench's throughput split),
the curves (harness/reporting/curves.py): throughput and its speedup over AR at the same batch
size, per batch size (or input length), and the best draft length per batch size, each under
`by-batch-size-…/` (`by-input-length-…/`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.reporting import published
from harness.reporting.breakdown import write_breakdown
from harness.reporting.curves import find_curves, write_curves
from harness.reporting.tables import build_tables, find_runs, group_table, slugify, tables_holding, write_tables


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


def main(argv=None) -> int:
    args = run_set_arguments(__doc__, argv, "results/report/<run set>")
    out = args.out or Path("results") / "report" / run_set_name(args.runs)
    tables = report(args.runs, out, args.select, args.tables_of)
    print("\n\n".join(sections(out, list(tables))) if args.tables_of else (out / "report.md").read_text())
    print(f"{len(tables)} table(s) from {', '.join(map(str, args.runs))} written under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
