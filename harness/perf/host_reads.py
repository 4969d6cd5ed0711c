"""Host reads per decoding step: how often a method's step waits for a value computed by
the target's device. On a GPU each read is a synchronization, the GPU idles while the host decides,
and no step containing one can be a CUDA graph; on a CPU the same reads are merely counted.

Counted: every aten `_local_scalar_dense` (`int(t)`, `float(t)`, `t.item()`, `bool(t)`), every
`nonzero` (a data-dependent shape), every copy of a tensor to another device, and every
`Tensor.tolist()` / `Tensor.numpy()` (which read memory without a dispatch). A read of a tensor the
host built itself counts too: on a GPU engine such bookkeeping lives on the device as well.

    python -m harness.host_reads [--methods ar,sps,...] [--questions 2] [--max-new-tokens 48] [--temperature 0]

prints, per method, the host reads per decoding step of the embedded model (fp32, CPU; greedy, or
sampling with `--temperature T`; `--params total_tokens=60` gives EAGLE-2/3 a fixed tree size).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from contextlib import contextmanager

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from harness.perf.engine import EMBEDDED
from harness.perf.workload import spec_bench_prompts
from harness.running.prompts import ChatTemplate
from methods.base import BuildContext, available_methods, check_method_params, get_method, method_settings
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.machine.profile import MachineProfile
from methods.models.loading import load_model, load_tokenizer
from methods.models.specs import ModelSpec, model_config
from methods.settings.params import ConfigError

# scalar reads: `_local_scalar_dense` outside inference mode; inside it the dispatcher sees the
# composite `item` / `is_nonzero` instead (and never `_local_scalar_dense`), so both are counted
_ATEN_READS = {"aten::_local_scalar_dense": "scalar", "aten::item": "scalar", "aten::is_nonzero": "scalar",
               "aten::nonzero": "nonzero", "aten::masked_select": "nonzero"}
# copies: `_to_copy` outside inference mode, the composite `to` inside it
_COPIES = ("aten::_to_copy", "aten::to", "aten::copy_")


def _target_device(name: str, args, kwargs) -> torch.device | None:
    """The device a copy op sends its source to (None: the source's own, or not named)."""
    if name == "aten::copy_":
        return args[0].device
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, (torch.device, str)) and not isinstance(value, torch.dtype):
            try:
                return torch.device(value)
            except (RuntimeError, TypeError):
                continue
        if isinstance(value, torch.Tensor):  # `to(other)`
            return value.device
    return None


class HostReads(TorchDispatchMode):
    """Counts host reads while active; `counts` by kind (scalar, nonzero, device copy, tolist, numpy).
    Reads a kernel makes inside itself (`repeat_interleave` without `output_size`) are not seen."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _ATEN_READS:
            self.counts[_ATEN_READS[name]] += 1
        elif name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                           for i in (args[1] if len(args) > 1 else ()) or ()):
            self.counts["nonzero"] += 1  # a boolean mask's index: a data-dependent shape
        elif name in _COPIES:
            source = args[1] if name == "aten::copy_" else args[0]
            target = _target_device(name, args, kwargs)
            if isinstance(source, torch.Tensor) and target is not None and target != source.device:
                self.counts["device copy"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextmanager
def counting_host_reads():
    """`with counting_host_reads() as reads: ...` then `reads.total`, `reads.counts`."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(name):
        def read(self, *args, **kwargs):
            reads.counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return read

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with reads:
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def reads_per_step(decoder, prompts, stop, sampling: SamplingConfig = SamplingConfig(),
                   seed: int = 0) -> tuple[float, Counter, int]:
    """Host reads per decoding step of `decoder` over `prompts` (the prefill's included in its run)."""
    total, steps = Counter(), 0
    generator = None if sampling.greedy else torch.Generator().manual_seed(seed)
    for prompt in prompts:
        with counting_host_reads() as reads:
            out = decoder.generate(prompt, stop, sampling, generator)
        total.update(reads.counts)
        steps += out.stats.steps
    return sum(total.values()) / max(steps, 1), total, steps


def runs_on(method: str, model: dict) -> bool:
    """Whether the method's defaults run on this model config; if not, why, printed in one line."""
    try:
        method_settings(method)().check_model(model)
    except ConfigError as err:
        print(f"  {method:<10} skipped: {err}", flush=True)
        return False
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=None, help="comma-separated; default: every lossless method")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (the budget: 1 a step); > 0: sampling (2 a step)")
    parser.add_argument("--params", default="",
                        help="method settings KEY=VALUE,... given to each method that has the key "
                                                     "(e.g. total_tokens=60: EAGLE-2/3 at a fixed size)")
    args = parser.parse_args(argv)
    try:
        sampling = SamplingConfig(temperature=args.temperature)
    except ValueError as err:  # one line and exit 2, before the model loads
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    greedy_only = {"lazyllm"} | (set() if sampling.greedy else {"jacobi"})
    methods = args.methods.split(",") if args.methods else [m for m in available_methods() if m not in greedy_only]
    unknown = sorted(set(methods) - set(available_methods()))
    if unknown:  # one line and exit 2, as every bad value in the suite
        print(f"error: unknown method(s) {', '.join(unknown)}; valid: {', '.join(available_methods())}",
              file=sys.stderr)
        sys.exit(2)

    try:
        params = dict(item.split("=", 1) for item in args.params.split(",") if item)
        params = {key: int(value) if value.isdigit() else value for key, value in params.items()}
        for method in methods:
            check_method_params(method, {k: v for k, v in params.items() if k in method_settings(method).schema()})
        unused = sorted(set(params) - {key for method in methods for key in method_settings(method).schema()})
        if unused:
            raise ValueError(f"no method of {', '.join(methods)} has the setting(s) {', '.join(unused)}")
    except ValueError as err:
        print(f"error: --params {args.params!r}: {err}", file=sys.stderr)
        sys.exit(2)

    config = model_config(EMBEDDED)
    if not args.methods:  # by default, the methods the embedded model runs now (a draft not trained yet is skipped)
        methods = [m for m in methods if runs_on(m, OmegaConf.to_container(config, resolve=True))]
    spec = ModelSpec.from_mapping(config)
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, torch.float32, torch.device("cpu"))
    prompts = spec_bench_prompts(ChatTemplate.for_model(config, tokenizer), args.questions)
    stop = StopCondition(args.max_new_tokens, frozenset([tokenizer.eos_token_id]))
    profile = MachineProfile("cpu")  # sizes and kernels as a run has them (measured where missing, logged)
    profile.prepare(model, EMBEDDED)
    context = BuildContext(model, EMBEDDED, OmegaConf.to_container(config, resolve=True), profile)
    result = {}
    print(f"host reads per decoding step: {EMBEDDED}, fp32, CPU, "
          f"{'greedy' if sampling.greedy else f'temperature {sampling.temperature}'}, {args.questions} Spec-Bench "
          "prompts x "
          f"{args.max_new_tokens} new tokens")
    for method in methods:
        own = {key: value for key, value in params.items() if key in method_settings(method).schema()}
        decoder = get_method(method)(ModelRunner(model, profile=profile), {"name": method, **own}, context)
        per_step, counts, steps = reads_per_step(decoder, prompts, stop, sampling)
        result[method] = {"per_step": per_step, "steps": steps, "counts": dict(counts)}
        kinds = ", ".join(f"{kind} {n / max(steps, 1):.1f}" for kind, n in counts.most_common())
        print(f"  {method:<10} {per_step:7.1f}  ({steps} steps; {kinds})", flush=True)
    return result


if __name__ == "__main__":
    main()
