"""data_scripts: the Spec-Bench download checks what it fetched."""

from __future__ import annotations

import pytest

from data_scripts import spec_bench
from tests.conftest import SPEC_BENCH, SPEC_BENCH_SAMPLE


def test_spec_bench_fetch_verifies_and_writes(tmp_path):
    if not SPEC_BENCH.is_file():
        pytest.skip("no shared Spec-Bench copy to serve as the source")
    out = spec_bench.fetch(tmp_path / "q.jsonl", url=SPEC_BENCH.as_uri())
    assert out.read_bytes() == SPEC_BENCH.read_bytes()


def test_spec_bench_fetch_rejects_other_content(tmp_path):
    bogus = tmp_path / "bogus.jsonl"
    bogus.write_text('{"question_id": 1}\n')
    with pytest.raises(SystemExit, match="sha256"):
        spec_bench.fetch(tmp_path / "q.jsonl", url=bogus.as_uri())


def test_spec_bench_fetch_offline_message(tmp_path):
    with pytest.raises(SystemExit, match="could not download .*dataset.path="):
        spec_bench.fetch(tmp_path / "q.jsonl", url=(tmp_path / "missing.jsonl").as_uri())


def test_sample_fixture_is_a_verbatim_part_of_spec_bench():
    if not SPEC_BENCH.is_file():
        pytest.skip("no shared Spec-Bench copy")
    full = {line for line in SPEC_BENCH.read_text().splitlines()}
    assert all(line in full for line in SPEC_BENCH_SAMPLE.read_text().splitlines())
