"""Where a draft step's time goes, as a decoding step runs it (a benchmark, part of `make perf`).

Every part is timed right after a target forward of one token (a 256-token prefix), which streams the
target's weights and so evicts the draft's from the caches as a step's verification does:

  * EAGLE-2 (the EAGLE head, the 8,192-token draft vocabulary) at the headline's depth 3, EAGLE-3 at
    depth 4, both top-4 with the adaptive size on this run's curve: the follow of 2 accepted tokens
    (the head over them and the root's logits); one level over 4 nodes as its parts (inputs: the
    embedding and fc, EAGLE-3: its norms and the concatenation; layer: RoPE, the level mask and the
    decoder layer; lm head: the draft vocabulary's rows; top-k: log-softmax over the draft
    vocabulary, top-k, target ids); the decoder's whole expansion and its rerank; the step (follow,
    expansion, rerank) against its floor, the weights a head forward reads over the target's, times
    the depth + 1 head forwards of a step;
  * one token of SpS's draft LM over its draft vocabulary: its forward without logits, its LM head
    (and the scatter onto the target's vocabulary), the greedy top-1, beside the share of the
    target's weights it reads;
  * the block drafters, DFlash and PARD, at the headline's settings (`auto`): one draft forward a step
    fills the whole block, so the step is timed as decoding runs it, a greedy answer's draft phase over
    its steps (each draft right after that step's verification), beside the drafts it proposes and the
    draft forwards it ran per step.

    python -m harness.perf.draft_split [--rounds 9]     # writes results/perf/draft-split-<hardware>-float32.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.perf.workload import write_result
from harness.running.environment import environment, hardware_name, hardware_slug
from harness.running.prompts import ChatTemplate, Message
from methods.base import BuildContext, get_method
from methods.eagle.decoder import one_sequence
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.engine.tree import level_mask
from methods.machine.probes import streamed_size, weight_bytes
from methods.machine.profile import MachineProfile
from methods.models.loading import load_draft_lm, load_model, load_tokenizer, resolve_device
from methods.models.specs import ModelSpec, ModelUnavailableError, model_config

EMBEDDED = "smollm2-135m"


def parameter_bytes(*modules) -> int:
    """Bytes of the modules' parameters as the engine streams them, each once: 2 a value for an fp32
    parameter of bf16 values (a draft as stored; the native kernel reads it as bf16 panels)."""
    seen = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * streamed_size(p) for p in seen.values())


class StepClock:
    """Times the parts of a draft as a decoding step runs them: `evict()` runs the target's one-token
    forward (a 256-token prefix), which streams the target's weights and so evicts the draft's from
    the caches as a step's verification does; `part(name, fn)` times `fn()` and keeps its result."""

    def __init__(self, runner: ModelRunner, prefix: int = 256):
        self.runner, self.prefix, self.samples = runner, prefix, {}
        runner.reset()
        runner.prefill([0] * prefix)

    def evict(self) -> None:
        self.runner.forward([0])
        self.runner.rollback(self.prefix)

    def part(self, name: str, fn):
        start = time.perf_counter()
        out = fn()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        self.samples.setdefault(name, []).append(time.perf_counter() - start)
        return out

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(v) for name, v in self.samples.items()}


# The headline's EAGLE-2 and EAGLE-3 settings (conf/headline/smollm2-135m.yaml)
HEADLINE_TREES = {"eagle2": {"depth": 3, "top_k": 4}, "eagle3": {"depth": 4, "top_k": 4}}


