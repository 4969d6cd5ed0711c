"""The DFlash draft (z-lab/dflash `dflash/model.py`, `DFlashDraftModel`): a few Qwen3-style decoder layers
whose attention also reads the target's hidden features, drafting a whole block in one forward.

    ctx   = hidden_norm(fc(concat(f_k for k in target_layer_ids)))   f_k: the OUTPUT of the target's decoder
                                                                     layer k (HF hidden_states[k + 1]), n·H -> H
    h     = embed(block)                                             the target's embedding, unscaled; the block is
                                                                     [last token, mask, mask, ...] at positions
                                                                     start .. start + bs - 1
    per layer: x = input_layernorm(h)
               q = q_norm(q_proj(x))                     (RoPE at the block's positions)
               k = k_norm(k_proj([ctx; x])),  v = v_proj([ctx; x])   (the same projections; RoPE at the
                                                                     context's and the block's positions)
               h = h + o_proj(attention(q; cached context K/V, new context K/V, block K/V))   NOT causal
               h = h + mlp(post_attention_layernorm(h))            SwiGLU, no bias
    out   = norm(h);  draft logits = the target's lm_head(out[1:])  same-position prediction: slot i drafts
                                                                     the token at position start + i

`ctx` is computed once per forward and shared by every layer (no per-layer norm on it). The draft
cache keeps each layer's context K and V (RoPE and k_norm applied) across steps; the block's K/V are
never kept (upstream crops them, `draft_cache.crop(start)`). There is no embed_tokens and no lm_head:
the target's are used, so the draft's hidden size is the target's.

Released format (`z-lab/Qwen3-8B-DFlash-b16`, `z-lab/Qwen3-4B-DFlash-b16`,
`z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat`): `config.json`, a Qwen3 config with `block_size`,
`num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`; `model.safetensors` with
exactly these keys (no prefix): `fc.weight` [H, n·H], `hidden_norm.weight`, `norm.weight` [H], and per
layer i `layers.{i}.input_layernorm.weight`, `layers.{i}.post_attention_layernorm.weight` [H],
`layers.{i}.self_attn.{q,k,v,o}_proj.weight` (+ `.bias` with `attention_bias`),
`layers.{i}.self_attn.{q,k}_norm.weight` [head_dim], `layers.{i}.mlp.{gate,up,down}_proj.weight`.
Without `target_layer_ids`, upstream's `build_target_layer_ids(num_target_layers, num_hidden_layers)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..specs import ModelSpec
from .checkpoints import place_like_target, read_head

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
UPSTREAM_BLOCK = 16  # the released drafts' block size (`-b16`), the config's `block_size`
# config.json keys that are not Qwen3Config fields, or that it must not see
NOT_CONFIG = ("architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Upstream's default feature layers (model.py:27-36): the middle layer for a one-layer draft, else
    `num_draft_layers` ids spread evenly from 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + (i * (end - start)) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: w * x / sqrt(mean(x^2) + eps), computed in fp32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, heads, n, d] with cos/sin [B, n, d] (rotate_half's convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class DFlashAttention(nn.Module):
    """Qwen3 GQA with q_norm/k_norm whose keys and values also cover the context features (model.py:185-255)."""

    def __init__(self, config):
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, n, H] (the block, input-normed), context [B, m, H] (the fused features); cos/sin [B, m + n, d]
        at the context's then the block's positions. Returns q [B, heads, n, d] and k, v [B, kv_heads, m + n, d]
        (context rows first), RoPE applied to q and k, k_norm to both parts of k (model.py:223-235)."""
        B, n, m, d = x.shape[0], x.shape[1], context.shape[1], self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, n, -1, d)).transpose(1, 2)
        both = torch.cat([context, x], 1)
        k = self.k_norm(self.k_proj(both).view(B, m + n, -1, d)).transpose(1, 2)
        v = self.v_proj(both).view(B, m + n, -1, d).transpose(1, 2)
        return rotate(q, cos[:, m:], sin[:, m:]), rotate(k, cos, sin), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence's non-causal GQA attention without a mask: q [heads, n, d] over k, v [kv_heads, L, d]
    (query head h reads kv head h // (heads / kv_heads), as transformers' repeat_kv) -> [n, heads · d],
    scaled by d^-0.5. The query heads of a kv head are attended together: no copy of the keys."""
    heads, n, d = q.shape
    kv_heads = k.shape[0]
    out = F.scaled_dot_product_attention(q.reshape(kv_heads, heads // kv_heads * n, d), k, v)
    return out.view(heads, n, d).transpose(0, 1).reshape(n, heads * d)


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """`Qwen3DFlashDecoderLayer` (model.py:258-299): pre-norm attention and SwiGLU MLP."""

    def __init__(self, config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ContextCache:
    """One sequence's draft cache: every layer's context keys (RoPE and k_norm applied) and values,
    [layers, 2, kv_heads, capacity, head_dim], positions 0 .. length - 1. A draft forward writes its new
    context rows after them and its block's rows after those (read by that forward only: `length` counts
    the context alone, as upstream's crop to `start`)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def reset(self, capacity: int, draft: "DFlashDraft") -> None:
        """Empty, with room for `capacity` positions (the buffer kept when it is large enough)."""
        shape = (len(draft.layers), 2, draft.kv_heads, capacity, draft.head_dim)
        weight = draft.fc.weight
        if self.buffer is None or self.buffer.shape[3] < capacity or self.buffer.shape[:3] != shape[:3] \
                or self.buffer.dtype != weight.dtype or self.buffer.device != weight.device:
            self.buffer = weight.new_zeros(shape)
        self.length = 0

    def room(self, needed: int) -> None:
        """At least `needed` positions (grown by doubling, the filled part copied)."""
        if needed > self.buffer.shape[3]:
            grown = self.buffer.new_zeros(*self.buffer.shape[:3], max(needed, 2 * self.buffer.shape[3]),
                                          self.buffer.shape[4])
            grown[..., : self.length, :] = self.buffer[..., : self.length, :]
            self.buffer = grown


class DFlashDraft(nn.Module):
    """`DFlashDraftModel` (model.py:302-347) without its generate loop: `draft` runs one block per
    sequence over its context cache; `forward_masked` runs blocks under an explicit visibility mask (no
    cache: the test's full recompute, and training)."""

    def __init__(self, config, target_layer_ids: list[int], block_size: int, mask_token_id: int):
        super().__init__()
        # lazy: transformers' model code, slow to import: not to check a config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        hidden = config.hidden_size
        self.config = config
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.target_layer_ids = list(target_layer_ids)
        self.block_size, self.mask_token_id = int(block_size), int(mask_token_id)
        attention = self.layers[0].self_attn
        self.kv_heads, self.head_dim = attention.kv_heads, attention.head_dim

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target decoder layers whose INPUTS are the features (`ModelRunner.capture_inputs`): the
        output of layer k is the input of layer k + 1."""
        return tuple(k + 1 for k in self.target_layer_ids)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n·H] target features -> [..., H] (model.py:334)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def draft(self, embeds: torch.Tensor, features: torch.Tensor, counts: list[int], starts: list[int],
              caches: list[ContextCache]) -> torch.Tensor:
        """One forward for B sequences' blocks: embeds [B, n, H] (the target's embedding of each block),
        features [B, M, n·H] (each sequence's `counts[b]` context features not yet in its cache, the
        positions cache.length .. starts[b] - 1, right-padded), `starts[b]`: the position of block slot 0.
        Appends the new context K/V to each cache and returns the blocks' outputs [B, n, H] after `norm`."""
        B, n = embeds.shape[:2]
        M = features.shape[1]
        for b, cache in enumerate(caches):
            if cache.length + counts[b] != starts[b]:
                raise RuntimeError(f"draft cache holds {cache.length} positions and {counts[b]} new context "
                                   f"features, but the block starts at {starts[b]}")
            cache.room(starts[b] + n)
        positions = torch.tensor([[c.length + j for j in range(M)] + [s + i for i in range(n)]
                                  for c, s in zip(caches, starts)], device=embeds.device)
        cos, sin = self.rotary_emb(embeds, positions)
        context, h = self.fuse(features), embeds.to(self.fc.weight.dtype)
        for index, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.project(layer.input_layernorm(h), context, cos, sin)
            rows = []
            for b, cache in enumerate(caches):
                at, m = cache.length, counts[b]
                keys, values = cache.buffer[index, 0], cache.buffer[index, 1]
                keys[:, at:at + m], values[:, at:at + m] = k[b, :, :m], v[b, :, :m]
                keys[:, at + m:at + m + n], values[:, at + m:at + m + n] = k[b, :, M:], v[b, :, M:]
                rows.append(attend(q[b], keys[:, :at + m + n], values[:, :at + m + n]))
            h = h + layer.self_attn.o_proj(torch.stack(rows))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for b, cache in enumerate(caches):
            cache.length += counts[b]
        return self.norm(h)

    def forward_masked(self, embeds: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                       feature_positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Blocks without a cache: embeds [B, Q, H] at `positions` [B, Q]; context features [B, S, n·H] at
        `feature_positions` [B, S]; `visible` [B, Q, S + Q] bool, what each block row sees of the context
        and of the block rows (every row must see something). Returns [B, Q, H] after `norm`."""
        cos, sin = self.rotary_emb(embeds, torch.cat([feature_positions, positions], 1))
        context, h = self.fuse(features), embeds.to(self.fc.weight.dtype)
        mask = visible[:, None]
        for layer in self.layers:
            attention = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = attention.project(x, context, cos, sin)
            groups = attention.heads // attention.kv_heads
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, Q, d]
            h = h + attention.o_proj(out.transpose(1, 2).flatten(2))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def draft_config(config: dict):
    """The draft's config.json as the Qwen3Config upstream reads it (`config_class = Qwen3Config`): RoPE from
    the draft's own fields (`rope_theta`, `rope_scaling` / `rope_parameters`)."""
    from transformers import Qwen3Config  # lazy: transformers' configs, slow to import: not to check a config

    return Qwen3Config(**{k: v for k, v in config.items() if k not in NOT_CONFIG})


def dflash_config(target_model, layers: int, block_size: int, mask_token_id: int,
                  target_layer_ids: list[int] | None = None) -> dict:
    """config.json of a DFlash draft for this target in the released format: the target's layer shapes
    (hidden, intermediate, heads, head_dim, RoPE, eps) as a Qwen3 config, `layers` decoder layers, its
    feature layers upstream's `build_target_layer_ids` unless given."""
    cfg = target_model.config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", 10000.0)})
    theta = rope.pop("rope_theta", 10000.0)
    ids = list(target_layer_ids or build_target_layer_ids(cfg.num_hidden_layers, layers))
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or hidden // heads, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": theta,
        **({"rope_scaling": rope} if rope.get("rope_type", "default") != "default" else {}),
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "tie_word_embeddings": False, "layer_types": ["full_attention"] * layers,
        "block_size": block_size, "num_target_layers": cfg.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids}, "torch_dtype": "bfloat16",
    }


