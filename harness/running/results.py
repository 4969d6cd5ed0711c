"""Results folders under `results/`, written as a run goes, safe to resume.

    results/<model>/<dataset>/<method>/<hardware>-<dtype>-<settings hash>/
        config.yaml          the resolved Hydra config
        environment.json     versions, CPU/GPU, threads, git commit
        answers/<method>.jsonl   one line per finished question (Spec-Bench answer record plus,
        answers/ar.jsonl         per turn, prompt and output token ids and decoder statistics, and
                             the machine state while it was measured)
        summary.json         the machine-readable summary (written when the run completes)

Answer records carry `records_format` (RECORDS_FORMAT). Format 1 (no field: every run before it)
counted the prefill as a decoding step of every decoder and began each turn's accept lengths
with its 1; `read_answers` reads such a file as format 2 (`upgrade_record`: the prefill's token
folded into the first verification, as Spec-Bench counts; AR's and LazyLLM's records unchanged),
so old results folders, the committed reference run included, report τ by today's definition
(docs/benchmarks.md, "τ").

A run's AR baseline lives in the same folder: each question is answered by AR and the method in
the same session, one after the other (the order alternates between questions), and both records
are appended together, so a speedup always divides two measurements taken side by side. The
settings hash covers the model, dataset, question selection, generation settings and the method.

Re-running a command resumes: finished questions are skipped; a question found for only some of
the folder's decoders (a crash between them), a half-written line or a duplicate is dropped, and
the question is measured again on every side. Appends and rewrites hold a file lock. A folder
measured on other hardware or software, or by another build of the decoding code (`methods/`,
`environment.code_digest`: an engine change retimes every answer), is never resumed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

RECORDS_FORMAT = 2  # answer records: 2 = Spec-Bench's decoding steps and accept lengths, logit margins
# Format 1 decoders whose prefill was (and is) a decoding step: AR, and LazyLLM (AR with a pruned prefill)
FORMAT1_PREFILL_STEP = ("ar", "lazyllm")
MARGIN_DIGITS = 3  # significant digits of a stored logit margin


class FolderMismatch(RuntimeError):
    """A results folder holds answers measured on other hardware, software or decoding code (one line)."""


def compact_margins(margins: list[float]) -> list[float | None]:
    """Logit margins as stored in a record: 3 significant digits (a near-tie threshold is read
    from the first), None where not finite (a one-token vocabulary)."""
    return [float(f"{m:.{MARGIN_DIGITS}g}") if math.isfinite(m) else None for m in margins]


def decoder_of(record: dict) -> str:
    """The decoder that wrote a record: its answer id is `<decoder>-<question id>`."""
    return str(record.get("answer_id", "")).removesuffix(f"-{record.get('question_id')}")


def upgrade_record(record: dict, decoder: str | None = None) -> dict:
    """A record of an older format as RECORDS_FORMAT (a new dict; the input is left alone).
    Format 1 -> 2: for a decoder whose prefill is not a step, each turn's leading 1 (the prefill's
    token) is folded into its next accept length and its decoding steps drop by one (a turn that
    ended at the prefill's token keeps its single step)."""
    if record.get("records_format", 1) >= RECORDS_FORMAT:
        return record
    decoder = decoder or decoder_of(record)
    prefill_step = decoder in FORMAT1_PREFILL_STEP
    choices = []
    for choice in record.get("choices", []):
        choice = dict(choice)
        steps, lengths = list(choice.get("decoding_steps", [])), list(choice.get("accept_lengths", []))
        if not prefill_step:
            if sum(steps) == len(lengths):  # format 1: one accept length per forward, the prefill's first
                folded, start = [], 0
                for count in steps:
                    turn, start = lengths[start:start + count], start + count
                    folded += [turn[0] + turn[1], *turn[2:]] if len(turn) > 1 else turn
                choice["accept_lengths"] = folded
            choice["decoding_steps"] = [count - 1 if count > 1 else count for count in steps]
        choice["stats"] = [{**turn, "prefill_step": turn.get("prefill_step", prefill_step)}
                           for turn in choice.get("stats", [])]
        choices.append(choice)
    return {**record, "choices": choices, "records_format": RECORDS_FORMAT, "upgraded_from": 1}


def read_answers(path: Path, decoder: str | None = None) -> list[dict]:
    """An answers file's records as RECORDS_FORMAT (`decoder` defaults to the file's name)."""
    path = Path(path)
    return [upgrade_record(r, decoder or path.stem) for r in read_jsonl(path)]


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

    def check(self, hardware_key: dict, resume: bool, measured: list[Path] | None = None) -> None:
        """Raises FolderMismatch when resuming would mix answers measured with another `hardware_key`
        (hardware, software, decoding code) into this folder. `measured`: the files that hold its
        measurements (default: its decoders' answers files)."""
        env_file = self.path / "environment.json"
        measured = [self.answers(d) for d in self.decoders] if measured is None else measured
        if env_file.is_file() and resume and any(path.is_file() for path in measured):
            previous = json.loads(env_file.read_text())
            differ = [f"{k} {previous.get(k)!r} there, {v!r} here" for k, v in hardware_key.items()
                      if previous.get(k) != v]
            if differ:
                raise FolderMismatch(
                    f"{self.path} holds results measured elsewhere ({'; '.join(differ)}): numbers from different "
                    "hardware, software or decoding code are never mixed: pass run_name=<new name> or resume=false to "
                    "start over"
                )

    def prepare(self, config_yaml: str, environment: dict, hardware_key: dict, resume: bool) -> set:
        """Create or reopen the folder; returns the ids of the questions every decoder finished
        (the others are dropped from every answers file, to be measured again as a pair)."""
        with self.locked():
            (self.path / "answers").mkdir(parents=True, exist_ok=True)
            self.check(hardware_key, resume)
            env_file = self.path / "environment.json"
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
        for row in read_answers(self.answers(decoder), decoder):
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
