"""Speculation under load: the tables and figures of `python -m harness.serve` runs.

    python -m harness.reporting.serving [RUNS ...] [--out DIR] [--plots DIR]

Every folder holding a `points.jsonl` under RUNS (default: results/) is one run: a method and AR at each
load, on the same requests. Per run, a table (`serving.md` in `--out/<run>/`): per load, the method's
output tokens/s and AR's, their ratio, TTFT p50, TPOT p50 and p90 (ms) of each, τ, and whether the
point ran on a busy machine; and figures (`--plots/<run>/`): throughput against concurrency and TPOT
(p50, p90) against concurrency, the method's lines beside AR's, and throughput against TPOT p50 (the
throughput-latency trade, one point per load). A point measured busy is marked. Across the runs, per group
of runs that served the same prompts (the dataset, and its input-length bucket) with the same speculation
policy (`serve.speculate_up_to`): one table of every method's throughput over AR's at each load and of
their TPOT p50 (`summary.md`), and two figures with a line per method (`--plots/summary/<group>/`:
`spec_bench`, `needle-2000`, `spec_bench-up-to-1`): throughput over AR's against concurrency, and
throughput against TPOT p50 (the throughput-latency Pareto of the bucket, AR's line beside).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harness.reporting.figures import (  # noqa: E402
    AR_STYLE,
    COLUMN_WIDTH,
    MARKERS,
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


def read_settings(run: Path) -> dict:
    path = run / "settings.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def run_labels(runs: list[Path]) -> dict[Path, str]:
    """Each run's method, with the method settings that tell it apart from another run of the same method
    (`sam` and `sam auxiliary=eagle2`)."""
    methods = {run: read_settings(run).get("method", {}) for run in runs}
    labels = {}
    for run, config in methods.items():
        name = config.get("name") or next(p["decoder"] for p in read_points(run) if p["decoder"] != BASELINE)
        others = [c for r, c in methods.items() if r != run and c.get("name") == name]
        differ = sorted(k for k, v in config.items() if any(o.get(k) != v for o in others) and k != "name")
        labels[run] = " ".join([name] + [f"{k}={config[k]}" for k in differ if config[k] is not None])
    return labels


def workload(run: Path, settings: dict) -> str:
    """The prompts a run served (`settings`: its settings.json): its dataset, and its input-length bucket where
    it has one (the needle set's `lengths`, in tokens), and how they came: in closed loops, or arriving (an
    open loop)."""
    dataset, rate = settings.get("dataset", {}), (settings.get("serve") or {}).get("rate")
    lengths = dataset.get("lengths")
    return ((dataset.get("name") or run.parts[-4]) + (f" ≈{'/'.join(map(str, lengths))} tokens" if lengths else "")
            + (", open loop" if rate else ""))


def policy(limit: int | None) -> str:
    """A run's speculation policy (`serve.speculate_up_to`)."""
    return "always speculating" if limit is None else f"drafting nothing above {limit} running sequence(s)"


def groups(runs: list[Path]) -> dict[tuple[str, int | None], list[Path]]:
    """The runs by (workload, `serve.speculate_up_to`): one group's runs are the rows of one table and the
    lines of one figure."""
    grouped: dict[tuple[str, int | None], list[Path]] = {}
    for run in runs:
        settings = read_settings(run)
        grouped.setdefault((workload(run, settings), (settings.get("serve") or {}).get("speculate_up_to")),
                           []).append(run)
    return dict(sorted(grouped.items(), key=lambda item: (item[0][0], item[0][1] or 0)))


def group_folder(key: tuple[str, int | None]) -> str:
    """A group's figures' folder: `spec_bench`, `needle-2000`, `spec_bench-up-to-1`, `spec_bench-open-loop`."""
    name = key[0].replace(" ≈", "-").replace(" tokens", "").replace(",", "").replace("/", "-").replace(" ", "-")
    return name + ("" if key[1] is None else f"-up-to-{key[1]}")


def summary_table(runs: list[Path]) -> str:
    """Per group of runs (`groups`): every run's method beside AR at each load: output tokens/s over AR's
    (both tokens/s), TPOT p50 (method / AR, ms), and the ratio's two factors (τ, and a step's time in AR
    steps); a busy point is starred."""
    parts = [f"**{key[0]}, {policy(key[1])}.**\n\n{group_table(members)}" for key, members in groups(runs).items()]
    return "\n".join(parts) + "\n\\* measured partly on a busy machine.\n"


