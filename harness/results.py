"""Results folders under `results/`, written as a run goes, safe to resume and to share.

    results/<model>/<dataset>/<method>/<hardware>-<dtype>-<settings hash>/
        config.yaml          the resolved Hydra config
        environment.json     versions, CPU/GPU, threads, git commit
        answers/<method>.jsonl   one line per finished question (Spec-Bench answer record plus,
                             per turn, prompt and output token ids and decoder statistics)
        summary.json         the machine-readable summary (written when the run completes)

The AR baseline lives in the `ar` folder of the same model, dataset, hardware, dtype and
generation settings (its hash leaves out which questions were selected), so every method of a
sweep reuses it and it grows with the questions asked of it; `method=ar` writes the same folder.

Re-running a command resumes: finished questions are skipped; a half-written line (a crash
mid-write) or a duplicate is dropped. Appends and rewrites hold a file lock, so parallel cluster
jobs can share a baseline folder. A folder measured on other hardware or software is never reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any


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
    """The results folder of one decoder under one set of settings."""

    def __init__(self, path: Path, decoder: str):
        self.path = Path(path)
        self.decoder = decoder
        self.answers = self.path / "answers" / f"{decoder}.jsonl"

    @contextlib.contextmanager
    def locked(self):
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def prepare(self, config_yaml: str, environment: dict, hardware_key: dict, resume: bool) -> set:
        """Create or reopen the folder; returns the ids of finished questions."""
        with self.locked():
            self.answers.parent.mkdir(parents=True, exist_ok=True)
            env_file = self.path / "environment.json"
            if env_file.is_file() and self.answers.is_file() and resume:
                previous = json.loads(env_file.read_text())
                previous_key = {k: previous.get(k) for k in hardware_key}
                if previous_key != hardware_key:
                    raise RuntimeError(
                        f"{self.path} holds results measured on {previous_key}, this run is on {hardware_key}; "
                        "numbers from different hardware or software are never mixed: pass run_name=<new name> "
                        "or resume=false to start over"
                    )
            if not resume:
                self.answers.unlink(missing_ok=True)
                (self.path / "summary.json").unlink(missing_ok=True)
            (self.path / "config.yaml").write_text(config_yaml)
            write_json(env_file, environment)
            rows = self._deduplicated()
            rewrite_jsonl(self.answers, rows)
            return {row["question_id"] for row in rows}

    def _deduplicated(self) -> list[dict]:
        rows, seen = [], set()
        for row in read_jsonl(self.answers):
            if row.get("question_id") is not None and row["question_id"] not in seen:
                rows.append(row)
                seen.add(row["question_id"])
        return rows

    def append(self, record: dict) -> None:
        with self.locked(), open(self.answers, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self, question_ids=None) -> list[dict]:
        """Finished records (first of duplicates), in file order, optionally only these questions."""
        rows = self._deduplicated()
        if question_ids is None:
            return rows
        wanted = set(question_ids)
        return [row for row in rows if row["question_id"] in wanted]

    def finished(self) -> set:
        return {row["question_id"] for row in self._deduplicated()}

    def write_summary(self, summary: dict) -> None:
        write_json(self.path / "summary.json", summary)


def rewrite_jsonl(path: Path, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
