"""Fidelity that explains itself: each output of a lossless method that differs from AR's is a
near-tie (both top-2 logit gaps at the first differing token within the dtype's rounding) or a
mismatch, which fails a float32 run (docs/benchmarks.md, "fidelity")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.running.results import read_jsonl
from harness.running.run import run
from harness.stats import NEAR_TIE, fidelity, fidelity_failure, summarize
from harness.stats.text import format_summary
from methods.engine.acceptance import greedy_accept
from methods.loop import logit_margins
from methods.sps import SpeculativeSamplingDecoder
from tests.conftest import REPO
from tests.test_harness import config, tiny_overrides


@pytest.fixture
def questions_file(tmp_path):
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now another one."]},
            {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]}]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_logit_margin_is_the_top2_gap_of_the_chosen_argmax_and_negative_otherwise():
    rows = torch.tensor([[1.0, 3.0, 2.5, -1.0], [0.0, 0.0, 4.0, 1.0]])
    assert logit_margins(rows, [1, 2]) == pytest.approx([0.5, 3.0])
    assert logit_margins(rows, [2, 3]) == pytest.approx([-0.5, -3.0])  # not the argmax: by how much it lost


def answer(qid, outputs, margins):
    return {"question_id": qid, "category": "c", "choices": [{
        "new_tokens": [len(o) for o in outputs], "wall_time": [1.0] * len(outputs),
        "decoding_steps": [len(o) for o in outputs],
        "accept_lengths": [1] * sum(map(len, outputs)), "output_ids": outputs, "logit_margins": margins,
        "stats": [{"ttft": 0.1, "drafted_tokens": 0, "accepted_drafts": 0, "position_proposed": [],
                   "position_tested": [],
                   "position_accepted": [], "phase_time": {}} for _ in outputs]}]}


def test_divergences_are_classified_by_both_gaps_against_the_dtype_threshold():
    ar = [answer(1, [[5, 6, 7]], [[2.0, 0.0004, 1.0]]), answer(2, [[5, 6, 7]], [[2.0, 0.0004, 1.0]]),
          answer(3, [[5, 6, 7]], [[2.0, 1.5, 1.0]]), answer(4, [[1, 2], [3, 4]], [[1.0, 1.0], [0.2, 0.0002]])]
    method = [answer(1, [[5, 8, 7]], [[2.0, 0.0003, 1.0]]),  # both gaps tiny: a near-tie in fp32
              answer(2, [[5, 8, 7]], [[2.0, -0.9, 1.0]]),  # its forward preferred AR's token by 0.9
              answer(3, [[5, 8, 7]], [[2.0, 0.0001, 1.0]]),  # AR was sure (1.5): the method's logits are wrong
              answer(4, [[1, 2], [3, 9]], [[1.0, 1.0], [0.2, 0.0007]])]  # second turn, a near-tie
    fid = fidelity(method, ar, "float32")
    assert [d["kind"] for d in fid["first_divergence"]] == ["near-tie", "mismatch", "mismatch", "near-tie"]
    assert [(d["turn"], d["position"]) for d in fid["first_divergence"]] == [(0, 1), (0, 1), (0, 1), (1, 1)]
    assert (fid["differing_questions"], fid["near_ties"], fid["mismatches"]) == (4, 2, 2)
    assert fid["max_near_tie_gap"] == pytest.approx(0.0007) and fid["threshold"] == NEAR_TIE["float32"]
    # in bf16 its rounding is coarser: a gap of 0.9 is a near-tie, 1.5 is not
    assert [d["kind"] for d in fidelity(method, ar, "bfloat16")["first_divergence"]] == [
        "near-tie", "near-tie", "mismatch", "near-tie"]
    # records without margins (written before they were) are not guessed at
    bare = [dict(r, choices=[{k: v for k, v in r["choices"][0].items() if k != "logit_margins"}]) for r in method]
    assert fidelity(bare, ar, "float32")["unclassified"] == 4
    summary = summarize("x", method, ar, {"dtype": "float32", "lossless": True, "model": "m", "dataset": "d",
                                          "sampling": {"temperature": 0.0}})
    text = format_summary(summary)
    assert "4 differ: 2 near-ties (max gap 0.0007), 2 mismatches" in text and "FIDELITY MISMATCH" in text
    assert fidelity_failure(summary) and not fidelity_failure({**summary, "dtype": "bfloat16"})
    lossy = summarize("x", method, ar, {"dtype": "float32", "lossless": False, "sampling": {"temperature": 0.0}})
    assert "4 differ (lossy)" in format_summary(lossy) and not fidelity_failure(lossy)
    sampled = summarize("x", method, ar, {"dtype": "float32", "lossless": True, "sampling": {"temperature": 0.7}})
    assert sampled["fidelity"]["mismatches"] == 0 and not fidelity_failure(sampled)


def test_a_genuine_run_has_no_mismatch_and_records_the_forwards_margins(tiny_chat_model_dir, questions_file, tmp_path):
    summary = run(config(*tiny_overrides(tiny_chat_model_dir, questions_file, tmp_path, "method=sps", "limit=2")))
    fid = summary["fidelity"]
    assert fid["classified"] and fid["mismatches"] == 0 and fid["threshold"] == NEAR_TIE["float32"]
    assert fidelity_failure(summary) is None and "FIDELITY MISMATCH" not in format_summary(summary)
    folder = Path(summary["results"])
    by_id = {r["question_id"]: r for r in read_jsonl(folder / "answers" / "ar.jsonl")}
    compared = 0
    for record in read_jsonl(folder / "answers" / "sps.jsonl"):
        mine, base = record["choices"][0], by_id[record["question_id"]]["choices"][0]
        for side in (mine, base):
            assert [len(m) for m in side["logit_margins"]] == [len(o) for o in side["output_ids"]]
        assert all(m >= 0 for turn in base["logit_margins"] for m in turn)  # greedy AR chose each argmax
        for ours, theirs, out, ar_out in zip(mine["logit_margins"], base["logit_margins"], mine["output_ids"],
                                             base["output_ids"]):
            for m, a, x, y in zip(ours, theirs, out, ar_out):
                if x != y:
                    break
                # the same token chosen by a verification row and by AR's own step: the same gap
                assert m == pytest.approx(a, rel=1e-2, abs=NEAR_TIE["float32"])
                compared += 1
    assert compared > 10


def broken_accept(self, state, tree, logits, extra=None):
    """Greedy acceptance with a bug: the token after the accepted path is the row's argmin."""
    accepted = greedy_accept(tree, logits.argmax(-1).tolist())
    return type(accepted)(accepted.path, int(logits[accepted.path[-1]].argmin()))


