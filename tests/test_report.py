"""Tables and figures from a small results fixture; the sweep plumbing through submitit_local."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cluster.jobs import job_status
from harness.reporting.figures import figures
from harness.reporting.report import report
from harness.reporting.tables import OVERALL
from tests.conftest import REPO

ENV = {"torch": "2.13.0", "transformers": "5.23.0"}


def cells(line: str) -> list[str]:
    """A Markdown table row's cells (pandas pads them to the column's width)."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def record(qid, category, tokens, wall, steps, accepted=(), tested=(), prompt_len=50, ttft=0.1, diverge_at=None):
    stats = {"ttft": ttft, "drafted_tokens": 4 * steps, "accepted_drafts": tokens - steps,
             "position_proposed": list(tested), "position_tested": list(tested), "position_accepted": list(accepted),
             "phase_time": {"draft": 0.3 * wall, "verify": 0.6 * wall, "other": 0.1 * wall}, "extra": {}}
    output = [t if diverge_at is None or t < diverge_at else -1 for t in range(tokens)]
    return {"question_id": qid, "category": category, "records_format": 2, "choices": [{  # steps: Spec-Bench's
        "turns": ["x"], "new_tokens": [tokens], "wall_time": [wall], "decoding_steps": [steps],
        "accept_lengths": [], "prompt_ids": [list(range(prompt_len))], "output_ids": [output],
        "stats": [stats]}]}


def write_run(root, method, run, records, baseline_dir, config, hardware="CPU-A", dataset="spec_bench",
              max_new_tokens=128, mtime=None, batch_size=1):
    folder = root / "tiny" / dataset / method / run
    (folder / "answers").mkdir(parents=True)
    (folder / "answers" / f"{method}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"method": method, "model": "tiny", "dataset": dataset, "hardware": hardware, "dtype": "float32",
               "environment": ENV, "method_config": {"method": method, "lossless": True, **config},
               "max_new_tokens": max_new_tokens, "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
               "baseline_results": str(baseline_dir), "batch_size": batch_size}
    (folder / "summary.json").write_text(json.dumps(summary))
    if mtime is not None:
        os.utime(folder / "summary.json", (mtime, mtime))
    return folder


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    base = root / "tiny" / "spec_bench" / "ar" / "cpu-float32-x"
    (base / "answers").mkdir(parents=True)
    baseline = [record(1, "writing", 100, 4.0, 100), record(2, "writing", 80, 2.0, 80),
                record(3, "qa", 60, 1.5, 60), record(4, "qa", 40, 1.0, 40)]
    (base / "answers" / "ar.jsonl").write_text("".join(json.dumps(r) + "\n" for r in baseline))
    # sps with gamma 4, run per category (as a sweep over categories makes them)
    write_run(root, "sps", "w", [record(1, "writing", 100, 2.0, 50, [30, 20], [50, 30]),
                                 record(2, "writing", 80, 1.0, 40, [25, 15], [40, 25])], base, {"gamma": 4})
    write_run(root, "sps", "q", [record(3, "qa", 60, 1.0, 40, [15, 5], [40, 15]),
                                 record(4, "qa", 40, 0.8, 25, [10, 5], [25, 10])], base, {"gamma": 4})
    write_run(root, "sps", "g2", [record(1, "writing", 100, 2.5, 60, [30], [60], diverge_at=7)], base, {"gamma": 2})
    # the same method measured on other hardware: its own table
    write_run(root, "sps", "other", [record(1, "writing", 100, 1.0, 50, [30], [50])], base, {"gamma": 4},
              hardware="GPU-B")
    return root


