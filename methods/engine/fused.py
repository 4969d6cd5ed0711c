"""The engine's own forward for Llama-family decoders (Llama 1-3, Vicuna, SmolLM2, Qwen2, Mistral).

`transformers` runs a decoder layer as ~70 small aten calls (per-projection linears, RoPE by
`cat`, mask construction, dtype casts, cache bookkeeping); for a 135M model on a CPU those calls,
not the weights, are half of a one-token forward. This forward computes the same thing with fewer
calls over the model's own weights:

  * q, k and v are one linear (`qkv`), gate and up one (`gate_up`): the model's projection weights
    become row views of the fused matrices, so no weight is stored twice, and the linear path
    (`linear.py`) streams each fused matrix in one kernel call;
  * RoPE rotates q and k together, with cos/sin read from a table made once by the model's own
    rotary module (so every `rope_type` whose frequencies do not depend on the sequence length
    is exact: default, linear, llama3, yarn, longrope's short factor is not: see `ROPE_TYPES`);
  * attention is one `scaled_dot_product_attention` over the cache's buffers (`kv_cache.py`),
    grouped-query heads without copies;
  * RMSNorm is `transformers`' formula (fp32 statistics, cast, weight), so numerics match;
  * in fp32 on a CPU whose linear plan puts all four projections of a layer on the native kernel
    (`linear.py`), the whole layer is one call of `native.c` (`FusedLayer.native_layer`) instead
    of the torch operations above (docs/performance.md, "The native kernels"). Its attention walks
    each row's visible keys in position order, so a token verified in a tree, or a sequence in a
    batch, gets the bits it gets alone.

Every tensor keeps a leading batch dimension `[B, n, ...]`; masks broadcast over it.
Architectures or configurations outside this set run through `transformers` (`unsupported()`
says why), exactly as before.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .linear import active_path, gemms_are_skipped, native_active

ARCHITECTURES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")
DECODER_MODES = ("auto", "transformers")


def unsupported(model) -> str | None:
    """Why this model cannot run on the fused forward; None when it can."""
    decoder = model.get_decoder()
    return unsupported_layers(model.config, getattr(decoder, "rotary_emb", None))


def unsupported_layers(config, rotary) -> str | None:
    """Why decoder layers of this config (and rotary module) cannot run fused; None when they can."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} (the fused forward runs {', '.join(ARCHITECTURES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    rope = getattr(rotary, "rope_type", None)
    if rope not in ROPE_TYPES:
        return f"rope_type {rope!r} (exact from a table: {', '.join(ROPE_TYPES)})"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return f"attention implementation {config._attn_implementation!r}"
    return None


def _fuse(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One Linear whose rows are the given Linears' rows; theirs become views of its weight."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]) \
        if any(has_bias) else None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    row = 0
    for m in linears:
        m.weight.data = fused.weight.data[row:row + m.out_features]
        if m.bias is not None:
            m.bias.data = fused.bias.data[row:row + m.out_features]
        row += m.out_features
    return fused


def sliding_window(config) -> int | None:
    """The attention window `transformers` applies, if any: a forward whose keys would reach past
    it runs on the stock forward (`ModelRunner.forward`), below it the window changes nothing."""
    window = getattr(config, "sliding_window", None)
    if window and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False)):
        return int(window)
    return None


def rms_norm(x: torch.Tensor, norm: nn.Module, native_kernels: bool = False) -> torch.Tensor:
    """`LlamaRMSNorm.forward` in the fewest calls: statistics in fp32, the weight in x's dtype (in
    fp32 torch's fused kernel computes the same formula: measured identical on the embedded model;
    `native_kernels`: torch's statistic, then the rest in one call of `native.c`'s, bit for bit).
    An `nn.Identity` norm (EAGLE's head has no input norm) passes x through."""
    if isinstance(norm, nn.Identity):
        return x
    if native_kernels:
        return native.rms_norm(x, norm.weight, norm.variance_epsilon)
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon))).to(x.dtype)