@torch.inference_mode()
def eagle_step_split(model, runner: ModelRunner, context: BuildContext, method: str, curve: dict[int, float],
                     clock: StepClock, rounds: int = 9, accepted: int = 2) -> dict | None:
    """One EAGLE-family draft step split into its parts, each sample after a target forward (`StepClock`):
    the follow of `accepted` accepted tokens (the head over them, the root's logits); one level over
    top_k nodes as its parts: inputs (embedding and fc, EAGLE-3: its two norms and the concatenation),
    layer (RoPE, the level mask, the decoder layer), lm head (the draft vocabulary's rows), top-k
    (log-softmax over the draft vocabulary, top-k, target ids); then the decoder's whole expansion of
    depth + 1 levels and its rerank (the adaptive size on `curve`, the tree). The floor: the weights
    the head reads per forward (its layer, fc for EAGLE, the LM head's draft rows) over the target's,
    for the depth + 1 head forwards of a step. None where the model has no such head."""
    settings = HEADLINE_TREES[method]
    try:
        decoder = get_method(method)(ModelRunner(model, profile=runner.profile), {"name": method, **settings}, context)
    except (ValueError, OSError) as err:
        print(f"  (no {method} head for this model: {err}; its split skipped)")
        return None
    decoder.verify_seconds, decoder.total_tokens = curve, max(curve)  # the adaptive size, on this run's curve
    drafter, head, k = decoder.drafter, decoder.drafter.head, settings["top_k"]
    width = len(head.layers) * model.config.hidden_size if method == "eagle3" else model.config.hidden_size
    layer = drafter.fused.layer
    lm_rows = head.lm_head if method == "eagle3" else (drafter.vocabulary.head(drafter.lm_head.weight)
                                                        if drafter.vocabulary else drafter.lm_head)
    per_forward = parameter_bytes(head.midlayer if method == "eagle3" else head.layers[0], lm_rows,
                                  *([] if method == "eagle3" else [head.fc]))
    names = {part: f"{method} {part}" for part in ("follow", "inputs", "layer", "lm head", "top-k", "expansion",
                                                   "rerank")}
    with decoder.target.linear.active():
        drafter.reset(1024)
        drafter.follow([i % model.config.vocab_size for i in range(256)],
                       torch.randn(256, width, dtype=runner.dtype, device=model.device))
        committed = drafter.committed
        for _ in range(rounds):
            drafter.committed = committed
            clock.evict()
            clock.part(names["follow"], lambda: drafter.follow(list(range(accepted)), torch.randn(
                accepted, width, dtype=runner.dtype, device=model.device)))
            _, tokens = drafter.top(drafter.root_draft, k)
            parent = drafter.root_hidden.expand(k, -1)
            x, attn_in = clock.part(names["inputs"], lambda: head.layer_inputs(tokens, parent))

            def one_layer():
                cos, sin = drafter.fused.rope.lookup(torch.full((1, k), drafter.committed, device=model.device), x,
                                                     drafter.committed + 1)
                mask = level_mask(drafter.committed, 0, torch.zeros(k, 0, dtype=torch.bool), drafter.dtype,
                                  drafter.device)
                attn = None if attn_in is None else attn_in[None]
                return layer.forward(x[None], cos, sin, mask, drafter.cache, attn)[0]

            hidden = clock.part(names["layer"], one_layer)
            logits = clock.part(names["lm head"], lambda: drafter.draft_logits(hidden))
            clock.part(names["top-k"], lambda: drafter.top(logits, k))
            drafter.cache.rollback(drafter.committed)
            clock.evict()
            levels = settings["depth"] + 1
            candidates = clock.part(names["expansion"], lambda: decoder.expand(
                drafter.root_hidden[None], drafter.root_draft[None], levels, one_sequence(drafter.feed_level), drafter))
            clock.part(names["rerank"], lambda: decoder.rerank(0, *(c[0] for c in candidates), levels, True))
            drafter.cache.rollback(drafter.committed)
    seconds = {part: clock.medians()[name] for part, name in names.items()}
    return {"seconds": seconds, "depth": settings["depth"], "top_k": k, "accepted": accepted,
            "step_seconds": seconds["follow"] + seconds["expansion"] + seconds["rerank"],
            "head_forwards": settings["depth"] + 1, "forward_weight_share": per_forward / weight_bytes(model)}


