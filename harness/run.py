"""`python -m harness.run method=... model=... dataset=...`: run a method and the AR baseline on
the same questions, with the same stopping rule, and write one results folder.

Per question, AR and the method answer every turn (multi-turn questions continue from each
decoder's own previous answer); both records are appended as soon as the question finishes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import zlib
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from harness.datasets import Question, load_questions, truncate_middle
from harness.environment import environment, hardware_key, hardware_name, hardware_slug
from harness.metrics import format_summary, summarize
from harness.quality import score_records
from harness.prompts import ChatTemplate, Message
from harness.results import RunFolder, settings_hash, write_json
from harness.validate import validate
from methods.base import BuildContext, Decoder, get_method
from methods.models.loading import load_model, load_tokenizer, resolve_device, resolve_dtype
from methods.models.specs import ModelSpec, ModelUnavailableError
from methods.engine.hardware import auto_dtype
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig

log = logging.getLogger("harness")
# Errors that a user's setting or missing file causes: one line and exit code 2, not a traceback
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, ModelUnavailableError)
BASELINE = "ar"
TEMPLATE_ALLOWANCE = 64  # tokens left for the chat template around a truncated prompt


class Benchmark:
    """The loaded target, its template and the decoders of one run."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.dtype_reason = auto_dtype(self.device)[1] if cfg.dtype == "auto" else f"dtype={cfg.dtype} asked for"
        spec = ModelSpec.from_mapping(cfg.model)
        log.info("loading %s (%s) as %s on %s", cfg.model.name, spec.describe(), self.dtype, self.device)
        self.tokenizer = load_tokenizer(spec)
        self.model = load_model(spec, self.dtype, self.device)
        self.template = ChatTemplate.for_model(cfg.model, self.tokenizer)
        self.sampling = SamplingConfig(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k))
        self.max_new_tokens = int(cfg.max_new_tokens or cfg.dataset.max_new_tokens)
        context = BuildContext(self.model, cfg.model.name, OmegaConf.to_container(cfg.model, resolve=True))
        params = OmegaConf.to_container(cfg.method, resolve=True)
        skinny = cfg.engine.skinny_gemm
        self.decoders: dict[str, Decoder] = {
            cfg.method.name: get_method(cfg.method.name)(ModelRunner(self.model, skinny), params, context)}
        if cfg.baseline and cfg.method.name != BASELINE:
            self.decoders = {BASELINE: get_method(BASELINE)(ModelRunner(self.model, skinny), {}, context), **self.decoders}

    def engine_record(self) -> dict:
        """How the engine ran: the dtype and why, the linear path and the kernels it chose."""
        linear = next(iter(self.decoders.values())).target.linear
        return {"dtype_reason": self.dtype_reason, "skinny_gemm": self.cfg.engine.skinny_gemm,
                "linear_kernels": linear.plan.to_dict()["kernels"] if linear.plan else None}

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

    def answer(self, decoder: Decoder, question: Question, max_new_tokens: int | None = None) -> dict:
        """All turns of one question; a Spec-Bench answer record with token ids and statistics."""
        max_new_tokens = max_new_tokens or self.max_new_tokens_for(question.category)
        messages: list[Message] = []
        turns, steps, new_tokens, wall, accept_lengths, prompts, outputs, stats = ([] for _ in range(8))
        for turn_index, turn in enumerate(question.turns):
            messages.append(Message("user", self.user_turn(turn, max_new_tokens)))
            prompt = self.template.prompt_ids(messages)
            stop = self.template.stop_condition(max_new_tokens)
            seed = zlib.crc32(f"{self.cfg.seed}/{question.question_id}/{turn_index}".encode())
            generator = torch.Generator(device=self.device).manual_seed(seed)
            try:
                out = decoder.generate(prompt, stop, self.sampling, generator)
            except Exception as err:
                raise RuntimeError(f"{decoder.name} failed on question {question.question_id} turn {turn_index}: {err}") from err
            text = self.template.answer_text(out.tokens, stop)
            messages.append(Message("assistant", text))
            turn_stats = out.stats.to_dict()
            accept_lengths.extend(turn_stats.pop("accepted_lengths"))
            turns.append(text)
            steps.append(out.stats.steps)
            new_tokens.append(out.stats.new_tokens)
            wall.append(out.stats.total_time)
            prompts.append(prompt)
            outputs.append(out.tokens)
            stats.append(turn_stats)
        return {
            "question_id": question.question_id,
            "category": question.category,
            "answer_id": f"{decoder.name}-{question.question_id}",
            "model_id": f"{self.cfg.model.name}-{decoder.name}",
            "tstamp": time.time(),
            "choices": [{
                "index": 0, "turns": turns, "decoding_steps": steps, "new_tokens": new_tokens,
                "wall_time": wall, "accept_lengths": accept_lengths,
                "ttft": [s["ttft"] for s in stats], "prompt_ids": prompts, "output_ids": outputs, "stats": stats,
            }],
        }

    def warm_up(self, question: Question) -> None:
        warm = Question(question.question_id, question.category, question.turns[:1])
        for _ in range(int(self.cfg.warmup)):
            for decoder in self.decoders.values():
                self.answer(decoder, warm, max_new_tokens=min(32, self.max_new_tokens))