def test_tables_equal_values_recomputed_from_records(results, tmp_path):
    tables = report(results, tmp_path / "report")
    # CPU-A and GPU-B never share a table; on CPU-A, sps gamma=2 answered other questions: its own table
    assert sorted(tables) == ["tiny-spec-bench-n1-128tok-greedy-float32-cpu-a",
                              "tiny-spec-bench-n1-128tok-greedy-float32-gpu-b",
                              "tiny-spec-bench-n4-128tok-greedy-float32-cpu-a"]
    columns, table = tables["tiny-spec-bench-n4-128tok-greedy-float32-cpu-a"]
    assert columns == ["qa", "writing", OVERALL] and list(table) == ["sps (gamma=4)"]
    sps4 = table["sps (gamma=4)"]  # joined from its two runs over disjoint questions (a sweep over categories)
    # Spec-Bench form: mean method tokens/s over mean AR tokens/s, per column and overall
    assert sps4["writing"]["speedup"] == pytest.approx((100 / 2 + 80 / 1) / 2 / ((100 / 4 + 80 / 2) / 2))
    assert sps4["qa"]["speedup"] == pytest.approx((60 / 1 + 40 / 0.8) / 2 / ((60 / 1.5 + 40 / 1) / 2))
    overall = (100 / 2 + 80 / 1 + 60 / 1 + 40 / 0.8) / 4 / ((100 / 4 + 80 / 2 + 60 / 1.5 + 40 / 1) / 4)
    assert sps4[OVERALL]["speedup"] == pytest.approx(overall)
    low, high = sps4[OVERALL]["speedup_ci95"]
    assert low <= overall <= high
    assert sps4[OVERALL]["tau"] == pytest.approx(280 / 155)
    assert sps4[OVERALL]["acceptance_per_position"] == [pytest.approx(80 / 155), pytest.approx(45 / 80)]
    _, small = tables["tiny-spec-bench-n1-128tok-greedy-float32-cpu-a"]
    assert small["sps (gamma=2)"]["writing"]["speedup"] == pytest.approx((100 / 2.5) / (100 / 4))
    folder = tmp_path / "report" / "tiny-spec-bench-n4-128tok-greedy-float32-cpu-a"
    for metric in ("speedup", "tau", "acceptance", "ttft"):
        for ext in ("md", "csv", "tex"):
            assert (folder / f"{metric}.{ext}").stat().st_size > 0
    markdown = (folder / "speedup.md").read_text()
    # every table says n, max_new_tokens and the dataset; n = 4 is below the interval threshold
    assert "spec_bench, n = 4 questions, max_new_tokens 128, greedy" in markdown
    lines = markdown.splitlines()
    assert cells(lines[2])[:4] == ["method", "qa (n=2)", "writing (n=2)", "Overall (n=4)"]
    assert cells(lines[-1])[0] == "sps (gamma=4)" and cells(lines[-1])[3] == f"{overall:.2f}×" and "[" not in lines[-1]
    rows = list(csv.DictReader(open(folder / "tau.csv")))
    assert {(r["method"], r["column"]) for r in rows} >= {("sps (gamma=4)", "writing"), ("sps (gamma=4)", "qa")}
    assert {r["max_new_tokens"] for r in rows} == {"128"}
    assert r"\toprule" in (folder / "speedup.tex").read_text()
    # one line per method: speed, fidelity to AR, time breakdown
    breakdown = {r["method"]: r for r in csv.DictReader(open(folder / "breakdown.csv"))}
    assert float(breakdown["sps (gamma=4)"]["speedup"]) == pytest.approx(overall)
    assert breakdown["sps (gamma=4)"]["differ_from_ar"] == "0"
    assert float(breakdown["sps (gamma=4)"]["verify"]) == pytest.approx(0.6)
    small_breakdown = tmp_path / "report" / "tiny-spec-bench-n1-128tok-greedy-float32-cpu-a" / "breakdown.csv"
    row = next(csv.DictReader(open(small_breakdown)))
    assert (row["differ_from_ar"], row["first_divergence_median"]) == ("1", "7")
    assert "Per method" in (tmp_path / "report" / "report.md").read_text()


@pytest.fixture
def busy_results(tmp_path):
    """Six questions whose AR answers 0-2 were measured beside other work (1.5 cores): pld with
    num_draft=4 (τ 5, speedup 4, one output differs) and num_draft=8 (τ 2, speedup 4: above τ)."""
    root = tmp_path / "busy"
    base = root / "tiny" / "spec_bench" / "ar" / "x"
    (base / "answers").mkdir(parents=True)
    baseline = [dict(record(q, "qa", 100, 4.0, 100, prompt_len=20 * (q + 1), ttft=0.01 * (q + 1)),
                     machine={"other_cores": 1.5 if q < 3 else 0.0}) for q in range(6)]
    (base / "answers" / "ar.jsonl").write_text("".join(json.dumps(r) + "\n" for r in baseline))
    method = [dict(record(q, "qa", 100, 1.0, 20, [12, 6], [20, 12], diverge_at=50 if q == 0 else None,
                          prompt_len=20 * (q + 1)), machine={"other_cores": 0.0}) for q in range(6)]
    write_run(root, "pld", "r", method, base, {"num_draft": 4})
    fast = [dict(record(q, "qa", 100, 1.0, 50, [8], [10], prompt_len=20 * (q + 1)), machine={"other_cores": 0.0})
            for q in range(6)]
    write_run(root, "pld", "s", fast, base, {"num_draft": 8})
    return root


