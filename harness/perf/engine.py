"""`make perf`: does the engine measure the methods, not itself? (A benchmark, not a test.)

In one run, on the same model, prompts, dtype and stopping rule (greedy, EOS, max new tokens):
  * the machine: read bandwidth (a tensor of random values summed: twice the L3, at least 256 MB, on a CPU;
    2 GB on a GPU) and the roofline of one forward, weight bytes / bandwidth; on a CPU the FMA peak
    (registers only) and each verification size's floor, max(bytes / bandwidth, flops / peak);
  * the target's forward latency against tokens per forward (1..64 after a 256-token prefix):
    the engine as it runs (its own fused forward, `engine.decoder=auto`, and the measured linear
    path, `engine.skinny_gemm=auto`), the `transformers` decoder stack on that linear path, and
    stock `transformers` (`F.linear`), and in an fp32 run the engine in bf16w too (the same weights
    rounded to bf16, streamed in half the bytes), interleaved round by round: the curve that decides
    what speculation can gain;
  * where a one-token forward's time goes: its GEMMs (and the bandwidth they reach) against
    everything else (the other aten ops and Python), and how many aten calls it makes;
  * a draft step of EAGLE-2 and EAGLE-3 and a draft-LM token split into their parts, as a step runs them,
    and DFlash's and PARD's one-forward draft step (`draft_split.py`), in units of the target's one-token
    forward;
  * our AR loop vs `transformers` `generate(do_sample=False)`, and our SpS vs
    `generate(assistant_model=draft)` with the same draft and a constant γ; both sides' tokens compared;
  * the peers (`peers.py`): our PLD and `generate`'s, llama.cpp, and in an fp32 run our AR in bf16w
    beside llama.cpp on a BF16 GGUF.
Alternatives are interleaved and repeated; medians are reported. Writes results/perf/engine-<hardware>-<dtype>.json.

    python -m harness.perf [--dtype auto] [--questions 5] [--max-new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from harness.perf import peers
from harness.perf.draft_split import EMBEDDED, block_prompt, draft_split, print_split
from harness.perf.workload import greedy_generate, spec_bench_prompts, timed_generations, write_result
from harness.running.environment import environment, hardware_name, hardware_slug
from harness.running.prompts import ChatTemplate
from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext
from methods.engine import native
from methods.engine.linear import gemms_skipped
from methods.engine.native import WEIGHTS_BF16, dtype_name
from methods.engine.runner import ModelRunner
from methods.machine.curves import forward_latencies
from methods.machine.probes import read_bandwidth, streamed_weights, weight_bytes
from methods.machine.profile import MachineProfile
from methods.models.loading import compute_dtype, load_draft_lm, load_model, load_tokenizer, resolve_device
from methods.models.specs import ModelSpec, model_config
from methods.sps import SpeculativeSamplingDecoder

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
    precision = dtype_name(dtype)
    print(f"{hardware}, {precision} ({dtype_reason}), {torch.get_num_threads()} threads, torch {torch.__version__}")

    probe = read_bandwidth() if device.type == "cpu" else read_bandwidth(2048, device=device)
    parameters, weights = streamed_weights(model)
    peak = native.fma_peak() if native.available(device, compute_dtype(dtype)) else None  # fp32 kernels
    # an fp32 run times bf16w beside it (the same weights rounded to bf16, streamed in half the bytes)
    half = load_model(spec, WEIGHTS_BF16, device) if precision == "float32" and peak else None
    print("measuring the linear path (once per machine; cached) ...", flush=True)
    runners = {"auto": ModelRunner(model, "auto", "auto", profile=profile),
               "transformers": ModelRunner(model, "auto", "transformers", profile=profile),
               "off": ModelRunner(model, "off", "transformers", profile=profile),
               **({WEIGHTS_BF16: ModelRunner(half, "auto", "auto", profile=profile)} if half is not None else {})}
    curves = forward_latencies(runners, SIZES, prefix_length=256, repeats=7)
    breakdown = {name: forward_breakdown(runners[name], weights) for name in ("auto", "transformers")}
    streamed = engine_streamed(breakdown)
    # the roofline's bandwidth: the probe's, or the engine's own GEMMs' where they streamed faster (then
    # the probe is the wrong number, and `print_curves` says so)
    bandwidth = max(probe or 0.0, streamed or 0.0) or None
    roofline = weights / bandwidth if bandwidth else None
    floors = verification_floors(weights, parameters, bandwidth, peak)
    context = BuildContext(model, EMBEDDED, OmegaConf.to_container(config, resolve=True), profile)  # `auto` sizes
    split = draft_split(model, runners["auto"], context, config, curves["auto"],
                        prompt=block_prompt(config, tokenizer))
    result = {
        "dtype": precision, "dtype_reason": dtype_reason, "device": str(device), "hardware": hardware,
        "environment": env,
        "read_bandwidth_bytes_per_second": probe, "engine_gemm_bytes_per_second": streamed,
        "roofline_bandwidth_bytes_per_second": bandwidth, "weight_bytes": weights, "roofline_seconds": roofline,
        "fma_peak_flops_per_second": peak, "floor_seconds_by_tokens": floors,
        "forward_seconds_by_tokens": curves, "one_token_forward_breakdown": breakdown,
        # bf16w's roofline: its weights as the kernel streams them (bf16 panels), at the same bandwidth
        "roofline_seconds_bf16w": weight_bytes(half) / bandwidth if half is not None and bandwidth else None,
        "linear_kernels": runners["auto"].linear.describe(),
        "draft_split": split,
    }
    print_curves(result)

    if not args.curve_only:
        result.update(compare_with_transformers(args, model, tokenizer, config, device, profile))
    result.update(peers.run_peers(args, model, tokenizer, config, device, result, profile, half))
    write_result(args.out, f"engine-{hardware_slug(env)}-{precision}", result)
    return result


def verification_floors(weights: int, parameters: int, bandwidth: float | None, peak: float | None) -> dict | None:
    """What a forward over n tokens cannot beat on this machine: the weights read once at the
    measured bandwidth, or the multiply-adds of n tokens (2 flops per weight per token) at the
    measured FMA peak, whichever is longer (perfect overlap of the two; attention's few flops and
    the cache's reads left out)."""
    if not bandwidth or not peak:
        return None
    return {n: max(weights / bandwidth, 2 * parameters * n / peak) for n in SIZES}


def engine_streamed(breakdown: dict) -> float | None:
    """The fastest bytes per second the engine's own GEMMs streamed in a one-token forward (None on
    a GPU, where the breakdown has no GEMM share)."""
    streamed = [part["gemm_bytes_per_second"] for part in breakdown.values() if part.get("gemm_bytes_per_second")]
    return max(streamed) if streamed else None


def probe_shortfall(result: dict) -> str | None:
    """Why the bandwidth probe is the wrong number for the roofline here, or None: the engine's
    GEMMs streamed faster than the probe read (a forward cannot read faster than memory streams).
    The roofline then uses the engine's rate, a lower bound of the machine's."""
    probe, streamed = result.get("read_bandwidth_bytes_per_second"), result.get("engine_gemm_bytes_per_second")
    if probe and streamed and streamed > probe:
        return (f"the engine's GEMMs streamed {streamed / 1e9:.1f} GB/s, more than the probe's {probe / 1e9:.1f} "
                "GB/s: the probe understates this machine's bandwidth, and the roofline uses the engine's rate")
    return None


def print_curves(result: dict) -> None:
    curves = result["forward_seconds_by_tokens"]
    shortfall = probe_shortfall(result)
    if result["roofline_seconds"]:
        streamed = result.get("engine_gemm_bytes_per_second")
        rate = result["weight_bytes"] / result["roofline_seconds"]
        print(f"read bandwidth: probe {result['read_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s (every thread "
              "streams a buffer past the last-level cache, best of 7)"
              + (f", the engine's GEMMs {streamed / 1e9:.1f} GB/s" if streamed else "")
              + f"; weights {result['weight_bytes'] / 1e6:.0f} MB -> roofline t(1) = "
              f"{1000 * result['roofline_seconds']:.1f} ms at {rate / 1e9:.1f} GB/s")
    if shortfall:
        print(f"NOTE: {shortfall}")
    if result.get("fma_peak_flops_per_second"):
        print(f"FMA peak {result['fma_peak_flops_per_second'] / 1e9:.0f} GFLOP/s ({native.isa()} build, "
              f"{torch.get_num_threads()} threads, registers only)")
    print("target forward by tokens per forward (256-token prefix), median ms and ratio to one token:")
    labels = {"auto": "engine (fused forward, measured linears)",
              "transformers": "transformers stack, measured linears",
              "off": "transformers stack, F.linear",
              WEIGHTS_BF16: "engine in bf16w (bf16 weight panels)"}
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
    if WEIGHTS_BF16 in curves:
        print("  bf16w / fp32:   " + "  ".join(f"t({n}) {curves[WEIGHTS_BF16][n] / curves['auto'][n]:.2f}x"
                                               for n in SIZES))
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
        roof = result["weight_bytes"] / result["roofline_seconds"] if result.get("roofline_seconds") else None
        share = f", {bandwidth / roof:.0%} of the roofline's bandwidth" if bandwidth and roof else ""
        print(f"  {labels.get(name, name)}: t(1) {1000 * part['t1_seconds']:.1f} ms = GEMMs "
              f"{1000 * part['gemm_seconds']:.1f} ms ({(bandwidth or 0) / 1e9:.1f} GB/s{share}) + everything else "
              f"{1000 * part['without_gemms_seconds']:.1f} ms ({part['aten_calls']} aten calls)")
    if result.get("draft_split"):
        print_split(result["draft_split"], curves["auto"][1])


def compare_with_transformers(args, model, tokenizer, config, device, profile: MachineProfile) -> dict:
    """Our AR and SpS against `generate` and assisted `generate` on the same prompts, interleaved."""
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
