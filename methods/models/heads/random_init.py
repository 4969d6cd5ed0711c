"""Randomly initialized Medusa / EAGLE / EAGLE-3 heads and DFlash drafts written in the released file formats, for
models that have no trained heads yet: decoding stays exact, acceptance is near zero."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...engine.storage import cache_root
from .dflash import UPSTREAM_BLOCK, dflash_config
from .eagle3 import feature_layers


def random_head_folder(kind: str, target_model, seed: int) -> Path:
    embed = target_model.get_input_embeddings()
    hidden, vocab = embed.embedding_dim, embed.num_embeddings
    if kind == "eagle3":
        feature_layers(target_model.config.num_hidden_layers)  # the target can feed an EAGLE-3 head
    folder = cache_root() / "heads" / f"{kind}-random-h{hidden}-v{vocab}-seed{seed}"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=generator) * std

    if kind == "medusa":
        heads, layers = 4, 1
        state = {}
        for i in range(heads):
            state[f"{i}.0.linear.weight"] = normal(hidden, hidden)
            state[f"{i}.0.linear.bias"] = torch.zeros(hidden)
        torch.save(state, folder / "medusa_lm_head.pt")  # vocab projections left out: the target's lm_head
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "random"}
    elif kind == "eagle":
        config = eagle_config(target_model)
        head_dim, inter = config["head_dim"], config["intermediate_size"]
        q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
        state = {
            "fc.weight": normal(hidden, 2 * hidden), "fc.bias": torch.zeros(hidden),
            "layers.0.self_attn.q_proj.weight": normal(q, hidden),
            "layers.0.self_attn.k_proj.weight": normal(kv, hidden),
            "layers.0.self_attn.v_proj.weight": normal(kv, hidden),
            "layers.0.self_attn.o_proj.weight": normal(hidden, q),
            "layers.0.mlp.gate_proj.weight": normal(inter, hidden),
            "layers.0.mlp.up_proj.weight": normal(inter, hidden),
            "layers.0.mlp.down_proj.weight": normal(hidden, inter),
            "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        }
        torch.save(state, folder / "pytorch_model.bin")  # embed_tokens left out: the target's
    elif kind == "eagle3":
        draft_vocab = min(vocab, 32000)  # the first ids (upstream keeps the most frequent; none are known here)
        config = eagle3_config(target_model, draft_vocab)
        heads = config["num_attention_heads"]
        head_dim, inter = hidden // heads, config["intermediate_size"]
        q, kv = heads * head_dim, config["num_key_value_heads"] * head_dim
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:draft_vocab] = True
        state = {
            "fc.weight": normal(hidden, 3 * hidden),
            "midlayer.self_attn.q_proj.weight": normal(q, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": normal(kv, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": normal(kv, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": normal(hidden, q),
            "midlayer.mlp.gate_proj.weight": normal(inter, hidden),
            "midlayer.mlp.up_proj.weight": normal(inter, hidden),
            "midlayer.mlp.down_proj.weight": normal(hidden, inter),
            "midlayer.hidden_norm.weight": torch.ones(hidden), "midlayer.input_layernorm.weight": torch.ones(hidden),
            "midlayer.post_attention_layernorm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden),
            "lm_head.weight": normal(draft_vocab, hidden), "d2t": torch.zeros(draft_vocab, dtype=torch.long),
            "t2d": t2d,
        }
        torch.save(state, folder / "pytorch_model.bin")  # embed_tokens left out: the target's
    elif kind == "dflash":  # one layer reading the middle layer's output (upstream's rule), a block of 16
        config = dflash_config(target_model, 1, UPSTREAM_BLOCK, vocab - 1)
        state = random_dflash(config, normal)
        from safetensors.torch import save_file  # lazy: only a random DFlash draft is written as safetensors

        save_file(state, str(folder / "model.safetensors"))  # no embedding, no lm_head: the target's
    else:
        raise ValueError(f"no random initialization for head kind {kind!r}; valid: medusa, eagle, eagle3, dflash")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def random_dflash(config: dict, normal) -> dict[str, torch.Tensor]:
    """A DFlash draft's tensors for `config` (released key names): projections from `normal`, norms at 1."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    state = {"fc.weight": normal(hidden, len(config["dflash_config"]["target_layer_ids"]) * hidden),
             "hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        state |= {p + "self_attn.q_proj.weight": normal(q, hidden), p + "self_attn.k_proj.weight": normal(kv, hidden),
                  p + "self_attn.v_proj.weight": normal(kv, hidden), p + "self_attn.o_proj.weight": normal(hidden, q),
                  p + "self_attn.q_norm.weight": torch.ones(head_dim),
                  p + "self_attn.k_norm.weight": torch.ones(head_dim),
                  p + "mlp.gate_proj.weight": normal(inter, hidden), p + "mlp.up_proj.weight": normal(inter, hidden),
                  p + "mlp.down_proj.weight": normal(hidden, inter), p + "input_layernorm.weight": torch.ones(hidden),
                  p + "post_attention_layernorm.weight": torch.ones(hidden)}
    return state


def eagle_config(target_model) -> dict:
    """config.json of an EAGLE head for this target, as released heads write it (a one-layer
    LlamaConfig with the target's shapes; `bias` names whether fc has a bias)."""
    cfg = target_model.config
    hidden = cfg.hidden_size
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True, "hidden_size": hidden,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads, "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
    }


def eagle3_config(target_model, draft_vocab_size: int) -> dict:
    """config.json of an EAGLE-3 head for this target, as released heads write it: a one-layer
    LlamaConfig with the target's shapes and `draft_vocab_size` (no `bias`: fc has none)."""
    config = {**eagle_config(target_model), "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": draft_vocab_size}
    del config["bias"], config["head_dim"]
    return config