def test_every_table_carries_its_caveats(busy_results, tmp_path):
    """Each metric's table (Markdown, CSV, LaTeX) and the breakdown say, per method, n, how many
    questions were measured on a busy machine and how many outputs differ from AR's."""
    report(busy_results, tmp_path / "report")
    folder = tmp_path / "report" / "tiny-spec-bench-n6-128tok-greedy-float32-cpu-a"
    note = ("n 6; BUSY 3/6 (others used up to 1.5 cores); 1/6 differ from AR: 0 near-ties, 0 mismatches, "
            "1 unclassified (no logit margins recorded)")
    for metric in ("speedup", "tau", "acceptance", "ttft"):
        markdown = (folder / f"{metric}.md").read_text().splitlines()
        assert cells(markdown[2])[-2:] == ["Overall (n=6)", "caveats (Overall)"] and cells(markdown[4])[-1] == note
        row = next(csv.DictReader(open(folder / f"{metric}.csv")))
        assert (row["busy"], row["differ_from_ar"], row["above_tau"], row["caveats"]) == ("3", "1", "False", note)
        assert "BUSY 3/6" in (folder / f"{metric}.tex").read_text()
    first, second = (folder / "breakdown.md").read_text().splitlines()[-2:]
    assert "3/6 (others up to 1.5 cores)" in cells(first) and "above τ" not in first
    assert "4.00× [4.00, 4.00] **above τ, busy: not to be trusted**" in cells(second)
    assert "speedup > τ on a busy machine: not to be trusted" in (folder / "speedup.md").read_text().splitlines()[5]


def test_runs_with_other_settings_never_share_a_table_and_the_newest_answer_wins(results, tmp_path):
    base = next((results / "tiny" / "spec_bench" / "ar").iterdir())
    # an 8-token run of the same variant on the same questions: another table, never merged
    write_run(results, "sps", "short", [record(q, "writing" if q < 3 else "qa", 8, 0.1, 4) for q in (1, 2, 3, 4)],
              base, {"gamma": 4}, max_new_tokens=8)
    # a newer run of question 1 with the same settings: it replaces the older answer of that question
    write_run(results, "sps", "newer", [record(1, "writing", 100, 1.0, 50, [30, 20], [50, 30])], base, {"gamma": 4},
              mtime=time.time() + 60)
    tables = report(results, tmp_path / "report")
    assert "tiny-spec-bench-n4-8tok-greedy-float32-cpu-a" in tables
    _, table = tables["tiny-spec-bench-n4-128tok-greedy-float32-cpu-a"]
    expected = (100 / 1 + 80 / 1 + 60 / 1 + 40 / 0.8) / 4 / ((100 / 4 + 80 / 2 + 60 / 1.5 + 40 / 1) / 4)
    assert table["sps (gamma=4)"][OVERALL]["speedup"] == pytest.approx(expected)
    assert (
        "3 run(s)"
        in (tmp_path / "report" / "tiny-spec-bench-n4-128tok-greedy-float32-cpu-a" / "speedup.md").read_text()
    )


