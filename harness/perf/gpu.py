"""`make perf-gpu`: the engine on a GPU, with no Hub: models of real shapes with random weights.

Random weights measure the engine, not the methods: a forward costs what it costs whatever the
weights are, but τ needs the real target and its trained drafts (say so beside any number). For
each shape (the embedded SmolLM2-135M's, and Vicuna-7B's), built on the GPU in the chosen dtype:

  * the GPU's read bandwidth (a 2 GB tensor summed) and the roofline of one forward, weight bytes /
    bandwidth;
  * the target's forward latency by tokens per forward (1..64 after a 256-token prefix): the engine
    with CUDA graphs (`engine.cuda_graphs=on`: one captured static step per size), the engine
    without (`off`), and the `transformers` decoder stack, interleaved; then, at 1, 8 and 64 tokens,
    the graphs with each static step compiled first (`engine.compile=on`, and `max-autotune`:
    `--compile`), beside the plain graphs again;
  * AR tokens/s with graphs on (plain, and compiled in each `--compile` mode) and off against
    `transformers` `generate` (greedy; the share of tokens before the first difference: in fp16
    kernels of another order differ at near-ties), and the AR step against the roofline; the
    one-token graph's kernel count and replay time, plain and compiled;
  * an oracle draft: a chain of γ of AR's own next tokens verified per step (every one accepted,
    τ = γ + 1): what the engine gives a drafter that is always right and free, by γ.

    python -m harness.perf.gpu [--shapes smollm2-135m,vicuna-7b] [--dtype float16] [--new-tokens 128]
                               [--compile on,max-autotune]

Writes results/perf/gpu-<gpu>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from harness.perf.workload import timed_generations, write_result
from methods.ar import AutoregressiveDecoder
from methods.engine.graphs import COMPILE_MODES
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.engine.tree import Tree
from methods.machine.curves import forward_latencies
from methods.machine.probes import read_bandwidth, weight_bytes
from methods.machine.profile import MachineProfile

SIZES = (1, 2, 4, 8, 16, 32, 64)
COMPILED_SIZES = (1, 8, 64)  # a compilation per size: the compiled graphs are timed at these only
# the published configurations (config.json of HuggingFaceTB/SmolLM2-135M-Instruct and lmsys/vicuna-7b-v1.3)
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "vicuna-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                      tie_word_embeddings=False, rms_norm_eps=1e-6),
}


def random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A Llama model of `shape` with random weights, made on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # lazy: transformers (only to build the models)

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape])
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def synced(device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def ar_tokens_per_second(contenders: dict, prompts: list[list[int]], device, rounds: int = 3):
    """Each contender (prompt -> tokens) on each prompt, interleaved, `rounds` times
    (`workload.timed_generations`): median tokens/s, and for each contender the share of its tokens
    before the first difference from the first contender's, averaged over the prompts."""
    rates, outputs = timed_generations(contenders, prompts, rounds, device)
    first = next(iter(outputs.values()))

    def agreement(a, b):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return same / max(len(a), 1)
    return ({name: statistics.median(v) for name, v in rates.items()},
            {name: statistics.mean(agreement(out[i], first[i]) for i in first) for name, out in outputs.items()})


def oracle_chain(runner: ModelRunner, prompt: list[int], answer: list[int], gamma: int) -> float:
    """Tokens/s of verifying chains of γ of `answer`'s tokens (AR's own), all accepted, + the bonus token."""
    sync = synced(runner.device)
    runner.reset()
    runner.reserve(len(prompt) + len(answer) + gamma + 1)
    runner.prefill(prompt)
    done = 0
    sync()
    start = time.perf_counter()
    while done + gamma + 1 <= len(answer):
        chain = answer[done: done + gamma + 1]  # the root (already emitted) + γ drafts
        length = runner.length
        out = runner.verify(Tree(torch.tensor(chain), list(range(-1, gamma))))
        out.logits.argmax(-1).tolist()  # the step's one read
        runner.commit(length, list(range(gamma + 1)))
        done += gamma + 1
    sync()
    return done / (time.perf_counter() - start)


