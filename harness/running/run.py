"""`python -m harness.run method=... model=... dataset=...`: run a method and the AR baseline on
the same questions, with the same stopping rule, and write one results folder.

Per question, AR and the method answer every turn (multi-turn questions continue from each
decoder's own previous answer); both records are appended as soon as the question finishes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import traceback
import uuid
import zlib
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from harness.cluster.slurm import slurm_job
from harness.running import busy
from harness.running.datasets import Question, load_questions, truncate_middle
from harness.running.environment import drafts_digest, environment, hardware_key, hardware_name, hardware_slug
from harness.running.execution import SandboxUnavailable
from harness.running.prompts import ChatTemplate, Message
from harness.running.quality import score_records
from harness.running.results import (
    RECORDS_FORMAT,
    FolderMismatch,
    RunFolder,
    compact_margins,
    settings_hash,
    write_json,
)
from harness.running.validate import check_group_choices, validate
from harness.stats import fidelity_failure, summarize
from harness.stats.text import format_summary
from methods.base import BuildContext, Decoder, get_method
from methods.engine.native import dtype_name
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.machine.profile import MachineProfile
from methods.models.loading import load_model, load_tokenizer, resolve_device
from methods.models.specs import PROJECT_ROOT as REPO
from methods.models.specs import ModelSpec, ModelUnavailableError

log = logging.getLogger("harness")
# Errors that a user's setting or missing file causes: one line and exit code 2, not a traceback
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, ModelUnavailableError, SandboxUnavailable, FolderMismatch)
BASELINE = "ar"
TEMPLATE_ALLOWANCE = 64  # tokens left for the chat template around a truncated prompt


class Benchmark:
    """The settings of one run (known before anything loads: its results folder is checked first),
    the machine profile (`choose_dtype` and `load` measure through it, the only place that times the
    machine), then, after `load`, the target, its template and the decoders."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        self.device = resolve_device(cfg.device)
        self.profile = MachineProfile(self.device)  # reads and measures nothing yet
        self.dtype, self.dtype_reason = None, None  # `choose_dtype`
        self.sampling = SamplingConfig(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k))
        self.max_new_tokens = int(cfg.max_new_tokens or cfg.dataset.max_new_tokens)
        self.batch_size = int(cfg.batch_size)  # questions decoded together, AR and the method alike
        paired = cfg.baseline and cfg.method.name != BASELINE
        self.names = [BASELINE, cfg.method.name] if paired else [cfg.method.name]

    def choose_dtype(self) -> None:
        """`dtype=auto`'s choice from the machine profile (on a CPU with native bf16: bf16 timed against
        fp32 once per machine and model, logged)."""
        cfg = self.cfg
        self.dtype, self.dtype_reason = self.profile.dtype(cfg.dtype, ModelSpec.from_mapping(cfg.model), cfg.model.name)
        log.info("dtype %s: %s", dtype_name(self.dtype), self.dtype_reason)

    def load(self) -> None:
        """The target, then the machine profile's parts it needs (measured once per machine, logged), then
        the decoders, built on the profile: building them measures nothing of the target."""
        cfg = self.cfg
        spec = ModelSpec.from_mapping(cfg.model)
        log.info("loading %s (%s) as %s on %s", cfg.model.name, spec.describe(), self.dtype, self.device)
        self.tokenizer = load_tokenizer(spec)
        self.model = load_model(spec, self.dtype, self.device)
        self.template = ChatTemplate.for_model(cfg.model, self.tokenizer)
        skinny, forward, graphs = cfg.engine.skinny_gemm, cfg.engine.decoder, cfg.engine.cuda_graphs
        self.profile.prepare(self.model, cfg.model.name, skinny)
        context = BuildContext(self.model, cfg.model.name, OmegaConf.to_container(cfg.model, resolve=True),
                               self.profile)
        params = OmegaConf.to_container(cfg.method, resolve=True)
        self.decoders: dict[str, Decoder] = {
            name: get_method(name)(ModelRunner(self.model, skinny, forward, graphs, profile=self.profile,
                                               compile=cfg.engine.compile),
                                   params if name == cfg.method.name else {}, context)
            for name in self.names}

    def engine_record(self) -> dict:
        """How the engine ran: the dtype and why, the forward (fused or not, and why not), the linear
        path and the kernels it chose, and the hardware profiles that chose kernels and sizes (each
        file, when it was measured and whether the machine was quiet)."""
        target = next(iter(self.decoders.values())).target
        linear = target.linear
        return {"dtype_reason": self.dtype_reason, "skinny_gemm": self.cfg.engine.skinny_gemm,
                "decoder": "fused" if target.fused else f"transformers ({target.unfused_reason})",
                "cuda_graphs": f"{self.cfg.engine.cuda_graphs} ({target.graph_mode})",
                "compile": self.cfg.engine.compile,
                "linear_kernels": linear.plan.to_dict()["kernels"] if linear.plan else None,
                "profiles": self.profile.used()}

    def max_new_tokens_for(self, category: str) -> int:
        """max_new_tokens when given, else the dataset's per-category setting, else its default."""
        if self.cfg.max_new_tokens:
            return int(self.cfg.max_new_tokens)
        return int((self.cfg.dataset.get("max_new_tokens_by_category") or {}).get(category, self.max_new_tokens))

    def user_turn(self, text: str, max_new_tokens: int) -> str:
        """Datasets with `truncate: middle` (LongBench) keep an over-long prompt's first and last
        halves, so that prompt, template and answer fit the model's context."""
        if self.cfg.dataset.get("truncate") != "middle":
            return text
        context = getattr(self.model.config, "max_position_embeddings", None) or 4096
        return truncate_middle(text, self.tokenizer, context - max_new_tokens - TEMPLATE_ALLOWANCE)

    def answer(self, decoder: Decoder, question: Question, max_new_tokens: int | None = None,
               progress: LiveCount | None = None) -> dict:
        """All turns of one question; a Spec-Bench answer record with token ids and statistics."""
        return self.answer_batch(decoder, [question], max_new_tokens, progress)[0]

    def answer_batch(self, decoder: Decoder, questions: list[Question], max_new_tokens: int | None = None,
                     progress: LiveCount | None = None) -> list[dict]:
        """All turns of these questions, one answer record each. At `batch_size` 1 one question,
        one `generate` per turn; above it, turn t of every question that has one is decoded in one
        batch (`methods/loop.py`) and each record keeps, per turn, the size of its batch and the
        batch's wall time (its `wall_time` and `ttft` are the request's own: latency and TTFT)."""
        limits = [max_new_tokens or self.max_new_tokens_for(q.category) for q in questions]
        messages: list[list[Message]] = [[] for _ in questions]
        fields = ("turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths", "ttft", "prompt_ids",
                  "output_ids", "logit_margins", "stats",
                  *(("batch_size", "batch_wall_time") if self.batch_size > 1 else ()))
        choices = [{name: [] for name in fields} for _ in questions]
        for turn_index in range(max(len(q.turns) for q in questions)):
            group = [i for i, q in enumerate(questions) if turn_index < len(q.turns)]
            prompts, stops, generators = [], [], []
            for i in group:
                messages[i].append(Message("user", self.user_turn(questions[i].turns[turn_index], limits[i])))
                prompts.append(self.template.prompt_ids(messages[i]))
                stops.append(self.template.stop_condition(limits[i]))
                seed = zlib.crc32(f"{self.cfg.seed}/{questions[i].question_id}/{turn_index}".encode())
                generators.append(torch.Generator(device=self.device).manual_seed(seed))
            if progress is not None:  # the live count follows the batch's first sequence
                turn = f" turn {turn_index + 1}" if len(questions[group[0]].turns) > 1 else ""
                progress.start(decoder.name + turn + (f" (batch of {len(group)})" if self.batch_size > 1 else ""),
                               limits[group[0]])
                stops[0] = dataclasses.replace(stops[0], progress=progress)
            try:
                outs = decoder.generate_batch(prompts, stops, self.sampling, generators)
            except Exception as err:
                ids = ", ".join(str(questions[i].question_id) for i in group)
                raise RuntimeError(f"{decoder.name} failed on question {ids} turn {turn_index}: {err}") from err
            batch_wall = max(out.stats.total_time for out in outs)
            for i, prompt, stop, out in zip(group, prompts, stops, outs):
                text = self.template.answer_text(out.tokens, stop)
                messages[i].append(Message("assistant", text))
                turn_stats = out.stats.to_dict()
                # per target forward; the record keeps Spec-Bench's per decoding step
                del turn_stats["accepted_lengths"]
                choice = choices[i]
                choice["logit_margins"].append(compact_margins(turn_stats.pop("logit_margins")))
                choice["accept_lengths"].extend(out.stats.accept_lengths)
                choice["turns"].append(text)
                choice["decoding_steps"].append(out.stats.decoding_steps)
                choice["new_tokens"].append(out.stats.new_tokens)
                choice["wall_time"].append(out.stats.total_time)
                choice["ttft"].append(out.stats.ttft)
                choice["prompt_ids"].append(prompt)
                choice["output_ids"].append(out.tokens)
                choice["stats"].append(turn_stats)
                if self.batch_size > 1:
                    choice["batch_size"].append(len(group))
                    choice["batch_wall_time"].append(batch_wall)
        return [{
            "question_id": question.question_id,
            "category": question.category,
            "answer_id": f"{decoder.name}-{question.question_id}",
            "model_id": f"{self.cfg.model.name}-{decoder.name}",
            "tstamp": time.time(),
            "records_format": RECORDS_FORMAT,
            "choices": [{"index": 0, **choice}],
        } for question, choice in zip(questions, choices)]

    def warm_up(self, question: Question) -> None:
        warm = Question(question.question_id, question.category, question.turns[:1])
        for _ in range(int(self.cfg.warmup)):
            for decoder in self.decoders.values():
                self.answer_batch(decoder, [warm] * self.batch_size, max_new_tokens=min(32, self.max_new_tokens))


