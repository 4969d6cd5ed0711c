"""The curves over batch size and input length (harness/reporting/curves.py) from fixture
records: no model runs."""

from __future__ import annotations

import csv
import json

import pytest

from harness.reporting.curves import best_draft_lengths, find_curves
from harness.reporting.figures import figures
from harness.reporting.report import report
from harness.reporting.tables import build_tables, find_runs, run_folders
from tests.test_report import capture_figures, cells, record, results, write_run  # noqa: F401 (results: a fixture)

# batch size -> the batch wall time of AR, pld num_draft=2 and num_draft=4 over batches of 100-token answers:
# throughput 100 B / wall, so AR 25, 40, 50 tok/s; num_draft=2 50, 50, 40; num_draft=4 40, 62.5, 44.4
WALLS = {1: (4.0, 2.0, 2.5), 2: (5.0, 4.0, 3.2), 4: (8.0, 10.0, 9.0)}


def batched(qid, category, batch_size, wall, prompt_len=50):
    """A 100-token answer decoded in a batch of `batch_size` that took `wall` seconds (at B = 1 a
    record without the batch keys, as batch-1 runs write them)."""
    answer = record(qid, category, 100, wall, 50, [30], [50], prompt_len=prompt_len)
    if batch_size > 1:
        answer["choices"][0].update(batch_size=[batch_size], batch_wall_time=[wall])
    return answer