def test_a_broken_acceptor_is_a_mismatch_and_fails_the_run(tiny_chat_model_dir, questions_file, tmp_path, monkeypatch,
                                                           capsys):
    monkeypatch.setattr(SpeculativeSamplingDecoder, "accept", broken_accept)
    overrides = tiny_overrides(tiny_chat_model_dir, questions_file, tmp_path, "method=sps", "limit=2", "warmup=0")
    summary = run(config(*overrides))
    fid = summary["fidelity"]
    assert fid["differing_questions"] == 2 and fid["mismatches"] == 2 and fid["near_ties"] == 0
    for divergence in fid["first_divergence"]:
        assert divergence["kind"] == "mismatch" and divergence["gap"] < -NEAR_TIE["float32"]
    assert "FIDELITY MISMATCH: 2 output(s)" in capsys.readouterr().out
    assert "2 mismatches" in format_summary(summary) and fidelity_failure(summary)
    assert json.loads((Path(summary["results"]) / "summary.json").read_text())["fidelity"]["mismatches"] == 2
    # `python -m harness.run` (what `make bench` runs) exits 1, with the same broken acceptor
    script = ("import runpy, sys; from methods.sps import SpeculativeSamplingDecoder as D; "
              "from tests.test_fidelity import broken_accept; D.accept = broken_accept; "
              "sys.argv = ['harness.run', *sys.argv[1:]]; runpy.run_module('harness.run', run_name='__main__')")
    # a results folder of its own: this process's thread count differs from the run above's, and a
    # run never mixes its answers with another setting's
    fresh = tiny_overrides(tiny_chat_model_dir, questions_file, tmp_path / "cli", "method=sps", "limit=2", "warmup=0")
    done = subprocess.run([sys.executable, "-c", script, *fresh], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "FIDELITY FAILURE: 2 of 2 outputs" in done.stderr and "FIDELITY MISMATCH" in done.stdout


def test_a_headline_with_a_mismatch_writes_its_report_and_fails(tiny_chat_model_dir, questions_file, tmp_path,
                                                                monkeypatch):
    from harness.reporting.headline import main

    monkeypatch.setattr(SpeculativeSamplingDecoder, "accept", broken_accept)
    results = tmp_path / "results"
    headline = tmp_path / "headline.yaml"
    headline.write_text(json.dumps({"model": "smollm2-135m", "dataset": "spec_bench", "limit": 2, "max_new_tokens": 12,
                                    "results_dir": str(results), "figures_dir": str(tmp_path / "plots"),
                                    "methods": {"sps": []}}))
    overrides = tiny_overrides(tiny_chat_model_dir, questions_file, results, "warmup=0")
    assert main(["--config", str(headline), *overrides]) == 1
    assert any((results / "report").rglob("speedup.md"))  # the report is written before the headline fails
