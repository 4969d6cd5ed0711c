"""`make perf-batch`: a batch of prompts of mixed lengths against the same prompts one at a time.
(A benchmark, not a test.)

The prompts: the first Spec-Bench question of each of `--categories` (by default writing, extraction,
rag and summarization: prompts from tens to hundreds of tokens, each answered at length), in the
embedded model's chat template. Each method decodes them together at B = len(prompts)
(`methods/loop.py`: each prompt prefilled alone into its cache row, then one verification per step
for the whole batch) and one after another at B = 1, the two interleaved, `--repeats` times, greedy in
fp32. Reported per method: the prompts' lengths; the median throughput of each way, whole (new tokens
over the wall clock, prefills included) and decoding only (tokens after the first over the time after
the prefills); their ratios; and whether every sequence decoded the same tokens both ways (it must).
Writes results/perf/batch-lengths-<hardware>-float32.json.

    python -m harness.perf.batch_lengths [--methods ar,pld,eagle2] [--max-new-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.perf.draft_split import EMBEDDED, HEADLINE_TREES
from harness.perf.workload import write_result
from harness.running.datasets import load_questions
from harness.running.environment import environment, hardware_name, hardware_slug
from harness.running.prompts import ChatTemplate, Message
from methods.base import BuildContext, check_method_params, get_method
from methods.engine.runner import ModelRunner
from methods.machine.profile import MachineProfile
from methods.models.loading import load_model, load_tokenizer, resolve_device
from methods.models.specs import PROJECT_ROOT as REPO
from methods.models.specs import ModelSpec, model_config
from methods.settings.params import ConfigError


def mixed_prompts(template: ChatTemplate, categories: list[str]) -> list[list[int]]:
    """The first turn of the first Spec-Bench question of each category, in order."""
    cfg = OmegaConf.load(REPO / "conf" / "dataset" / "spec_bench.yaml")
    prompts = []
    for category in categories:
        cfg.categories = [category]
        question = load_questions(cfg, 1)[0]
        prompts.append(template.prompt_ids([Message("user", question.turns[0])]))
    return prompts


def throughput(outputs, wall: float) -> tuple[float, float]:
    """(new tokens / wall, tokens after the first / (wall - the prefills)) of generations that took `wall`
    seconds; a batch's outputs share one prefill (each output's `ttft`), one at a time each has its own."""
    new = sum(len(out.tokens) for out in outputs)
    prefill = outputs[0].stats.ttft if len({out.stats.ttft for out in outputs}) == 1 else \
        sum(out.stats.ttft for out in outputs)
    return new / wall, (new - len(outputs)) / (wall - prefill)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,pld,eagle2",
                        help="comma-separated; EAGLE-2/3 at the headline's depth and top-k")
    parser.add_argument("--categories", default="writing,extraction,rag,summarization",
                        help="Spec-Bench categories, one prompt each (the batch size)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("results/perf"))
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:  # an unknown method or setting stops here, in one line, before the model loads
        try:
            check_method_params(method, HEADLINE_TREES.get(method, {}))
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None

    device = resolve_device(args.device)
    config = model_config(EMBEDDED)
    spec = ModelSpec.from_mapping(config)
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, torch.float32, device)
    profile = MachineProfile(device)
    profile.prepare(model, EMBEDDED)
    context = BuildContext(model, EMBEDDED, OmegaConf.to_container(config, resolve=True), profile)
    template = ChatTemplate.for_model(config, tokenizer)
    prompts = mixed_prompts(template, [c.strip() for c in args.categories.split(",") if c.strip()])
    stops = [template.stop_condition(args.max_new_tokens) for _ in prompts]
    env = environment(device)
    lengths = [len(p) for p in prompts]
    print(f"{hardware_name(env)}, float32, {torch.get_num_threads()} threads; prompts of {lengths} tokens, "
          f"{args.max_new_tokens} new tokens at most, greedy; B = {len(prompts)} against one at a time, "
          f"{args.repeats} rounds", flush=True)

    results = {}
    for method in methods:
        decoder = get_method(method)(ModelRunner(model, profile=profile),
                                     {"name": method, **HEADLINE_TREES.get(method, {})}, context)
        rates = {"batch": [], "alone": [], "batch decoding": [], "alone decoding": []}
        tokens = {}

        def together():
            return decoder.generate_batch(prompts, stops)

        def alone():
            return [decoder.generate(p, s) for p, s in zip(prompts, stops)]

        together(), alone()  # warm-up (and the drafters' caches made)
        for round_ in range(args.repeats):
            for name, run in (("batch", together), ("alone", alone)):
                start = time.perf_counter()
                outputs = run()
                whole, decoding = throughput(outputs, time.perf_counter() - start)
                rates[name].append(whole)
                rates[f"{name} decoding"].append(decoding)
                tokens[name] = [out.tokens for out in outputs]
            print(f"  {method} round {round_ + 1}/{args.repeats}: tokens/s batch {rates['batch'][-1]:.1f} "
                  f"(decoding {rates['batch decoding'][-1]:.1f}), alone {rates['alone'][-1]:.1f} "
                  f"(decoding {rates['alone decoding'][-1]:.1f})", flush=True)
        median = {name: statistics.median(v) for name, v in rates.items()}
        results[method] = {"tokens_per_second": rates, "median_tokens_per_second": median,
                           "new_tokens": sum(len(t) for t in tokens["alone"]),
                           "batch_over_alone": median["batch"] / median["alone"],
                           "decoding_batch_over_alone": median["batch decoding"] / median["alone decoding"],
                           "same_tokens": tokens["batch"] == tokens["alone"]}
        r = results[method]
        print(f"{method}: B = {len(prompts)} {median['batch']:.1f} tokens/s, one at a time {median['alone']:.1f}: "
              f"{r['batch_over_alone']:.2f}x (decoding only: {median['batch decoding']:.1f} against "
              f"{median['alone decoding']:.1f}, {r['decoding_batch_over_alone']:.2f}x); same tokens: "
              f"{r['same_tokens']}", flush=True)
    result = {"hardware": hardware_name(env), "environment": env, "dtype": "float32", "prompt_lengths": lengths,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "methods": results}
    write_result(args.out, f"batch-lengths-{hardware_slug(env)}-float32", result)
    return result


if __name__ == "__main__":
    main()
