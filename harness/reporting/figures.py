"""`make figures`: paper figures from one explicit set of runs (PNG and PDF, sized for a column).

    python -m harness.reporting.figures [RUNS ...] [--out DIR] [--select GLOB] [--tables-of RUN ...]

The runs are chosen as `make report` chooses them (by default every run under `results/` except
the committed reference run) and fall into the same tables: one folder of figures per table
(same settings, same questions) under `plots/<run set>/<table>/` (with `--tables-of`, only the tables
holding those runs' answers, as `make report`'s):
  speedup_by_dataset      speedup per column (category / dataset) per method, 95% interval bars
                          where a column has at least report.MIN_INTERVAL_N questions; a red x
                          over a bar measured partly on a busy machine
  size_sweep              τ and speedup against draft length / tree size (gamma, k-config nodes,
                          tree nodes, total_tokens, block size), one line per method swept over
                          at least two sizes; not written when no method was
  acceptance_by_position  acceptance rate per draft position with Wilson 95% intervals, one line
                          per method, over the number of times each position was tested
  ttft_vs_prompt_length   TTFT against prompt length, one point per turn, one series per method
                          and one for the AR baselines (LazyLLM)
  speedup_vs_tau          speedup (95% interval) against τ, with the ideal line speedup = τ; a red
                          ring marks a method measured partly on a busy machine
Across tables (`curves.py`'s curves: tables whose settings differ only in batch size, or
only in the SPEED-Bench throughput split), under `plots/<run set>/<curves>/`:
  speedup_vs_batch_size   throughput speedup over AR at the same batch size, one line per method
  / _vs_input_length      variant, against batch size or mean prompt length
  throughput_vs_batch_size  tokens/s summed over the batch, AR's line too (its paired answers pooled)
  / _vs_input_length
  best_draft_length       per method measured at several draft lengths: the one with the highest
                          throughput at each batch size, labelled with its speedup
A figure with nothing to show is not written (and an older one of that name is removed). Each
method has one colour in every figure (its variants differ by marker and line style); legends
name a method by its name, with the settings that tell its variants apart (the report's tables
name every setting); titles name the model, hardware, dtype, dataset, n and max_new_tokens.
The files are reproducible: the same runs draw the same bytes (no date in them).
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402
from scipy.stats import binomtest  # noqa: E402

from harness.reporting.curves import AR, Curves, best_draft_lengths, find_curves  # noqa: E402
from harness.reporting.report import run_set_arguments, run_set_name  # noqa: E402
from harness.reporting.tables import (  # noqa: E402
    OVERALL,
    Table,
    baseline_records,
    build_tables,
    column_counts,
    find_runs,
    group_table,
    method_label,
    settings_of,
    tables_holding,
)
from harness.stats import MIN_INTERVAL_N  # noqa: E402

plt.rcParams.update({"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 6.5, "figure.dpi": 150,
                     "axes.spines.top": False, "axes.spines.right": False})
COLUMN_WIDTH = 3.4  # inches: one column of a two-column paper
# One colour per method, the same in every figure and every run set (Tableau 10, then black, a teal,
# Tableau 20b's dark tones, a magenta and a rust: a pale colour is hard to see as a line); a method not
# listed here gets the last dark tone.
METHOD_ORDER = ("ar", "sps", "mcsd", "medusa", "hydra", "eagle", "eagle2", "eagle3", "jacobi", "lookahead",
                "pld", "recycling", "lazyllm", "suffix", "rest", "sam", "dflash", "pard")
PALETTE = ([plt.get_cmap("tab10")(i) for i in range(10)] + ["black", plt.get_cmap("tab20b")(0), "#e6ab02"]
           + [plt.get_cmap("tab20b")(4), "#1b9e77", plt.get_cmap("tab20b")(16), "#e7298a", "#b15928"]
           + [plt.get_cmap("tab20b")(12)])
BUSY_COLOUR = "red"
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINES = ("-", "--", ":", "-.")


def method_colour(method: str):
    if method in METHOD_ORDER:
        return PALETTE[METHOD_ORDER.index(method)]
    return PALETTE[len(METHOD_ORDER) + zlib.crc32(method.encode()) % (len(PALETTE) - len(METHOD_ORDER))]


def styles(table: Table | Curves) -> dict[str, dict]:
    """label -> colour (by method), marker and line style (by variant within the method)."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for label, row in table.rows.items():
        k = seen[row.method]
        seen[row.method] += 1
        out[label] = {"color": method_colour(row.method), "marker": MARKERS[k % len(MARKERS)],
                      "linestyle": LINES[k % len(LINES)], "hatch": [None, "//", "..", "xx"][k % 4]}
    return out


