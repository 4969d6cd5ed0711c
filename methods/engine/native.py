"""The engine's native CPU kernels: `native.c`, compiled for this machine class and called through
ctypes (no torch headers, so it builds quickly, once per machine class).

* `pack` and `linear`, the `native` kernel of the linear path: MKL's and oneDNN's fp32 GEMV for one
  row of a 135M model's weights stream them at well under the machine's read bandwidth, and their
  GEMM for 2-16 rows computes slower than the weights stream (docs/performance.md). This one reads
  a copy of each weight packed once into panels of 16 outputs (AVX-512) or 8 (AVX2) and computes
  8 rows x 48 outputs (AVX-512) or 4 rows x 24 outputs (AVX2) per step from registers. Whether it wins is measured like
  every other kernel (`machine/plan.measure_plan`), per weight shape and row count.
* A weight whose every value is a bfloat16 (a draft stored in bf16: `bf16_exact`) is packed into
  bf16 panels, the top 16 bits of each fp32 value, and widened back exactly as it streams: the same
  outputs, bit for bit, as its fp32 panels, from half the bytes (a draft's forward is memory-bound).
* `rms_norm` and `rope_store`: the fused forward's small operations (`fused.py`), bit for bit what
  torch computes, in one call each instead of four to ten.
* `NativeLayer`: a whole decoder layer in one call (`decodebench_layer_f32`), where every
  projection of the layer is planned on the native kernel: for a 135M model the ~30 torch
  operations and five kernel calls of a layer are one call instead. Each row is computed on its own, attention
  included (the keys a row sees, compacted in position order), so a token verified in a tree gets
  the bits it gets decoded alone.

The shared library is built once per (source, compiler flags, CPU class) into the machine's
profile folder, written whole or not at all (concurrent jobs of a sweep may build it together),
and reused by every later run: the AVX-512 build where the CPU has AVX-512F, else the AVX2 one.
Every entry point checks the dtype, device, layout and shape of what it passes to C and raises
`ValueError` otherwise: C trusts the sizes it is given. Where there is no C compiler, no AVX2 + FMA, or the build fails,
`available()` is False with a reason and the plan simply does not consider the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from .hardware import cpu_flags, profile_dir

SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: products and sums round on their own, as torch's eager ops do (no implicit FMA)
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# The GEMM's vector width by build (native.c's PW): AVX-512 where the CPU has it, else AVX2. Both
# compute every output as the same FMA chain: the same bits (tests/test_native.py).
ISA_FLAGS = {"avx2": (), "avx512": ("-mavx512f",)}
log = logging.getLogger(__name__)


def isa(flags: set[str] | None = None) -> str:
    """The build this CPU runs: `avx512` with AVX-512F, else `avx2`; $DECODEBENCH_NATIVE_ISA=avx2
    forces the narrower one (to compare the two on one machine)."""
    forced = os.environ.get("DECODEBENCH_NATIVE_ISA")
    if forced:
        if forced not in ISA_FLAGS:
            raise ValueError(f"DECODEBENCH_NATIVE_ISA={forced!r}; valid: {', '.join(ISA_FLAGS)}")
        return forced
    return "avx512" if "avx512f" in (cpu_flags() if flags is None else flags) else "avx2"


def digest(build: str | None = None) -> str:
    """Names a build of the kernels (source, flags, ISA): a linear plan measured with another build
    is measured again."""
    return _digest(isa() if build is None else build)


@functools.lru_cache(maxsize=None)
def _digest(build: str) -> str:
    return hashlib.sha1(SOURCE.read_bytes() + " ".join(FLAGS + ISA_FLAGS[build]).encode()).hexdigest()[:12]


class NativeUnavailable(RuntimeError):
    """Why the native kernels cannot run here (one line)."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=None)
