"""`make perf`: is our machinery as fast as the reference implementation? (A benchmark, not a test.)

In one run, on the same model, prompts, dtype and stopping rule (greedy, EOS, max new tokens):
  * our AR loop vs `transformers` `generate(do_sample=False)`: a slower baseline would inflate
    every speedup the suite reports, so ours must not be slower;
  * our SpS vs `generate(assistant_model=draft)` with the same draft and a constant γ
    (`num_assistant_tokens_schedule="constant"`, `assistant_confidence_threshold=0`);
  * the target's forward latency against the number of tokens in one forward (the hardware curve
    that decides what speculation can gain).
Runs alternate between implementations and repeat; medians are reported. Also checks that both
sides produced the same tokens. Writes results/perf/<hardware>-<dtype>.json.

    python -m harness.perf [--dtype auto] [--questions 5] [--max-new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.datasets import load_questions
from harness.environment import environment, hardware_slug
from harness.prompts import ChatTemplate, Message
from methods.ar import AutoregressiveDecoder
from methods.models.loading import load_draft_lm, load_model, load_tokenizer, resolve_device, resolve_dtype
from methods.models.specs import ModelSpec, model_config
from methods.engine.runner import ModelRunner, forward_latency
from methods.sps import SpeculativeSamplingDecoder

EMBEDDED = "smollm2-135m"


def spec_bench_prompts(template: ChatTemplate, count: int) -> list[list[int]]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "dataset" / "spec_bench.yaml")
    questions = load_questions(cfg, count)
    return [template.prompt_ids([Message("user", q.turns[0])]) for q in questions]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="SpS draft: the target's first k layers; default: the draft conf/model/smollm2-135m.yaml names")
    parser.add_argument("--out", type=Path, default=Path("results/perf"))
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config = model_config(EMBEDDED)
    spec = ModelSpec.from_mapping(config)
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, dtype, device)
    draft_spec = ({"target_layers": args.draft_layers} if args.draft_layers
                  else OmegaConf.to_container(config.drafts.sps, resolve=True))
    draft = load_draft_lm(draft_spec, model)
    draft.generation_config.num_assistant_tokens = args.gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    template = ChatTemplate.for_model(config, tokenizer)
    prompts = spec_bench_prompts(template, args.questions)
    stop = template.stop_condition(args.max_new_tokens)
    eos = sorted(stop.eos_token_ids)

    def hf(prompt, **kwargs):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos[0], **kwargs)
        return out[0, len(prompt):].tolist()

    ours_ar = AutoregressiveDecoder(ModelRunner(model))
    ours_sps = SpeculativeSamplingDecoder(ModelRunner(model), draft, gamma=args.gamma)
    contenders = {
        "ar_ours": lambda p: ours_ar.generate(p, stop).tokens,
        "ar_generate": lambda p: hf(p),
        "sps_ours": lambda p: ours_sps.generate(p, stop).tokens,
        "sps_generate": lambda p: hf(p, assistant_model=draft),
    }
    for run in contenders.values():  # warm-up
        run(prompts[0][:32])
    tokens_per_second = {name: [] for name in contenders}
    outputs = {name: {} for name in contenders}
    for repeat in range(args.repeats):
        for index, prompt in enumerate(prompts):
            for name, run in contenders.items():
                start = time.perf_counter()
                tokens = run(prompt)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                tokens_per_second[name].append(len(tokens) / (time.perf_counter() - start))
                outputs[name][index] = tokens
    median = {name: statistics.median(v) for name, v in tokens_per_second.items()}
    env = environment(device)
    result = {
        "dtype": str(dtype).replace("torch.", ""), "device": str(device), "hardware": env["gpu"] or env["cpu"],
        "environment": env, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "gamma": args.gamma, "draft": draft_spec,
        "tokens_per_second_median": median,
        "ratio_ar_ours_over_generate": median["ar_ours"] / median["ar_generate"],
        "ratio_sps_ours_over_assisted_generate": median["sps_ours"] / median["sps_generate"],
        "same_tokens": {
            "ar": all(outputs["ar_ours"][i] == outputs["ar_generate"][i] for i in outputs["ar_ours"]),
            "sps": all(outputs["sps_ours"][i] == outputs["sps_generate"][i] for i in outputs["sps_ours"]),
        },
        "target_forward_seconds_by_tokens": forward_latency(ModelRunner(model), (1, 2, 4, 8, 16, 32, 64)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{hardware_slug(env)}-{result['dtype']}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{result['hardware']}, {result['dtype']}, {len(prompts)} Spec-Bench prompts x {args.max_new_tokens} "
          f"new tokens, {args.repeats} repeats (median tokens/s)")
    for name, value in median.items():
        print(f"  {name:<14}{value:8.2f}")
    print(f"  our AR / generate:                  {result['ratio_ar_ours_over_generate']:.3f}x")
    print(f"  our SpS / generate(assistant_model): {result['ratio_sps_ours_over_assisted_generate']:.3f}x")
    print(f"  same tokens: {result['same_tokens']}")
    one = result["target_forward_seconds_by_tokens"][1]
    print("  target forward ms by tokens: " + ", ".join(
        f"{n}: {1000 * s:.0f} ({s / one:.1f}x)" for n, s in result["target_forward_seconds_by_tokens"].items()))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