SELECTION_KEYS = ("categories", "sample", "path", "prepare_hint")


class LiveCount:
    """The live token count of the question being answered, on the progress bar's line: shown once
    a question has run for `after` seconds, refreshed at most every `every` seconds (the decoders
    call it once per step, inside their timed loop, so it must cost next to nothing)."""

    def __init__(self, bar, after: float = 3.0, every: float = 1.0):
        self.bar, self.after, self.every = bar, after, every
        self.label, self.limit, self.begin, self.shown = "", 0, 0.0, 0.0

    def start(self, label: str, limit: int) -> None:
        self.label, self.limit, self.begin = label, limit, time.monotonic()
        self.shown = self.begin + self.after - self.every

    def __call__(self, tokens: int) -> None:
        now = time.monotonic()
        if now - self.shown < self.every:
            return
        self.shown = now
        self.bar.set_postfix_str(f"{self.label}: {tokens}/{self.limit} tokens, {tokens / (now - self.begin):.1f} tok/s")


class LogProgress:
    """The progress of a run whose stderr is not a terminal (a sweep job's log, `make bench > log`):
    a line `sps on spec_bench: 3/13 questions, 2.1 min` after a question when `every` seconds have
    passed since the last line (and after the last question), and the live count of a long question
    (`LiveCount`) on such a line as often, instead of tqdm's one line of carriage returns that grows
    for the whole run."""

    def __init__(self, items: list, desc: str, every: float = 30.0, emit=None, clock=time.monotonic,
                 unit: str = "questions"):
        self.items, self.desc, self.every, self.clock, self.unit = items, desc, every, clock, unit
        self.emit = emit or (lambda line: log.info("%s", line))
        self.done, self.begin = 0, clock()
        self.last = self.begin

    def _line(self, extra: str = "") -> None:
        self.last = self.clock()
        self.emit(f"{self.desc}: {self.done}/{len(self.items)} {self.unit}, {(self.last - self.begin) / 60:.1f} "
                  f"min{extra}")

    def __iter__(self):
        for item in self.items:
            yield item
            self.done += 1
            if self.clock() - self.last >= self.every or self.done == len(self.items):
                self._line()

    def set_postfix_str(self, text: str) -> None:
        if self.clock() - self.last >= self.every:
            self._line(f"; now {text}")


