"""Speculation under load: the tables and figures of `python -m harness.serve` runs.

    python -m harness.reporting.serving [RUNS ...] [--out DIR] [--plots DIR]

Every folder holding a `points.jsonl` under RUNS (default: results/) is one run: a method and AR at each
load, on the same requests. Per run, a table (`serving.md` in `--out/<run>/`): per load, the method's
output tokens/s and AR's, their ratio, TTFT p50, TPOT p50 and p90 (ms) of each, τ, and whether the
point ran on a busy machine; and figures (`--plots/<run>/`): throughput against concurrency and TPOT
(p50, p90) against concurrency, the method's lines beside AR's, and throughput against TPOT p50 (the
throughput-latency trade, one point per load). A point measured busy is marked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harness.reporting.figures import (  # noqa: E402
    AR_STYLE,
    COLUMN_WIDTH,
    busy_rings,
    legend_below,
    method_colour,
    save_figure,
)

BASELINE = "ar"


def find_serve_runs(paths) -> list[Path]:
    """Every serving run (a folder with `points.jsonl`) under `paths`."""
    found = set()
    for path in map(Path, paths):
        found.update(p.parent for p in (path.rglob("points.jsonl") if path.is_dir() else []))
    return sorted(found)


def read_points(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "points.jsonl").read_text().splitlines() if line.strip()]


def load_name(load: dict) -> str:
    if load["loop"] == "closed":
        return f"c = {load['concurrency']}"
    return f"{load['rate']:g} req/s (≤ {load['concurrency']})"


def paired(points: list[dict]) -> list[tuple[dict, dict | None, dict | None]]:
    """(load, the method's point, AR's point) per load, in the run's order."""
    by_load: dict[str, dict] = {}
    for point in points:
        entry = by_load.setdefault(json.dumps(point["load"], sort_keys=True), {"load": point["load"]})
        entry["ar" if point["decoder"] == BASELINE else "method"] = point
    return [(e["load"], e.get("method"), e.get("ar")) for e in by_load.values()]


def ms(point: dict | None, metric: str, q: str) -> str:
    value = (point or {}).get(metric, {}).get(q)
    return "–" if value is None else f"{1000 * value:.0f}"


def table(points: list[dict]) -> str:
    """The run's table: one row per load."""
    method = next((p["decoder"] for p in points if p["decoder"] != BASELINE), BASELINE)
    lines = [f"| load | {method} tokens/s | AR tokens/s | ratio | TTFT p50 ms ({method} / AR) | "
             f"TPOT p50 ms | TPOT p90 ms | τ | busy |", "|---|---|---|---|---|---|---|---|---|"]
    for load, mine, ar in paired(points):
        if mine is None or ar is None:
            continue
        ratio = mine["output_tokens_per_second"] / ar["output_tokens_per_second"]
        lines.append(
            f"| {load_name(load)} | {mine['output_tokens_per_second']:.1f} | {ar['output_tokens_per_second']:.1f} | "
            f"**{ratio:.2f}×** | {ms(mine, 'ttft', 'p50')} / {ms(ar, 'ttft', 'p50')} | "
            f"{ms(mine, 'tpot', 'p50')} / {ms(ar, 'tpot', 'p50')} | "
            f"{ms(mine, 'tpot', 'p90')} / {ms(ar, 'tpot', 'p90')} | {mine['tau']:.2f} | "
            f"{'yes' if mine['busy'] or ar['busy'] else 'no'} |")
    return "\n".join(lines) + "\n"


def figures(points: list[dict], out: Path) -> list[Path]:
    """Throughput and TPOT against concurrency (closed loops), and throughput against TPOT p50."""
    method = next((p["decoder"] for p in points if p["decoder"] != BASELINE), BASELINE)
    closed = [(load, mine, ar) for load, mine, ar in paired(points) if load["loop"] == "closed" and mine and ar]
    written = []
    if closed:
        xs = [load["concurrency"] for load, _, _ in closed]
        for metric, label in (("throughput", "output tokens/s"), ("tpot", "TPOT (ms)")):
            fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.6))
            busy = []
            for name, index, look in ((method, 1, {"color": method_colour(method), "marker": "o"}),
                                      ("AR", 2, AR_STYLE)):
                series = [entry[index] for entry in closed]
                if metric == "throughput":
                    ax.plot(xs, [p["output_tokens_per_second"] for p in series], label=name, **look)
                else:
                    for q, line in (("p50", "-"), ("p90", ":")):
                        ax.plot(xs, [1000 * p["tpot"][q] for p in series], label=f"{name} {q}",
                                **{**look, "linestyle": line})
                busy += [(x, p["output_tokens_per_second"] if metric == "throughput" else 1000 * p["tpot"]["p50"])
                         for x, p in zip(xs, series) if p["busy"]]
            busy_rings(ax, busy)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("concurrency (requests decoding at once)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            legend_below(ax, ncols=2)
            written += save_figure(fig, out, f"{metric}_vs_concurrency")
    pairs = [(load, mine, ar) for load, mine, ar in paired(points) if mine and ar]
    if pairs:
        fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 2.6))
        for name, index, look in ((method, 1, {"color": method_colour(method), "marker": "o"}),
                                  ("AR", 2, AR_STYLE)):
            ax.plot([1000 * e[index]["tpot"]["p50"] for e in pairs],
                    [e[index]["output_tokens_per_second"] for e in pairs], label=name, **look)
        for load, mine, _ in pairs:
            ax.annotate(load_name(load), (1000 * mine["tpot"]["p50"], mine["output_tokens_per_second"]), fontsize=5)
        ax.set_xlabel("TPOT p50 (ms)")
        ax.set_ylabel("output tokens/s")
        legend_below(ax, ncols=2)
        written += save_figure(fig, out, "throughput_vs_tpot")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=["results"])
    parser.add_argument("--out", type=Path, default=Path("results/report/serving"))
    parser.add_argument("--plots", type=Path, default=Path("plots/serving"))
    args = parser.parse_args(argv)
    runs = find_serve_runs(args.runs)
    if not runs:
        print(f"no serving run (points.jsonl) under {', '.join(args.runs)}: python -m harness.serve writes one")
        return 1
    for run in runs:
        points = read_points(run)
        name = "-".join(run.parts[-4:])
        (args.out / name).mkdir(parents=True, exist_ok=True)
        (args.out / name / "serving.md").write_text(table(points))
        figures(points, args.plots / name)
        print(f"{run}: {args.out / name / 'serving.md'}, {args.plots / name}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
