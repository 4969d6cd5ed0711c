"""`make figures`: paper figures from one explicit set of runs (PNG and PDF, sized for a column).

    python -m harness.figures [RUNS ...] [--out DIR] [--select GLOB]

The runs are chosen as `make report` chooses them (by default every run under `results/` except
the committed reference run) and fall into the same tables: one folder of figures per table
(same settings, same questions) under `plots/<run set>/<table>/`:
  speedup_by_dataset      speedup per column (category / dataset) per method, 95% interval bars
                          where a column has at least report.MIN_INTERVAL_N questions
  size_sweep              τ and speedup against draft length / tree size (gamma, k-config nodes,
                          tree nodes, total_tokens, block size), one line per method
  acceptance_by_position  acceptance rate per draft position, one line per method
  ttft_vs_prompt_length   TTFT against prompt length for each method and its AR baseline (LazyLLM)
  speedup_vs_tau          speedup against τ, with the ideal line speedup = τ
Each method has one colour in every figure (its variants differ by marker and line style); titles
name the model, hardware, dtype, dataset, n and max_new_tokens.
"""

from __future__ import annotations

import argparse
import math
import zlib
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from harness.report import (  # noqa: E402
    MIN_INTERVAL_N, OVERALL, Table, build_tables, column_counts, find_runs, group_table, run_set_name)

plt.rcParams.update({"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 6.5, "figure.dpi": 150,
                     "axes.spines.top": False, "axes.spines.right": False})
COLUMN_WIDTH = 3.4  # inches: one column of a two-column paper
# One colour per method, the same in every figure and every run set (Tableau 10, then Tableau 20's
# light tones); a method not listed here gets one from its name's hash.
METHOD_ORDER = ("ar", "sps", "mcsd", "medusa", "hydra", "eagle", "eagle2", "eagle3", "jacobi", "lookahead",
                "pld", "recycling", "lazyllm")
PALETTE = [plt.get_cmap("tab10")(i) for i in range(10)] + [plt.get_cmap("tab20")(2 * i + 1) for i in range(10)]
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINES = ("-", "--", ":", "-.")


def method_colour(method: str):
    if method in METHOD_ORDER:
        return PALETTE[METHOD_ORDER.index(method)]
    return PALETTE[len(METHOD_ORDER) + zlib.crc32(method.encode()) % (len(PALETTE) - len(METHOD_ORDER))]


def styles(table: Table) -> dict[str, dict]:
    """label -> colour (by method), marker and line style (by variant within the method)."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for label, row in table.rows.items():
        k = seen[row.method]
        seen[row.method] += 1
        out[label] = {"color": method_colour(row.method), "marker": MARKERS[k % len(MARKERS)],
                      "linestyle": LINES[k % len(LINES)], "hatch": [None, "//", "..", "xx"][k % 4]}
    return out


def title_of(table: Table) -> str:
    s = table.settings
    return (f"{s['model']}, {s['hardware']}, {s['dtype']}\n{s['dataset']}, n = {len(table.questions)}, "
            f"max_new_tokens {s['max_new_tokens']}, {s['sampling']}")


def size_of(method: str, config: dict) -> tuple[str, float] | None:
    """The draft length / tree size parameter of a method variant, if it has one."""
    if "gamma" in config:
        return "draft length γ", config["gamma"]
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


def _legend_below(ax, ncols: int = 1) -> None:
    """The figure's legend under its axes (method labels are long: inside they hide the data);
    the figure grows by the legend's height so the axes keep theirs."""
    fig = ax.figure
    handles, labels = ax.get_legend_handles_labels()
    rows = math.ceil(len(labels) / ncols)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + 0.13 * rows + 0.1)
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, frameon=False)


def _save(fig, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return paths


def speedup_by_dataset(table: Table, columns, cells, style, out) -> list[Path]:
    labels = list(cells)
    counts = column_counts(table)
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH * 2, 2.4))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs, ys, bars = [], [], []  # bars: (x, y, below, above) where the cell has enough questions
        for j, column in enumerate(columns):
            cell = cells[label].get(column)
            if cell and cell["speedup"] is not None:
                x = j + (i - (len(labels) - 1) / 2) * width
                xs.append(x)
                ys.append(cell["speedup"])
                if cell["questions"] >= MIN_INTERVAL_N:
                    low, high = cell["speedup_ci95"]
                    bars.append((x, cell["speedup"], max(0.0, cell["speedup"] - low), max(0.0, high - cell["speedup"])))
        ax.bar(xs, ys, width, label=label, color=style[label]["color"], hatch=style[label]["hatch"],
               edgecolor="white", linewidth=0.3)
        if bars:
            ax.errorbar([b[0] for b in bars], [b[1] for b in bars], yerr=[[b[2] for b in bars], [b[3] for b in bars]],
                        fmt="none", ecolor="black", capsize=1.5, linewidth=0.6)
    ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(columns)), [f"{c} (n={counts.get(c, 0)})" for c in columns], rotation=30, ha="right")
    ax.set_ylabel("speedup over AR (×)")
    ax.set_title(title_of(table) + f"; bars: 95% intervals where n >= {MIN_INTERVAL_N}")
    _legend_below(ax, ncols=2)
    return _save(fig, out, "speedup_by_dataset")


