"""`make perf-contention`: what OpenMP's wait policy costs on a quiet CPU and saves on a busy one.

Between parallel regions OpenMP's worker threads wait for the next one. libgomp's default spins
(up to GOMP_SPINCOUNT = 300,000 iterations) before it sleeps; on a quiet machine that saves the
wake-up, on an oversubscribed one a spinning thread burns the time slice its partner needs, and a
step of ~100 regions stalls at every barrier. This benchmark decodes greedily with our AR loop in
a fresh process per setting (the policy is read once, when the OpenMP runtime loads), with 0, 2x
and 5x oversubscription: k x cores runnable threads in all, the rest spinning processes. It prints
tokens/s against the fair share (quiet tokens/s / k) for each policy, interleaved round by round,
medians over rounds; writes results/perf/contention-<hardware>.json. `auto` is the suite's own
choice (`methods/machine/threads.py`, which holds the measurements behind it).

    python -m harness.perf.contention [--rounds 2] [--tokens 64] [--loads 1,2,5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.perf.workload import spec_bench_prompts, write_result
from harness.running.environment import environment, hardware_name, hardware_slug
from harness.running.prompts import ChatTemplate
from methods.ar import AutoregressiveDecoder
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.machine.profile import MachineProfile
from methods.models.loading import load_model, load_tokenizer
from methods.models.specs import ModelSpec, model_config

POLICIES = ("auto", "default", "OMP_WAIT_POLICY=PASSIVE", "GOMP_SPINCOUNT=1000")
# what a policy may set; "default" sets none: libgomp's own policy (300,000 spins), one thread per core
KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
SPIN = "while True: pass"  # one oversubscribing process


def policy_environment(policy: str) -> dict:
    """"auto" (the suite's own choice, methods/machine/threads.py), "default" or "KNOB=VALUE[+KNOB=VALUE]"
    with KNOB among KNOBS -> the variables to set."""
    if policy == "auto":
        return {"DECODEBENCH_OMP_POLICY": "auto"}
    if policy == "default":
        return {"DECODEBENCH_OMP_POLICY": "inherit"}
    pairs = dict(item.split("=", 1) for item in policy.split("+") if "=" in item)
    if not pairs or any(knob not in KNOBS for knob in pairs) or len(pairs) != policy.count("="):
        raise ValueError(f"policy {policy!r}: 'auto', 'default' or KNOB=VALUE joined by '+', KNOB among "
                         f"{', '.join(KNOBS)}")
    return {**pairs, "DECODEBENCH_OMP_POLICY": "inherit"}  # measure the environment given, not the suite's choice


def child(tokens: int, prompts: int) -> None:
    """One measurement in this process: AR over `prompts` Spec-Bench prompts, `tokens` new tokens each."""
    config = model_config("smollm2-135m")
    spec = ModelSpec.from_mapping(config)
    tokenizer, model = load_tokenizer(spec), load_model(spec, torch.float32, torch.device("cpu"))
    template = ChatTemplate.for_model(config, tokenizer)
    stop = StopCondition(max_new_tokens=tokens)  # no EOS: every prompt decodes exactly `tokens` tokens
    decoder = AutoregressiveDecoder(ModelRunner(model, profile=MachineProfile("cpu")))
    items = spec_bench_prompts(template, prompts)
    decoder.generate(items[0][:32], StopCondition(max_new_tokens=8))  # warm-up
    produced, start = 0, time.perf_counter()
    for prompt in items:
        produced += len(decoder.generate(prompt, stop).tokens)
    env = environment(torch.device("cpu"))
    print(json.dumps({"tokens_per_second": produced / (time.perf_counter() - start), "threads": torch.get_num_threads(),
                      "hardware": hardware_name(env), "slug": hardware_slug(env), "omp_wait": env["omp_wait"]}))


def measure(policy: str, load: int, cores: int, tokens: int, prompts: int) -> dict:
    threads = int(policy_environment(policy).get("OMP_NUM_THREADS", cores))
    hogs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(max(0, load * cores - threads))]
    try:
        env = {key: value for key, value in os.environ.items() if key not in KNOBS}
        env.update(policy_environment(policy))
        done = subprocess.run([sys.executable, "-m", "harness.perf.contention", "--child", "--tokens", str(tokens),
                               "--prompts", str(prompts)], env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--loads", default="1,2,5", help="oversubscription factors k (1 = quiet)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="'auto', 'default' or KNOB=VALUE (joined by '+'), KNOB among " + ", ".join(KNOBS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("results/perf"))
    args = parser.parse_args(argv)
    if args.child:
        child(args.tokens, args.prompts)
        return {}
    names = [name.strip() for name in args.policies.split(",")]
    for name in names:
        try:
            policy_environment(name)
        except ValueError as err:
            parser.error(str(err))
    loads = [int(k) for k in args.loads.split(",")]
    cores = len(os.sched_getaffinity(0))
    runs: dict[str, dict[int, list[float]]] = {name: {k: [] for k in loads} for name in names}
    machine = {}
    for round_ in range(args.rounds):
        for k in loads:
            for name in names:
                machine = measure(name, k, cores, args.tokens, args.prompts)
                value = machine.pop("tokens_per_second")
                runs[name][k].append(value)
                print(f"round {round_ + 1}/{args.rounds}  load {k}x  {name:<26}{value:7.2f} tokens/s  "
                      f"({machine['omp_wait']['policy']})", flush=True)
    median = {name: {k: statistics.median(v) for k, v in by_load.items()} for name, by_load in runs.items()}
    quiet = max(median[name][1] for name in names) if 1 in loads else None
    print(f"\n{machine['hardware']}, {cores} cores; median tokens/s (x fair share = best quiet / k)")
    print(f"{'policy':<24}" + "".join(f"{f'{k}x':>18}" for k in loads))
    for name in names:
        cells = [f"{median[name][k]:7.2f}" + (f" ({median[name][k] * k / quiet:.2f})" if quiet else "") for k in loads]
        print(f"{name:<24}" + "".join(f"{c:>18}" for c in cells))
    result = {"hardware": machine["hardware"], "cores": cores, "tokens": args.tokens, "prompts": args.prompts,
              "tokens_per_second": runs, "median": median}
    write_result(args.out, f"contention-{machine['slug']}", result)
    return result


if __name__ == "__main__":
    main()