def _library(build: str | None = None) -> ctypes.CDLL:
    build = isa() if build is None else build
    needs = {"avx2", "fma"} | ({"avx512f"} if build == "avx512" else set())
    if not needs <= cpu_flags():
        raise NativeUnavailable(f"the CPU lacks {' + '.join(sorted(needs - cpu_flags()))}")
    compiler = _compiler()
    if compiler is None:
        raise NativeUnavailable("no C compiler (cc, gcc or $CC)")
    target = profile_dir(torch.device("cpu")) / f"native-{digest(build)}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp.so")
        log.info("building the native kernels (%s, %s, once per machine)", build, target.name)
        done = subprocess.run([compiler, *FLAGS, *ISA_FLAGS[build], str(SOURCE), "-o", str(tmp), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeUnavailable(
                f"{compiler} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
            )
        tmp.replace(target)
    # torch is imported, so libgomp.so.1 resolves to the OpenMP runtime torch loaded: one thread pool
    lib = ctypes.CDLL(str(target))
    pointer, long = ctypes.c_void_p, ctypes.c_long
    for name, argtypes in (("pack_f32", [pointer] * 2 + [long] * 2),
                           ("pack_bf16", [pointer] * 2 + [long] * 2),
                           ("linear_f32", [pointer] * 4 + [long] * 3),
                           ("linear_bf16", [pointer] * 4 + [long] * 3),
                           ("rms_norm_f32", [pointer] * 4 + [long] * 2 + [ctypes.c_float]),
                           ("rope_store_f32", [pointer] * 6 + [long] * 7),
                           ("layer_f32", [pointer] * 6 + [ctypes.c_float] * 2 + [pointer] * 13 + [long] * 10
                            + [ctypes.c_float, long, long, long])):
        function = getattr(lib, f"decodebench_{name}")
        function.restype, function.argtypes = None, argtypes
    for name, argtypes in (("layer_scratch", [long] * 6), ("panel_width", []), ("fma_peak", [long])):
        function = getattr(lib, f"decodebench_{name}")
        function.restype, function.argtypes = long, argtypes
    lib.decodebench_stream_read.restype = ctypes.c_float
    lib.decodebench_stream_read.argtypes = [pointer, long]
    return lib


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the native kernels run here, else why not."""
    try:
        _library()
    except (NativeUnavailable, OSError, ValueError) as err:
        return str(err)
    return None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def panel_width() -> int:
    """Outputs per packed panel: 16 in the AVX-512 build, 8 in the AVX2 one."""
    return _library().decodebench_panel_width()


def fma_peak(seconds: float = 0.2) -> float:
    """The CPU's fp32 FMA peak on every thread torch uses, flops per second: registers only, no
    memory (`make perf` computes each verification size's arithmetic floor from it); best of 5."""
    lib, lanes, steps, best = _library(), panel_width(), 1 << 16, 0.0
    while True:  # size a run to ~`seconds`
        start = time.perf_counter()
        lib.decodebench_fma_peak(steps)
        if time.perf_counter() - start > seconds / 4:
            break
        steps *= 4
    for _ in range(5):
        start = time.perf_counter()
        fmas = lib.decodebench_fma_peak(steps)
        best = max(best, 2 * lanes * fmas / (time.perf_counter() - start))
    return best


def stream_read(x: torch.Tensor) -> float:
    """The sum of a contiguous fp32 CPU tensor, read by every thread torch uses with independent
    vector accumulators: the read bandwidth probe's stream (`machine/probes.py`). The order of
    the additions is not `x.sum()`'s, so the value agrees with it only to rounding."""
    _need(x, "x")
    return float(_library().decodebench_stream_read(x.data_ptr(), x.numel()))


# ------------------------------------------------------------------------------------------------
# What every entry point checks before it hands C a pointer: C trusts every size it is given, so a
# wrong dtype, device, layout or shape would read or write outside the tensors. Each check raises
# `ValueError` naming the argument; a checked call costs a few microseconds.

def _need(t: torch.Tensor | None, name: str, shape: tuple | None = None, contiguous: bool = True,
          optional: bool = False, dtypes: tuple = (torch.float32,)) -> None:
    """t is an fp32 CPU tensor (or of `dtypes`; contiguous unless told), of `shape` where given (None: any size)."""
    if t is None:
        if optional:
            return
        raise ValueError(f"native kernels: {name} is required")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"native kernels: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or t.device.type != "cpu":
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"native kernels: {name} must be {want} on the CPU, got {t.dtype} on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"native kernels: {name} must be contiguous")
    if shape is not None and (len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape))):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"native kernels: {name} has shape {list(t.shape)}, expected {want}")


def _packed(packed: torch.Tensor, name: str = "packed") -> tuple[int, int]:
    """A weight `pack` made (this build's panel width; fp32 or bf16 panels): its (panels, in_features)."""
    _need(packed, name, (None, None, panel_width()), dtypes=(torch.float32, torch.bfloat16))
    return packed.shape[0], packed.shape[1]


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of this fp32 tensor is a bfloat16 (its low 16 bits are zero): a draft
    stored in bf16 and loaded in fp32. A sample is read first, so an ordinary fp32 weight is told in
    microseconds."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return False
    bits = weight.detach().contiguous().view(torch.int32).reshape(-1)
    return not bool((bits[:4096] & 0xFFFF).any()) and not bool((bits & 0xFFFF).any())


WEIGHTS_BF16 = "bf16w"  # the precision of an fp32 model whose weight matrices all hold bf16 values