def progress(items: list, desc: str, unit: str = "questions"):
    """tqdm's bar on a terminal, else periodic log lines (`LogProgress`); items counted in `unit`."""
    return tqdm(items, desc=desc, unit=unit) if sys.stderr.isatty() else LogProgress(items, desc, unit=unit)


def run(cfg: DictConfig, started=None) -> dict:
    """`started(folder, questions)`, when given, is called once the results folder is known (sweep status)."""
    validate(cfg)  # before anything loads: a bad value costs seconds, not a model load
    bench = Benchmark(cfg)
    bench.choose_dtype()
    questions = load_questions(cfg.dataset, cfg.limit)
    env = environment(bench.device)
    precision = dtype_name(bench.dtype)
    method = cfg.method.name
    settings = run_settings(cfg, bench, questions, precision)
    slug = f"{hardware_slug(env)}-{precision}"
    root = Path(cfg.results_dir) / cfg.model.name / cfg.dataset.name
    folder = RunFolder(root / method / (cfg.run_name or f"{slug}-{settings_hash(settings)}"), bench.names)
    key = hardware_key(env)
    folder.check(key, resume=bool(cfg.resume))  # a folder it may not resume refuses before the model loads
    bench.load()
    engine = bench.engine_record()
    environment_record = {**env, "dtype": precision, "engine": engine}
    finished = folder.prepare(OmegaConf.to_yaml(cfg, resolve=True), environment_record, key, resume=bool(cfg.resume))
    todo = [(i, q) for i, q in enumerate(questions) if q.question_id not in finished]
    log.info("results in %s: %d questions, %d already finished", folder.path, len(questions),
             len(questions) - len(todo))
    if started:
        started(folder.path, len(questions))
    ids = [q.question_id for q in questions]
    try:
        answer_questions(bench, folder, todo, f"{method} on {cfg.dataset.name}", int(cfg.warmup))
    except KeyboardInterrupt:
        saved = len(folder.records(method, ids))
        raise Interrupted(f"interrupted: {saved} of {len(ids)} questions saved in {folder.path}; "
                          "run the same command again to resume") from None
    summary = run_summary(cfg, bench, folder, questions, env, engine, precision)
    folder.write_summary(summary)
    print(format_summary(summary))
    print(f"results: {folder.path}")
    return summary