def short_labels(table: Table | Curves) -> dict[str, str]:
    """label -> the method's name, with only the settings that tell its variants in this table
    apart (`sps (gamma=2)`), and `[lossy]`: full labels (every setting) do not fit a legend."""
    variants = defaultdict(list)
    for label, row in table.rows.items():
        variants[row.method].append(label)
    out = {}
    for method, labels in variants.items():
        configs = {label: table.rows[label].config for label in labels}
        keys = {k for config in configs.values() for k in config}
        differ = {k for k in keys if len({str(config.get(k)) for config in configs.values()}) > 1}
        for label, config in configs.items():
            out[label] = method_label(method, {k: v for k, v in config.items() if k in differ or k == "lossless"})
    return out


def busy_count(cell: dict | None) -> int:
    """Questions of a table cell measured on a busy machine (0 where none or not recorded)."""
    return ((cell or {}).get("caveats") or {}).get("busy") or 0


def wilson_interval(accepted: int, tested: int) -> tuple[float, float]:
    """Wilson's 95% interval of an acceptance rate (`scipy.stats.binomtest`)."""
    interval = binomtest(accepted, tested).proportion_ci(0.95, method="wilson")
    return float(interval.low), float(interval.high)


def acceptance_points(cell: dict) -> list[tuple[int, float, float, float, int]]:
    """(draft position, rate, Wilson low, Wilson high, times tested) of every tested position."""
    points = []
    for d, (hit, tested) in enumerate(zip(cell.get("position_accepted") or [], cell.get("position_tested") or []), 1):
        if tested:
            points.append((d, hit / tested, *wilson_interval(hit, tested), tested))
    return points


def _plain_log_axis(axis) -> None:
    """A log axis labelled with plain numbers at 1, 2 and 5 of each decade, or at each decade only
    when the data span more than 2.5 decades (every minor tick's label overlaps its neighbours').
    Called once the data are drawn."""
    low, high = axis.get_data_interval()
    subs = (1.0, 2.0, 5.0) if high <= low * 10 ** 2.5 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=30))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def title_of(settings: dict, n) -> str:
    """The settings a figure's points share (a table's, or a curve's: `report.Curves.shared`)."""
    batch = f", batch size {settings['batch_size']}" if settings.get("batch_size", 1) > 1 else ""
    return (f"{settings['model']}, {settings['hardware']}, {settings['dtype']}\n{settings['dataset']}, n = {n}, "
            f"max_new_tokens {settings['max_new_tokens']}, {settings['sampling']}{batch}")


def legend_below(ax, ncols: int = 1) -> None:
    """The figure's legend under its axes (method labels are long: inside they hide the data);
    the figure grows by the legend's height so the axes keep theirs."""
    fig = ax.figure
    handles, labels = ax.get_legend_handles_labels()
    rows = math.ceil(len(labels) / ncols)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + 0.13 * rows + 0.1)
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, frameon=False)


# No creation date in a PDF (PNGs carry none): drawn again from the same runs, a figure is the same bytes
METADATA = {".png": None, ".pdf": {"CreationDate": None}}


def save_figure(fig, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, bbox_inches="tight", metadata=METADATA[path.suffix])
    plt.close(fig)
    return paths