def size_sweep(table: Table, cells, style, out) -> list[Path]:
    """Points of one method joined only within this table (one run set, one set of settings)."""
    series = defaultdict(list)  # (method, parameter name) -> [(size, tau, speedup)]
    for label, row in table.rows.items():
        size = size_of(row.method, row.config)
        cell = cells[label].get(OVERALL)
        if size and cell and isinstance(size[1], (int, float)):  # `adaptive` / `auto` sizes have no point on the axis
            series[(row.method, size[0])].append((size[1], cell["tau"], cell["speedup"]))
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, layout="constrained", figsize=(COLUMN_WIDTH * 2, 2.2))
    sizes = set()
    for (method, parameter), points in sorted(series.items()):
        points.sort()
        xs = [p[0] for p in points]
        sizes.update(xs)
        for ax, index in ((ax_tau, 1), (ax_speed, 2)):
            ax.plot(xs, [p[index] for p in points], marker="o", markersize=3, color=method_colour(method),
                    label=f"{method}: {parameter}")
    ax_tau.set_ylabel("τ (mean accepted tokens per decoding step)")
    ax_speed.set_ylabel("speedup over AR (×)")
    ax_speed.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    for ax in (ax_tau, ax_speed):
        ax.set_xlabel("draft length / tree size")
        if 0 < len(sizes) <= 12:
            ax.set_xticks(sorted(sizes))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if series:
        _legend_below(ax_tau, ncols=2)
    else:
        ax_tau.text(0.5, 0.5, "no method swept over a numeric size", transform=ax_tau.transAxes, ha="center")
    fig.suptitle(title_of(table), fontsize=8)
    return _save(fig, out, "size_sweep")


def acceptance_by_position(table: Table, cells, style, out) -> list[Path]:
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.2))
    for label, by_column in cells.items():
        rates = (by_column.get(OVERALL) or {}).get("acceptance_per_position") or []
        points = [(d, r) for d, r in enumerate(rates, start=1) if r is not None]
        if points:
            ax.plot([d for d, _ in points], [r for _, r in points], markersize=3, label=label,
                    **{k: style[label][k] for k in ("color", "marker", "linestyle")})
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title_of(table))
    _legend_below(ax)
    return _save(fig, out, "acceptance_by_position")


def ttft_vs_prompt_length(table: Table, style, out) -> list[Path]:
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.2))
    baseline_points = {}
    for label, row in table.rows.items():
        points = sorted(_turn_ttfts(row.records.values()))
        ax.plot([p for p, _ in points], [1000 * t for _, t in points], marker=".", linewidth=0.8, label=label,
                color=style[label]["color"], linestyle=style[label]["linestyle"])
        baseline_points.update({p: t for p, t in _turn_ttfts(row.baseline.values())})
    if baseline_points:
        points = sorted(baseline_points.items())
        ax.plot([p for p, _ in points], [1000 * t for _, t in points], marker=".", linewidth=0.8,
                color=method_colour("ar"), label="AR (full prefill)")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(title_of(table))
    _legend_below(ax)
    return _save(fig, out, "ttft_vs_prompt_length")


def _turn_ttfts(records) -> list[tuple[int, float]]:
    points = []
    for record in records:
        choice = record["choices"][0]
        points += [(len(prompt), stats["ttft"]) for prompt, stats in zip(choice["prompt_ids"], choice["stats"])]
    return points


def speedup_vs_tau(table: Table, cells, style, out) -> list[Path]:
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.4))
    highest = 1.0
    for label, by_column in cells.items():
        cell = by_column.get(OVERALL)
        if cell and cell["speedup"] is not None:
            ax.scatter([cell["tau"]], [cell["speedup"]], s=14, label=label, color=style[label]["color"],
                       marker=style[label]["marker"])
            highest = max(highest, cell["tau"], cell["speedup"])
    line = [0, math.ceil(highest + 0.5)]
    ax.plot(line, line, color="black", linewidth=0.6, linestyle="--", label="ideal: speedup = τ")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel("τ (mean accepted tokens per decoding step)")
    ax.set_ylabel("speedup over AR (×)")
    ax.set_xlim(0, line[1])
    ax.set_ylim(0, line[1])
    ax.set_title(title_of(table))
    _legend_below(ax)
    return _save(fig, out, "speedup_vs_tau")


def figures(paths, out: Path, select: str | None = None) -> list[Path]:
    written = []
    for table in build_tables(find_runs(paths, select)):
        folder = out / table.slug
        columns, cells = group_table(table)
        style = styles(table)
        written += speedup_by_dataset(table, columns, cells, style, folder)
        written += size_sweep(table, cells, style, folder)
        written += acceptance_by_position(table, cells, style, folder)
        written += ttft_vs_prompt_length(table, style, folder)
        written += speedup_vs_tau(table, cells, style, folder)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, default=[Path("results")],
                        help="results folders, folders holding them or sweep folders (default: results/, "
                             "without the committed reference run)")
    parser.add_argument("--out", type=Path, default=None, help="default: plots/<run set>")
    parser.add_argument("--select", help="glob over <model>/<dataset>/<method>/<run> folders")
    args = parser.parse_args(argv)
    out = args.out or Path("plots") / run_set_name(args.runs)
    written = figures(args.runs, out, args.select)
    for path in written:
        print(path)
    print(f"{len(written)} files from {', '.join(map(str, args.runs))} written under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