def run_settings(cfg: DictConfig, bench: Benchmark, questions: list[Question], precision: str) -> dict:
    """What a run's results folder is named by (`settings_hash`): the config that changes its answers, the questions,
    the batch size (above 1) and the trained drafts' contents."""
    settings = {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "dataset": {k: v for k, v in OmegaConf.to_container(cfg.dataset, resolve=True).items()
                    if k not in SELECTION_KEYS},
        "max_new_tokens": bench.max_new_tokens, "sampling": vars(bench.sampling), "seed": cfg.seed, "dtype": precision,
        "engine": OmegaConf.to_container(cfg.engine, resolve=True),
        "method": OmegaConf.to_container(cfg.method, resolve=True),
        "questions": [q.question_id for q in questions], "baseline": cfg.baseline, "warmup": cfg.warmup,
    }
    if bench.batch_size > 1:  # its own results folder: a run set never mixes batch sizes (B = 1 keys unchanged)
        settings["batch_size"] = bench.batch_size
    drafts = drafts_digest(settings["model"], settings["method"])
    if drafts:  # trained drafts' contents: retrained ones get their own folder (training-free methods' keys unchanged)
        settings["drafts"] = drafts
    return settings


def answer_questions(bench: Benchmark, folder: RunFolder, todo: list[tuple[int, Question]], desc: str,
                     warmup: int) -> None:
    """The questions not yet answered (`todo`: their index and question), after `warmup` untimed generations, in
    groups of the batch size, AR first on even groups and the method first on odd ones; each group's answers,
    with their session and machine state, appended to the folder as they come."""
    session = uuid.uuid4().hex[:12]  # the answers of one process: a pair never spans two
    if todo:
        log.info("warming up: %d untimed generation(s) per decoder", warmup)
        bench.warm_up(todo[0][1])
    size = bench.batch_size  # questions answered together; a group of one at batch_size 1
    groups = [todo[i:i + size] for i in range(0, len(todo), size)]
    bar = progress(groups, desc + (f" (batches of {size})" if size > 1 else ""), "batches" if size > 1 else "questions")
    live = LiveCount(bar)
    for group in bar:
        order = list(bench.decoders.items())
        if group[0][0] // size % 2:  # AR first on even questions (groups), the method first on odd ones
            order.reverse()
        records = {}
        for name, decoder in order:
            before = busy.snapshot()
            answers = bench.answer_batch(decoder, [question for _, question in group], progress=live)
            machine = busy.state(before, busy.snapshot())
            records[name] = [{**record, "session": session, "machine": machine} for record in answers]
        for row in range(len(group)):
            folder.append({name: records[name][row] for name in bench.decoders})