def _nothing_to_show(out: Path, name: str) -> list[Path]:
    """No figure without data: none is written, and one an earlier run set left is removed."""
    for path in (out / f"{name}.png", out / f"{name}.pdf"):
        path.unlink(missing_ok=True)
    return []


def speedup_by_dataset(table: Table, columns, cells, style, out) -> list[Path]:
    labels = list(cells)
    names = short_labels(table)
    counts = column_counts(table)
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH * 2, 2.4))
    width = 0.8 / max(1, len(labels))
    busy = []  # (x, top) of bars measured partly on a busy machine
    for i, label in enumerate(labels):
        xs, ys, bars = [], [], []  # bars: (x, y, below, above) where the cell has enough questions
        for j, column in enumerate(columns):
            cell = cells[label].get(column)
            if cell and cell["speedup"] is not None:
                x = j + (i - (len(labels) - 1) / 2) * width
                xs.append(x)
                ys.append(cell["speedup"])
                top = cell["speedup"]
                if cell["questions"] >= MIN_INTERVAL_N:
                    low, high = cell["speedup_ci95"]
                    bars.append((x, cell["speedup"], max(0.0, cell["speedup"] - low), max(0.0, high - cell["speedup"])))
                    top = max(top, high)
                if busy_count(cell):
                    busy.append((x, top))
        ax.bar(xs, ys, width, label=names[label], color=style[label]["color"], hatch=style[label]["hatch"],
               edgecolor="white", linewidth=0.3)
        if bars:
            ax.errorbar([b[0] for b in bars], [b[1] for b in bars], yerr=[[b[2] for b in bars], [b[3] for b in bars]],
                        fmt="none", ecolor="black", capsize=1.5, linewidth=0.6)
    if busy:
        ax.scatter([x for x, _ in busy], [1.04 * top for _, top in busy], marker="x", s=10, linewidth=0.8,
                   color=BUSY_COLOUR, label="measured partly on a busy machine")
    ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(columns)), [f"{c} (n={counts.get(c, 0)})" for c in columns], rotation=30, ha="right")
    ax.set_ylabel("speedup over AR (×)")
    ax.set_title(title_of(table.settings, len(table.questions)) + f"; bars: 95% intervals where n >= {MIN_INTERVAL_N}")
    legend_below(ax, ncols=4)
    return save_figure(fig, out, "speedup_by_dataset")


def size_sweep(table: Table, cells, style, out) -> list[Path]:
    """τ and speedup of each method measured at two sizes or more (points of one method joined only
    within this table: one run set, one set of settings); not written when no method was."""
    series = defaultdict(list)  # (method, parameter name) -> [(size, tau, speedup, low, high)]
    for label, row in table.rows.items():
        size = settings_of(row.method).size_in(row.config)
        cell = cells[label].get(OVERALL)
        if size and cell and isinstance(size[1], (int, float)):  # `adaptive` / `auto` sizes have no point on the axis
            low, high = cell["speedup_ci95"] if cell["questions"] >= MIN_INTERVAL_N else (None, None)
            series[(row.method, size[0])].append((size[1], cell["tau"], cell["speedup"], low, high))
    series = {key: sorted(points) for key, points in series.items() if len({p[0] for p in points}) >= 2}
    if not series:
        return _nothing_to_show(out, "size_sweep")
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, layout="constrained", figsize=(COLUMN_WIDTH * 2, 2.2))
    sizes = set()
    for (method, parameter), points in sorted(series.items()):
        xs = [p[0] for p in points]
        sizes.update(xs)
        colour = method_colour(method)
        ax_tau.plot(xs, [p[1] for p in points], marker="o", markersize=3, color=colour, label=f"{method}: {parameter}")
        ax_speed.plot(xs, [p[2] for p in points], marker="o", markersize=3, color=colour)
        bars = [p for p in points if p[3] is not None]
        if bars:
            ax_speed.errorbar([p[0] for p in bars], [p[2] for p in bars], fmt="none", ecolor=colour, capsize=1.5,
                              linewidth=0.6, yerr=[[p[2] - p[3] for p in bars], [p[4] - p[2] for p in bars]])
    ax_tau.set_ylabel("τ (tokens per step)")
    ax_speed.set_ylabel("speedup over AR (×)")
    ax_speed.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    for ax in (ax_tau, ax_speed):
        ax.set_xlabel("draft length / tree size")
        if len(sizes) <= 12:
            ax.set_xticks(sorted(sizes))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    legend_below(ax_tau, ncols=2)
    fig.suptitle(
        title_of(table.settings, len(table.questions)) + f"; bars: 95% intervals where n >= {MIN_INTERVAL_N}",
        fontsize=8,
    )
    return save_figure(fig, out, "size_sweep")


