"""Comparable with published numbers: the published-settings headline (refused without a GPU, before
anything loads; its configs compose and validate) and the report's published column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from harness.reporting import headline, published
from tests.conftest import REPO

SPECBENCH = REPO / "conf" / "headline" / "vicuna-7b-specbench.yaml"
MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
TASKS = MT_BENCH + ["translation", "summarization", "qa", "math_reasoning", "rag"]


# ------------------------------------------------------------------ the refusal, before anything loads

def test_refuses_without_a_gpu_in_one_line_before_torch_is_imported():
    code = ("import sys; from harness.reporting import headline; "
            f"rc = headline.main(['--config', {str(SPECBENCH)!r}]); "
            "print('rc', rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert done.stdout.strip() == "rc 2 False False", done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "needs a CUDA GPU with at least 16 GiB" in lines[0] and "no CUDA GPU here" in lines[0]
    assert elapsed < 5, f"the refusal took {elapsed:.1f} s"


def test_refusal_stops_before_any_run_and_names_a_small_gpu(monkeypatch, capsys):
    def no_run(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr("harness.running.run.run", no_run)
    monkeypatch.setattr(headline, "compose", no_run)  # not even a config is composed
    monkeypatch.setattr(headline, "gpu_memory_gib", lambda: 8.0)
    assert headline.main(["--config", str(SPECBENCH)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "this GPU has 8 GiB" in err


def test_configs_without_requirements_are_not_refused(monkeypatch):
    monkeypatch.setattr(headline, "gpu_memory_gib", lambda: None)
    assert headline.unmet_requirement(OmegaConf.load(REPO / "conf" / "headline" / "smollm2-135m.yaml"), "x") is None
    assert headline.unmet_requirement(OmegaConf.load(SPECBENCH), "x") is not None
    monkeypatch.setattr(headline, "gpu_memory_gib", lambda: 80.0)
    assert headline.unmet_requirement(OmegaConf.load(SPECBENCH), "x") is None


# ------------------------------------------------------------------ the published settings compose and validate

@pytest.fixture(scope="module")
def specbench_runs():
    from harness.running.validate import validate

    runs = headline.run_overrides(OmegaConf.load(SPECBENCH))
    configs = {method: headline.compose(overrides) for method, overrides in runs.items()}
    for cfg in configs.values():
        validate(cfg)  # raises on the first bad value
    return configs


def test_specbench_config_is_spec_bench_setting(specbench_runs):
    a100 = next(t for t in published.load() if t.id == "spec-bench-a100-vicuna-7b")
    # every run has a published number to compare with (a second run of a method: `<method>@<variant>`)
    assert {run.split("@")[0] for run in specbench_runs} <= set(a100.methods)
    for run, cfg in specbench_runs.items():
        method = run.split("@")[0]
        assert (cfg.model.name, cfg.model.path, cfg.dataset.name) == ("vicuna-7b", "lmsys/vicuna-7b-v1.3", "spec_bench")
        assert (cfg.dtype, cfg.temperature, cfg.max_new_tokens, cfg.limit,
                cfg.device) == ("float16", 0, 1024, None, "cuda")
        assert cfg.method.get("draft_vocab", "full") == "full" and cfg.method.name == method
    m = {name: cfg.method for name, cfg in specbench_runs.items()}
    assert (m["eagle2"].total_tokens, m["eagle2"].depth, m["eagle2"].top_k) == (60, 5, 10)
    assert m["eagle"].tree == "eagle_mc_sim_7b_63" and m["medusa"].tree == "medusa_mc_sim_7b_63"
    assert m["hydra"].tree == "hydra_mc_sim_7b_63" and m["medusa"].acceptance == m["hydra"].acceptance == "exact"
    assert m["sps"].gamma == "heuristic" and specbench_runs["sps"].model.drafts.sps.path == "double7/vicuna-68m"
    assert (m["lookahead"].level, m["lookahead"].window, m["lookahead"].guess,
            m["lookahead"].pool_from_prompt) == (5, 7, 7, False)
    assert (m["recycling"].tree, m["recycling"].top_k, m["recycling"].persist) == ("2.2.2", 8, True)
    assert (m["pld"].max_ngram, m["pld"].num_draft) == (3, 10)
    sam = m["sam@eagle2"]
    assert (sam.auxiliary, sam.n_predicts, sam.len_threshold, sam.len_bias, sam.total_tokens, sam.depth,
            sam.top_k) == ("eagle2", 40, 5, 5, 60, 5, 10)
    # Spec-Bench's samd is SAM-Decoding[EAGLE2]: published beside that variant of ours only
    assert a100.numbers("sam", sam)["speedup"]["overall"] == 2.73
    assert a100.numbers("sam", {**sam, "auxiliary": "none"}) is None
    drafts = specbench_runs["eagle"].model.drafts
    assert (
        drafts.eagle.path == "yuhuili/EAGLE-Vicuna-7B-v1.3"
        and drafts.medusa.path == "FasterDecoding/medusa-vicuna-7b-v1.3"
    )


def test_check_validates_every_run_on_any_machine(monkeypatch, capsys):
    monkeypatch.setattr("harness.running.run.run", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr(headline, "gpu_memory_gib", lambda: None)  # --check works without a GPU, and says so
    assert headline.main(["--config", str(SPECBENCH), "--check"]) == 0
    out, err = capsys.readouterr()
    assert "lookahead: method=lookahead model=vicuna-7b" in out and "needs a CUDA GPU" in err
    monkeypatch.setattr(headline, "gpu_memory_gib", lambda: 80.0)
    assert headline.main(["--config", str(SPECBENCH), "--check"]) == 0
    assert capsys.readouterr().err == ""
    assert headline.main(["--config", str(SPECBENCH), "--check", "method.nonsense=1"]) == 2  # a bad key: one line
    err = capsys.readouterr().err
    assert "method.nonsense" in err and len(err.strip().splitlines()) == 1
    assert headline.main(["--config", str(SPECBENCH), "--check", "temperature=-1"]) == 2  # a bad value
    assert "temperature=-1" in capsys.readouterr().err


# ------------------------------------------------------------------ the published data and column

def test_published_data_carry_their_sources():
    tables = {t.id: t for t in published.load()}
    assert {"spec-bench-a100-vicuna-7b", "spec-bench-3090-vicuna-7b", "eagle2-paper-vicuna-7b"} <= set(tables)
    for table in tables.values():
        assert table.source and table.hardware and table.methods
        for numbers in table.methods.values():
            assert set(numbers["speedup"]) <= set(table.columns) | {"mean"}
    spec = json.loads((REPO / "docs" / "published" / "spec_bench.json").read_text())
    assert len(spec["commit"]) == 40 and spec["file"] == "Leaderboard.md"
    assert sorted(c for col in spec["columns"].values() for c in col.get("categories", [])) == sorted(TASKS)


def record(qid, category, tokens, wall, steps):
    stats = {"ttft": 0.1, "drafted_tokens": 4 * steps, "accepted_drafts": tokens - steps, "position_proposed": [],
             "position_tested": [], "position_accepted": [], "phase_time": {"verify": wall}, "extra": {}}
    return {"question_id": qid, "category": category, "records_format": 2, "choices": [{  # Spec-Bench's steps
        "turns": ["x"], "new_tokens": [tokens], "wall_time": [wall], "decoding_steps": [steps],
        "accept_lengths": [tokens // steps] * steps,
        "prompt_ids": [[1, 2]], "output_ids": [list(range(tokens))], "stats": [stats]}]}


def fake_run_set(root, questions=480, max_new_tokens=1024, dtype="float16", model="vicuna-7b"):
    """AR and EAGLE-2 on `questions` Spec-Bench questions (categories in turn): EAGLE-2 runs twice as
    fast as AR on MT-bench questions and 1.6 times on the others, with 4 tokens per step."""
    ar, eagle2 = [], []
    for qid in range(questions):
        category = TASKS[qid % len(TASKS)]
        ar.append(record(qid, category, 100, 4.0, 100))
        eagle2.append(record(qid, category, 100, 2.0 if category in MT_BENCH else 2.5, 25))
    folder = root / model / "spec_bench" / "eagle2" / "gpu"
    (folder / "answers").mkdir(parents=True)
    for name, records in (("ar", ar), ("eagle2", eagle2)):
        (folder / "answers" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"method": "eagle2", "model": model, "dataset": "spec_bench", "hardware": "NVIDIA H100", "dtype": dtype,
               "environment": {"torch": "2.13.0", "transformers": "5.23.0"}, "max_new_tokens": max_new_tokens,
               "method_config": {"method": "eagle2", "lossless": True, "total_tokens": 60, "depth": 5, "top_k": 10},
               "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}, "baseline_results": str(folder)}
    (folder / "summary.json").write_text(json.dumps(summary))
    return root


def published_sections(paths, out) -> str:
    """`make report`'s comparison sections (`<table>/published.md`), as one text."""
    from harness.reporting.report import report

    report(paths, out)
    return "\n\n".join(f.read_text().strip() for f in sorted(out.glob("*/published.md")))


