"""EAGLE head recipe: fc over [embedding; feature] + one decoder layer (initialized from the target's
last layer with its residual branches zeroed, so it starts by predicting f_{i+1} = f_i), trained as
in EAGLE: smooth-L1 on the next feature (per dimension in units of its spread: SmolLM2 has a few
massive-activation dimensions that would otherwise dominate) + cross-entropy of the target's
next-token distribution through the frozen lm_head, with uniform noise on the input features.

`batch_loss` runs a mini-batch of conversations in one forward of the head (right-padded; the
attention is causal, so no real position sees a pad). With a reduced `vocabulary` the
classification term runs over its K rows of the lm_head (the target's distribution renormalized
over them, positions whose target argmax lies outside them left out of that term); the saved head
is the same either way. Held-out `acc_1` (under no_grad): top-1 over the vocabulary it drafts from
against the target's own argmax."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from methods.models.heads.eagle import EagleHead, head_config
from methods.models.heads.random_init import eagle_config

from .examples import Example, offset_mask, pad_batch, target_top


class EagleRecipe:
    kind = "eagle"
    on_gpu = True  # batch_loss places each batch where the recipe is (`distributed.place`)

    def __init__(self, target, seed: int, cls_weight: float = 0.1, feature_scale: torch.Tensor | None = None,
                 vocabulary=None):
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
        self.ids = None if vocabulary is None else vocabulary.ids
        weight = self.lm_head.weight.detach()
        self.rows = weight if self.ids is None else weight[self.ids].contiguous()
        self.in_vocab = None
        if self.ids is not None:
            self.in_vocab = torch.zeros(weight.shape[0], dtype=torch.bool)
            self.in_vocab[self.ids] = True

    def parameters(self):
        return [p for p in self.head.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        return self.batch_loss([example], noise, [generator])

    def batch_loss(self, examples: list[Example], noise: float, generators) -> tuple[torch.Tensor, dict]:
        """The sum over `examples` of each one's loss (regression + cls_weight x classification, each
        its mean over the example's answer positions)."""
        # pair i = (token i+1, feature i) at position i predicts feature i+1 and token i+2
        device = self.rows.device
        ids, lengths, starts, states = pad_batch(examples, hidden=True, device=device)
        B, width, H = states.shape
        n = width - 1
        features = states[:, :-1]
        if noise:
            features = features.clone()
            for b, (e, generator) in enumerate(zip(examples, generators)):
                real = features[b, :len(e.ids) - 1]
                scale = real.std()
                uniform = torch.rand(real.shape, generator=generator).to(device)
                features[b, :len(e.ids) - 1] = real + (uniform - 0.5) * 2 * noise * scale
        head = self.head
        x = head.fc(torch.cat([head.embed_tokens(ids[:, 1:]), features], dim=-1))
        position_ids = torch.arange(n, device=device)[None]
        mask = torch.full((n, n), float("-inf"), device=device).triu_(1)[None, None]
        out = head.layers[0](x, attention_mask=mask, position_ids=position_ids, past_key_values=None, use_cache=False,
                             position_embeddings=head.rotary_emb(x, position_ids))
        out = out[0] if isinstance(out, tuple) else out
        keep = offset_mask(lengths, starts, width, 2)  # [B, n-1]: pair i predicts token i+2 of the answer
        owner = torch.arange(B, device=device)[:, None].expand_as(keep)[keep]
        predicted = out[:, :-1][keep]  # pairs 0..n-2
        wanted = states[:, 1:n][keep]
        scale = 1.0 if self.feature_scale is None else self.feature_scale
        counts = states.new_zeros(B).index_add(0, owner, states.new_ones(len(owner)))
        per_row = F.smooth_l1_loss(predicted / scale, wanted / scale, reduction="none").mean(-1)
        reg = states.new_zeros(B).index_add(0, owner, per_row) / counts.clamp_min(1)
        logits = (predicted @ self.rows.T).float()
        with torch.no_grad():
            target_probs = (wanted @ self.rows.T).float().softmax(-1)
            need_top = self.ids is not None or not torch.is_grad_enabled()
            if need_top:
                tops = torch.zeros_like(ids)
                for b, e in enumerate(examples):
                    tops[b, :len(e.ids)] = target_top(e, self.lm_head).to(device)
                top = tops[:, 1:n][keep]  # the target's choice for token i+2
        ce = -(target_probs * logits.log_softmax(-1)).sum(-1)
        if self.ids is not None:
            ce = ce * self.in_vocab.to(device)[top]
        cls = states.new_zeros(B).index_add(0, owner, ce) / counts.clamp_min(1)
        has = (counts > 0).float()
        total = ((reg + self.cls_weight * cls) * has).sum()
        stats = {"reg": (reg * has).sum().detach(), "cls": (cls * has).sum().detach()}
        if not torch.is_grad_enabled():
            draft = logits.argmax(-1)
            if self.ids is not None:
                draft = self.ids.to(device)[draft]
            stats["acc_1"] = (draft == top).float().cpu()
        return total, stats

    def save(self, out: Path) -> None:
        state = {k: v.detach().to(torch.bfloat16).cpu().clone() for k, v in self.head.state_dict().items()
                 if not k.startswith(("embed_tokens.", "rotary_emb."))}
        torch.save(state, out / "pytorch_model.bin")
        (out / "config.json").write_text(json.dumps(self.config_dict, indent=2))
