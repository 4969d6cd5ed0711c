"""The linear path: how the engine computes every `nn.Linear` of the models it runs.

A 135M model on a CPU is memory-bound: a forward streams every weight once, so a forward over
2-32 tokens (verification, tree drafting, Medusa heads) should cost about what one token costs.
Stock `F.linear` does not get there on CPUs: MKL's GEMM for a few rows streams the weights more
slowly than its one-row GEMV (docs/performance.md, "The linear path"). Which formulation is fastest depends on the
machine, the weight's shape and the number of rows, so it is measured, not assumed:

    f_linear   torch.nn.functional.linear (MKL on CPU, cuBLAS on CUDA): the reference
    w_xt       (W @ x.T).T: MKL's GEMM with the weight as the left operand
    onednn     oneDNN with the weight prepacked once for this machine (batch hint 8)
    native     `native.c`, compiled for this machine (`native.py`), on the weight packed once
               into panels of 16 (AVX-512) or 8 outputs: read once per call; a weight of bf16 values
               (a draft stored in bf16) packed as bf16, the same outputs from half the bytes

The machine profile (`methods/machine/plan.py`) times every candidate for each weight shape of a
model and each row bucket (1, 2, 4, 8, 16, 32; larger forwards, prefills, stay on `f_linear`) with
the weights cycled through copies larger than the caches, interleaved in rounds, and keeps the
median's winner.
`LinearPath.adopt(models)` marks the linears of the models the engine runs (their class becomes
`RoutedLinear`, an `nn.Linear` whose forward consults the path); `LinearPath.active()` routes
them through the plan while the engine runs: outside it (e.g. `transformers.generate` in tests)
they compute stock `F.linear`, under autograd too, and every other `nn.Linear` of the process is
never touched.
All kernels compute in the weight's dtype (fp32 stays fp32); `off` keeps `f_linear`.

Inputs may carry a batch dimension: rows = every leading dimension together.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .hardware import cpu_flags

KERNELS = ("f_linear", "w_xt", "onednn", "native")
BUCKETS = (1, 2, 4, 8, 16, 32)
ONEDNN_BATCH_HINT = 8
# The native kernel is kept for a shape and bucket while it is within this factor of the fastest
# kernel measured alone: a layer whose four projections are all native runs as one native call
# (`fused.FusedLayer.native_layer`), which saves far more than the few percent a stock GEMV may win
# per projection (docs/performance.md, "Choosing the kernel").
NATIVE_SLACK = 1.25
_ACTIVE: contextvars.ContextVar["LinearPath | None"] = contextvars.ContextVar("linear_path", default=None)
_MEMO: contextvars.ContextVar["dict | None"] = contextvars.ContextVar("linear_memo", default=None)


def onednn_available(device: torch.device) -> bool:
    return (
        device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


# oneDNN's bf16 weight reorder needs these (its own error otherwise: "bf16 path needs the cpu support ...")
ONEDNN_BF16_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


def kernel_available(kernel: str, weight: torch.Tensor) -> bool:
    """Whether `kernel` can compute linears with this weight on this machine."""
    if kernel == "onednn":
        if weight.dtype == torch.bfloat16 and not any(need <= cpu_flags() for need in ONEDNN_BF16_FLAGS):
            return False
        return onednn_available(weight.device)
    if kernel == "native":
        return native.available(weight.device, weight.dtype)
    return kernel in KERNELS


def prepack(kernel: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of `weight` the kernel reads, made once (None: it reads the weight itself)."""
    if kernel == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_BATCH_HINT)
    if kernel == "native":
        return native.pack(weight)
    return None


