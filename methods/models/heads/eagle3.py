"""The EAGLE-3 draft head (SafeAILab/EAGLE main: `eagle/model/cnets.py`, trained by `eagle/traineagle3`).

    g_i   = fc(concat(a_i, b_i, c_i))      the target's hidden states at position i ENTERING its decoder
                                           layers 2, L//2 and L-3 (upstream's modified Llama collects
                                           them before each of those layers runs), 3·H_t -> H, no bias
    x_i   = concat(input_layernorm(embed(x_{i+1})), hidden_norm(g_i))     2·H: the attention's input
    h     = g_i + attn(x_i);  out_i = h + mlp(post_attention_layernorm(h))   one decoder layer `midlayer`
    draft logits = lm_head(norm(out_i)) over `draft_vocab_size` tokens; draft id d is target id d + d2t[d]

Tree levels after the first feed the head's own output `out` in place of g (not fused again), as
upstream's `topK_genrate` does. RoPE is the head's own config (no rope_theta: 10000, as upstream).

Released format (`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` and the other official heads):
`pytorch_model.bin` (or `model.safetensors`) with `fc.weight` [H, 3·H_t],
`midlayer.self_attn.{q,k,v}_proj.weight` [*, 2·H], `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`,
`norm.weight`, `lm_head.weight` [draft_vocab_size, H], `d2t` (long [draft_vocab_size]), `t2d` (bool
[vocab_size]); `embed_tokens.weight` usually left out (then the target's, which needs H = H_t).
`config.json`: LlamaConfig fields + `draft_vocab_size`, optionally `target_hidden_size`. When
`draft_vocab_size == vocab_size` d2t/t2d may be absent (identity).
"""

from __future__ import annotations

import torch
from torch import nn

from ...engine.fused import FusedHeadLayer, RopeTable, fused_layer, rms_norm, unsupported_layers
from ...engine.linear import native_active
from ...engine.vocab import DraftVocabulary
from ..specs import ModelSpec
from .checkpoints import place_like_target, read_head
from .eagle import head_config

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 fuses: 2, L//2, L-3 (upstream's rule), low to high."""
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) != 3 or layers[-1] <= layers[1] or layers[1] <= 2:
        raise ValueError(f"EAGLE-3 reads the inputs of layers 2, L//2 and L-3, which must be distinct: "
                         f"a target with {num_layers} layers gives {layers} (needs L >= 7)")
    return layers