def group_table(runs: list[Path]) -> str:
    labels = run_labels(runs)
    loads = {}
    rows = []
    for run in sorted(runs, key=lambda r: labels[r]):
        cells = {}
        for load, mine, ar in paired(read_points(run)):
            if mine is None or ar is None:
                continue
            key = json.dumps(load, sort_keys=True)
            loads.setdefault(key, load)
            busy = " *" if mine["busy"] or ar["busy"] else ""
            ratio = mine["output_tokens_per_second"] / ar["output_tokens_per_second"]
            cells[key] = (f"**{ratio:.2f}×** "
                          f"({mine['output_tokens_per_second']:.0f} / {ar['output_tokens_per_second']:.0f}){busy}",
                          f"{ms(mine, 'tpot', 'p50')} / {ms(ar, 'tpot', 'p50')}{busy}",
                          f"{mine['tau']:.2f} / {mine['tau'] / ratio:.2f}{busy}")
        rows.append((labels[run], cells))
    order = sorted(loads, key=lambda k: (loads[k]["loop"], loads[k]["concurrency"], loads[k].get("rate", 0)))
    head = "| method | " + " | ".join(load_name(loads[k]) for k in order) + " |\n|---|" + "---|" * len(order) + "\n"
    parts = []
    for index, what in ((0, "Output tokens/s over AR's (method / AR tokens/s)"), (1, "TPOT p50, ms (method / AR)"),
                        (2, "Why: τ (tokens per step of a sequence) / a step's time in AR steps at the same load "
                            "(τ over the throughput ratio: drafting, verifying the draft rows, the method's own "
                            "work, its share of the joins' prefills); the ratio is their quotient")):
        body = "".join(f"| {label} | " + " | ".join(cells[k][index] if k in cells else "–" for k in order) + " |\n"
                       for label, cells in rows)
        parts.append(f"{what}:\n\n{head}{body}")
    return "\n".join(parts)


def summary_figures(runs: list[Path], out: Path) -> list[Path]:
    """Per group of runs (`groups`, in `out/<group>/`): a line per method, throughput over AR's against
    concurrency, and throughput against TPOT p50 with AR's line (the throughput-latency Pareto; AR's points
    pooled over the group's runs: the median at each load)."""
    written = []
    for key, members in groups(runs).items():
        written += group_figures(members, out / group_folder(key))
    return written


def group_figures(runs: list[Path], out: Path) -> list[Path]:
    labels = run_labels(runs)
    ordered = sorted(runs, key=lambda r: labels[r])
    closed_by_run = {run: [(load, mine, ar) for load, mine, ar in paired(read_points(run))
                           if load["loop"] == "closed" and mine and ar] for run in ordered}
    if not any(closed_by_run.values()):  # an open loop's group: one load, its table says it all
        return []
    written = []
    for name in ("speedup_vs_concurrency", "throughput_vs_tpot"):
        fig, ax = plt.subplots(layout="constrained", figsize=(COLUMN_WIDTH, 3.0))
        busy, ar_points = [], {}
        for i, run in enumerate(ordered):
            closed = closed_by_run[run]
            if not closed:
                continue
            look = {"color": method_colour(labels[run].split()[0]), "marker": MARKERS[i % len(MARKERS)],
                    "markersize": 3, "linewidth": 0.8}
            for load, _, ar in closed:
                ar_points.setdefault(load["concurrency"], []).append(ar)
            if name == "speedup_vs_concurrency":
                xy = [(load["concurrency"], mine["output_tokens_per_second"] / ar["output_tokens_per_second"])
                      for load, mine, ar in closed]
            else:
                xy = [(1000 * mine["tpot"]["p50"], mine["output_tokens_per_second"]) for _, mine, _ in closed]
            ax.plot([x for x, _ in xy], [y for _, y in xy], label=labels[run], **look)
            busy += [point for point, (_, mine, ar) in zip(xy, closed) if mine["busy"] or ar["busy"]]
        if name == "speedup_vs_concurrency":
            xs = sorted(ar_points)
            ax.axhline(1.0, color="black", linewidth=0.6, linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("concurrency (requests decoding at once)")
            ax.set_ylabel("output tokens/s over AR's")
        else:
            pooled = [(statistics.median(1000 * p["tpot"]["p50"] for p in ar_points[c]),
                       statistics.median(p["output_tokens_per_second"] for p in ar_points[c]))
                      for c in sorted(ar_points)]
            ax.plot([x for x, _ in pooled], [y for _, y in pooled], label="AR (median over the runs)",
                    **{**AR_STYLE, "linewidth": 1.2})
            for (x, y), c in zip(pooled, sorted(ar_points)):
                ax.annotate(f"c={c}", (x, y), fontsize=5, textcoords="offset points", xytext=(2, -6))
            ax.set_xlabel("TPOT p50 (ms)")
            ax.set_ylabel("output tokens/s")
        busy_rings(ax, busy)
        legend_below(ax, ncols=3)
        written += save_figure(fig, out, name)
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
    (args.out / "summary.md").write_text(summary_table(runs))
    summary_figures(runs, args.plots / "summary")
    print(f"all {len(runs)} runs: {args.out / 'summary.md'}, {args.plots / 'summary'}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