class FusedLayer:
    """One decoder layer over fused projections (its module's weights become views of them)."""

    def __init__(self, layer, config):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.intermediate = mlp.gate_proj.out_features
        self.index = attn.layer_idx
        self.native: native.NativeLayer | None = None  # the layer's constants for one native call

    def native_layer(self, x: torch.Tensor, mask: torch.Tensor | None, cache) -> "native.NativeLayer | None":
        """The whole layer as one native call (`native.NativeLayer`) for this forward, when the
        native kernels run (`native_active`), the plan computes all four projections on the native
        kernel for this many rows, the cache takes in-place writes and the mask covers exactly the
        cache plus the new tokens; None: the layer runs as torch operations."""
        batch, n, _ = x.shape
        if not native_active(x) or not hasattr(cache, "reserve"):
            return None
        if mask is not None and (mask.dtype != torch.float32 or mask.dim() != 4 or mask.shape[0] not in (1, batch)
                                 or mask.shape[1] != 1 or mask.shape[2] != n
                                 or mask.shape[3] != cache.get_seq_length(self.index) + n):
            return None
        packed = active_path().native_packed((self.qkv, self.o_proj, self.gate_up, self.down_proj), batch * n)
        if packed is None:
            return None
        if self.native is None or any(a is not b for a, b in zip(self.native.packed, packed)):
            norms = [None if isinstance(m, nn.Identity) else m.weight for m in (self.input_norm, self.post_norm)]
            eps = [getattr(m, "variance_epsilon", 0.0) for m in (self.input_norm, self.post_norm)]
            self.native = native.NativeLayer(norms, eps, packed, [m.bias for m in (self.qkv, self.o_proj, self.gate_up,
                                                                                   self.down_proj)],
                                             self.heads, self.kv_heads, self.head_dim, self.intermediate, self.scaling)
        return self.native

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache, attn_in: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, n, H] -> [B, n, H]; cos/sin [B, n, 1, d] (sin signed: `RopeTable`); appends k/v to
        `cache` at this layer's index; no mask: causal over the new tokens (a prefill) or one token.
        `attn_in` [B, n, qkv's inputs]: what q, k, v read instead of the input norm of x (EAGLE-3's
        layer, whose residual stream x is not what its attention reads)."""
        batch, n, _ = x.shape
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        whole = self.native_layer(x, mask, cache)
        if whole is not None:
            keys, values, start = cache.reserve(self.index, n, batch, kv_heads, d, x.dtype, x.device)
            y = whole(x, cos, sin, keys, values, start, mask, gemms_are_skipped(), attn_in)
            cache.advance(self.index, n)
            return y
        glue = native_active(x)  # native RMSNorm, RoPE, KV write
        qkv = self.qkv(rms_norm(x, self.input_norm, glue) if attn_in is None else attn_in)
        qkv = qkv.view(batch, n, heads + 2 * kv_heads, d)
        # native RoPE + KV write where the projection came back in rows (a transposed `w_xt` output
        # goes the torch way: attention's rounding follows q's memory layout, and torch's q has qkv's)
        if glue and qkv.is_contiguous() and hasattr(cache, "reserve"):
            key_buffer, value_buffer, start = cache.reserve(self.index, n, batch, kv_heads, d, x.dtype, x.device)
            q = native.rope_store(qkv, cos, sin, key_buffer, value_buffer, start, heads, kv_heads)
            cache.advance(self.index, n)
            keys, values = cache.layers[self.index].keys, cache.layers[self.index].values
        else:
            qk = qkv[:, :, : heads + kv_heads]
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            q = qk[:, :, :heads].transpose(1, 2)
            keys, values = cache.update(qk[:, :, heads:].transpose(1, 2),
                                        qkv[:, :, heads + kv_heads:].transpose(1, 2), self.index)
        if n == 1 and heads != kv_heads:
            # one query: a group's heads become rows of its kv head (no broadcast over heads)
            attn = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, -1, d), keys, values, attn_mask=mask,
                                                  scale=self.scaling).reshape(batch, heads, 1, d)
        else:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and n > 1,
                                                  scale=self.scaling, enable_gqa=heads != kv_heads)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(batch, n, heads * d))
        h = self.gate_up(rms_norm(x, self.post_norm, glue))
        return x + self.down_proj(F.silu(h[..., : self.intermediate]) * h[..., self.intermediate:])


class RopeTable:
    """cos and sign-folded sin per position, made by the model's own rotary module (so exactly what
    it computes per forward): `reserve(n)` makes it n positions long once, else it grows by doubling."""

    def __init__(self, rotary, head_dim: int):
        self.rotary, self.head_dim = rotary, head_dim
        self._cos = self._sin = None  # [positions, head_dim]

    def reserve(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        """At least `size` positions in `dtype` (a table already that long is kept: same address)."""
        if self._cos is None or self._cos.shape[0] < size or self._cos.dtype != dtype:
            probe = torch.empty(1, dtype=dtype, device=device)
            cos, sin = self.rotary(probe, torch.arange(size, device=device).view(1, -1))
            half = self.head_dim // 2
            # rotate_half(x) * sin == x.roll(half) * signed_sin
            self._cos = cos[0].contiguous()
            self._sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1).contiguous()

    @property
    def cos(self) -> torch.Tensor | None:
        """The cos table [positions, head_dim] (None before the first `reserve`), what a static step
        gathers at device positions."""
        return self._cos

    @property
    def sin(self) -> torch.Tensor | None:
        """The sign-folded sin table, as `cos`."""
        return self._sin

    def clear(self) -> None:
        """Forget the table: the next `reserve` or lookup makes it anew, as long as it needs."""
        self._cos = self._sin = None

    def lookup(self, positions: torch.Tensor, like: torch.Tensor,
               bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, n] -> cos, sin [B, n, 1, d] in `like`'s dtype (broadcast over heads).
        `bound`: positions are below it, known on the host (no read of `positions` back)."""
        needed = bound if bound is not None else int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < needed or self._cos.dtype != like.dtype:
            current = 0 if self._cos is None or self._cos.dtype != like.dtype else self._cos.shape[0]
            self.reserve(max(needed, 256, 2 * current), like.dtype, like.device)
        return self._cos[positions].unsqueeze(2), self._sin[positions].unsqueeze(2)