class Eagle3Layer(nn.Module):
    """`midlayer`: a Llama decoder layer whose attention reads [input_layernorm(embedding); hidden_norm(g)]
    (q/k/v take 2·H inputs) and whose residual stream is g."""

    def __init__(self, config):
        super().__init__()
        # lazy: transformers' model code, slow to import: not to check a config
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx=0)
        head_dim = self.self_attn.head_dim
        for name, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads),
                            ("v", config.num_key_value_heads)):
            setattr(self.self_attn, f"{name}_proj", nn.Linear(2 * hidden, heads * head_dim, bias=False))
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, mask, cache) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=mask,
                                     past_key_values=cache)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    def __init__(self, config, target_hidden_size: int, draft_vocab_size: int, layers: tuple[int, ...]):
        super().__init__()
        # lazy: transformers' model code, slow to import: not to check a config
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        hidden = config.hidden_size
        self.config, self.layers = config, tuple(layers)  # layers: the target layers whose inputs fc fuses
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(len(layers) * target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.vocabulary: DraftVocabulary | None = None  # the target ids of the draft vocabulary (None: all, in order)

    def fused(self):
        """(layer, rope table) on the engine's fused forward (`methods/engine/fused.py`), a `FusedHeadLayer`,
        for drafting: the midlayer as a fused layer whose q, k, v read `layer_inputs`' second part; None where its
        layer type is not supported; training keeps `forward`."""
        if unsupported_layers(self.config, self.rotary_emb):
            return None
        layer = fused_layer(self.midlayer, self.config)
        return FusedHeadLayer(layer, RopeTable(self.rotary_emb, layer.head_dim))

    def layer_inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [n], hidden [n, H] -> the fused layer's residual stream g [n, H] and what its
        q, k, v read, [input_layernorm(embed(tokens)); hidden_norm(g)] [n, 2·H]."""
        hidden = hidden.to(self.fc.weight.dtype)
        embeds = self.embed_tokens(tokens)
        glue = native_active(hidden)
        midlayer = self.midlayer
        return hidden, torch.cat([rms_norm(embeds, midlayer.input_layernorm, glue),
                                  rms_norm(hidden, midlayer.hidden_norm, glue)], dim=-1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[n, 3·H_t] target features -> [n, H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, cache) -> torch.Tensor:
        """tokens [n], hidden [n, H] (fused target features, or the head's own outputs), positions [n]
        -> the head's outputs [n, H] (before `norm`)."""
        hidden = hidden.to(self.fc.weight.dtype)[None]
        position_ids = positions.view(1, -1)
        out = self.midlayer(self.embed_tokens(tokens)[None], hidden, self.rotary_emb(hidden, position_ids), mask, cache)
        return out[0]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab_size] fp32 logits over the draft vocabulary (draft ids)."""
        return self.lm_head(rms_norm(hidden, self.norm, native_active(hidden))).float()


def eagle3_head_config(config: dict):
    cfg = head_config({k: v for k, v in config.items() if k not in ("draft_vocab_size", "target_hidden_size")},
                      qkv_bias=False)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads  # upstream's attention: hidden / heads, always
    cfg.attention_bias = cfg.mlp_bias = False
    return cfg


def load_eagle3_head(spec: ModelSpec, target_model) -> Eagle3Head:
    folder, state, config, where = read_head(spec, WEIGHT_FILES)
    if "draft_vocab_size" not in config:
        raise ValueError(f"{folder}: config.json has no draft_vocab_size: not an EAGLE-3 head "
                         "(an EAGLE-1/2 head is `method=eagle` / `eagle2`)")
    target_embed = target_model.get_input_embeddings()
    target_vocab = target_model.get_output_embeddings().out_features
    hidden, target_hidden = config.get("hidden_size"), config.get("target_hidden_size", config.get("hidden_size"))
    if target_hidden != target_embed.embedding_dim:
        raise ValueError(f"EAGLE-3 head {spec.describe()} reads target features of size {target_hidden}, the "
                         f"target's are {target_embed.embedding_dim}: it was trained for another model")
    if config.get("vocab_size") != target_vocab:
        raise ValueError(f"EAGLE-3 head {spec.describe()} has vocab_size {config.get('vocab_size')}, "
                         f"the target {target_vocab}: it was trained for another model")
    draft_vocab = int(config["draft_vocab_size"])
    if "d2t" not in state or "t2d" not in state:
        if draft_vocab != target_vocab:
            raise ValueError(f"{where}: d2t/t2d missing, and draft_vocab_size {draft_vocab} != vocab_size "
                             f"{target_vocab}")
        state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        state.setdefault("t2d", torch.ones(target_vocab, dtype=torch.bool))
    share_embedding = "embed_tokens.weight" not in state
    if share_embedding:
        if hidden != target_embed.embedding_dim:
            raise ValueError(f"{where}: no embed_tokens.weight, and the head's hidden_size {hidden} differs from "
                             f"the target's {target_embed.embedding_dim}, so the target's cannot stand in")
        state["embed_tokens.weight"] = target_embed.weight.detach()
    layers = feature_layers(target_model.config.num_hidden_layers)
    head = Eagle3Head(eagle3_head_config(config), target_hidden, draft_vocab, layers)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb")]
    if missing or unexpected:
        raise ValueError(f"{where}: not an EAGLE-3 checkpoint (missing {missing[:4]}, unexpected {unexpected[:4]})")
    ids = torch.arange(draft_vocab) + head.d2t
    if int(ids.min()) < 0 or int(ids.max()) >= target_vocab or ids.unique().numel() != draft_vocab:
        raise ValueError(f"{where}: d2t maps the draft vocabulary outside 0..{target_vocab - 1} or onto repeated ids")
    used = torch.zeros(target_vocab, dtype=torch.bool)
    used[ids] = True
    if not torch.equal(used, head.t2d.bool()):
        raise ValueError(f"{where}: t2d does not mark exactly the target ids that d2t maps to")
    if not bool((ids[1:] > ids[:-1]).all()):  # upstream writes them in id order; keep that order for the scatter
        order = torch.argsort(ids)
        head.lm_head.weight.data = head.lm_head.weight.data[order]
        ids = ids[order]
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    if not torch.equal(ids, torch.arange(target_vocab)):
        head.vocabulary = DraftVocabulary(ids, target_vocab,
                                          f"{spec.describe()}: d2t, {draft_vocab} of {target_vocab} tokens")
    return place_like_target(head, target_model, target_embed if share_embedding else None)
