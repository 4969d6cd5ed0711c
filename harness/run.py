"""`python -m harness.run method=... model=... dataset=...`: run a method and the AR baseline on
the same questions, with the same stopping rule, and write one results folder.

Per question, AR and the method answer every turn (multi-turn questions continue from each
decoder's own previous answer); both records are appended as soon as the question finishes.
"""

from __future__ import annotations

import logging
import time
import zlib
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from harness.datasets import Question, load_questions
from harness.environment import environment, hardware_key, hardware_slug
from harness.metrics import format_summary, summarize
from harness.quality import score_records
from harness.prompts import ChatTemplate, Message
from harness.results import RunFolder, settings_hash
from methods.base import BuildContext, Decoder, available_methods, get_method
from methods.loading import ModelSpec, load_model, load_tokenizer, resolve_device, resolve_dtype
from methods.runner import ModelRunner
from methods.sampling import SamplingConfig

log = logging.getLogger("harness")
BASELINE = "ar"


class Benchmark:
    """The loaded target, its template and the decoders of one run."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        if cfg.method.name not in available_methods():
            raise ValueError(f"unknown method {cfg.method.name!r}; valid methods: {', '.join(available_methods())}")
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        spec = ModelSpec.from_mapping(cfg.model)
        log.info("loading %s (%s) as %s on %s", cfg.model.name, spec.describe(), self.dtype, self.device)
        self.tokenizer = load_tokenizer(spec)
        self.model = load_model(spec, self.dtype, self.device)
        self.template = ChatTemplate(cfg.model.template, self.tokenizer, cfg.model.get("system_message"),
                                     cfg.model.get("eos_token_ids") or ())
        self.sampling = SamplingConfig(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k))
        self.max_new_tokens = int(cfg.max_new_tokens or cfg.dataset.max_new_tokens)
        context = BuildContext(self.model, cfg.model.name, OmegaConf.to_container(cfg.model, resolve=True))
        params = OmegaConf.to_container(cfg.method, resolve=True)
        self.decoders: dict[str, Decoder] = {cfg.method.name: get_method(cfg.method.name)(ModelRunner(self.model), params, context)}
        if cfg.baseline and cfg.method.name != BASELINE:
            self.decoders = {BASELINE: get_method(BASELINE)(ModelRunner(self.model), {}, context), **self.decoders}

    def answer(self, decoder: Decoder, question: Question, max_new_tokens: int | None = None) -> dict:
        """All turns of one question; a Spec-Bench answer record with token ids and statistics."""
        max_new_tokens = max_new_tokens or self.max_new_tokens
        messages: list[Message] = []
        turns, steps, new_tokens, wall, accept_lengths, prompts, outputs, stats = ([] for _ in range(8))
        for turn_index, turn in enumerate(question.turns):
            messages.append(Message("user", turn))
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


def run(cfg: DictConfig) -> dict:
    bench = Benchmark(cfg)
    questions = load_questions(cfg.dataset, cfg.limit)
    env = environment(bench.device)
    dtype_name = str(bench.dtype).replace("torch.", "")
    settings = {
        "method": OmegaConf.to_container(cfg.method, resolve=True),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "dataset": {k: v for k, v in OmegaConf.to_container(cfg.dataset, resolve=True).items() if k != "path"},
        "questions": [q.question_id for q in questions],
        "max_new_tokens": bench.max_new_tokens, "sampling": vars(bench.sampling), "seed": cfg.seed,
        "dtype": dtype_name, "baseline": cfg.baseline, "warmup": cfg.warmup,
    }
    name = cfg.run_name or f"{hardware_slug(env)}-{dtype_name}-{settings_hash(settings)}"
    folder = RunFolder(Path(cfg.results_dir) / cfg.model.name / cfg.dataset.name / cfg.method.name / name,
                       bench.decoders)
    finished = folder.prepare(OmegaConf.to_yaml(cfg, resolve=True), {**env, "dtype": dtype_name},
                              hardware_key(env), bool(cfg.resume))
    todo = [q for q in questions if q.question_id not in finished]
    log.info("results in %s: %d questions, %d already finished", folder.path, len(questions), len(questions) - len(todo))
    if todo:
        bench.warm_up(todo[0])
    for question in tqdm(todo, desc=f"{cfg.method.name} on {cfg.dataset.name}", unit="q"):
        for decoder_name, decoder in bench.decoders.items():
            folder.append(decoder_name, bench.answer(decoder, question))
    meta = {
        "model": cfg.model.name, "dataset": cfg.dataset.name, "dtype": dtype_name,
        "device": str(bench.device), "hardware": env["gpu"] or env["cpu"], "environment": env,
        "max_new_tokens": bench.max_new_tokens, "sampling": vars(bench.sampling),
        "lossless": bench.decoders[cfg.method.name].lossless,
        "method_config": bench.decoders[cfg.method.name].describe(), "results": str(folder.path),
    }
    baseline = folder.records(BASELINE) if BASELINE in bench.decoders and cfg.method.name != BASELINE else None
    summary = summarize(cfg.method.name, folder.records(cfg.method.name), baseline, meta)
    references = {q.question_id: q.reference for q in questions}
    metric_by_category = OmegaConf.to_container(cfg.dataset.quality, resolve=True) if cfg.dataset.get("quality") else None
    quality = {name: score_records(folder.records(name), references, metric_by_category) for name in bench.decoders}
    if any(quality.values()):
        summary["quality"] = quality
    folder.write_summary(summary)
    print(format_summary(summary))
    print(f"results: {folder.path}")
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