SELECTION_KEYS = ("categories", "sample", "path", "fallback_paths", "prepare_hint")


def run(cfg: DictConfig) -> dict:
    validate(cfg)  # before anything loads: a bad value costs seconds, not a model load
    bench = Benchmark(cfg)
    questions = load_questions(cfg.dataset, cfg.limit)
    env = environment(bench.device)
    dtype_name = str(bench.dtype).replace("torch.", "")
    method = cfg.method.name
    # What makes AR's numbers what they are; which questions were selected is left out, so the
    # baseline folder is shared by every run with these settings and grows with their questions.
    generation = {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "dataset": {k: v for k, v in OmegaConf.to_container(cfg.dataset, resolve=True).items() if k not in SELECTION_KEYS},
        "max_new_tokens": bench.max_new_tokens, "sampling": vars(bench.sampling), "seed": cfg.seed, "dtype": dtype_name,
        "engine": OmegaConf.to_container(cfg.engine, resolve=True),
    }
    settings = {**generation, "method": OmegaConf.to_container(cfg.method, resolve=True),
                "questions": [q.question_id for q in questions], "baseline": cfg.baseline, "warmup": cfg.warmup}
    slug = f"{hardware_slug(env)}-{dtype_name}"
    root = Path(cfg.results_dir) / cfg.model.name / cfg.dataset.name
    baseline_name = f"{slug}-{settings_hash(generation)}"
    folders = {name: RunFolder(root / name / (cfg.run_name or (baseline_name if name == BASELINE
                                                               else f"{slug}-{settings_hash(settings)}")), name)
               for name in bench.decoders}
    engine = bench.engine_record()
    environment_record, key = {**env, "dtype": dtype_name, "engine": engine}, hardware_key(env)
    finished = {}
    for name, folder in folders.items():
        is_method = name == method
        config_text = OmegaConf.to_yaml(cfg, resolve=True) if is_method else OmegaConf.to_yaml(OmegaConf.create(generation))
        finished[name] = folder.prepare(config_text, environment_record, key, resume=bool(cfg.resume) or not is_method)
    if BASELINE in folders and method != BASELINE:
        check_baseline_prompts(bench, folders[BASELINE], questions, finished[BASELINE])
    todo = [q for q in questions if any(q.question_id not in done for done in finished.values())]
    log.info("results in %s: %d questions, %d already finished", folders[method].path, len(questions),
             len(questions) - len(todo))
    ids = [q.question_id for q in questions]
    try:
        if todo:
            log.info("warming up: %d untimed generation(s) per decoder", int(cfg.warmup))
            bench.warm_up(todo[0])
        for question in tqdm(todo, desc=f"{method} on {cfg.dataset.name}", unit="q"):
            for name, decoder in bench.decoders.items():  # AR first, then the method, per question
                if question.question_id not in finished[name]:
                    folders[name].append(bench.answer(decoder, question))
    except KeyboardInterrupt:
        saved = len(folders[method].records(ids))
        raise Interrupted(f"interrupted: {saved} of {len(ids)} questions saved in {folders[method].path}; "
                          "run the same command again to resume") from None
    meta = {
        "model": cfg.model.name, "dataset": cfg.dataset.name, "dtype": dtype_name,
        "device": str(bench.device), "hardware": hardware_name(env), "environment": env, "engine": engine,
        "max_new_tokens": bench.max_new_tokens, "sampling": vars(bench.sampling),
        "categories": sorted({q.category for q in questions}),
        "lossless": bench.decoders[method].lossless,
        "method_config": bench.decoders[method].describe(), "results": str(folders[method].path),
        "baseline_results": str(folders[BASELINE].path) if BASELINE in folders and method != BASELINE else None,
    }
    records = {name: folder.records(ids) for name, folder in folders.items()}
    baseline = records[BASELINE] if method != BASELINE and BASELINE in records else None
    summary = summarize(method, records[method], baseline, meta)
    references = {q.question_id: q.reference for q in questions}
    metric_by_category = OmegaConf.to_container(cfg.dataset.quality, resolve=True) if cfg.dataset.get("quality") else None
    quality = {name: score_records(rows, references, metric_by_category) for name, rows in records.items()}
    if any(quality.values()):
        summary["quality"] = quality
    folders[method].write_summary(summary)
    print(format_summary(summary))
    print(f"results: {folders[method].path}")
    return summary