def save_dflash(draft: DFlashDraft, config: dict, folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The draft in the released format: config.json and model.safetensors (the keys above, in `dtype`)."""
    from safetensors.torch import save_file  # lazy: only a recipe or a random draft writes one

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def check_config(config: dict, where, target_model) -> tuple[list[int], int, int]:
    """(target_layer_ids, block_size, mask_token_id) of a DFlash config.json for this target, or a
    one-line ValueError saying why it cannot draft for it."""
    target = target_model.config
    layers, hidden = target.num_hidden_layers, target_model.get_input_embeddings().embedding_dim
    rows = target_model.get_input_embeddings().num_embeddings
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"{where}: config.json has no dflash_config: not a DFlash draft")
    if dflash.get("mask_token_id") is None:
        raise ValueError(f"{where}: config.json's dflash_config has no mask_token_id")
    if config.get("hidden_size") != hidden:
        raise ValueError(f"{where}: a draft of hidden size {config.get('hidden_size')} for a target of {hidden} "
                         "(the draft reads the target's embedding and features): it was trained for another model")
    trained_for = config.get("num_target_layers")
    if trained_for is not None and trained_for != layers:
        raise ValueError(f"{where}: trained for a target of {trained_for} layers, this one has {layers}")
    ids = dflash.get("target_layer_ids") or build_target_layer_ids(trained_for or layers, config["num_hidden_layers"])
    if any(not 0 <= int(k) <= layers - 2 for k in ids):
        raise ValueError(f"{where}: target_layer_ids {list(ids)}: each must be 0 .. {layers - 2} (the output of "
                         f"layer {layers - 1}, the last, is the hidden state before the final norm, which the "
                         "runner does not capture)")
    kinds = set(config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{where}: layer_types {sorted(kinds)}: only full_attention layers are supported "
                         "(the released Qwen3 and Llama-3.1 drafts' kind)")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {config.get('hidden_act')!r}: the draft's MLP is SwiGLU (silu)")
    mask = int(dflash["mask_token_id"])
    if not 0 <= mask < rows:
        raise ValueError(f"{where}: mask_token_id {mask} is outside the target's {rows} embedding rows")
    return [int(k) for k in ids], int(config.get("block_size") or UPSTREAM_BLOCK), mask


def load_dflash_draft(spec: ModelSpec, target_model) -> DFlashDraft:
    """A DFlash draft in the released format, on the target's device and dtype, checked against the target;
    a wrong checkpoint is refused in one line."""
    folder, state, config, where = read_head(spec, WEIGHT_FILES)
    ids, block, mask = check_config(config, where, target_model)
    draft = DFlashDraft(draft_config(config), ids, block, mask)
    try:
        missing, unexpected = draft.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape than the config gives
        wrong = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
        raise ValueError(f"{where}: not a DFlash checkpoint for this config ({(wrong or [str(err)])[0]})") from None
    if missing or unexpected:
        raise ValueError(f"{where}: not a DFlash checkpoint for this config (missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]})")
    return place_like_target(draft, target_model)
