"""The engine's native CPU kernels: `native.c`, compiled for this machine class and called through
ctypes (no torch headers, so it builds in about a second).

* `pack` and `linear`, the `native` kernel of the linear path: MKL's and oneDNN's fp32 GEMV for one
  row of a 135M model's weights stream them at well under the machine's read bandwidth, and their
  GEMM for 2-16 rows computes slower than the weights stream (docs/performance.md). This one reads
  a copy of each weight packed once into panels of 8 outputs and computes 4 rows x 24 outputs per
  step from registers. Whether it wins is measured like every other kernel
  (`linear.measure_plan`), per weight shape and row count.
* `rms_norm` and `rope_store`: the fused forward's small operations (`fused.py`), bit for bit what
  torch computes, in one call each instead of four to ten.
* `NativeLayer`: a whole decoder layer in one call (`decodebench_layer_f32`), where every
  projection of the layer is planned on the native kernel: for a 135M model the ~30 torch
  operations and five kernel calls of a layer cost a third of a one-token forward. Each row is computed on its own, attention
  included (the keys a row sees, compacted in position order), so a token verified in a tree gets
  the bits it gets decoded alone.

The shared library is built once per (source, compiler flags, CPU class) into the machine's
profile folder, written whole or not at all (concurrent jobs of a sweep may build it together),
and reused by every later run. Where there is no C compiler, no AVX2 + FMA, or the build fails,
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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: products and sums round on their own, as torch's eager ops do (no implicit FMA)
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
log = logging.getLogger(__name__)
# names this build of the kernels: a linear plan measured with another one is measured again
DIGEST = hashlib.sha1(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]


class NativeUnavailable(RuntimeError):
    """Why the native kernels cannot run here (one line)."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    from .hardware import cpu_flags, profile_dir

    if not {"avx2", "fma"} <= cpu_flags():
        raise NativeUnavailable("the CPU lacks AVX2 + FMA")
    compiler = _compiler()
    if compiler is None:
        raise NativeUnavailable("no C compiler (cc, gcc or $CC)")
    target = profile_dir(torch.device("cpu")) / f"native-{DIGEST}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp.so")
        log.info("building the native kernels (%s, once per machine)", target.name)
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeUnavailable(f"{compiler} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        tmp.replace(target)
    # torch is imported, so libgomp.so.1 resolves to the OpenMP runtime torch loaded: one thread pool
    lib = ctypes.CDLL(str(target))
    pointer, long = ctypes.c_void_p, ctypes.c_long
    for name, argtypes in (("pack", [pointer] * 2 + [long] * 2),
                           ("linear", [pointer] * 4 + [long] * 3),
                           ("rms_norm", [pointer] * 4 + [long] * 2 + [ctypes.c_float]),
                           ("rope_store", [pointer] * 6 + [long] * 7),
                           ("layer", [pointer] * 5 + [ctypes.c_float] * 2 + [pointer] * 13 + [long] * 10
                            + [ctypes.c_float, long])):
        function = getattr(lib, f"decodebench_{name}_f32")
        function.restype, function.argtypes = None, argtypes
    lib.decodebench_layer_scratch.restype, lib.decodebench_layer_scratch.argtypes = long, [long] * 6
    return lib


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the native kernels run here, else why not."""
    try:
        _library()
    except (NativeUnavailable, OSError) as err:
        return str(err)
    return None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and unavailable_reason() is None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 weight [out, in] (any layout) -> the copy `linear` reads: [ceil(out / 8), in, 8], each
    panel the weights of 8 consecutive outputs for every input (the last zero padded)."""
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    packed = weight.new_empty(-(-out_features // 8), in_features, 8)
    _library().decodebench_pack_f32(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias for the weight W [out_features, in] that `pack` packed; fp32 on
    the CPU; bias contiguous."""
    if not x.is_contiguous():
        x = x.contiguous()
    out = x.new_empty(x.shape[:-1] + (out_features,))
    in_features = packed.shape[1]
    _library().decodebench_linear_f32(packed.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None,
                                      out.data_ptr(), out_features, in_features, x.numel() // in_features)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm` in fp32 over the last dimension of x (any layout), bit for bit: the statistic
    by torch (its summation order), the rest in one call (`native.c`)."""
    variance = x.pow(2).mean(-1)  # on x as it is laid out: a reduction's order follows the layout
    x = x.contiguous()  # the kernel reads rows of contiguous memory (a no-op when x is)
    out = torch.empty_like(x)
    _library().decodebench_rms_norm_f32(x.data_ptr(), variance.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                        x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               start: int, heads: int, kv_heads: int) -> torch.Tensor:
    """A layer's fused projection qkv [B, n, heads + 2 kv_heads, d] -> its rotated queries
    [B, heads, n, d]; the rotated keys and the values are written into the cache buffers `keys`,
    `values` [B, kv_heads, capacity, d] at positions start .. start + n - 1. cos and the signed sin
    [B, n, 1, d] (`fused.RopeTable`), any layout; the buffers contiguous; bit for bit torch's RoPE."""
    # the kernel reads contiguous memory: a linear kernel may return a transposed layout (`w_xt`)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    batch, n, _, d = qkv.shape
    q = torch.empty(batch, heads, n, d)
    _library().decodebench_rope_store_f32(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), keys.data_ptr(),
                                          values.data_ptr(), batch, n, heads, kv_heads, d, keys.shape[2], start)
    return q


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeLayer:
    """A decoder layer's constants for `decodebench_layer_f32`: norm weights (None: identity, as
    EAGLE's head has no input norm), the packed projections (qkv, o, gate_up, down) and their
    biases, the attention shape. The tensors stay referenced here while the layer runs natively."""

    def __init__(self, norms, eps, packed, biases, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, scaling: float):
        tensors = [t.detach().contiguous() if t is not None else None for t in (*norms, *biases)]
        self.norms, self.biases, self.packed = tensors[:2], tensors[2:], list(packed)
        self.constants = (_pointer(self.norms[0]), _pointer(self.norms[1]), eps[0], eps[1],
                          *(p for pair in zip(self.packed, self.biases) for p in (pair[0].data_ptr(), _pointer(pair[1]))))
        self.heads, self.kv_heads, self.head_dim, self.intermediate, self.scaling = \
            heads, kv_heads, head_dim, intermediate, scaling

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, start: int, mask: torch.Tensor | None, skip_gemms: bool = False) -> torch.Tensor:
        """x [B, n, hidden] -> the layer's output; cos, sin [B, n, 1, d]; the cache buffers keys,
        values [B, kv, capacity, d] (contiguous) get positions start .. start + n - 1; mask None
        (causal) or additive [1 or B, 1, n, start + n]. `skip_gemms`: profiling only
        (`linear.gemms_skipped`), the projections' outputs are zeros."""
        batch, n, hidden = x.shape
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        if mask is not None:
            mask = mask.contiguous()
        lib = _library()
        scratch = torch.empty(lib.decodebench_layer_scratch(batch * n, hidden, self.heads, self.kv_heads,
                                                            self.head_dim, self.intermediate))
        y = torch.empty_like(x)
        lib.decodebench_layer_f32(x.data_ptr(), y.data_ptr(), scratch.data_ptr(), *self.constants,
                                  cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), _pointer(mask),
                                  batch, n, hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                                  keys.shape[2], start, 1 if mask is None else mask.shape[0], self.scaling,
                                  int(skip_gemms))
        return y