def acceptance_by_position(table: Table, cells, style, out) -> list[Path]:
    """Acceptance rate per draft position with Wilson 95% intervals (a deep position is tested
    rarely: its interval says how little its rate rests on), over the times each was tested."""
    names = short_labels(table)
    series = {label: acceptance_points(by_column.get(OVERALL) or {}) for label, by_column in cells.items()}
    series = {label: points for label, points in series.items() if points}
    if not series:
        return _nothing_to_show(out, "acceptance_by_position")
    fig, (ax, ax_n) = plt.subplots(2, 1, sharex=True, layout="constrained", figsize=(COLUMN_WIDTH, 3.2),
                                   gridspec_kw={"height_ratios": [2.2, 1]})
    shift = 0.3 / max(1, len(series))  # methods side by side at each position, so their intervals stay apart
    for i, (label, points) in enumerate(series.items()):
        xs = [d + (i - (len(series) - 1) / 2) * shift for d, *_ in points]
        rates = [p[1] for p in points]
        look = {k: style[label][k] for k in ("color", "marker", "linestyle")}
        ax.errorbar(
            xs,
            rates,
            yerr=[[r - p[2] for r, p in zip(rates, points)], [p[3] - r for r, p in zip(rates, points)]],
            markersize=3,
            linewidth=1.2,
            elinewidth=0.6,
            capsize=1.2,
            label=names[label],
            **look,
        )
        ax_n.plot(xs, [p[4] for p in points], markersize=2.5, linewidth=0.9, **look)
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title_of(table.settings, len(table.questions)) + "\nbars: Wilson 95% intervals")
    ax_n.set_yscale("log")
    _plain_log_axis(ax_n.yaxis)
    ax_n.set_ylabel("times tested")
    ax_n.set_xlabel("draft position (depth)")
    ax_n.xaxis.set_major_locator(MaxNLocator(integer=True))
    legend_below(ax, ncols=2)
    return save_figure(fig, out, "acceptance_by_position")


def ttft_vs_prompt_length(table: Table, style, out) -> list[Path]:
    """One point per turn (questions are unrelated: no line joins them), one series per method and
    one for the AR baselines the methods were paired with."""
    names = short_labels(table)
    series = {names[label]: (style[label], _turn_ttfts(row.records.values())) for label, row in table.rows.items()}
    baseline = _turn_ttfts(baseline_records(table))
    if not baseline and not any(points for _, points in series.values()):
        return _nothing_to_show(out, "ttft_vs_prompt_length")
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.4))
    if baseline:
        ax.scatter([p for p, _ in baseline], [1000 * t for _, t in baseline], s=14, marker="o", facecolors="none",
                   edgecolors=method_colour("ar"), linewidths=0.5, label="AR baselines (full prefill)")
    for name, (look, points) in series.items():
        ax.scatter(
            [p for p, _ in points],
            [1000 * t for _, t in points],
            s=6,
            marker=look["marker"],
            color=look["color"],
            alpha=0.8,
            linewidths=0,
            label=name,
        )
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_axis(ax.xaxis)
    _plain_log_axis(ax.yaxis)
    ax.set_title(title_of(table.settings, len(table.questions)))
    legend_below(ax, ncols=3)
    return save_figure(fig, out, "ttft_vs_prompt_length")