class FusedHeadLayer(NamedTuple):
    """A draft head's decoder layer on the fused forward and its RoPE table (the heads' `fused()`)."""

    layer: FusedLayer
    rope: RopeTable


def fused_layer(layer, config) -> FusedLayer:
    """A layer's fused form, made once per layer module: every runner of the model shares it."""
    fused = getattr(layer, "_decodebench_fused", None)
    if fused is None:
        with torch.no_grad():
            fused = layer._decodebench_fused = FusedLayer(layer, config)
    return fused


def fused_decoder(model) -> "FusedDecoder":
    """The model's fused forward, made once per model."""
    fused = getattr(model, "_decodebench_fused", None)
    if fused is None:
        fused = model._decodebench_fused = FusedDecoder(model)
    return fused


class FusedDecoder:
    """`forward(ids [B, n], positions [B, n], mask, cache)` -> last hidden state [B, n, H] after the
    final norm, and the hidden states entering the layers named in `capture`."""

    def __init__(self, model):
        reason = unsupported(model)
        if reason:
            raise ValueError(f"the fused forward does not run this model: {reason}")
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.norm = decoder.norm
        self.layers = [fused_layer(layer, model.config) for layer in decoder.layers]
        self.linears = [m for layer in self.layers for m in (layer.qkv, layer.gate_up)]
        self.rope = RopeTable(decoder.rotary_emb, self.layers[0].head_dim)
        self.window = sliding_window(model.config)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                capture: Sequence[int] = (), bound: int | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        x = self.embed(ids)
        cos, sin = self.rope.lookup(positions, x, bound)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            x = layer.forward(x, cos, sin, mask, cache)
        return rms_norm(x, self.norm, native_active(x)), captured
