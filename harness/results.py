"""Results folders under `results/`, written as a run goes, safe to resume.

    results/<model>/<dataset>/<method>/<hardware>-<dtype>-<settings hash>/
        config.yaml          the resolved Hydra config
        environment.json     versions, CPU/GPU, threads, git commit
        answers/<method>.jsonl   one line per finished question (Spec-Bench answer record plus,
        answers/ar.jsonl         per turn, prompt and output token ids and decoder statistics, and
                             the machine state while it was measured)
        summary.json         the machine-readable summary (written when the run completes)

A run's AR baseline lives in the same folder: each question is answered by AR and the method in
the same session, one after the other (the order alternates between questions), and both records
are appended together, so a speedup always divides two measurements taken side by side. The
settings hash covers the model, dataset, question selection, generation settings and the method.

Re-running a command resumes: finished questions are skipped; a question found for only some of
the folder's decoders (a crash between them), a half-written line or a duplicate is dropped, and
the question is measured again on every side. Appends and rewrites hold a file lock. A folder
measured on other hardware or software is never reused.
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
    """The results folder of one run: the answers of each of its decoders (the method and, when
    it has one, its paired AR baseline)."""

    def __init__(self, path: Path, decoders: list[str]):
        self.path = Path(path)
        self.decoders = list(decoders)

    def answers(self, decoder: str) -> Path:
        return self.path / "answers" / f"{decoder}.jsonl"

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
        """Create or reopen the folder; returns the ids of the questions every decoder finished
        (the others are dropped from every answers file, to be measured again as a pair)."""
        with self.locked():
            (self.path / "answers").mkdir(parents=True, exist_ok=True)
            env_file = self.path / "environment.json"
            if env_file.is_file() and resume and any(self.answers(d).is_file() for d in self.decoders):
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
                    self.answers(decoder).unlink(missing_ok=True)
                (self.path / "summary.json").unlink(missing_ok=True)
            (self.path / "config.yaml").write_text(config_yaml)
            write_json(env_file, environment)
            rows = {d: self._deduplicated(d) for d in self.decoders}
            complete = set.intersection(*({r["question_id"] for r in found} for found in rows.values()))
            for decoder, found in rows.items():
                rewrite_jsonl(self.answers(decoder), [r for r in found if r["question_id"] in complete])
            return complete

    def _deduplicated(self, decoder: str) -> list[dict]:
        rows, seen = [], set()
        for row in read_jsonl(self.answers(decoder)):
            if row.get("question_id") is not None and row["question_id"] not in seen:
                rows.append(row)
                seen.add(row["question_id"])
        return rows

    def append(self, records: dict[str, dict]) -> None:
        """The records of one question, one per decoder, appended together."""
        with self.locked():
            for decoder, record in records.items():
                with open(self.answers(decoder), "a") as f:
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    os.fsync(f.fileno())

    def records(self, decoder: str, question_ids=None) -> list[dict]:
        """Finished records (first of duplicates), in file order, optionally only these questions."""
        rows = self._deduplicated(decoder)
        if question_ids is None:
            return rows
        wanted = set(question_ids)
        return [row for row in rows if row["question_id"] in wanted]

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