def test_make_report_leaves_the_reference_run_alone(results, tmp_path, monkeypatch):
    """`make report` reads every run but the committed reference run, writes under
    results/report/<run set>/, and leaves the reference files byte-identical."""
    from harness.reporting import figures as figures_cli
    from harness.reporting import report as report_cli

    base = next((results / "tiny" / "spec_bench" / "ar").iterdir())
    reference = results / "reference"
    write_run(reference, "eagle", "ref", [record(q, "writing", 100, 1.0, 40) for q in (1, 2)], base, {})
    assert report_cli.main([str(reference), "--out", str(reference / "report")]) == 0
    assert figures_cli.main([str(reference), "--out", str(tmp_path / "plots" / "reference")]) == 0
    before = {p: p.read_bytes() for p in [*reference.rglob("*"), *(tmp_path / "plots").rglob("*")] if p.is_file()}
    monkeypatch.chdir(tmp_path)
    assert report_cli.main([str(results)]) == 0 and figures_cli.main([str(results)]) == 0
    after = {p: p.read_bytes() for p in [*reference.rglob("*"), *(tmp_path / "plots" / "reference").rglob("*")]
             if p.is_file()}
    assert after == before
    user_report = (tmp_path / "results" / "report" / "all" / "report.md").read_text()
    assert "sps (gamma=4)" in user_report and "eagle" not in user_report
    assert (
        tmp_path / "plots" / "all" / "tiny-spec-bench-n4-128tok-greedy-float32-cpu-a" / "speedup_vs_tau.png"
    ).is_file()


def test_a_users_report_and_figures_stay_out_of_git():
    """What `make report` and `make figures` write for a user's run set is ignored by git; the
    committed reference run's report and figures are not."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    user = ["results/report/all/report.md", "plots/all/tiny-table/size_sweep.png",
            "plots/20261123-171500/t/speedup_vs_tau.pdf"]
    committed = ["plots/README.md", "plots/reference/t/speedup_vs_tau.png", "results/reference/report/report.md"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *user, *committed], cwd=REPO, capture_output=True,
                          text=True)
    assert done.stdout.split() == user


def test_figures_are_written_and_none_without_data(results, tmp_path):
    """Every table gets its figures, but no size sweep where no method was measured at two sizes
    (sps gamma=2 answered other questions: another table), and a stale one is removed."""
    stale = tmp_path / "plots" / "tiny-spec-bench-n4-128tok-greedy-float32-cpu-a" / "size_sweep.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier run set's")
    written = figures(results, tmp_path / "plots")
    names = {p.name for p in written}
    for figure in ("speedup_by_dataset", "acceptance_by_position", "ttft_vs_prompt_length", "speedup_vs_tau"):
        assert {f"{figure}.png", f"{figure}.pdf"} <= names
    assert "size_sweep.png" not in names and not stale.exists()
    assert all(p.stat().st_size > 1000 for p in written)


def test_figures_drawn_twice_from_the_same_runs_are_the_same_bytes(results, tmp_path, monkeypatch):
    """No date in a figure: drawn again (at another time: SOURCE_DATE_EPOCH is the date matplotlib would
    write), every PNG and PDF is byte-identical, so redrawing unchanged runs leaves `git status` clean."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1000000000")
    first = {p.relative_to(tmp_path / "a"): p.read_bytes() for p in figures(results, tmp_path / "a")}
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1800000000")
    second = {p.relative_to(tmp_path / "b"): p.read_bytes() for p in figures(results, tmp_path / "b")}
    assert {p.suffix for p in first} == {".png", ".pdf"} and len(first) >= 8
    assert second == first
    assert not [p for p, data in first.items() if (b"/CreationDate" if p.suffix == ".pdf" else b"tIME") in data]


def test_the_headline_reports_and_draws_only_the_tables_of_its_own_runs(results, tmp_path):
    """`make headline --only pld` on CPU-A: its report and figures rewrite CPU-A's table of those questions
    only; the run set's other tables (another machine class, another question count) keep their files as they
    are, and report.md indexes them as their files stand."""
    from harness.reporting.headline import report_and_draw

    plots, out = tmp_path / "plots", results / "report"
    report(results, out)
    figures(results, plots)
    ours = "tiny-spec-bench-n4-128tok-greedy-float32-cpu-a"
    others = [path for folder in (out, plots) for path in folder.rglob("*.*")
              if ours not in path.parts and path.name != "report.md"]
    assert {path.parent.name for path in others} == {"tiny-spec-bench-n1-128tok-greedy-float32-cpu-a",
                                                     "tiny-spec-bench-n1-128tok-greedy-float32-gpu-b"}
    before = {path: path.read_bytes() for path in (out / ours / "speedup.csv", plots / ours / "speedup_vs_tau.pdf")}
    for path in others:  # as another machine, or an older version, left them
        path.write_bytes(b"left as it was: " + path.name.encode() + b"\n")
    base = next((results / "tiny" / "spec_bench" / "ar").iterdir())
    pld = write_run(results, "pld", "new", [record(q, "writing" if q < 3 else "qa", 100 - 10 * q, 1.0, 40, [30], [40])
                                            for q in (1, 2, 3, 4)], base, {"num_draft": 4})
    report_and_draw(results, [pld], plots)
    assert all(path.read_bytes() == b"left as it was: " + path.name.encode() + b"\n" for path in others)
    assert "pld (num_draft=4)" in (out / ours / "speedup.md").read_text()
    assert all(path.read_bytes() != data for path, data in before.items())  # its own table: redrawn with pld
    index = (out / "report.md").read_text()
    assert "pld (num_draft=4)" in index and "left as it was: speedup.md" in index


