"""One folder per run under `results/`, written as the run goes, safe to resume.

    results/<model>/<dataset>/<method>/<hardware>-<dtype>-<settings hash>/
        config.yaml          the resolved Hydra config
        environment.json     versions, CPU/GPU, threads, git commit
        answers/<decoder>.jsonl   one line per finished question (Spec-Bench answer record plus,
                             per turn, prompt and output token ids and decoder statistics);
                             `ar.jsonl` is the baseline of the same run
        summary.json         the machine-readable summary (written when the run completes)

A question counts as finished when every decoder of the run has its line. Re-running the same
command resumes: finished questions are skipped, partial lines (a crash mid-write) and lines of a
question that only some decoders finished are dropped before continuing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable


def settings_hash(settings: dict) -> str:
    blob = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def read_jsonl(path: Path) -> list[dict]:
    """Valid JSON lines of a file; a half-written line (crash mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class RunFolder:
    def __init__(self, path: Path, decoders: Iterable[str]):
        self.path = Path(path)
        self.decoders = list(decoders)
        self.answers = self.path / "answers"

    def answer_file(self, decoder: str) -> Path:
        return self.answers / f"{decoder}.jsonl"

    def prepare(self, config_yaml: str, environment: dict, hardware_key: dict, resume: bool) -> set:
        """Create or reopen the folder; returns the ids of finished questions."""
        self.answers.mkdir(parents=True, exist_ok=True)
        env_file = self.path / "environment.json"
        if env_file.is_file() and resume and any(self.answer_file(d).is_file() for d in self.decoders):
            previous = json.loads(env_file.read_text())
            previous_key = {k: previous.get(k) for k in hardware_key}
            if previous_key != hardware_key:
                raise RuntimeError(
                    f"{self.path} holds results measured on {previous_key}, this run is on {hardware_key}; "
                    "numbers from different hardware or software are never mixed: pass run_name=<new name> "
                    "or resume=false to start over"
                )
        if not resume:
            for decoder in self.decoders:
                self.answer_file(decoder).unlink(missing_ok=True)
            (self.path / "summary.json").unlink(missing_ok=True)
        (self.path / "config.yaml").write_text(config_yaml)
        write_json(env_file, environment)
        return self._finished_questions()

    def _finished_questions(self) -> set:
        rows = {d: read_jsonl(self.answer_file(d)) for d in self.decoders}
        ids = [{r["question_id"] for r in rows[d]} for d in self.decoders]
        finished = set.intersection(*ids) if ids else set()
        for decoder in self.decoders:  # rewrite without partial lines and unfinished questions
            kept, seen = [], set()
            for row in rows[decoder]:
                if row["question_id"] in finished and row["question_id"] not in seen:
                    kept.append(row)
                    seen.add(row["question_id"])
            self._rewrite(self.answer_file(decoder), kept)
        return finished

    @staticmethod
    def _rewrite(path: Path, rows: list[dict]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)

    def append(self, decoder: str, record: dict) -> None:
        with open(self.answer_file(decoder), "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self, decoder: str) -> list[dict]:
        return read_jsonl(self.answer_file(decoder))

    def write_summary(self, summary: dict) -> None:
        write_json(self.path / "summary.json", summary)


def write_json(path: Path, data: Any) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