def one_token_step(runner: ModelRunner, replays: int = 50) -> dict | None:
    """The captured one-token step: its kernel count (profiled once, as it runs: compiled under
    `engine.compile`) and one replay's time alone (its writes land past the cache's end: harmless)."""
    step = runner.static.steps.get(1) if runner.static else None
    if step is None or step.graph is None:
        return None
    from torch.profiler import ProfilerActivity, profile  # lazy: the profiler (only on a GPU)

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.step()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        step.graph.replay()
    torch.cuda.synchronize()
    return {"kernels": kernels, "replay_seconds": (time.perf_counter() - start) / replays}


def compiled_curves(graphs: ModelRunner, compiled: dict[str, ModelRunner]) -> dict:
    """The compiled runners' forward latencies at `COMPILED_SIZES`, interleaved with the plain graphs'
    again (each compilation happens in the untimed first run of its size), printed beside them."""
    if not compiled:
        return {}
    curves = forward_latencies({"graphs": graphs, **compiled}, COMPILED_SIZES, prefix_length=256, repeats=9)
    print("  compiled static steps (torch.compile, then captured), median ms and ratio to the plain graphs':")
    for name, curve in curves.items():
        print("  " + f"{name:<24}" + "".join(f"  t({n}) {1000 * curve[n]:.3f} ({curve[n] / curves['graphs'][n]:.2f}x)"
                                             for n in COMPILED_SIZES))
    return {name: curve for name, curve in curves.items() if name != "graphs"}