def run_kernel(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b by the named formulation; x [..., in], weight [out, in] -> [..., out]."""
    if kernel == "f_linear":
        return F.linear(x, weight, bias)
    if kernel == "w_xt":
        rows = x.reshape(-1, x.shape[-1])
        out = torch.mm(weight, rows.T).T
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if kernel == "native":
        return native.linear(x, packed, weight.shape[0], bias)
    raise ValueError(f"unknown linear kernel {kernel!r}; valid: {', '.join(KERNELS)}")


def bucket_of(rows: int) -> int | None:
    """The plan bucket of a forward with `rows` rows: the smallest bucket >= rows; None above."""
    for bucket in BUCKETS:
        if rows <= bucket:
            return bucket
    return None


def shape_key(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The plan's key of a weight: its shape, `+b` with a bias, `:bf16` when every value is a
    bfloat16 (a draft stored in bf16: the native kernel streams it in half the bytes, so its
    kernels are measured apart)."""
    half = ":bf16" if weight.device.type == "cpu" and native.bf16_exact(weight) else ""
    return f"{weight.shape[0]}x{weight.shape[1]}{'+b' if bias is not None else ''}{half}"


@dataclass
class LinearPlan:
    """The kernel per weight shape and row bucket, with what was measured to choose it."""

    kernels: dict[str, dict[int, str]] = field(default_factory=dict)  # shape key -> bucket -> kernel
    seconds: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)  # ... -> kernel -> median s

    def kernel(self, key: str, rows: int) -> str:
        bucket = bucket_of(rows)
        if bucket is None:
            return "f_linear"
        return self.kernels.get(key, {}).get(bucket, "f_linear")

    def to_dict(self) -> dict:
        return {"kernels": {k: {str(b): v for b, v in d.items()} for k, d in self.kernels.items()},
                "seconds": {k: {str(b): v for b, v in d.items()} for k, d in self.seconds.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "LinearPlan":
        seconds = {k: {int(b): v for b, v in d.items()} for k, d in data.get("seconds", {}).items()}
        kernels = {k: {int(b): v for b, v in d.items()} for k, d in data.get("kernels", {}).items()}
        return cls({k: {b: choose(s) for b, s in seconds[k].items()} if k in seconds else d
                    for k, d in kernels.items()},
                   seconds)


def choose(seconds: dict[str, float]) -> str:
    """The kernel a plan takes given each one's median seconds: the fastest, or the native kernel
    where it is within `NATIVE_SLACK` of the fastest (so that whole layers stay one native call)."""
    fastest = min(seconds, key=seconds.get)
    if "native" in seconds and seconds["native"] <= NATIVE_SLACK * seconds[fastest]:
        return "native"
    return fastest


def linear_shapes(*models: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """One (weight, bias) per distinct linear shape of the models."""
    shapes = {}
    for model in models:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                shapes.setdefault(shape_key(module.weight, module.bias), (module.weight, module.bias))
    return shapes


class LinearPath:
    """Routes the linears of the models it adopted through a plan while active (`path.adopt(model)`,
    then `with path.active(): ...`).

    An adopted linear computes stock `F.linear` unless a path is active in the current context:
    code outside the engine, and every linear whose shape the plan does not name, runs exactly as
    before; linears of models the engine was not given are plain `nn.Linear`s."""

    def __init__(self, plan: LinearPlan | None):
        self.plan = plan  # None: off (f_linear everywhere)
        self._packed: dict[tuple[int, str], tuple] = {}  # (id(weight), kernel) -> (weight, its packed copy)
        self._routes: dict[tuple[int, int], tuple] = {}  # (id(weight), rows) -> (weight, bias, x -> y)
        self._native: dict[tuple, tuple] = {}  # (ids of the weights, rows) -> (weights, packed copies or None)

    @staticmethod
    def adopt(*models: nn.Module | None) -> None:
        """Route these models' `nn.Linear`s (exactly that class; subclasses keep their own forward)
        through whichever path is active: their class becomes `RoutedLinear`. Idempotent."""
        for model in models:
            for module in model.modules() if model is not None else ():
                if type(module) is nn.Linear:
                    module.__class__ = RoutedLinear

    @contextlib.contextmanager
    def active(self):
        token = _ACTIVE.set(self if self.plan is not None else None)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def packed(self, kernel: str, weight: torch.Tensor) -> torch.Tensor | None:
        """The kernel's packed copy of `weight`, made on first use (warm-up pays it) and kept."""
        entry = self._packed.get((id(weight), kernel))
        if entry is None or entry[0] is not weight:
            entry = self._packed[(id(weight), kernel)] = (weight, prepack(kernel, weight))
        return entry[1]

    def route(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
        """The function x -> x W^T + b this plan computes for `rows` rows of x, resolved once per
        (weight, row count): a decode step pays one dict lookup per linear, not the plan's."""
        entry = self._routes.get((id(weight), rows))
        if entry is None or entry[0] is not weight or entry[1] is not bias:
            kernel = self.plan.kernel(shape_key(weight, bias), rows)
            if not kernel_available(kernel, weight):  # e.g. a bf16 weight of a shape planned on native (fp32)
                kernel = "f_linear"
            if kernel == "f_linear":
                function = functools.partial(F.linear, weight=weight, bias=bias)
            else:
                packed = self.packed(kernel, weight)

                def function(x, kernel=kernel, weight=weight, bias=bias, packed=packed):
                    return run_kernel(kernel, x, weight, bias, packed)
            entry = self._routes[(id(weight), rows)] = (weight, bias, function)
        return entry[2]

    def native_packed(self, linears, rows: int) -> list[torch.Tensor] | None:
        """The native kernel's packed copies of these linears' weights when the plan computes every
        one of them on it for `rows` rows (so a whole layer may run in one native call), else None;
        resolved once per (linears, row count)."""
        weights = tuple(m.weight for m in linears)
        key = (tuple(map(id, weights)), rows)
        entry = self._native.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], weights)):
            native_all = all(self.plan.kernel(shape_key(m.weight, m.bias), rows) == "native"
                             and kernel_available("native", m.weight) for m in linears)
            entry = self._native[key] = (weights, [self.packed("native", w) for w in weights] if native_all else None)
        return entry[1]

    def describe(self) -> dict:
        if self.plan is None:
            return {"skinny_gemm": "off"}
        return {"skinny_gemm": "measured", "buckets": list(BUCKETS), **self.plan.to_dict()}


def active_path() -> LinearPath | None:
    """The measured linear path routing linears in this context (None: stock `F.linear`)."""
    return _ACTIVE.get()


def native_active(x: torch.Tensor) -> bool:
    """Whether the engine computes this tensor's small operations (RMSNorm, RoPE) with the native
    kernels (`native.c`) too: a measured linear path is active (`engine.skinny_gemm=auto`; `off`
    is stock torch throughout), x is fp32 on a CPU where they run, and no gradient is recorded."""
    return (not torch.compiler.is_compiling() and _ACTIVE.get() is not None and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.is_grad_enabled() and native.unavailable_reason() is None)


@contextlib.contextmanager
def gemms_skipped(memo: dict | None = None):
    """Profiling only (`make perf`): within the block, a routed linear computes its output once per
    (module, input shape), kept in `memo`, and then returns that tensor, and a native decoder layer
    computes zeros for its projections, so a forward's time is everything but its GEMMs. Outputs
    are wrong; never decode under it."""
    token = _MEMO.set({} if memo is None else memo)
    try:
        yield
    finally:
        _MEMO.reset(token)


def gemms_are_skipped() -> bool:
    """Whether this context is inside `gemms_skipped` (the native decoder layer skips its own)."""
    return _MEMO.get() is not None


def _dispatch(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if torch.compiler.is_compiling():  # traced for a graph (as a GPU's step): stock F.linear, the GPU's path
        return F.linear(x, weight, bias)
    path = _ACTIVE.get()
    if path is None or x.dtype != weight.dtype or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    memo = _MEMO.get()
    if memo is not None:
        key = (id(module), tuple(x.shape))
        if key not in memo:
            memo[key] = F.linear(x, weight, bias)
        return memo[key]
    return path.route(weight, bias, x.numel() // x.shape[-1])(x)


class RoutedLinear(nn.Linear):
    """An `nn.Linear` of a model the engine runs (`LinearPath.adopt`): the same parameters, state
    dict and outputs, computed by the active path's plan inside the engine, by `F.linear` outside."""

    forward = _dispatch
