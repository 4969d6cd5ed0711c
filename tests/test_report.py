"""Tables and figures from a small results fixture; the sweep plumbing through submitit_local."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.figures import figures
from harness.report import OVERALL, job_status, report
from tests.conftest import REPO

ENV = {"torch": "2.13.0", "transformers": "5.23.0"}


def record(qid, category, tokens, wall, steps, accepted=(), tested=(), prompt_len=50, ttft=0.1, diverge_at=None):
    stats = {"ttft": ttft, "drafted_tokens": 4 * steps, "accepted_drafts": tokens - steps,
             "position_proposed": list(tested), "position_tested": list(tested), "position_accepted": list(accepted),
             "phase_time": {"draft": 0.3 * wall, "verify": 0.6 * wall, "other": 0.1 * wall}, "extra": {}}
    output = [t if diverge_at is None or t < diverge_at else -1 for t in range(tokens)]
    return {"question_id": qid, "category": category, "choices": [{
        "turns": ["x"], "new_tokens": [tokens], "wall_time": [wall], "decoding_steps": [steps],
        "accept_lengths": [], "prompt_ids": [list(range(prompt_len))], "output_ids": [output],
        "stats": [stats]}]}


def write_run(root, method, run, records, baseline_dir, config, hardware="CPU-A", dataset="spec_bench"):
    folder = root / "tiny" / dataset / method / run
    (folder / "answers").mkdir(parents=True)
    (folder / "answers" / f"{method}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"method": method, "model": "tiny", "dataset": dataset, "hardware": hardware, "dtype": "float32",
               "environment": ENV, "method_config": {"method": method, "lossless": True, **config},
               "baseline_results": str(baseline_dir)}
    (folder / "summary.json").write_text(json.dumps(summary))
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
    assert len(tables) == 2  # CPU-A and GPU-B never share a table
    columns, table = tables[("tiny", "CPU-A", "float32", "2.13.0", "5.23.0")]
    assert columns == ["qa", "writing", OVERALL]
    sps4 = table["sps (gamma=4)"]
    # Spec-Bench form: mean method tokens/s over mean AR tokens/s, per column and overall
    assert sps4["writing"]["speedup"] == pytest.approx((100 / 2 + 80 / 1) / 2 / ((100 / 4 + 80 / 2) / 2))
    assert sps4["qa"]["speedup"] == pytest.approx((60 / 1 + 40 / 0.8) / 2 / ((60 / 1.5 + 40 / 1) / 2))
    overall = (100 / 2 + 80 / 1 + 60 / 1 + 40 / 0.8) / 4 / ((100 / 4 + 80 / 2 + 60 / 1.5 + 40 / 1) / 4)
    assert sps4[OVERALL]["speedup"] == pytest.approx(overall)
    low, high = sps4[OVERALL]["speedup_ci95"]
    assert low <= overall <= high
    assert sps4[OVERALL]["tau"] == pytest.approx(280 / 155)
    assert sps4[OVERALL]["acceptance_per_position"] == [pytest.approx(80 / 155), pytest.approx(45 / 80)]
    assert table["sps (gamma=2)"]["writing"]["speedup"] == pytest.approx((100 / 2.5) / (100 / 4))
    assert "qa" not in table["sps (gamma=2)"]
    folder = tmp_path / "report" / "tiny-cpu-a-float32"
    for metric in ("speedup", "tau", "acceptance", "ttft"):
        for ext in ("md", "csv", "tex"):
            assert (folder / f"{metric}.{ext}").stat().st_size > 0
    markdown = (folder / "speedup.md").read_text()
    assert f"{overall:.2f}×" in markdown and "| sps (gamma=2) |" in markdown
    rows = list(csv.DictReader(open(folder / "tau.csv")))
    assert {(r["method"], r["column"]) for r in rows} >= {("sps (gamma=4)", "writing"), ("sps (gamma=4)", "qa")}
    assert r"\toprule" in (folder / "speedup.tex").read_text()
    # one line per method: speed, fidelity to AR, time breakdown
    breakdown = {r["method"]: r for r in csv.DictReader(open(folder / "breakdown.csv"))}
    assert float(breakdown["sps (gamma=4)"]["speedup"]) == pytest.approx(overall)
    assert breakdown["sps (gamma=4)"]["differ_from_ar"] == "0"
    assert (breakdown["sps (gamma=2)"]["differ_from_ar"], breakdown["sps (gamma=2)"]["first_divergence_median"]) == ("1", "7")
    assert float(breakdown["sps (gamma=4)"]["verify"]) == pytest.approx(0.6)
    assert "1/1 (first at token 7, median)" in (folder / "breakdown.md").read_text()
    assert "Per method" in (tmp_path / "report" / "report.md").read_text()


def test_figures_are_written(results, tmp_path):
    written = figures(results, tmp_path / "plots")
    names = {p.name for p in written}
    for figure in ("speedup_by_dataset", "size_sweep", "acceptance_by_position", "ttft_vs_prompt_length", "speedup_vs_tau"):
        assert {f"{figure}.png", f"{figure}.pdf"} <= names
    assert all(p.stat().st_size > 1000 for p in written)


def test_size_sweep_skips_sizes_that_are_not_numbers(results, tmp_path):
    """An EAGLE-2 run sized `adaptive` beside one with total_tokens=60 must not break the figures."""
    base = next((results / "tiny" / "spec_bench" / "ar").iterdir())
    for run, total in (("a", "adaptive"), ("b", 60)):
        write_run(results, "eagle2", run, [record(1, "writing", 100, 2.0, 50, [30], [50])], base, {"total_tokens": total})
    names = {p.name for p in figures(results, tmp_path / "plots")}
    assert "size_sweep.png" in names


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
    assert "method.gamma=0: valid: auto or an integer >= 1" in jobs[0]["error"]
    for job in jobs[1:]:
        assert (Path(job["results"]) / "summary.json").is_file()
    listing = subprocess.run([sys.executable, "-m", "harness.report", "--jobs", str(sweep_dir)], cwd=REPO,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert listing.returncode == 1 and "1 failed" in listing.stdout and "FAILED" in listing.stdout


def test_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.partition == "gpu" and launcher.array_parallelism == 16