def measure_shape(shape: str, dtype: torch.dtype, device: torch.device, new_tokens: int, gammas=(1, 2, 4, 7),
                  compile_modes=("on", "max-autotune")) -> dict:
    model = random_model(shape, dtype, device)
    weights = weight_bytes(model)
    bandwidth = read_bandwidth(2048, device=device)
    roofline = weights / bandwidth
    print(f"\n{shape} (random weights), {str(dtype).replace('torch.', '')}: {weights / 1e9:.2f} GB of weights; "
          f"read bandwidth {bandwidth / 1e9:.0f} GB/s -> roofline t(1) = {1000 * roofline:.3f} ms", flush=True)
    profile = MachineProfile(device)  # on a GPU: stock cuBLAS linears either way; said as a run says it
    runners = {"graphs": ModelRunner(model, cuda_graphs="on", profile=profile),
               "eager": ModelRunner(model, cuda_graphs="off", profile=profile),
               "transformers": ModelRunner(model, decoder="transformers", cuda_graphs="off", profile=profile)}
    curves = forward_latencies(runners, SIZES, prefix_length=256, repeats=9)
    print("  forward by tokens (256-token prefix), median ms and ratio to one token:")
    print("  " + f"{'':<14}" + "".join(f"{n:>14}" for n in SIZES))
    for name, curve in curves.items():
        print("  " + f"{name:<14}" + "".join(f"{1000 * curve[n]:>8.3f} {curve[n] / curve[1]:>4.2f}x" for n in SIZES))
    print(f"  t(1) with graphs = {curves['graphs'][1] / roofline:.2f}x the roofline; without = "
          f"{curves['eager'][1] / roofline:.2f}x", flush=True)
    compiled = {f"graphs, {mode}": ModelRunner(model, cuda_graphs="on", profile=profile, compile=mode)
                for mode in compile_modes}
    curves.update(compiled_curves(runners["graphs"], compiled))
    inside = {}
    for name in ("graphs", *compiled):
        one = one_token_step({**runners, **compiled}[name])
        if one:
            inside[name] = one
            print(f"  the one-token step's graph ({name}): {one['kernels']} kernels, replayed alone in "
                  f"{1000 * one['replay_seconds']:.3f} ms ({1e6 * one['replay_seconds'] / one['kernels']:.1f} µs "
                  "a kernel); "
                  f"the rest of t(1) is the host's (inputs, cache lengths, LM head, the read)", flush=True)

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, SHAPES[shape]["vocab_size"], (64,), generator=generator).tolist() for _ in range(3)]
    stop = StopCondition(new_tokens)  # no EOS: every contender makes exactly new_tokens tokens
    ar = {mode: AutoregressiveDecoder(ModelRunner(model, cuda_graphs=mode, profile=profile)) for mode in ("on", "off")}
    ar.update({mode: AutoregressiveDecoder(runner) for mode, runner in compiled.items()})

    def generate(prompt):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    contenders = {"ar, graphs": lambda p: ar["on"].generate(p, stop).tokens,
                  **{f"ar, {mode}": (lambda p, mode=mode: ar[mode].generate(p, stop).tokens) for mode in compiled},
                  "ar, no graphs": lambda p: ar["off"].generate(p, stop).tokens, "generate": generate}
    for run in contenders.values():  # warm-up: captures, cuBLAS heuristics, generate's compile
        run(prompts[0])
    rates, same = ar_tokens_per_second(contenders, prompts, device)
    print(f"  AR, {len(prompts)} prompts x {new_tokens} tokens, tokens/s (median): " +
          ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())
          + "; tokens equal to the first's before the first difference: " +
          ", ".join(f"{name} {share:.0%}" for name, share in same.items()))
    for name in ("ar, graphs", *(f"ar, {mode}" for mode in compiled)):
        step = 1 / rates[name]
        print(f"  AR step ({name}) {1000 * step:.3f} ms = {step / roofline:.2f}x the roofline; "
              f"{rates[name] / rates['generate']:.2f}x generate", flush=True)

    answer = ar["on"].generate(prompts[0], StopCondition(new_tokens)).tokens
    runner = ar["on"].target
    oracle = {gamma: statistics.median(oracle_chain(runner, prompts[0], answer, gamma) for _ in range(3))
              for gamma in gammas}
    print("  oracle chain (AR's own tokens, all accepted), tokens/s and speedup over AR with graphs: " +
          ", ".join(f"γ={g} {r:.0f} ({r / rates['ar, graphs']:.2f}x)" for g, r in oracle.items()), flush=True)
    result = {"weight_bytes": weights, "read_bandwidth_bytes_per_second": bandwidth, "roofline_seconds": roofline,
              "forward_seconds_by_tokens": curves, "ar_tokens_per_second": rates, "agreement_with_graphs": same,
              "one_token_step": inside,
              "oracle_tokens_per_second_by_gamma": oracle, "captures": runners["graphs"].static.captures,
              "static_step_rows": sorted(runners["graphs"].static.steps)}
    # frees them before empty_cache (rebound, not deleted: generate and the contenders close over model and ar)
    model = runners = compiled = ar = None
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smollm2-135m,vicuna-7b")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compile", default="on,max-autotune",
                        help="engine.compile modes timed beside the plain graphs, comma-separated; none: none")
    parser.add_argument("--out", type=Path, default=Path("results/perf"))
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; valid: {', '.join(SHAPES)}")
    modes = [] if args.compile == "none" else args.compile.split(",")
    bad = sorted(set(modes) - (set(COMPILE_MODES) - {"off"}))
    if bad:
        parser.error(f"unknown --compile mode(s) {', '.join(bad)}; valid: none, on, max-autotune")
    if not torch.cuda.is_available():
        parser.error(
            "no CUDA device: `make perf-gpu` measures the engine on a GPU (`make perf` measures it on this CPU)"
        )
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}; random weights: engine efficiency only "
          "(τ needs the real target and drafts)")
    result = {"gpu": name, "torch": torch.__version__, "dtype": args.dtype,
              "compile": modes,
              "shapes": {s: measure_shape(s, getattr(torch, args.dtype), device, args.new_tokens, compile_modes=modes)
                         for s in shapes}}
    write_result(args.out, f"gpu-{name.replace(' ', '-').lower()}-{args.dtype}", result)
    return result


if __name__ == "__main__":
    main()
