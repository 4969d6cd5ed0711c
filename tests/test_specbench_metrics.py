"""Answer records read the way Spec-Bench's tools read them (docs/benchmarks.md, "τ").

Spec-Bench's `evaluation/speed.py` arithmetic, written here from its description (not copied):
speedup = mean over questions of (Σ new tokens ÷ Σ wall time over the question's turns), divided
by the same mean of the baseline's answers; mean accepted tokens = the mean of every accept length
of every question. Its EAGLE/Medusa scripts count the verifications as decoding steps and fold the
prefill's token into the first one's accept length; its baseline counts one step per token.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from harness.reporting.report import report
from harness.reporting.tables import OVERALL
from harness.running.results import RECORDS_FORMAT, read_answers, read_jsonl, upgrade_record
from harness.running.run import run
from harness.stats import decoder_stats
from methods.state import DecodeStats
from tests.conftest import REPO
from tests.test_harness import config, tiny_overrides

REFERENCE = REPO / "results" / "reference" / "smollm2-135m" / "spec_bench"


def specbench_speed(records: list[dict]) -> float:
    """Mean over questions of tokens/s, tokens and wall time summed over the question's turns."""
    return statistics.fmean(sum(r["choices"][0]["new_tokens"]) / sum(r["choices"][0]["wall_time"]) for r in records)


def specbench_mean_accepted(records: list[dict]) -> float:
    return statistics.fmean(n for r in records for n in r["choices"][0]["accept_lengths"])


@pytest.fixture
def questions_file(tmp_path):
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now another one."]},
            {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]},
            {"question_id": 3, "category": "math", "turns": ["What is 2+2?"]}]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_summary_equals_specbench_arithmetic_on_the_answer_files(tiny_chat_model_dir, questions_file, tmp_path):
    summary = run(config(*tiny_overrides(tiny_chat_model_dir, questions_file, tmp_path, "method=sps", "limit=3")))
    folder = Path(summary["results"])
    # the answer files as Spec-Bench's scripts would open them: plain JSON lines
    method = [json.loads(line) for line in (folder / "answers" / "sps.jsonl").read_text().splitlines()]
    base = [json.loads(line) for line in (folder / "answers" / "ar.jsonl").read_text().splitlines()]
    assert summary["speedup"]["specbench"] == pytest.approx(specbench_speed(method) / specbench_speed(base))
    assert summary["decoder"]["tau"] == pytest.approx(specbench_mean_accepted(method))
    assert summary["baseline"]["tau"] == specbench_mean_accepted(base) == 1.0
    verifications = 0
    for record in method:
        choice = record["choices"][0]
        assert record["records_format"] == RECORDS_FORMAT
        assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"])
        assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])
        start = 0
        for steps, turn in zip(choice["decoding_steps"], choice["stats"]):
            # decoding steps are the verifications: the target forwards after the prefill
            assert steps == turn["steps"] - 1 >= 1 and not turn["prefill_step"]
            lengths = choice["accept_lengths"][start:start + steps]
            start += steps
            # the first step's accept length holds the prefill's token and at least the step's own token
            assert lengths[0] >= 2 and all(n >= 1 for n in lengths[:-1])
            verifications += steps
    assert summary["decoder"]["decoding_steps"] == verifications
    for record in base:  # AR: as Spec-Bench's baseline, one step per token, the prefill included
        choice = record["choices"][0]
        assert choice["decoding_steps"] == choice["new_tokens"] == [turn["steps"] for turn in choice["stats"]]
        assert set(choice["accept_lengths"]) == {1}


def test_decode_stats_fold_the_prefill_token_into_the_first_verification():
    stats = DecodeStats(new_tokens=9, steps=4, accepted_lengths=[1, 3, 1, 4])
    assert (stats.decoding_steps, stats.accept_lengths, stats.tau) == (3, [4, 1, 4], 3.0)
    ar = DecodeStats(new_tokens=3, steps=3, accepted_lengths=[1, 1, 1], prefill_step=True)
    assert (ar.decoding_steps, ar.accept_lengths, ar.tau) == (3, [1, 1, 1], 1.0)
    ended_at_prefill = DecodeStats(new_tokens=1, steps=1, accepted_lengths=[1])
    assert (ended_at_prefill.decoding_steps, ended_at_prefill.accept_lengths, ended_at_prefill.tau) == (1, [1], 1.0)


def test_format1_records_are_read_as_today():
    old = {"question_id": 7, "answer_id": "eagle2-7", "choices": [{
        "new_tokens": [6, 1], "decoding_steps": [3, 1], "accept_lengths": [1, 2, 3, 1],
        "stats": [{"steps": 3}, {"steps": 1}]}]}
    new = upgrade_record(old)
    choice = new["choices"][0]
    assert (choice["decoding_steps"], choice["accept_lengths"]) == ([2, 1], [3, 3, 1])
    assert new["records_format"] == RECORDS_FORMAT and old["choices"][0]["decoding_steps"] == [3, 1]  # input untouched
    assert [turn["steps"] for turn in choice["stats"]] == [3, 1]  # the forwards, prefill included, kept
    ar = upgrade_record({**old, "answer_id": "ar-7",
                         "choices": [{**old["choices"][0], "accept_lengths": [1, 1, 1, 1]}]})
    assert ar["choices"][0]["decoding_steps"] == [3, 1]  # AR's prefill was and is a step
    assert upgrade_record(new) is new


@pytest.mark.skipif(not (REFERENCE / "pld").is_dir(), reason="the committed reference run is absent")
def test_the_reference_run_reports_tau_as_spec_bench_counts_it(tmp_path):
    """The committed reference answers (format 2; format 1 is converted on read, above): τ = new
    tokens ÷ decoding steps, the same in the records, the run's stats, its summary and the report."""
    for run_dir in sorted((REFERENCE / "pld").iterdir()):
        raw = read_jsonl(run_dir / "answers" / "pld.jsonl")
        assert all(r["records_format"] == RECORDS_FORMAT for r in raw)
        tokens = sum(sum(r["choices"][0]["new_tokens"]) for r in raw)
        steps = sum(sum(r["choices"][0]["decoding_steps"]) for r in raw)
        answers = read_answers(run_dir / "answers" / "pld.jsonl")
        assert decoder_stats(answers)["tau"] == pytest.approx(tokens / steps)
        assert specbench_mean_accepted(answers) == pytest.approx(tokens / steps)
        assert decoder_stats(read_answers(run_dir / "answers" / "ar.jsonl"))["tau"] == 1.0
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["decoder"]["tau"] == pytest.approx(tokens / steps)
    copy = tmp_path / "reference" / "smollm2-135m" / "spec_bench" / "pld" / run_dir.name
    shutil.copytree(run_dir, copy)
    summary["baseline_results"] = str(copy)
    (copy / "summary.json").write_text(json.dumps(summary))
    (_, cells), = report(tmp_path / "reference", tmp_path / "report").values()
    (label, row), = cells.items()
    assert row[OVERALL]["tau"] == pytest.approx(tokens / steps)


def test_per_position_counts_follow_the_tree_depth():
    """Positions are counted from the tree's node depths: a depth-3 tree has 3, no phantom 4th."""
    stats = DecodeStats()
    stats.count_step(3, [True, True, False], 2)  # a depth-3 tree, two drafts accepted, the second node a leaf
    stats.count_step(3, [True, False], 1)
    stats.count_step(2, [True], 0)
    assert stats.position_proposed == [3, 3, 2]
    assert stats.position_tested == [3, 1, 0]
    assert stats.position_accepted == [2, 1, 0]
