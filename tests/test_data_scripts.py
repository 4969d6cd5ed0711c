"""data_scripts: the shipped Spec-Bench file is Spec-Bench's, and a download checks what it fetched."""

from __future__ import annotations

import json

import pytest

from data_scripts import spec_bench
from tests.conftest import SPEC_BENCH


def test_the_shipped_spec_bench_file_is_the_pinned_one_and_the_dataset_reads_it(capsys):
    from omegaconf import OmegaConf

    from harness.running.datasets import load_questions

    assert SPEC_BENCH == spec_bench.SHIPPED
    spec_bench.main(["--check"])
    assert spec_bench.SHA256 in capsys.readouterr().out
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    assert len(rows) == 480 and len({r["category"] for r in rows}) == 13
    cfg = OmegaConf.load(SPEC_BENCH.parents[2] / "conf" / "dataset" / "spec_bench.yaml")
    assert [q.question_id for q in load_questions(cfg)] == [r["question_id"] for r in rows]


def test_spec_bench_check_rejects_another_file(tmp_path):
    other = tmp_path / "q.jsonl"
    other.write_bytes(SPEC_BENCH.read_bytes()[:-1])
    with pytest.raises(SystemExit, match="sha256"):
        spec_bench.main(["--check", "--out", str(other)])


def test_spec_bench_fetch_verifies_and_writes(tmp_path):
    out = spec_bench.fetch(tmp_path / "q.jsonl", url=SPEC_BENCH.as_uri())
    assert out.read_bytes() == SPEC_BENCH.read_bytes()


def test_spec_bench_fetch_rejects_other_content(tmp_path):
    bogus = tmp_path / "bogus.jsonl"
    bogus.write_text('{"question_id": 1}\n')
    with pytest.raises(SystemExit, match="sha256"):
        spec_bench.fetch(tmp_path / "q.jsonl", url=bogus.as_uri())
    assert not (tmp_path / "q.jsonl").exists()


def test_spec_bench_fetch_offline_message(tmp_path):
    with pytest.raises(SystemExit, match="could not download .*dataset.path="):
        spec_bench.fetch(tmp_path / "q.jsonl", url=(tmp_path / "missing.jsonl").as_uri())