def test_matching_run_set_gets_the_published_column(tmp_path):
    text = published_sections([fake_run_set(tmp_path / "results")], tmp_path / "report")
    assert "| speedup | published | ours ÷ published |" in text and "hemingkx/Spec-Bench@fd2c1cd7" in text
    a100 = next(t for t in published.load() if t.id == "spec-bench-a100-vicuna-7b").methods["eagle2"]
    section = text.split("**Published: Spec-Bench leaderboard, A100, vicuna-7b**")[1].split("**Published")[0]
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| eagle2")}
    assert set(rows) == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "overall"}
    # ours from the fake records: 2x on MT-bench's 8 categories, 1.6x elsewhere, 4 tokens per step
    mt_n = sum(TASKS[q % len(TASKS)] in MT_BENCH for q in range(480))
    assert rows["mt_bench"][2] == str(mt_n) and rows["rag"][2] == str(sum(q % len(TASKS) == 12 for q in range(480)))
    assert rows["mt_bench"][3] == "2.00×" and rows["rag"][3] == "1.60×"
    assert rows["overall"][3] == f"{(mt_n * 50 + (480 - mt_n) * 40) / 480 / 25:.2f}×"
    assert rows["mt_bench"][4] == f"{a100['speedup']['mt_bench']:.2f}×" and rows["overall"][4] == "2.36×"
    assert rows["mt_bench"][5] == f"{2.0 / a100['speedup']['mt_bench']:.2f}"
    assert rows["overall"][6] == "4.00" and rows["overall"][7] == f"{a100['tau']['overall']:.2f}"
    assert rows["rag"][7] == "–"  # Spec-Bench publishes mean accepted tokens overall only
    assert rows["overall"][8] == "n 480; busy not recorded; 0/480 differ from AR"  # our number's caveats
    assert text in (tmp_path / "report" / "report.md").read_text()
    # the RTX 3090 table has the same setting: its own section
    assert "**Published: Spec-Bench leaderboard, 3090, vicuna-7b**" in text
    assert "EAGLE-2 paper" not in text  # other datasets
    # the report table itself holds the same comparison
    from harness.reporting.tables import build_tables, find_runs

    (table,) = build_tables(find_runs([tmp_path / "results"]))
    assert published.markdown(table) == text


@pytest.mark.parametrize("change", [{"questions": 13}, {"max_new_tokens": 96}, {"dtype": "float32"},
                                    {"model": "smollm2-135m"}])
def test_other_settings_get_no_published_column(tmp_path, change):
    text = published_sections([fake_run_set(tmp_path / "results", **change)], tmp_path / "report")
    assert text == "" and "Published:" not in (tmp_path / "report" / "report.md").read_text()
