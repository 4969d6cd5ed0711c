"""`make perf`: does the engine measure the methods, not itself? (A benchmark, not a test.)

In one run, on the same model, prompts, dtype and stopping rule (greedy, EOS, max new tokens):
  * the machine: read bandwidth (a tensor of random values summed: twice the L3, at least 256 MB, on a CPU;
    2 GB on a GPU) and the roofline of one forward, weight bytes / bandwidth; on a CPU the FMA peak
    (registers only) and each verification size's floor, max(bytes / bandwidth, flops / peak);
  * the target's forward latency against tokens per forward (1..64 after a 256-token prefix):
    the engine as it runs (its own fused forward, `engine.decoder=auto`, and the measured linear
    path, `engine.skinny_gemm=auto`), the `transformers` decoder stack on that linear path, and
    stock `transformers` (`F.linear`), interleaved round by round: the curve that decides what
    speculation can gain;
  * where a one-token forward's time goes: its GEMMs (and the bandwidth they reach) against
    everything else (the other aten ops and Python), and how many aten calls it makes;
  * one draft level of each head kind (EAGLE with the full and the reduced vocabulary, EAGLE-3: the
    head over 4 nodes + its projection) and one token of the SpS draft LM, in units of the target's
    one-token forward;
  * our AR loop vs `transformers` `generate(do_sample=False)`, and our SpS vs
    `generate(assistant_model=draft)` with the same draft and a constant γ; both sides' tokens compared.
Alternatives are interleaved and repeated; medians are reported. Writes results/perf/<hardware>-<dtype>.json.

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
from torch.utils._python_dispatch import TorchDispatchMode

from harness.perf import peers
from harness.perf.workload import greedy_generate, spec_bench_prompts, timed_generations
from harness.running.environment import environment, hardware_name, hardware_slug
from harness.running.prompts import ChatTemplate
from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext
from methods.engine import native
from methods.engine.linear import gemms_skipped
from methods.engine.runner import ModelRunner
from methods.engine.tree import level_mask
from methods.machine.curves import forward_latencies
from methods.machine.probes import read_bandwidth, weight_bytes
from methods.machine.profile import MachineProfile
from methods.models.loading import load_draft_lm, load_model, load_tokenizer, resolve_device
from methods.models.specs import ModelSpec, model_config
from methods.sps import SpeculativeSamplingDecoder

EMBEDDED = "smollm2-135m"
SIZES = (1, 2, 4, 8, 16, 32, 64)


def timed(fn, device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def count_aten_calls(fn) -> int:
    """The aten operator calls `fn()` makes."""
    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


@torch.inference_mode()
def forward_breakdown(runner: ModelRunner, weights: int, prefix: int = 256, rounds: int = 9) -> dict:
    """A one-token forward after a `prefix`-token prefix, timed whole and without its GEMMs (each
    linear returns a remembered output: `linear.gemms_skipped`), interleaved: the difference is
    the GEMMs' time, and weight bytes over it the bandwidth they reach."""
    runner.reset()
    runner.prefill([0] * prefix)

    def one():
        runner.forward([0])
        runner.rollback(prefix)

    # On a GPU launches are asynchronous: both timings would be the host's, their difference no GEMM time
    split = runner.device.type != "cuda"
    memo: dict = {}
    if split:
        with gemms_skipped(memo):
            one()  # remember every linear's output
    total, rest = [], []
    for _ in range(rounds):
        total.append(timed(one, runner.device))
        if split:
            with gemms_skipped(memo):
                rest.append(timed(one, runner.device))
    calls = count_aten_calls(one)
    runner.reset()
    t = statistics.median(total)
    if not split:
        return {"t1_seconds": t, "without_gemms_seconds": None, "gemm_seconds": None,
                "gemm_bytes_per_second": None, "aten_calls": calls}
    other = statistics.median(rest)
    return {"t1_seconds": t, "without_gemms_seconds": other, "gemm_seconds": t - other,
            "gemm_bytes_per_second": weights / (t - other) if t > other else None, "aten_calls": calls}


def parameter_bytes(*modules) -> int:
    """Bytes of the modules' parameters, each once."""
    seen = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


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
    from methods.base import get_method

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
        drafter.follow(list(range(256)), torch.randn(256, width, dtype=runner.dtype, device=model.device))
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
            candidates = clock.part(names["expansion"], lambda: decoder._expand(
                drafter.root_hidden, drafter.root_draft, levels, drafter.feed_level, drafter))
            clock.part(names["rerank"], lambda: decoder._rerank(0, *candidates, levels, True))
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
            logits = clock.part("draft LM lm head", lambda: draft_runner._logits(out.hidden, slice(-1, None)))
        clock.part("draft LM top-1", lambda: torch.topk(logits, 1))
        draft_runner.rollback(256)
    medians = clock.medians()
    seconds = {part: medians[f"draft LM {part}"] for part in ("forward", "lm head", "top-1")}
    return {"seconds": seconds, "token_seconds": sum(seconds.values()),
            "draft_vocab": len(vocabulary) if vocabulary else None,
            "weight_share": reads / weight_bytes(model),
            "whole_model_weight_share": weight_bytes(draft) / weight_bytes(model)}


