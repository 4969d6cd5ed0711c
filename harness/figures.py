"""`make figures`: paper figures from every results folder (PNG and PDF, sized for a column).

    python -m harness.figures [--results results] [--select GLOB] [--out plots]

Per (model, hardware, dtype, software) group:
  speedup_by_dataset      speedup per column (category / dataset) per method, 95% interval bars
  size_sweep              τ and speedup against draft length / tree size (gamma, k-config nodes,
                          tree nodes, total_tokens, block size), one line per method
  acceptance_by_position  acceptance rate per draft position, one line per method
  ttft_vs_prompt_length   TTFT against prompt length for each method and its AR baseline (LazyLLM)
  speedup_vs_tau          speedup against τ, with the ideal line speedup = τ
"""

from __future__ import annotations

import argparse
import math
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harness.report import OVERALL, build_rows, find_runs, group_table  # noqa: E402

plt.rcParams.update({"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 6.5, "figure.dpi": 150,
                     "axes.spines.top": False, "axes.spines.right": False})
COLUMN_WIDTH = 3.4  # inches: one column of a two-column paper


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


def speedup_by_dataset(columns, table, title, out) -> list[Path]:
    labels = list(table)
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH * 2, 2.4))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs, ys, errs = [], [], [[], []]
        for j, column in enumerate(columns):
            cell = table[label].get(column)
            if cell and cell["speedup"] is not None:
                low, high = cell["speedup_ci95"]
                xs.append(j + (i - (len(labels) - 1) / 2) * width)
                ys.append(cell["speedup"])
                errs[0].append(max(0.0, cell["speedup"] - low))
                errs[1].append(max(0.0, high - cell["speedup"]))
        ax.bar(xs, ys, width, yerr=errs, capsize=1.5, label=label, error_kw={"linewidth": 0.6})
    ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
    ax.set_ylabel("speedup over AR (×)")
    ax.set_title(title)
    _legend_below(ax, ncols=2)
    return _save(fig, out, "speedup_by_dataset")


def size_sweep(rows, table, title, out) -> list[Path]:
    series = defaultdict(list)  # (method, parameter name) -> [(size, tau, speedup)]
    for label, row in rows.items():
        size = size_of(row.method, row.config)
        cell = table[label].get(OVERALL)
        if size and cell and isinstance(size[1], (int, float)):  # `adaptive` / `auto` sizes have no point on the axis
            series[(row.method, size[0])].append((size[1], cell["tau"], cell["speedup"]))
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, layout="constrained", figsize=(COLUMN_WIDTH * 2, 2.2))
    for (method, parameter), points in sorted(series.items()):
        points.sort()
        xs = [p[0] for p in points]
        ax_tau.plot(xs, [p[1] for p in points], marker="o", markersize=3, label=f"{method}: {parameter}")
        ax_speed.plot(xs, [p[2] for p in points], marker="o", markersize=3, label=f"{method}: {parameter}")
    ax_tau.set_ylabel("τ (tokens per target forward)")
    ax_speed.set_ylabel("speedup over AR (×)")
    ax_speed.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    for ax in (ax_tau, ax_speed):
        ax.set_xlabel("draft length / tree size")
    _legend_below(ax_tau, ncols=2)
    fig.suptitle(title, fontsize=8)
    return _save(fig, out, "size_sweep")


def acceptance_by_position(table, title, out) -> list[Path]:
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.2))
    for label, cells in table.items():
        rates = (cells.get(OVERALL) or {}).get("acceptance_per_position") or []
        points = [(d, r) for d, r in enumerate(rates, start=1) if r is not None]
        if points:
            ax.plot([d for d, _ in points], [r for _, r in points], marker="o", markersize=3, label=label)
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    _legend_below(ax)
    return _save(fig, out, "acceptance_by_position")


def ttft_vs_prompt_length(rows, title, out) -> list[Path]:
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.2))
    baseline_points = {}
    for label, row in rows.items():
        points = sorted(_turn_ttfts(row.records.values()))
        ax.plot([p for p, _ in points], [1000 * t for _, t in points], marker=".", linewidth=0.8, label=label)
        baseline_points.update({p: t for p, t in _turn_ttfts(row.baseline.values())})
    if baseline_points:
        points = sorted(baseline_points.items())
        ax.plot([p for p, _ in points], [1000 * t for _, t in points], marker=".", linewidth=0.8, color="black",
                label="AR (full prefill)")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(title)
    _legend_below(ax)
    return _save(fig, out, "ttft_vs_prompt_length")


def _turn_ttfts(records) -> list[tuple[int, float]]:
    points = []
    for record in records:
        choice = record["choices"][0]
        points += [(len(prompt), stats["ttft"]) for prompt, stats in zip(choice["prompt_ids"], choice["stats"])]
    return points


def speedup_vs_tau(table, title, out) -> list[Path]:
    fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.4))
    highest = 1.0
    for label, cells in table.items():
        cell = cells.get(OVERALL)
        if cell and cell["speedup"] is not None:
            ax.scatter([cell["tau"]], [cell["speedup"]], s=12, label=label)
            highest = max(highest, cell["tau"], cell["speedup"])
    line = [0, math.ceil(highest + 0.5)]
    ax.plot(line, line, color="black", linewidth=0.6, linestyle="--", label="ideal: speedup = τ")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel("τ (tokens per target forward)")
    ax.set_ylabel("speedup over AR (×)")
    ax.set_xlim(0, line[1])
    ax.set_ylim(0, line[1])
    ax.set_title(title)
    _legend_below(ax)
    return _save(fig, out, "speedup_vs_tau")


def figures(root: Path, out: Path, select: str | None = None) -> list[Path]:
    written = []
    for group, rows in build_rows(find_runs(root, select)).items():
        model, hardware, dtype, _, _ = group
        folder = out / re.sub(r"[^a-z0-9]+", "-", f"{model}-{hardware}-{dtype}".lower()).strip("-")
        title = f"{model}, {hardware}, {dtype}"
        columns, table = group_table(rows)
        written += speedup_by_dataset(columns, table, title, folder)
        written += size_sweep(rows, table, title, folder)
        written += acceptance_by_position(table, title, folder)
        written += ttft_vs_prompt_length(rows, title, folder)
        written += speedup_vs_tau(table, title, folder)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out", type=Path, default=Path("plots"))
    parser.add_argument("--select", help="glob over <model>/<dataset>/<method>/<run> folders")
    args = parser.parse_args(argv)
    written = figures(args.results, args.out, args.select)
    for path in written:
        print(path)
    print(f"{len(written)} files written under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