@torch.inference_mode()
def draft_lm_split(model, runner: ModelRunner, context: BuildContext, config, clock: StepClock,
                   rounds: int = 9) -> dict:
    """One token of SpS's draft LM (over its draft vocabulary, as SpS runs it) split, each sample after a
    target forward: its forward without logits (embedding, layers, final norm), its LM head over the draft
    vocabulary's rows and the scatter onto the target's, and the greedy top-1; beside the share of the target's
    weights it reads (its layers, its norm, the LM head's draft rows)."""
    draft = load_draft_lm(OmegaConf.to_container(config.drafts.sps, resolve=True), model)
    draft_runner = ModelRunner(draft, profile=runner.profile)
    vocabulary = context.draft_vocabulary({}, draft.get_output_embeddings().out_features)
    draft_runner.restrict_vocabulary(vocabulary)
    lm_rows = vocabulary.head(draft_runner.lm_head.weight) if vocabulary else draft_runner.lm_head
    reads = parameter_bytes(*draft.get_decoder().layers, draft.get_decoder().norm, lm_rows)
    draft_runner.reset()
    draft_runner.prefill([0] * 256)
    for _ in range(rounds):
        clock.evict()
        out = clock.part("draft LM forward", lambda: draft_runner.forward([0], logits_for=None))
        with draft_runner.linear.active():
            logits = clock.part("draft LM lm head", lambda: draft_runner.head_logits(out.hidden, slice(-1, None)))
        clock.part("draft LM top-1", lambda: torch.topk(logits, 1))
        draft_runner.rollback(256)
    medians = clock.medians()
    seconds = {part: medians[f"draft LM {part}"] for part in ("forward", "lm head", "top-1")}
    return {"seconds": seconds, "token_seconds": sum(seconds.values()),
            "draft_vocab": len(vocabulary) if vocabulary else None,
            "weight_share": reads / weight_bytes(model),
            "whole_model_weight_share": weight_bytes(draft) / weight_bytes(model)}


BLOCK_DRAFTERS = ("dflash", "pard")  # one draft forward a step; the headline runs both at their defaults (`auto`)
BLOCK_PROMPT = "Explain how a refrigerator keeps food cold, step by step, for a curious ten-year-old."


def block_prompt(config, tokenizer) -> list[int]:
    """The prompt the block drafters answer in the split: `BLOCK_PROMPT` in the model's chat template."""
    return ChatTemplate.for_model(config, tokenizer).prompt_ids([Message("user", BLOCK_PROMPT)])


@torch.inference_mode()
def block_step_split(model, runner: ModelRunner, context: BuildContext, method: str, prompt: list[int],
                     rounds: int = 3, new_tokens: int = 48) -> dict | None:
    """A block drafter's draft step as decoding runs it: the median over `rounds` greedy answers of `new_tokens`
    to `prompt` of the loop's draft phase per step (each draft follows that step's verification, which
    evicts the draft's weights), the drafts it proposes (`draft_tokens`) and the draft forwards per step.
    None where the model has no such draft."""
    try:
        decoder = get_method(method)(ModelRunner(model, profile=runner.profile), {"name": method}, context)
    except (ValueError, OSError, ModelUnavailableError) as err:
        print(f"  (no {method} draft for this model: {' '.join(str(err).split())}; its split skipped)")
        return None
    samples = []
    for _ in range(rounds + 1):  # the first answer warms up
        stats = decoder.generate(prompt, StopCondition(new_tokens)).stats
        samples.append((stats.phase_time["draft"] / stats.steps, stats.new_tokens / stats.steps,
                        stats.extra.get("draft_forwards", stats.steps) / stats.steps))
    step, tau, forwards = (statistics.median(s[i] for s in samples[1:]) for i in range(3))
    return {"step_seconds": step, "draft_tokens": decoder.sizing.value, "tau": tau, "forwards_per_step": forwards,
            "new_tokens": new_tokens}