class Interrupted(RuntimeError):
    """Ctrl-C during a run: what is saved and how to resume, in one line."""


def check_baseline_prompts(bench: Benchmark, folder: RunFolder, questions: list[Question], finished: set) -> None:
    """A shared baseline is reused only for the very prompts this run would send."""
    stored = {r["question_id"]: r["choices"][0]["prompt_ids"][0] for r in folder.records()}
    for question in questions:
        if question.question_id in finished:
            first = bench.user_turn(question.turns[0], bench.max_new_tokens_for(question.category))
            prompt = bench.template.prompt_ids([Message("user", first)])
            if stored[question.question_id] != prompt:
                raise RuntimeError(
                    f"the AR baseline in {folder.path} answered question {question.question_id} with another "
                    "prompt than this run would send (the dataset file or template changed); it is not reused. "
                    "Remove that folder or pass baseline=false / run_name=<new name>."
                )


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """In a multirun (sweep), each job also leaves `job.json` in its Hydra job folder: its
    overrides and status, with the results folder or the error and traceback, so that no failure
    of a sweep is lost (`python -m harness.report --jobs <sweep dir>` lists them)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        try:
            run(cfg)
        except Interrupted as err:
            print(err, file=sys.stderr)
            sys.exit(130)
        except USER_ERRORS as err:
            if os.environ.get("DECODEBENCH_DEBUG"):
                raise
            print(f"error: {err} (DECODEBENCH_DEBUG=1 shows the traceback)", file=sys.stderr)
            sys.exit(2)
        return
    job_file = Path(hydra_cfg.runtime.output_dir) / "job.json"
    record = {"job": hydra_cfg.job.num, "overrides": list(hydra_cfg.overrides.task)}
    try:
        summary = run(cfg)
    except BaseException as err:
        import traceback

        write_json(job_file, {**record, "status": "failed", "error": f"{type(err).__name__}: {err}",
                              "traceback": traceback.format_exc()})
        raise
    write_json(job_file, {**record, "status": "ok", "results": summary["results"],
                          "speedup": (summary.get("speedup") or {}).get("specbench"), "tau": summary["decoder"]["tau"]})


if __name__ == "__main__":
    main()
