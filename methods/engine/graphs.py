"""The target's forward as a static step: fixed shapes, device-side positions, one CUDA graph per size.

A decoding step on a GPU is launch-bound when every kernel is launched from Python: the embedded
model's one-token forward is ~400 launches for ~0.1 ms of memory traffic. A CUDA graph replays
all of them as one launch, but only a step whose tensors keep their shapes and addresses and that
never reads a value back to the host can be captured. `StaticStep` is that step for the fused
decoder (`fused.py`): `rows` new tokens (a size bucket; `ModelRunner.verify` pads a tree to it,
padding rows at the root's position seeing only themselves) over a reserved KV cache
(`ModelRunner.reserve`):

  * its inputs are copied into buffers of fixed address (token ids, depths below the first free
    position, the rows' visibility among themselves, that first free position as a one-element
    tensor): the host sends them, it reads nothing back;
  * keys and values are written with `index_copy_` at device positions, and attention reads every
    layer's whole buffer under a mask built on the device (the prefix, then the tree's own
    visibility; the positions past the new rows are masked), so the kernel shapes never change;
  * the output (the last hidden state after the final norm, and the inputs of the layers a runner
    captures for EAGLE-3) lands in buffers the graph owns; the LM head runs after it.

The same pieces (`static_mask`, `static_layer`, `capture`) make the EAGLE family's draft depth loop one
graph over the head's reserved cache (`methods/eagle/static_draft.py`, `StaticDraft`).

`engine.cuda_graphs`: `auto` (= `on` on a GPU, `off` on a CPU), `on`, `off`. On a GPU `on`
captures one graph per rows bucket the first time that size runs (after two warm-up runs on a side
stream, with the step's real inputs: they write only free cache positions) and replays it after;
on a CPU `on` runs the same static step eagerly, which is what the CPU tests compare with the
ordinary forward (`torch.compile(fullgraph=True)` of it proves it has no graph break).

`engine.compile`: `off`, `on` or `max-autotune`: every static computation (the target's steps, the
EAGLE family's draft step) is compiled by `torch.compile` (Inductor, whole graph, static shapes: one
compilation per rows bucket) before it is captured or run; `max-autotune` also benchmarks GEMM
kernels for each shape (Inductor's `max-autotune-no-cudagraphs`: the capture is this module's).
Inductor fuses what the eager step launches one by one (an fp16 RMSNorm's eight elementwise
kernels, RoPE's four, the mask's) into a few kernels; on a GPU that is what a graph's kernel count,
and so the 135M step, comes down to. It needs the static steps (`engine.cuda_graphs` on, or auto on
a GPU: `check_compile`).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch
import torch.nn.functional as F

from .fused import FusedDecoder, rms_norm

GRAPH_MODES = ("auto", "on", "off")
# `engine.compile` -> torch.compile's mode (None: not compiled)
COMPILE_MODES = {"off": None, "on": "default", "max-autotune": "max-autotune-no-cudagraphs"}
T = TypeVar("T")
# rows a static step takes: a verification is padded to the smallest that holds it (`ModelRunner.verify`)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def graph_mode(mode: str, device: torch.device) -> str:
    """`engine.cuda_graphs` for this device: 'graphs' (captured), 'eager' (the static step, not
    captured) or 'off' (the ordinary forward)."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"engine.cuda_graphs={mode!r}; valid: {', '.join(GRAPH_MODES)}")
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return "off"
    return "graphs" if device.type == "cuda" else "eager"


def check_compile(compile_mode: str, graph_mode_: str) -> str | None:
    """`engine.compile` against the resolved graph mode: torch.compile's mode for the static
    computations, None when they are not compiled."""
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"engine.compile={compile_mode!r}; valid: {', '.join(COMPILE_MODES)}")
    if compile_mode != "off" and graph_mode_ == "off":
        raise ValueError(f"engine.compile={compile_mode} compiles the static steps: it needs engine.cuda_graphs=on "
                         "(auto is on only on a GPU) and the engine's fused forward")
    return COMPILE_MODES[compile_mode]