def _turn_ttfts(records) -> list[tuple[int, float]]:
    points = []
    for record in records:
        choice = record["choices"][0]
        points += [(len(prompt), stats["ttft"]) for prompt, stats in zip(choice["prompt_ids"], choice["stats"])]
    return points


def speedup_vs_tau(table: Table, cells, style, out) -> list[Path]:
    """Each method's speedup (95% interval where n >= MIN_INTERVAL_N) against its τ, under the
    ideal line speedup = τ that no method can pass without a cheaper prefill or a slower AR timing;
    a red ring marks a method measured partly on a busy machine."""
    names = short_labels(table)
    points = [(label, cell) for label, cell in ((label, by_column.get(OVERALL)) for label, by_column in cells.items())
              if cell and cell["speedup"] is not None]
    if not points:
        return _nothing_to_show(out, "speedup_vs_tau")
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.6))
    highest, lowest = 1.0, 1.0
    for label, cell in points:
        tau, speedup = cell["tau"], cell["speedup"]
        low, high = cell["speedup_ci95"] if cell["questions"] >= MIN_INTERVAL_N else (speedup, speedup)
        ax.errorbar(
            [tau],
            [speedup],
            yerr=[[speedup - low], [high - speedup]],
            fmt=style[label]["marker"],
            markersize=4,
            color=style[label]["color"],
            elinewidth=0.7,
            capsize=1.5,
            label=names[label],
        )
        highest, lowest = max(highest, tau, high), min(lowest, low)
    busy = [(cell["tau"], cell["speedup"]) for _, cell in points if busy_count(cell)]
    if busy:
        ax.scatter([t for t, _ in busy], [v for _, v in busy], s=70, facecolors="none", edgecolors=BUSY_COLOUR,
                   linewidths=0.9, label="measured partly on a busy machine", zorder=3)
    top = highest * 1.08
    bottom = min(0.0, lowest) if lowest < 0.5 else 0.5 * math.floor(2 * lowest * 0.9)
    ax.plot([0, top], [0, top], color="black", linewidth=0.6, linestyle="--", label="ideal: speedup = τ")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel("τ (mean accepted tokens per decoding step)")
    ax.set_ylabel("speedup over AR (×)")
    ax.set_xlim(min(0.9, min(cell["tau"] for _, cell in points) - 0.1), top)
    ax.set_ylim(bottom, top)
    ax.set_title(title_of(table.settings, len(table.questions)) + f"\nbars: 95% intervals where n >= {MIN_INTERVAL_N}")
    legend_below(ax, ncols=2)
    return save_figure(fig, out, "speedup_vs_tau")


AR_STYLE = {"color": method_colour("ar"), "marker": "o", "linestyle": "-"}
AXIS_LABELS = {"batch_size": "batch size B (sequences decoded together)",
               "dataset": "input length (mean prompt tokens per turn)"}


