"""The EAGLE draft head (SafeAILab/EAGLE, EAGLE-1 and EAGLE-2 share it).

    input at position i = fc(concat(embed(x_{i+1}), f_i))   f_i: the target's last hidden state at
                                                            position i, after the final norm
    one decoder layer without input_layernorm, no final norm
    logits = the target's lm_head(output)

Released format: `pytorch_model.bin` (fp32) or `model.safetensors` with keys `embed_tokens.weight`
(a copy of the target's; the target's own is used when it is left out), `fc.weight` [H, 2H],
`fc.bias` (absent when config.json has `"bias": false`), `layers.0.self_attn.{q,k,v,o}_proj.weight`
(Qwen2 heads add q/k/v biases), `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`; `config.json` is a LlamaConfig with one layer.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config

from ...engine.fused import FusedHeadLayer, RopeTable, fused_layer, unsupported_layers
from ..specs import ModelSpec
from .checkpoints import place_like_target, read_head

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _layer_classes(qkv_bias: bool):
    """Llama layers, or Qwen2 layers when q/k/v carry biases (EAGLE heads for Qwen2)."""
    if qkv_bias:
        # lazy: transformers' model code, slow to import: not to check a config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

        return Qwen2Config, Qwen2DecoderLayer, Qwen2RotaryEmbedding
    # lazy: transformers' model code, slow to import: not to check a config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    return LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding


def head_config(config: dict, qkv_bias: bool):
    config_class, _, _ = _layer_classes(qkv_bias)
    fields = {k: v for k, v in config.items()
              if k not in ("architectures", "model_type", "bias", "transformers_version")}
    fields["num_hidden_layers"] = 1
    fields.pop("layer_types", None)
    cfg = config_class(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


class EagleHead(nn.Module):
    def __init__(self, config, fc_bias: bool = True, qkv_bias: bool = False):
        super().__init__()
        _, layer_class, rotary_class = _layer_classes(qkv_bias)
        hidden = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        layer = layer_class(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = rotary_class(config=config)

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """tokens [n], features [n, H] -> the layer's input fc([e(x); f]) [n, H]"""
        return self.fc(torch.cat([self.embed_tokens(tokens), features.to(self.fc.weight.dtype)], dim=-1))

    def layer_inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The fused layer's input x [n, H] (its q, k, v read its input norm of x: None)."""
        return self.inputs(tokens, features), None

    def fused(self):
        """(layer, rope table) on the engine's fused forward (`methods/engine/fused.py`), a `FusedHeadLayer`,
        for drafting, or None where its layer type is not supported; training keeps `forward`."""
        if unsupported_layers(self.config, self.rotary_emb):
            return None
        layer = fused_layer(self.layers[0], self.config)
        return FusedHeadLayer(layer, RopeTable(self.rotary_emb, layer.head_dim))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, cache) -> torch.Tensor:
        """tokens [n], features [n, H], positions [n] -> predicted next features [n, H]"""
        x = self.inputs(tokens, features)[None]
        position_ids = positions.view(1, -1)
        x = self.layers[0](
            x, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True,
            position_embeddings=self.rotary_emb(x, position_ids),
        )
        return x[0]


def load_eagle_head(spec: ModelSpec, target_model) -> EagleHead:
    folder, state, config, where = read_head(spec, WEIGHT_FILES)
    qkv_bias = "layers.0.self_attn.q_proj.bias" in state
    fc_bias = "fc.bias" in state
    if config.get("bias", True) is False and fc_bias:
        raise ValueError(f"{folder}: config.json says bias=false but the weights hold fc.bias")
    target_embed = target_model.get_input_embeddings()
    if config.get("hidden_size") != target_embed.embedding_dim:
        raise ValueError(f"EAGLE head {spec.describe()} has hidden_size {config.get('hidden_size')}, "
                         f"the target {target_embed.embedding_dim}: it was trained for another model")
    head = EagleHead(head_config(config, qkv_bias), fc_bias=fc_bias, qkv_bias=qkv_bias)
    state.pop("layers.0.input_layernorm.weight", None)  # unused by EAGLE; some exports keep it
    share_embedding = "embed_tokens.weight" not in state
    if share_embedding:
        state["embed_tokens.weight"] = target_embed.weight.detach()
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb")]
    if missing or unexpected:
        raise ValueError(f"{where}: not an EAGLE checkpoint (missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]})")
    return place_like_target(head, target_model, target_embed if share_embedding else None)