def draft_split(model, runner: ModelRunner, context: BuildContext, config, curve: dict[int, float]) -> dict:
    """`eagle_step_split` for EAGLE-2 and EAGLE-3 at the headline's settings and `draft_lm_split`, timed
    interleaved with the target's t(1) as a step sees it (each part after a target forward)."""
    clock = StepClock(runner)
    split = {method: eagle_step_split(model, runner, context, method, curve, clock) for method in HEADLINE_TREES}
    split["draft LM"] = draft_lm_split(model, runner, context, config, clock)
    return {name: part for name, part in split.items() if part is not None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="SpS draft: the target's first k layers; default: the draft conf/model/smollm2-135m.yaml names",
    )
    parser.add_argument("--curve-only", action="store_true",
                        help="the machine, the latency curves and the draft level only")
    parser.add_argument("--out", type=Path, default=Path("results/perf"))
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    config = model_config(EMBEDDED)
    spec = ModelSpec.from_mapping(config)
    profile = MachineProfile(device)  # the machine profile the harness uses: measured here where missing (logged)
    dtype, dtype_reason = profile.dtype(args.dtype, spec, EMBEDDED)
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, dtype, device)
    env = environment(device)
    hardware = hardware_name(env)
    dtype_name = str(dtype).replace("torch.", "")
    print(f"{hardware}, {dtype_name} ({dtype_reason}), {torch.get_num_threads()} threads, torch {torch.__version__}")

    bandwidth = read_bandwidth() if device.type == "cpu" else read_bandwidth(2048, device=device)
    weights = weight_bytes(model)
    roofline = weights / bandwidth if bandwidth else None
    peak = native.fma_peak() if native.available(device, dtype) else None  # fp32 kernels
    floors = verification_floors(weights, next(model.parameters()).element_size(), bandwidth, peak)
    print("measuring the linear path (once per machine; cached) ...", flush=True)
    runners = {"auto": ModelRunner(model, "auto", "auto", profile=profile),
               "transformers": ModelRunner(model, "auto", "transformers", profile=profile),
               "off": ModelRunner(model, "off", "transformers", profile=profile)}
    curves = forward_latencies(runners, SIZES, prefix_length=256, repeats=7)
    breakdown = {name: forward_breakdown(runners[name], weights) for name in ("auto", "transformers")}
    context = BuildContext(model, EMBEDDED, OmegaConf.to_container(config, resolve=True))
    split = draft_split(model, runners["auto"], context, config, curves["auto"])
    result = {
        "dtype": dtype_name, "dtype_reason": dtype_reason, "device": str(device), "hardware": hardware,
        "environment": env,
        "read_bandwidth_bytes_per_second": bandwidth, "weight_bytes": weights, "roofline_seconds": roofline,
        "fma_peak_flops_per_second": peak, "floor_seconds_by_tokens": floors,
        "forward_seconds_by_tokens": curves, "one_token_forward_breakdown": breakdown,
        "linear_kernels": runners["auto"].linear.describe(),
        "draft_split": split,
    }
    print_curves(result)

    if not args.curve_only:
        result.update(compare_with_transformers(args, model, tokenizer, config, device, profile))
    result.update(peers.run_peers(args, model, tokenizer, config, device, result, profile))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{hardware_slug(env)}-{dtype_name}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return result


