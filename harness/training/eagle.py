"""EAGLE head recipe: fc over [embedding; feature] + one decoder layer (initialized from the target's
last layer with its residual branches zeroed, so it starts by predicting f_{i+1} = f_i), trained as
in EAGLE: smooth-L1 on the next feature (per dimension in units of its spread: SmolLM2 has a few
massive-activation dimensions that would otherwise dominate) + cross-entropy of the target's
next-token distribution through the frozen lm_head, with uniform noise on the input features."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .examples import Example, answer_mask


class EagleRecipe:
    kind = "eagle"

    def __init__(self, target, seed: int, cls_weight: float = 0.1, feature_scale: torch.Tensor | None = None):
        from methods.models.heads.eagle import EagleHead, head_config
        from methods.models.heads.random_init import eagle_config

        self.target = target
        self.cls_weight = cls_weight
        # the regression is measured per feature dimension in units of its spread: a few
        # "massive activation" dimensions (tens of times the others in SmolLM2) would dominate it
        self.feature_scale = feature_scale
        self.config_dict = eagle_config(target)
        self.head = EagleHead(head_config(self.config_dict, qkv_bias=False), fc_bias=True).float()
        last = target.model.layers[-1]
        layer = self.head.layers[0]
        layer.self_attn.load_state_dict(last.self_attn.state_dict())
        layer.mlp.load_state_dict(last.mlp.state_dict())
        layer.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
        hidden = self.config_dict["hidden_size"]
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.head.fc.weight.copy_(torch.cat([torch.randn(hidden, hidden, generator=generator) * 0.01,
                                                 torch.eye(hidden)], dim=1))
            self.head.fc.bias.zero_()
            # the layer's residual branches start at zero: the head starts by predicting f_{i+1} = f_i
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        self.head.embed_tokens.weight = target.get_input_embeddings().weight  # frozen, shared
        self.head.requires_grad_(True)
        self.head.embed_tokens.requires_grad_(False)
        self.lm_head = target.get_output_embeddings()
        self.head.train()

    def parameters(self):
        return [p for p in self.head.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        # pair i = (token i+1, feature i) at position i predicts feature i+1 and token i+2
        features = example.hidden[:-1]
        if noise:
            scale = features.std()
            features = features + (torch.rand(features.shape, generator=generator) - 0.5) * 2 * noise * scale
        n = len(features)
        tokens = example.ids[1:]
        positions = torch.arange(n)
        mask = torch.full((n, n), float("-inf")).triu_(1)[None, None]
        predicted = self.head(tokens, features, positions, mask, None)[:-1]  # pairs 0..n-2
        wanted = example.hidden[1:n]
        keep = answer_mask(example, 2)
        scale = 1.0 if self.feature_scale is None else self.feature_scale
        reg = F.smooth_l1_loss(predicted[keep] / scale, wanted[keep] / scale)
        logits = self.lm_head(predicted[keep]).float()
        with torch.no_grad():
            target_probs = self.lm_head(wanted[keep]).float().softmax(-1)
        cls = -(target_probs * logits.log_softmax(-1)).sum(-1).mean()
        correct = (logits.argmax(-1) == example.ids[2:][keep]).float()
        return reg + self.cls_weight * cls, {"acc_1": correct, "reg": reg.detach(), "cls": cls.detach()}

    def save(self, out: Path) -> None:
        state = {k: v.detach().to(torch.bfloat16).clone() for k, v in self.head.state_dict().items()
                 if not k.startswith(("embed_tokens.", "rotary_emb."))}
        torch.save(state, out / "pytorch_model.bin")
        (out / "config.json").write_text(json.dumps(self.config_dict, indent=2))