def compiled(compute: Callable[[], T], mode: str | None) -> Callable[[], T]:
    """`compute` compiled by Inductor in `mode` as one graph of static shapes (`engine.compile`), or
    itself (None). Every static step (a rows bucket, a runner) compiles the same code again: Dynamo's
    limit of 8 compilations per code object, past which it would quietly run the rest uncompiled, is
    raised to 64, and reaching it is an error."""
    if mode is None:
        return compute
    import torch._dynamo.config as dynamo  # lazy: only a compiled run touches Dynamo's settings

    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    dynamo.fail_on_recompile_limit_hit = True
    return torch.compile(compute, fullgraph=True, dynamic=False, mode=mode)


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    """cuBLAS's GEMM, whatever linear path is active: a GPU's path is stock `F.linear` anyway, and
    the CPU's measured path (a context variable per call) is a graph break."""
    return F.linear(x, module.weight, module.bias)


def static_mask(columns: torch.Tensor, start: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, rows, capacity] float mask over a reserved cache's slots `columns` (arange(capacity)):
    every slot before `start` (a one-element device tensor: the first free position) is seen, the
    `width` slots from it as `visible` [rows, width] says (the new rows are its last ones), the rest
    are hidden. Built on the device from device values: no read, fixed shape."""
    rows, width = visible.shape
    relative = columns - start  # [capacity]
    region = (relative >= 0) & (relative < width)
    among = visible.gather(1, relative.clamp(0, width - 1).expand(rows, -1))  # [rows, capacity]
    seen = (relative < 0).unsqueeze(0) | (region.unsqueeze(0) & among)
    mask = torch.zeros(1, 1, rows, columns.numel(), dtype=dtype, device=seen.device)
    return mask.masked_fill(~seen.view(1, 1, rows, -1), float("-inf"))


def static_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 slots: torch.Tensor, mask: torch.Tensor, attn_in: torch.Tensor | None = None) -> torch.Tensor:
    """A fused layer (`fused.FusedLayer`) over a reserved cache's whole buffers: x [1, rows, H], its
    keys/values written at the device positions `slots` [rows] with `index_copy_`, attention over
    every slot under `mask` (`static_mask`). `attn_in`: what q, k, v read instead of the input norm
    of x (EAGLE-3's layer), as `FusedLayer.forward`."""
    rows = x.shape[1]
    heads, kv_heads, d = layer.heads, layer.kv_heads, layer.head_dim
    qkv = _linear(layer.qkv, rms_norm(x, layer.input_norm) if attn_in is None
                  else attn_in).view(1, rows, heads + 2 * kv_heads, d)
    qk = qkv[:, :, : heads + kv_heads]
    qk = qk * cos + qk.roll(d // 2, -1) * sin
    q = qk[:, :, :heads].transpose(1, 2)
    keys.index_copy_(2, slots, qk[:, :, heads:].transpose(1, 2))
    values.index_copy_(2, slots, qkv[:, :, heads + kv_heads:].transpose(1, 2))
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling,
                                          enable_gqa=heads != kv_heads)
    x = x + _linear(layer.o_proj, attn.transpose(1, 2).reshape(1, rows, heads * d))
    h = _linear(layer.gate_up, rms_norm(x, layer.post_norm))
    return x + _linear(layer.down_proj, F.silu(h[..., : layer.intermediate]) * h[..., layer.intermediate:])


class StaticStep:
    """The fused decoder's forward over exactly `rows` tokens at fixed addresses (module docstring).
    `run(ids, depths, visible, start)` -> (hidden [rows, H], {layer: input [rows, H]})."""

    def __init__(self, fused: FusedDecoder, cache, rows: int, capture: Sequence[int], capacity: int,
                 device: torch.device, dtype: torch.dtype, graphed: bool, compile_: str | None = None):
        self.fused, self.cache, self.rows, self.capture = fused, cache, rows, tuple(capture)
        self.capacity, self.graphed = capacity, graphed
        self.step = compiled(self.compute, compile_)  # what runs (or is captured): `engine.compile`
        self.ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.depths = torch.zeros(rows, dtype=torch.long, device=device)
        self.visible = torch.eye(rows, dtype=torch.bool, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(rows, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.dtype = dtype
        self.graph = None
        self.outputs = None

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.key_buffer, layer.value_buffer) for layer in self.cache.layers]

    def compute(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step from the input buffers: every layer's keys/values written at start + offsets."""
        fused, rows = self.fused, self.rows
        positions = self.start + self.depths  # [rows]
        slots = self.start + self.offsets  # [rows]: where the new rows' keys/values go
        mask = static_mask(self.columns, self.start, self.visible, self.dtype)
        x = fused.embed(self.ids)
        cos, sin = fused.rope.cos[positions].view(1, rows, 1, -1), fused.rope.sin[positions].view(1, rows, 1, -1)
        captured = []
        for i, (layer, (keys, values)) in enumerate(zip(fused.layers, self.buffers())):
            if i in self.capture:
                captured.append(x[0])
            x = static_layer(layer, x, cos, sin, keys, values, slots, mask)
        return rms_norm(x, fused.norm)[0], captured

    def run(self, ids: torch.Tensor, depths: Sequence[int], visible: torch.Tensor, start: int):
        self.ids.copy_(ids.view(1, -1), non_blocking=True)
        self.depths.copy_(torch.as_tensor(depths), non_blocking=True)
        self.visible.copy_(visible, non_blocking=True)
        self.start.fill_(start)
        if not self.graphed:
            hidden, captured = self.step()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            hidden, captured = self.outputs
        for index in range(len(self.cache.layers)):
            self.cache.advance(index, self.rows)
        return hidden, dict(zip(self.capture, captured))

    def _capture(self) -> None:
        self.graph, self.outputs = capture(self.step)


def capture(compute: Callable[[], T]) -> tuple["torch.cuda.CUDAGraph", T]:
    """`compute` as a CUDA graph and the outputs it writes: two warm-up runs on a side stream (a
    step's warm-ups write the same free cache positions the step writes), then the capture; the
    replay that follows computes the step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compute()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # its own memory pool: a pool shared with graphs since freed (a runner's previous cache, a
    # previous model) fails the capture inside PyTorch's allocator (seen on an H100, torch 2.11)
    with torch.cuda.graph(graph):
        outputs = compute()
    return graph, outputs


class StaticSteps:
    """A runner's static steps, one per rows bucket, for one reserved cache (a new cache, or buffers
    that moved, makes them again: `valid_for`)."""

    def __init__(self, runner, graphed: bool, compile_: str | None = None):
        self.runner, self.graphed, self.compile = runner, graphed, compile_
        self.steps: dict[int, StaticStep] = {}
        self.cache = None
        self.addresses: list[int] = []
        self.captures = 0  # graphs captured (each costs a warm-up and a capture)

    def usable(self, rows: int, start: int) -> bool:
        """Whether a forward of `rows` new tokens at cache length `start` can run static: a bucket
        size, inside a reserved cache whose every layer's buffers exist."""
        cache = self.runner.cache
        capacity = cache.capacity
        fused = self.runner.fused
        rope = fused.rope
        return (rows in BUCKETS and (fused.window is None or capacity <= fused.window) and capacity is not None
                and start + rows <= capacity and start > 0
                and rope.cos is not None and rope.cos.shape[0] >= capacity and rope.cos.dtype == self.runner.dtype
                and len(cache.layers) == len(self.runner.fused.layers)
                and all(layer.is_initialized and layer.key_buffer is not None and layer.key_buffer.shape[-2] == capacity
                        for layer in cache.layers))

    def step(self, rows: int) -> StaticStep:
        cache = self.runner.cache
        rope = self.runner.fused.rope
        addresses = [t.data_ptr() for layer in cache.layers for t in (layer.key_buffer, layer.value_buffer)] + \
            [rope.cos.data_ptr(), rope.sin.data_ptr()]
        if cache is not self.cache or addresses != self.addresses:
            self.steps, self.cache, self.addresses = {}, cache, addresses
        step = self.steps.get(rows)
        if step is None or step.capture != self.runner.feature_layers:
            runner = self.runner
            step = self.steps[rows] = StaticStep(runner.fused, cache, rows, runner.feature_layers, cache.capacity,
                                                 runner.device, runner.dtype, self.graphed, self.compile)
            self.captures += self.graphed
        return step