def write_batch_runs(root, batch_size, walls, dataset="spec_bench", prompt_len=50, drafts=(2, 4), config=None,
                     method="pld", **settings):
    categories = ["writing", "writing", "qa", "qa"]
    ar_wall, *method_walls = walls
    name = f"b{batch_size}-{settings.get('max_new_tokens', 128)}-{'-'.join(map(str, (config or {}).values()))}"
    base = root / "tiny" / dataset / "ar" / name
    (base / "answers").mkdir(parents=True)
    answers = [batched(q, categories[q], batch_size, ar_wall, prompt_len) for q in range(4)]
    (base / "answers" / "ar.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers))
    for num_draft, wall in zip(drafts, method_walls):
        write_run(root, method, f"{name}-d{num_draft}", [batched(q, categories[q], batch_size, wall, prompt_len)
                                                          for q in range(4)], base,
                  {**({"num_draft": num_draft} if method == "pld" else {}), **(config or {})}, dataset=dataset,
                  batch_size=batch_size, **settings)


@pytest.fixture
def batch_results(tmp_path):
    root = tmp_path / "batch"
    for batch_size, walls in WALLS.items():
        write_batch_runs(root, batch_size, walls)
    # B = 8 with another max_new_tokens: never on these curves
    write_batch_runs(root, 8, (1.0, 1.0, 1.0), max_new_tokens=64)
    return root


def drawn_lines(figure) -> dict[str, list]:
    """label -> y values of a figure's labelled lines (not the reference line at 1)."""
    return {line.get_label(): [round(float(y), 4) for y in line.get_ydata()]
            for line in figure.axes[0].lines if not line.get_label().startswith("_")}


def test_speedup_per_batch_size_is_against_ar_at_that_batch_size(batch_results, tmp_path):
    [curves] = find_curves(build_tables(find_runs(batch_results)))
    assert curves.axis == "batch_size" and "max_new_tokens" in curves.shared and "batch_size" not in curves.shared
    speedups = {label: [(p.batch_size, round(p.speedup, 4)) for p in points]
                for label, points in curves.series().items()}
    assert speedups == {"pld (num_draft=2)": [(1, 2.0), (2, 1.25), (4, 0.8)],
                        "pld (num_draft=4)": [(1, 1.6), (2, 1.5625), (4, 0.8889)]}
    ar = curves.series(with_ar=True)["ar"]
    assert [round(p.throughput, 4) for p in ar] == [25.0, 40.0, 50.0]
    # the best draft length per batch size: the argmax of throughput (not of the B = 1 speedup)
    best = [(b["batch_size"], b["best"], round(b["throughput"], 2), round(b["speedup"], 4))
            for b in best_draft_lengths(curves)]
    assert best == [(1, 2, 50.0, 2.0), (2, 4, 62.5, 1.5625), (4, 4, 44.44, 0.8889)]


def test_the_best_draft_length_never_mixes_other_settings(tmp_path):
    """PLD at max_ngram 2 and 3: each its own best draft length per batch size."""
    root = tmp_path / "ngrams"
    for batch_size, walls in WALLS.items():
        write_batch_runs(root, batch_size, walls, config={"max_ngram": 3})
        # the lengths' walls swapped
        write_batch_runs(root, batch_size, (walls[0], walls[2], walls[1]), config={"max_ngram": 2})
    [curves] = find_curves(build_tables(find_runs(root)))
    best = [(b["setting"], b["batch_size"], b["best"]) for b in best_draft_lengths(curves)]
    assert best == [("pld (max_ngram=2)", 1, 4), ("pld (max_ngram=3)", 1, 2), ("pld (max_ngram=2)", 2, 2),
                    ("pld (max_ngram=3)", 2, 4), ("pld (max_ngram=2)", 4, 2), ("pld (max_ngram=3)", 4, 4)]


def test_an_auto_size_is_one_line_whatever_each_point_resolved_it_to(tmp_path):
    """PLD at num_draft=auto resolved to another draft length at each batch size (the run's curve,
    cut per batch size): one line, its points keeping the size each chose."""
    root = tmp_path / "auto"
    for (batch_size, walls), chosen in zip(WALLS.items(), (7, 3, 2)):
        write_batch_runs(root, batch_size, walls[:2], drafts=(0,), config={"num_draft": "auto", "draft_tokens": chosen})
    [curves] = find_curves(build_tables(find_runs(root)))
    [(line, points)] = curves.series().items()
    assert line == "pld (num_draft=auto)" and [p.batch_size for p in points] == [1, 2, 4]
    assert [p.size for p in points] == [7, 3, 2] and len({p.label for p in points}) == 3
    assert list(curves.rows) == ["pld (num_draft=auto)"]
    drawn = capture_figures(root, tmp_path)
    assert drawn_lines(drawn["speedup_vs_batch_size"]) == {"pld": [2.0, 1.25, 0.8]}


def test_an_auto_template_is_one_line_whatever_each_point_cut_it_to(tmp_path):
    """EAGLE at tree=auto (recorded in its sizing) cut to another template prefix at each batch size,
    its depth and top-k with it: one line, named by the setting asked for."""
    root = tmp_path / "auto-tree"
    for (batch_size, walls), (nodes, depth, top_k) in zip(WALLS.items(), ((8, 2, 4), (8, 2, 4), (3, 1, 2))):
        write_batch_runs(root, batch_size, walls[:2], drafts=(0,), method="eagle",
                         config={"sizing": {"tree": "auto", "verify_tokens": nodes}, "tree_nodes": nodes,
                                 "tree_depth": depth, "top_k": top_k, "sampling_rule": "eagle1"})
    [curves] = find_curves(build_tables(find_runs(root)))
    [(line, points)] = curves.series().items()
    assert line == "eagle (sampling_rule=eagle1, tree=auto)" and [p.batch_size for p in points] == [1, 2, 4]
    assert [p.size for p in points] == [8, 8, 3]


def test_batch_tables_and_figures_are_written(batch_results, tmp_path):
    report(batch_results, tmp_path / "report")
    [folder] = [p for p in (tmp_path / "report").iterdir() if p.name.startswith("by-batch-size")]
    assert folder.name == "by-batch-size-tiny-spec-bench-n4-128tok-greedy-float32-cpu-a"
    speedup = (folder / "throughput_speedup.md").read_text().splitlines()
    assert "tiny on CPU-A, float32; spec_bench, n = 4 questions, max_new_tokens 128" in speedup[0]
    assert cells(speedup[2]) == ["method", "B=1", "B=2", "B=4"]
    assert cells(speedup[4]) == ["pld (num_draft=2)", "2.00×", "1.25×", "0.80×"]
    assert cells((folder / "throughput.md").read_text().splitlines()[4]) == ["ar", "25.0", "40.0", "50.0"]
    points = list(csv.DictReader(open(folder / "points.csv")))
    assert len(points) == 9 and {p["max_new_tokens"] for p in points} == {"128"}
    best = list(csv.DictReader(open(folder / "best_draft_length.csv")))
    assert [(b["batch_size"], b["best"]) for b in best] == [("1", "2"), ("2", "4"), ("4", "4")]
    assert "2.00×" in (folder / "best_draft_length.md").read_text()
    assert "Throughput speedup over AR" in (tmp_path / "report" / "report.md").read_text()

    drawn = capture_figures(batch_results, tmp_path)
    assert drawn_lines(drawn["speedup_vs_batch_size"]) == {"pld (num_draft=2)": [2.0, 1.25, 0.8],
                                                           "pld (num_draft=4)": [1.6, 1.5625, 0.8889]}
    assert drawn_lines(drawn["throughput_vs_batch_size"])["AR (its paired answers, pooled)"] == [25.0, 40.0, 50.0]
    assert drawn_lines(drawn["best_draft_length"]) == {"pld: draft length γ": [2, 4, 4]}
    for name in ("speedup_vs_batch_size", "throughput_vs_batch_size", "best_draft_length"):
        assert "CPU-A" in drawn[name].axes[0].get_title()  # the machine
        for ext in ("png", "pdf"):
            assert (tmp_path / "plots" / folder.name / f"{name}.{ext}").stat().st_size > 1000


def test_speedup_by_input_length_over_the_throughput_splits(tmp_path):
    root = tmp_path / "splits"
    for dataset, length, walls in (("speed_bench_throughput_1k", 1000, (5.0, 3.2)),
                                   ("speed_bench_throughput_2k", 2000, (8.0, 8.0))):
        write_batch_runs(root, 2, walls, dataset=dataset, prompt_len=length, drafts=(4,))
    [curves] = find_curves(build_tables(find_runs(root)))
    assert curves.axis == "dataset" and curves.shared["batch_size"] == 2
    [(label, points)] = curves.series().items()
    assert [(p.input_length, round(p.speedup, 4)) for p in points] == [(1000, 1.5625), (2000, 1.0)]
    report(root, tmp_path / "report")
    table = (tmp_path / "report" / curves.slug / "throughput_speedup.md").read_text().splitlines()
    assert cells(table[2]) == ["method", "speed_bench_throughput_1k (1000 tok, n=4)",
                               "speed_bench_throughput_2k (2000 tok, n=4)"]
    assert "batch size 2" in table[0]
    drawn = capture_figures(root, tmp_path)
    ax = drawn["speedup_vs_input_length"].axes[0]
    [line] = [line for line in ax.lines if not line.get_label().startswith("_")]
    assert list(line.get_xdata()) == [1000, 2000] and "batch size 2" in ax.get_title()
    assert "best_draft_length" not in drawn


def test_runs_without_batches_draw_no_curves(results, tmp_path):  # noqa: F811 (the fixture imported above)
    report(results, tmp_path / "report")
    written = figures(results, tmp_path / "plots")
    assert not [p for p in written if p.parent.name.startswith("by-")]
    assert not [p for p in (tmp_path / "report").iterdir() if p.name.startswith("by-")]


def test_a_folder_of_sweeps_is_one_run_set(batch_results, tmp_path):
    """`make batch-sweep` leaves one sweep per method under one folder: RUNS=<that folder> reads them all."""
    runs = sorted(p.parent for p in batch_results.rglob("summary.json"))
    for num, run in enumerate(runs):
        job = tmp_path / "multirun" / ("pld" if num % 2 else "sps") / str(num)
        job.mkdir(parents=True)
        (job / "job.json").write_text(json.dumps({"job": num, "status": "ok", "overrides": [], "results": str(run)}))
    assert sorted(run_folders([tmp_path / "multirun"])) == runs