def precision(model) -> str:
    """How results name a model's precision: its parameters' dtype (float32, bfloat16, ...), or `bf16w`
    for an fp32 model whose every weight matrix holds bf16 values (weights-only bf16: the kernels here
    stream them as bf16 panels)."""
    dtype = next(model.parameters()).dtype
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    if dtype == torch.float32 and matrices and all(bf16_exact(p) for p in matrices):
        return WEIGHTS_BF16
    return dtype_name(dtype)


def dtype_name(dtype: torch.dtype | str) -> str:
    """How results name a precision: float32, bfloat16, float16, bf16w."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def pack(weight: torch.Tensor, bf16: bool | None = None) -> torch.Tensor:
    """fp32 weight [out, in] (any layout) -> the copy `linear` reads: [ceil(out / W), in, W], each
    panel the weights of W = `panel_width()` consecutive outputs for every input (the last zero
    padded). A weight of bf16 values (`bf16_exact`) is packed as bf16 panels: the same outputs from
    half the bytes. `bf16`: None = as the values allow; False = fp32 panels (to compare the two)."""
    _need(weight, "weight", (None, None), contiguous=False)
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    width, half = panel_width(), bf16_exact(weight) if bf16 is None else bf16
    if half and bf16 and not bf16_exact(weight):
        raise ValueError("native kernels: bf16 panels need a weight of bf16 values (bf16_exact)")
    packed = weight.new_empty(-(-out_features // width), in_features, width,
                              dtype=torch.bfloat16 if half else torch.float32)
    (_library().decodebench_pack_bf16 if half else _library().decodebench_pack_f32)(
        weight.data_ptr(), packed.data_ptr(), out_features, in_features)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias for the weight W [out_features, in] that `pack` packed; fp32 on
    the CPU; bias [out_features] contiguous."""
    panels, in_features = _packed(packed)
    if not 0 < out_features <= panels * panel_width() or out_features <= (panels - 1) * panel_width():
        raise ValueError(f"native kernels: out_features {out_features} does not match {panels} packed panels")
    _need(x, "x", contiguous=False)
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"native kernels: x has shape {list(x.shape)}, expected [..., {in_features}]")
    _need(bias, "bias", (out_features,), optional=True)
    if not x.is_contiguous():
        x = x.contiguous()
    out = x.new_empty(x.shape[:-1] + (out_features,))
    kernel = _library().decodebench_linear_bf16 if packed.dtype == torch.bfloat16 else _library().decodebench_linear_f32
    kernel(packed.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None,
           out.data_ptr(), out_features, in_features, x.numel() // in_features)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm` in fp32 over the last dimension of x (any layout), bit for bit: the statistic
    by torch (its summation order), the rest in one call (`native.c`)."""
    _need(x, "x", contiguous=False)
    _need(weight, "weight", (x.shape[-1] if x.dim() else 0,))
    variance = x.pow(2).mean(-1)  # on x as it is laid out: a reduction's order follows the layout
    x = x.contiguous()  # the kernel reads rows of contiguous memory (a no-op when x is)
    out = torch.empty_like(x)
    _library().decodebench_rms_norm_f32(x.data_ptr(), variance.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                        x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def _cache(keys: torch.Tensor, values: torch.Tensor, batch: int, kv_heads: int, d: int, start: int, n: int) -> None:
    """The layer's cache buffers [batch, kv_heads, capacity, d], room for positions start .. start + n - 1."""
    _need(keys, "keys", (batch, kv_heads, None, d))
    _need(values, "values", tuple(keys.shape))
    if start < 0 or start + n > keys.shape[2]:
        raise ValueError(f"native kernels: positions {start}..{start + n - 1} outside the cache's capacity "
                         f"{keys.shape[2]}")


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               start: int, heads: int, kv_heads: int) -> torch.Tensor:
    """A layer's fused projection qkv [B, n, heads + 2 kv_heads, d] -> its rotated queries
    [B, heads, n, d]; the rotated keys and the values are written into the cache buffers `keys`,
    `values` [B, kv_heads, capacity, d] at positions start .. start + n - 1. cos and the signed sin
    [B, n, 1, d] (`fused.RopeTable`), any layout; the buffers contiguous; bit for bit torch's RoPE."""
    _need(qkv, "qkv", (None, None, heads + 2 * kv_heads, None), contiguous=False)
    batch, n, _, d = qkv.shape
    _need(cos, "cos", (batch, n, 1, d), contiguous=False)
    _need(sin, "sin", (batch, n, 1, d), contiguous=False)
    _cache(keys, values, batch, kv_heads, d, start, n)
    # the kernel reads contiguous memory: a linear kernel may return a transposed layout (`w_xt`)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q = torch.empty(batch, heads, n, d)
    _library().decodebench_rope_store_f32(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), keys.data_ptr(),
                                          values.data_ptr(), batch, n, heads, kv_heads, d, keys.shape[2], start)
    return q


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeLayer:
    """A decoder layer's constants for `decodebench_layer_f32`: norm weights (None: identity, as
    EAGLE's head has no input norm), the packed projections (qkv, o, gate_up, down) and their
    biases, the attention shape, all checked here once. The tensors stay referenced here while the
    layer runs natively; each call checks what changes from call to call."""

    def __init__(self, norms, eps, packed, biases, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, scaling: float):
        tensors = [t.detach().contiguous() if t is not None else None for t in (*norms, *biases)]
        self.norms, self.biases, self.packed = tensors[:2], tensors[2:], list(packed)
        self.heads, self.kv_heads, self.head_dim, self.intermediate, self.scaling = \
            heads, kv_heads, head_dim, intermediate, scaling
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads or head_dim <= 0 or intermediate <= 0:
            raise ValueError(f"native kernels: a layer of {heads} heads over {kv_heads} KV heads of {head_dim}, "
                             f"intermediate {intermediate}")
        hidden, width = self.packed[2].shape[1], (heads + 2 * kv_heads) * head_dim  # gate_up reads the residual
        self.attn_width = self.packed[0].shape[1]  # q, k, v's inputs: hidden, or EAGLE-3's 2 x hidden
        # (outputs, inputs) of qkv, o, gate_up, down; each packed to this build's panel width
        for name, p, (outputs, inputs), bias in zip(("qkv", "o", "gate_up", "down"), self.packed,
                                                    ((width, self.attn_width), (hidden, heads * head_dim),
                                                     (2 * intermediate, hidden), (hidden, intermediate)), self.biases):
            _need(p, f"packed {name}", (-(-outputs // panel_width()), inputs, panel_width()),
                  dtypes=(torch.float32, torch.bfloat16))
            _need(bias, f"{name} bias", (outputs,), optional=True)
        for name, norm in zip(("input norm", "post-attention norm"), self.norms):
            _need(norm, name, (hidden,), optional=True)
        self.hidden = hidden
        # which projections stream bf16 panels (native.c's bits: 1 qkv, 2 o, 4 gate_up, 8 down)
        self.bf16 = sum(1 << i for i, p in enumerate(self.packed) if p.dtype == torch.bfloat16)
        self.constants = (_pointer(self.norms[0]), _pointer(self.norms[1]), eps[0], eps[1],
                          *(p for pair in zip(self.packed, self.biases)
                            for p in (pair[0].data_ptr(), _pointer(pair[1]))))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, start: int, mask: torch.Tensor | None, skip_gemms: bool = False,
                 attn_in: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, n, hidden] -> the layer's output; cos, sin [B, n, 1, d]; the cache buffers keys,
        values [B, kv, capacity, d] (contiguous) get positions start .. start + n - 1; mask None
        (causal) or additive [1 or B, 1, n, start + n]. `skip_gemms`: profiling only
        (`linear.gemms_skipped`), the projections' outputs are zeros. `attn_in` [B, n, qkv's
        inputs]: what q, k, v read instead of RMSNorm(x) (EAGLE-3's layer); x stays the residual."""
        _need(x, "x", (None, None, self.hidden), contiguous=False)
        batch, n, hidden = x.shape
        if attn_in is not None:
            _need(attn_in, "attn_in", (batch, n, self.attn_width), contiguous=False)
            attn_in = attn_in.contiguous()
        elif self.attn_width != hidden:
            raise ValueError(f"native kernels: this layer's q, k, v read {self.attn_width} inputs: attn_in is required")
        d = self.head_dim
        _need(cos, "cos", (batch, n, 1, d), contiguous=False)
        _need(sin, "sin", (batch, n, 1, d), contiguous=False)
        _cache(keys, values, batch, self.kv_heads, d, start, n)
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        if mask is not None:
            _need(mask, "mask", (None, 1, n, start + n), contiguous=False)
            if mask.shape[0] not in (1, batch):
                raise ValueError(f"native kernels: mask has batch {mask.shape[0]}, expected 1 or {batch}")
            mask = mask.contiguous()
        lib = _library()
        scratch = torch.empty(lib.decodebench_layer_scratch(batch * n, hidden, self.heads, self.kv_heads,
                                                            self.head_dim, self.intermediate))
        y = torch.empty_like(x)
        lib.decodebench_layer_f32(x.data_ptr(), _pointer(attn_in), y.data_ptr(), scratch.data_ptr(), *self.constants,
                                  cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), _pointer(mask),
                                  batch, n, hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                                  keys.shape[2], start, 1 if mask is None else mask.shape[0], self.scaling,
                                  int(skip_gemms), self.attn_width, self.bf16)
        return y