def _axis_ticks(ax, values) -> None:
    """A log axis (base 2) with a tick at each measured value, labelled plainly."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(values), [f"{v:.0f}" for v in sorted(values)])
    ax.xaxis.set_minor_formatter(NullFormatter())


def busy_rings(ax, points: list[tuple[float, float]]) -> None:
    if points:
        ax.scatter([x for x, _ in points], [y for _, y in points], s=60, facecolors="none", edgecolors=BUSY_COLOUR,
                   linewidths=0.8, label="measured partly on a busy machine", zorder=3)


def curve(curves: Curves, metric: str, style, out) -> list[Path]:
    """Throughput speedup over AR at the same batch size (`speedup`), or throughput with AR's line
    (`throughput`), against batch size or input length: one line per method variant; a red ring
    marks a point measured partly on a busy machine."""
    names = {**short_labels(curves), AR: "AR (its paired answers, pooled)"}
    along = "batch_size" if curves.axis == "batch_size" else "input_length"
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.6))
    values, busy = set(), []
    for label, points in curves.series(with_ar=metric == "throughput").items():
        xs = [curves.value(p) for p in points]
        ys = [p.speedup if metric == "speedup" else p.throughput for p in points]
        look = AR_STYLE if label == AR else {k: style[label][k] for k in ("color", "marker", "linestyle")}
        ax.plot(xs, ys, markersize=3, linewidth=1.1, label=names[label], **look)
        values.update(xs)
        busy += [(x, y) for x, y, p in zip(xs, ys, points) if p.busy]
    busy_rings(ax, busy)
    _axis_ticks(ax, values)
    if metric == "speedup":
        ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
        ax.set_ylabel("throughput speedup over AR (×)")
    else:
        ax.set_ylabel("throughput (tokens/s, batch summed)")
        ax.set_ylim(bottom=0)
    ax.set_xlabel(AXIS_LABELS[curves.axis])
    ax.set_title(title_of(curves.title_settings, curves.n) + "\nAR at the same batch size, same questions")
    legend_below(ax, ncols=2)
    return save_figure(fig, out, f"{metric}_vs_{along}")


def best_draft_length(curves: Curves, out) -> list[Path]:
    """Per method (with its other settings) measured at several draft lengths: the one with the
    highest throughput at each batch size, each point labelled with its speedup over AR; not
    written when no method was."""
    by_setting = defaultdict(list)
    for best in best_draft_lengths(curves):
        by_setting[best["setting"]].append(best)
    if not by_setting:
        return _nothing_to_show(out, "best_draft_length")
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.6))
    for i, (setting, points) in enumerate(by_setting.items()):
        # side by side (a few % of an octave) and their labels stacked: two may share a length
        xs = [p["batch_size"] * 2 ** (0.04 * (i - (len(by_setting) - 1) / 2)) for p in points]
        ys = [p["best"] for p in points]
        colour = method_colour(points[0]["method"])
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=3, linewidth=1.1, color=colour,
                label=f"{setting}: {points[0]['parameter']}")
        for x, y, p in zip(xs, ys, points):
            if p["speedup"]:
                ax.annotate(f"{p['speedup']:.2f}×", (x, y), textcoords="offset points", xytext=(0, 4 + 7 * i),
                            ha="center", fontsize=6, color=colour)
    _axis_ticks(ax, {p["batch_size"] for points in by_setting.values() for p in points})
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.1 + 0.05 * len(by_setting))  # room for the labels
    ax.set_xlabel(AXIS_LABELS["batch_size"])
    ax.set_ylabel("best draft length (highest tok/s)")
    ax.set_title(title_of(curves.title_settings, curves.n) + "\nlabels: its throughput speedup over AR")
    legend_below(ax)  # a method with its other settings: long names
    return save_figure(fig, out, "best_draft_length")


def figures(paths, out: Path, select: str | None = None, tables_of=None) -> list[Path]:
    """The figures of the run set's tables (with `tables_of`, run folders: of the tables holding their answers,
    and the curves through those) under `out`; every other table's figures stay as they are."""
    written = []
    tables = build_tables(find_runs(paths, select))
    drawn = set()
    for table in tables_holding(tables, tables_of):
        drawn.add(table.slug)
        folder = out / table.slug
        columns, cells = group_table(table)
        style = styles(table)
        written += speedup_by_dataset(table, columns, cells, style, folder)
        written += size_sweep(table, cells, style, folder)
        written += acceptance_by_position(table, cells, style, folder)
        written += ttft_vs_prompt_length(table, style, folder)
        written += speedup_vs_tau(table, cells, style, folder)
    for curves in find_curves(tables):
        if not any(table.slug in drawn for table in curves.tables):
            continue
        folder = out / curves.slug
        style = styles(curves)
        written += curve(curves, "speedup", style, folder) + curve(curves, "throughput", style, folder)
        if curves.axis == "batch_size":
            written += best_draft_length(curves, folder)
    return written


def main(argv=None) -> int:
    args = run_set_arguments(__doc__, argv, "plots/<run set>")
    out = args.out or Path("plots") / run_set_name(args.runs)
    written = figures(args.runs, out, args.select, args.tables_of)
    for path in written:
        print(path)
    print(f"{len(written)} files from {', '.join(map(str, args.runs))} written under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