def test_size_sweep_of_a_method_at_two_sizes_skips_sizes_that_are_not_numbers(results, tmp_path):
    """EAGLE-2 at total_tokens 30 and 60 is a sweep; its run sized `adaptive` has no point on the axis."""
    base = next((results / "tiny" / "spec_bench" / "ar").iterdir())
    for run, total in (("a", "adaptive"), ("b", 60), ("c", 30)):
        write_run(results, "eagle2", run, [record(1, "writing", 100, 2.0, 50, [30], [50])], base,
                  {"total_tokens": total})
    drawn = capture_figures(results, tmp_path)
    [line] = drawn["size_sweep"].axes[0].lines
    assert list(line.get_xdata()) == [30, 60]


def capture_figures(runs, tmp_path) -> dict:
    """name -> the matplotlib figure of each figure written (the last table's, by name)."""
    from harness.reporting import figures as module

    drawn, save = {}, module.save_figure
    def keep(fig, out, name):
        drawn[name] = fig
        return save(fig, out, name)
    original, module.save_figure = module.save_figure, keep
    try:
        figures(runs, tmp_path / "plots")
    finally:
        module.save_figure = original
    return drawn


def test_figures_show_intervals_counts_points_and_busy_marks(busy_results, tmp_path):
    """What a reviewer asks of each figure: acceptance per position with Wilson intervals over the
    times each position was tested; TTFT as points, one series per method and one for AR; speedup
    against τ with its interval and a ring on methods measured beside other work."""
    from harness.reporting.figures import wilson_interval

    assert wilson_interval(8, 10) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))  # Wilson 1927
    drawn = capture_figures(busy_results, tmp_path)
    [sizes] = drawn["size_sweep"].axes[0].lines  # PLD's num_draft is its draft length
    assert list(sizes.get_xdata()) == [4, 8]
    rates, counts = drawn["acceptance_by_position"].axes[:2]
    first = rates.containers[0]  # pld num_draft=4: 72/120 at position 1, 36/72 at 2
    assert [round(y, 3) for y in first.lines[0].get_ydata()] == [0.6, 0.5]
    bars = first.lines[2][0].get_segments()
    assert [(round(s[0][1], 4), round(s[1][1], 4)) for s in bars] == [
        tuple(round(v, 4) for v in wilson_interval(72, 120)), tuple(round(v, 4) for v in wilson_interval(36, 72))]
    assert [list(line.get_ydata()) for line in counts.lines] == [[120, 72], [60]]
    ttft = drawn["ttft_vs_prompt_length"].axes[0]
    assert not [line for line in ttft.lines if len(line.get_xdata()) > 1]  # no line joins unrelated questions
    series = {c.get_label(): len(c.get_offsets()) for c in ttft.collections}
    # the AR answers both runs were paired with, once each
    assert series == {"AR baselines (full prefill)": 6, "pld (num_draft=4)": 6, "pld (num_draft=8)": 6}
    tau = drawn["speedup_vs_tau"].axes[0]
    assert len(tau.containers) == 2 and all(c.has_yerr for c in tau.containers)
    [ring] = [c for c in tau.collections if c.get_label() == "measured partly on a busy machine"]
    assert sorted(map(tuple, ring.get_offsets().tolist())) == [(2.0, 4.0), (5.0, 4.0)]
    [busy] = [c for c in drawn["speedup_by_dataset"].axes[0].collections if c.get_label().startswith("measured partly")]
    assert len(busy.get_offsets()) == 4  # both methods, in the qa column and overall


