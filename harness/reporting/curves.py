"""Curves across tables.

The curves a serving engineer asks for (docs/batching.md), drawn across the report's
tables by `make report` (tables) and `make figures` (figures) from any run set that holds them
(`make batch-sweep` makes one):

* over batch size: the tables whose settings differ only in batch size, on the same questions, at
  two batch sizes or more. Per method variant its throughput (tokens per second summed over the
  batch) and its speedup over the AR it was paired with (same batch size, same questions, same
  process); AR's throughput (the AR answers of its table's runs, pooled); and, per method measured
  at two draft lengths or more at a batch size, the draft length with the highest throughput.
* over input length: the tables of SPEED-Bench's throughput splits (`speed_bench_throughput_*`)
  whose settings differ only in the split, two splits or more: the throughput speedup against the
  mean prompt length (tokens per turn, chat template included).

Every other setting (model, hardware, dtype, max_new_tokens, sampling, torch, transformers, the
engine; and the batch size over input length) is shared by all points of a set of curves: runs
that differ in one get curves of their own. Each point names the table (`make report`) with its
caveats.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from harness.reporting.tables import (
    Row,
    Table,
    baseline_records,
    markdown_table,
    method_label,
    name_uniquely,
    settings_of,
)
from harness.stats import busy_questions, decoder_stats

THROUGHPUT_SPLITS = "speed_bench_throughput_"  # SPEED-Bench's splits by input length
AXES = ("batch_size", "dataset")  # the setting a set of curves varies
AXIS_NAMES = {"batch_size": "batch size", "dataset": "input length"}
AR = "ar"  # AR's label and method: its paired measurements of a table, pooled


@dataclass
class Point:
    """One method variant (or AR) at one table's settings."""

    label: str  # its method variant (every setting, as its table's row)
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
    def line(self) -> str:
        """The line it is drawn on (`line_of`)."""
        return line_of(self.method, self.config)[0]

    @property
    def speedup(self) -> float | None:
        return self.throughput / self.ar_throughput if self.ar_throughput else None

    @property
    def size(self) -> float | None:
        """Its draft length / tree size, when it is a number (`Settings.size_in`)."""
        size = settings_of(self.method).size_in(self.config)
        return size[1] if size and isinstance(size[1], (int, float)) else None


@dataclass
class Curves:
    """Tables whose settings differ only in `axis`: one point per method variant and table."""

    axis: str
    shared: dict  # the settings every point shares (tables.SETTING_NAMES but the axis)
    tables: list[Table]
    slug: str = ""
    points: list[Point] = field(default_factory=list)

    @property
    def rows(self) -> dict[str, Row]:
        """Every line's variant (`line_of`: its method and settings, what figures.styles and short_labels
        read), by its line label."""
        out = {}
        for table in self.tables:
            for row in table.rows.values():
                label, config = line_of(row.method, row.config)
                out.setdefault(label, replace(row, label=label, config=config))
        return out

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
        """line label (`line_of`) -> its points in axis order (AR's too when asked)."""
        out = defaultdict(list)
        for point in sorted(self.points, key=self.value):
            if with_ar or point.method != AR:
                out[point.line].append(point)
        return dict(out)


def line_of(method: str, config: dict) -> tuple[str, dict]:
    """A method variant's line across batch sizes or input lengths, and its settings: the variant, but
    where its size was `auto` (a string setting, as `num_draft=auto`) without the size each run
    resolved it to (`Settings.size_recorded`: the machine's curve, cut per batch size) and what
    follows from it (`size_derived`: an `auto` template's depth and top-k), so that one configuration
    is one line whatever size each point chose (points.csv keeps each point's)."""
    settings = settings_of(method)
    recorded, setting = settings.size_recorded, settings.size_setting
    sizing = config.get("sizing") if isinstance(config.get("sizing"), dict) else {}
    # what was asked: the sizing record's (a size recorded under its own setting holds the resolved
    # value there: Jacobi's block_size, MCSD's k_config; a template's `auto` is in its sizing only)
    asked = sizing.get(setting, config.get(setting)) if setting else None
    if isinstance(asked, str) and (recorded in config or setting in config):
        resolved = {key for key in (recorded, setting) if key} | set(settings.size_derived)
        config = {**{k: v for k, v in config.items() if k not in resolved}, setting: asked}
    return (AR if method == AR else method_label(method, config)), config


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
            others = {k: v for k, v in point.config.items() if k not in settings_of(point.method).size_keys()}
            by_setting[(point.batch_size, method_label(point.method, others))].append(point)
    best = []
    for (batch_size, setting), points in sorted(by_setting.items()):
        if len({p.size for p in points}) >= 2:
            top = max(points, key=lambda p: p.throughput)
            best.append({"batch_size": batch_size, "method": top.method, "setting": setting,
                         "parameter": settings_of(top.method).size_label, "best": top.size, "variant": top.label,
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