def run_summary(cfg: DictConfig, bench: Benchmark, folder: RunFolder, questions: list[Question], env: dict,
                engine: dict, precision: str) -> dict:
    """The run's summary from the answers its folder holds: its settings, the numbers (`harness.stats.summarize`)
    and, where the dataset names them, the task-quality scores."""
    method = cfg.method.name
    ids = [q.question_id for q in questions]
    paired = BASELINE in bench.decoders and method != BASELINE
    meta = {
        "model": cfg.model.name, "dataset": cfg.dataset.name, "dtype": precision,
        "device": str(bench.device), "hardware": hardware_name(env), "environment": env, "engine": engine,
        "max_new_tokens": bench.max_new_tokens, "sampling": vars(bench.sampling), "batch_size": bench.batch_size,
        "categories": sorted({q.category for q in questions}), "question_ids": ids,
        "lossless": bench.decoders[method].lossless,
        "method_config": bench.decoders[method].describe(), "results": str(folder.path),
        "baseline_results": str(folder.path) if paired else None,
    }
    records = {name: folder.records(name, ids) for name in bench.decoders}
    summary = summarize(method, records[method], records[BASELINE] if paired else None, meta)
    references = {q.question_id: q.reference for q in questions}
    metric_by_category = OmegaConf.to_container(cfg.dataset.quality,
                                                resolve=True) if cfg.dataset.get("quality") else None
    quality = {name: score_records(rows, references, metric_by_category) for name, rows in records.items()}
    if any(quality.values()):
        summary["quality"] = quality
    return summary


class Interrupted(RuntimeError):
    """Ctrl-C during a run: what is saved and how to resume, in one line."""


@hydra.main(version_base="1.3", config_path=str(REPO / "conf"), config_name="config")
def main(cfg: DictConfig) -> None:
    """In a multirun (sweep), each job also leaves `job.json` in its Hydra job folder: its
    overrides and status, with the results folder or the error and traceback, so that no failure
    of a sweep is lost (`python -m harness.cluster.jobs <sweep dir>` lists them)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        try:
            summary = run(cfg)
        except Interrupted as err:
            print(err, file=sys.stderr)
            sys.exit(130)
        except USER_ERRORS as err:
            if os.environ.get("DECODEBENCH_DEBUG"):
                raise
            print(f"error: {err} (DECODEBENCH_DEBUG=1 shows the traceback)", file=sys.stderr)
            sys.exit(2)
        failure = fidelity_failure(summary)
        if failure:  # a lossless method's greedy fp32 output differs from AR's beyond a near-tie
            print(failure, file=sys.stderr)
            sys.exit(1)
        return

    job_file = Path(hydra_cfg.runtime.output_dir) / "job.json"
    record = {"job": hydra_cfg.job.num, "job_id": hydra_cfg.job.get("id"), "overrides": list(hydra_cfg.overrides.task),
              "method": cfg.method.name, "slurm": slurm_job(), "started": time.time()}
    write_json(job_file, {**record, "status": "running"})

    def started(folder: Path, questions: int) -> None:  # the sweep's status line counts its answers
        record.update(results=str(folder), questions=questions)
        write_json(job_file, {**record, "status": "running"})

    try:
        summary = run(cfg, started)
    except BaseException as err:
        # SystemExit: submitit requeues a preempted or timed-out job (it resumes its results folder)
        status = "interrupted" if isinstance(err, (SystemExit, KeyboardInterrupt, Interrupted)) else "failed"
        write_json(job_file, {**record, "status": status, "error": f"{type(err).__name__}: {err}",
                              "traceback": traceback.format_exc()})
        raise
    write_json(job_file, {**record, **job_result(summary)})


def job_result(summary: dict) -> dict:
    """What a finished sweep job adds to its job.json: its numbers with their caveats, as the
    sweep's status lines and `harness.cluster.jobs` print them (`harness.stats.text.speedup_status`)."""
    speedup = summary.get("speedup") or {}
    return {"status": "ok", "results": summary["results"], "speedup": speedup.get("specbench"),
            "speedup_ci95": speedup.get("specbench_ci95"), "tau": summary["decoder"]["tau"],
            "caveats": summary["caveats"], "fidelity_failure": fidelity_failure(summary)}


def entry(argv: list[str]) -> None:
    """`python -m harness.run`: a config group's unknown choice (`method=eagel`) is one line and
    exit code 2, checked before Hydra composes; then Hydra runs `main`."""
    try:
        check_group_choices(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    entry(sys.argv[1:])