def draft_split(model, runner: ModelRunner, context: BuildContext, config, curve: dict[int, float],
                rounds: int = 9, prompt: list[int] | None = None) -> dict:
    """`eagle_step_split` for EAGLE-2 and EAGLE-3 at the headline's settings and `draft_lm_split`, each part
    after a target forward (as a step sees it); with a `prompt`, `block_step_split` for DFlash and PARD."""
    clock = StepClock(runner)
    split = {method: eagle_step_split(model, runner, context, method, curve, clock, rounds)
             for method in HEADLINE_TREES}
    split["draft LM"] = draft_lm_split(model, runner, context, config, clock, rounds)
    if prompt is not None:
        split |= {method: block_step_split(model, runner, context, method, prompt) for method in BLOCK_DRAFTERS}
    return {name: part for name, part in split.items() if part is not None}


def print_split(split: dict, one: float) -> None:
    """The split in milliseconds and in units of `one`, the target's t(1)."""

    def units(seconds: float) -> str:
        return f"{1000 * seconds:6.3f} ms = {seconds / one:.3f} t(1)"

    print("drafting as a step runs it (each part timed after a target forward), in units of the target's t(1):")
    for method, part in split.items():
        if method == "draft LM" or method in BLOCK_DRAFTERS:
            continue
        s = part["seconds"]
        level = sum(s[p] for p in ("inputs", "layer", "lm head", "top-k"))
        print(f"  {method}, depth {part['depth']}, top-{part['top_k']}:")
        print(f"    {'follow (' + str(part['accepted']) + ' accepted tokens)':<30}{units(s['follow'])}")
        print(f"    {'one level over ' + str(part['top_k']) + ' nodes':<30}{units(level)}: "
              + ", ".join(f"{p} {1000 * s[p]:.3f}" for p in ("inputs", "layer", "lm head", "top-k")) + " ms")
        print(f"    {'expansion (' + str(part['head_forwards'] - 1) + ' levels + root)':<30}{units(s['expansion'])}")
        print(f"    {'rerank (adaptive size)':<30}{units(s['rerank'])}")
        print(f"    {'draft step':<30}{units(part['step_seconds'])}; floor "
              f"{part['head_forwards']} x {part['forward_weight_share']:.3f} = "
              f"{part['head_forwards'] * part['forward_weight_share']:.3f} t(1) (the weights a head forward reads "
              "over the target's)")
    lm = split.get("draft LM")
    if lm:
        s = lm["seconds"]
        print(f"  draft LM token ({lm['draft_vocab'] or 'full'} vocabulary) {units(lm['token_seconds'])}: "
              + ", ".join(f"{p} {1000 * s[p]:.3f}" for p in ("forward", "lm head", "top-1"))
              + f" ms; its weights: {lm['weight_share']:.3f} of the target's "
              f"({lm['whole_model_weight_share']:.3f} with its whole LM head)")
    for method in BLOCK_DRAFTERS:
        if method in split:
            part = split[method]
            print(f"  {method} draft step ({part['draft_tokens']} drafts, one block) {units(part['step_seconds'])}: "
                  f"{part['forwards_per_step']:.2f} draft forwards a step, tau {part['tau']:.2f} "
                  f"(a greedy answer of {part['new_tokens']} tokens)")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("results/perf"))
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    config = model_config(EMBEDDED)
    model = load_model(ModelSpec.from_mapping(config), torch.float32, device)
    profile = MachineProfile(device)  # the run's curve and linear plan, measured where missing (logged)
    profile.prepare(model, EMBEDDED)
    runner = ModelRunner(model, profile=profile)
    curve = profile.latency_curve(runner, EMBEDDED)
    context = BuildContext(model, EMBEDDED, OmegaConf.to_container(config, resolve=True), profile)  # `auto` sizes
    prompt = block_prompt(config, load_tokenizer(ModelSpec.from_mapping(config)))
    env = environment(device)
    print(f"{hardware_name(env)}, float32, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"t(1) {1000 * curve[1]:.2f} ms (this run's curve)", flush=True)
    split = draft_split(model, runner, context, config, curve, args.rounds, prompt)
    print_split(split, curve[1])
    result = {"hardware": hardware_name(env), "environment": env, "dtype": "float32", "t1_seconds": curve[1],
              "rounds": args.rounds, "draft_split": split}
    write_result(args.out, f"draft-split-{hardware_slug(env)}-float32", result)
    return result


if __name__ == "__main__":
    main()