def test_sweep_through_submitit_local_reports_results_and_failures(tmp_path, tiny_chat_model_dir):
    """Three jobs through the submitit plumbing: two land results, one fails (gamma=0) and its
    error is recorded, not lost; the sweep exits non-zero."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Question {i}?"]}) + "\n"
                                 for i in range(2)))
    sweep_dir = tmp_path / "sweep"
    command = [
        sys.executable, "-m", "harness.run", "-m", "hydra/launcher=local", "method=sps", "method.gamma=0,2,3",
        f"model.path={tiny_chat_model_dir}", "model.gguf_file=null", "model.gguf_package=null", "model.name=tiny",
        "method.draft={target_layers: 1}", "dtype=float32", "device=cpu", f"dataset.path={questions}",
        f"results_dir={tmp_path / 'results'}", "max_new_tokens=6", "warmup=0", f"hydra.sweep.dir={sweep_dir}",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0
    jobs = job_status(sweep_dir)
    assert [j["status"] for j in jobs] == ["failed", "ok", "ok"]
    assert "method.gamma=0: valid: auto, heuristic or an integer >= 1" in jobs[0]["error"]
    for job in jobs[1:]:
        assert (Path(job["results"]) / "summary.json").is_file()
    listing = subprocess.run([sys.executable, "-m", "harness.cluster.jobs", str(sweep_dir)], cwd=REPO,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert listing.returncode == 1 and "1 failed" in listing.stdout and "FAILED" in listing.stdout
    # the sweep folder as a run set: its finished jobs' runs (a job still running has no summary yet)
    (sweep_dir / "9").mkdir()
    (sweep_dir / "9" / "job.json").write_text(json.dumps({"job": 9, "status": "running", "overrides": [],
                                                          "results": str(tmp_path / "results" / "not-yet")}))
    tables = report(sweep_dir, tmp_path / "sweep-report")
    assert len(tables) == 1
    _, cells = next(iter(tables.values()))
    assert sorted(cells) == ["sps (draft_vocab=8192, gamma=2)", "sps (draft_vocab=8192, gamma=3)"]


class FinishedJob:
    """What `describe` reads of a submitit job."""

    def __init__(self, job_id, state="FINISHED"):
        self.job_id, self.state = job_id, state
        self.paths = type("Paths", (), {"stderr": Path("/logs") / f"{job_id}.err"})()

    def done(self):
        return self.state == "FINISHED"


def test_a_sweeps_status_lines_and_job_list_carry_the_caveats(tmp_path, capsys):
    """A sweep on a busy machine: each job's status line and the final job list print, beside its
    speedup, n, the busy questions and the near-ties (job.json as harness.running.run writes it)."""
    from harness.cluster.jobs import print_jobs
    from harness.running.run import job_result
    from harness.stats import summarize
    from hydra_plugins.decodebench_launcher.launcher import describe
    from tests.test_harness import answered

    meta = {"dtype": "bfloat16", "lossless": True, "sampling": {"temperature": 0.0}, "results": str(tmp_path / "run")}
    busy = summarize("pld", [answered(q, 100, 2.0, 90, diverge_at=40) for q in range(3)],
                     [answered(q, 100, 3.0, 100, other_cores=1.5) for q in range(3)], meta)
    quiet = summarize("pld", [answered(q, 100, 2.0, 90) for q in range(3)],
                      [answered(q, 100, 2.1, 100) for q in range(3)], meta)
    sweep = tmp_path / "sweep"
    records = []
    for num, summary in enumerate((busy, quiet)):
        (sweep / str(num)).mkdir(parents=True)
        records.append({"job": num, "job_id": f"7_{num}", "overrides": [f"method.num_draft={num + 4}"], "method": "pld",
                        **job_result(summary)})
        (sweep / str(num) / "job.json").write_text(json.dumps(records[-1]))
    busy_note = ("speedup 1.50x, τ 1.11; n 3; BUSY 3/3 (others used up to 1.5 cores); 3/3 differ from AR: "
                 "3 near-ties (max gap 0.5), 0 mismatches; speedup > τ on a busy machine: not to be trusted; "
                 "no interval from fewer than 5 questions")
    assert describe(FinishedJob("7_0"), records[0]) == ("done", f"done: {busy_note} ({tmp_path / 'run'})")
    state, line = describe(FinishedJob("7_1"), records[1])
    assert line.startswith("done: speedup 1.05x, τ 1.11; n 3; quiet (others used at most 0.00 cores); "
                           "0/3 differ from AR; no interval from fewer than 5 questions (")
    assert print_jobs(sweep) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[1] == f"  #0 ok          method.num_draft=4  {busy_note}  {tmp_path / 'run'}"
    # a job still running: how many of its finished questions were measured on a busy machine
    folder = tmp_path / "running"
    (folder / "answers").mkdir(parents=True)
    for name, cores in (("pld", 0.0), ("ar", 1.5)):
        rows = [answered(q, 10, 1.0, 10, other_cores=cores if q else 0.0) for q in range(3)]
        (folder / "answers" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    running = {"job": 2, "job_id": "7_2", "status": "running", "method": "pld", "results": str(folder), "questions": 5}
    assert describe(FinishedJob("7_2", "RUNNING"),
                    running)[1] == "running: 3/5 questions, BUSY 2/3 (log: /logs/7_2.err)"


@pytest.mark.parametrize("target, limit, tokens", [("sweep", "SWEEP_LIMIT", "SWEEP_MAX_NEW_TOKENS"),
                                                    ("batch-sweep", "BATCH_LIMIT", "BATCH_MAX_NEW_TOKENS")])
def test_a_sweep_says_what_each_job_answers_and_an_empty_limit_means_all(target, limit, tokens, tmp_path):
    """`make sweep` / `make batch-sweep` (dry run: `make -n`) print the per-job limits they pass first; an
    empty SWEEP_LIMIT / SWEEP_MAX_NEW_TOKENS passes null (all questions / the dataset's own), as `make bench`."""
    if not shutil.which("make"):
        pytest.skip("no make here")

    def dry_run(*variables) -> tuple[str, str]:
        done = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", "BATCH_METHODS=pld", *variables],
                              cwd=REPO, capture_output=True, text=True, check=True)
        [said] = [line for line in done.stdout.splitlines() if line.startswith(f'echo "{target}: ')]
        [run] = [line for line in done.stdout.replace("\\\n", " ").splitlines() if "harness.run -m" in line]
        return said, " ".join(run.split())

    said, run = dry_run()
    assert f"answers {'5' if target == 'sweep' else '8'} questions ({limit}=" in said and f"{limit}= for all" in said
    assert "limit=null" not in run and "max_new_tokens=64 " in run
    said, run = dry_run(f"{limit}=", f"{tokens}=")
    assert f"all questions ({limit}=) with the dataset's max_new_tokens ({tokens}=)" in said
    assert "limit=null max_new_tokens=null " in run
    said, run = dry_run(f"{limit}=7", f"{tokens}=12")
    assert f"7 questions ({limit}=7) with max_new_tokens=12 ({tokens})" in said
    assert "limit=7 max_new_tokens=12 " in run


def test_the_batch_sweep_runs_each_headline_method_with_its_settings_and_a_method_that_cannot_batch_alone():
    """`make batch-sweep` (dry run): a headline variant (`sam@eagle2`) runs its method with the headline's
    settings for it and the headline's own overrides; a method that does not batch (LazyLLM) runs at 1 only."""
    if not shutil.which("make"):
        pytest.skip("no make here")
    done = subprocess.run(["make", "-n", "batch-sweep", "BATCH_METHODS=sam@eagle2 lazyllm"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    runs = [" ".join(line.split()) for line in done.stdout.replace("\\\n", " ").split(";") if "harness.run -m" in line]
    sam, lazy = runs
    assert "method=sam dtype=auto temperature=0 warmup=1 method.auxiliary=eagle2 method.depth=3" in sam
    assert "batch_size=1,2,4 " in sam and "/sam@eagle2 " in sam
    assert "method=lazyllm " in lazy and "batch_size=1 " in lazy


def test_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.partition == "gpu" and launcher.array_parallelism == 16