def verification_floors(weights: int, element_size: int, bandwidth: float | None, peak: float | None) -> dict | None:
    """What a forward over n tokens cannot beat on this machine: the weights read once at the
    measured bandwidth, or the multiply-adds of n tokens (2 flops per weight per token) at the
    measured FMA peak, whichever is longer (perfect overlap of the two; attention's few flops and
    the cache's reads left out)."""
    if not bandwidth or not peak:
        return None
    return {n: max(weights / bandwidth, 2 * (weights // element_size) * n / peak) for n in SIZES}


def print_curves(result: dict) -> None:
    curves = result["forward_seconds_by_tokens"]
    if result["roofline_seconds"]:
        print(f"read bandwidth {result['read_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s; weights "
              f"{result['weight_bytes'] / 1e6:.0f} MB -> roofline t(1) = {1000 * result['roofline_seconds']:.1f} ms")
    if result.get("fma_peak_flops_per_second"):
        print(f"FMA peak {result['fma_peak_flops_per_second'] / 1e9:.0f} GFLOP/s ({native.isa()} build, "
              f"{torch.get_num_threads()} threads, registers only)")
    print("target forward by tokens per forward (256-token prefix), median ms and ratio to one token:")
    labels = {"auto": "engine (fused forward, measured linears)",
              "transformers": "transformers stack, measured linears",
              "off": "transformers stack, F.linear"}
    width = max(len(label) for label in labels.values())
    print("  " + f"{'':<{width}}" + "".join(f"{n:>13}" for n in SIZES))
    floors = result.get("floor_seconds_by_tokens")
    if floors:
        label = "floor: max(bytes / bandwidth, flops / FMA peak)"
        print("  " + f"{label:<{width}}"
              + "".join(f"{1000 * floors[n]:>7.1f} {floors[n] / floors[1]:>4.2f}x" for n in SIZES))
    for name, curve in curves.items():
        print("  " + f"{labels.get(name, name):<{width}}"
              + "".join(f"{1000 * curve[n]:>7.1f} {curve[n] / curve[1]:>4.2f}x" for n in SIZES))
    if floors:
        print("  engine / floor: " + "  ".join(f"t({n}) {curves['auto'][n] / floors[n]:.2f}x" for n in SIZES))
    if result["roofline_seconds"]:
        one = curves["auto"][1]
        print(f"  t(1) = {one / result['roofline_seconds']:.2f}x the roofline")
    for name, part in (result.get("one_token_forward_breakdown") or {}).items():
        if part["gemm_seconds"] is None:
            print(
                f"  {labels.get(name, name)}: t(1) {1000 * part['t1_seconds']:.1f} ms, {part['aten_calls']} aten calls "
                f"(on a GPU the step is the host's launches; the GEMMs' share needs a profiler)"
            )
            continue
        bandwidth = part["gemm_bytes_per_second"]
        share = f", {bandwidth / result['read_bandwidth_bytes_per_second']:.0%} of the read bandwidth" \
            if bandwidth and result["read_bandwidth_bytes_per_second"] else ""
        print(f"  {labels.get(name, name)}: t(1) {1000 * part['t1_seconds']:.1f} ms = GEMMs "
              f"{1000 * part['gemm_seconds']:.1f} ms ({(bandwidth or 0) / 1e9:.1f} GB/s{share}) + everything else "
              f"{1000 * part['without_gemms_seconds']:.1f} ms ({part['aten_calls']} aten calls)")
    split = result.get("draft_split")
    if split:
        one = curves["auto"][1]

        def units(seconds: float) -> str:
            return f"{1000 * seconds:6.3f} ms = {seconds / one:.3f} t(1)"

        print("drafting as a step runs it (each part timed after a target forward), in units of the target's t(1):")
        for method, part in split.items():
            if method == "draft LM":
                continue
            s = part["seconds"]
            level = sum(s[p] for p in ("inputs", "layer", "lm head", "top-k"))
            print(f"  {method}, depth {part['depth']}, top-{part['top_k']}:")
            print(f"    follow ({part['accepted']} accepted tokens)   {units(s['follow'])}")
            print(f"    one level over {part['top_k']} nodes       {units(level)}: "
                  + ", ".join(f"{p} {1000 * s[p]:.3f}" for p in ("inputs", "layer", "lm head", "top-k")) + " ms")
            print(f"    expansion ({part['head_forwards'] - 1} levels + root)  {units(s['expansion'])}")
            print(f"    rerank (adaptive size)     {units(s['rerank'])}")
            print(f"    draft step                 {units(part['step_seconds'])}; floor "
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


def compare_with_transformers(args, model, tokenizer, config, device, profile: MachineProfile) -> dict:
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

    hf = greedy_generate(model, device, args.max_new_tokens, eos)

    ours_ar = AutoregressiveDecoder(ModelRunner(model, profile=profile))
    # the same draft as generate's assistant, over the full vocabulary: like for like
    ours_sps = SpeculativeSamplingDecoder(ModelRunner(model, profile=profile), draft, gamma=args.gamma)
    contenders = {
        "ar_ours": lambda p: ours_ar.generate(p, stop).tokens,
        "ar_generate": lambda p: hf(p),
        "sps_ours": lambda p: ours_sps.generate(p, stop).tokens,
        "sps_generate": lambda p: hf(p, assistant_model=draft),
    }
    for run in contenders.values():  # warm-up
        run(prompts[0][:32])
    tokens_per_second, outputs = timed_generations(contenders, prompts, args.repeats, device)
    median = {name: statistics.median(v) for name, v in tokens_per_second.items()}
    result = {
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "gamma": args.gamma,
        "draft": draft_spec, "tokens_per_second_median": median,
        "ratio_ar_ours_over_generate": median["ar_ours"] / median["ar_generate"],
        "ratio_sps_ours_over_assisted_generate": median["sps_ours"] / median["sps_generate"],
        "same_tokens": {
            "ar": all(outputs["ar_ours"][i] == outputs["ar_generate"][i] for i in outputs["ar_ours"]),
            "sps": all(outputs["sps_ours"][i] == outputs["sps_generate"][i] for i in outputs["sps_ours"]),
        },
    }
    print(f"{len(prompts)} Spec-Bench prompts x {args.max_new_tokens} new tokens, {args.repeats} repeats (median "
          "tokens/s)")
    for name, value in median.items():
        print(f"  {name:<14}{value:8.2f}")
    print(f"  our AR / generate:                  {result['ratio_ar_ours_over_generate']:.3f}x")
    print(f"  our SpS / generate(assistant_model): {result['ratio_sps_ours_over_assisted_generate']:.3f}x")
    print(f"  same tokens: {result['same_tokens']}")
    return result


if __name__ == "__main__":
    main()
