"""Hydra / Hydra++ heads recipe (zankner/Hydra `hydra/train/train.py`, README's Hydra++ run: 4 heads,
4 layers, `prefix-mlp`, grounded, teacher loss weight 1, LM loss weight 0, dropout 0.2):

- head i at position t reads h_t (through the prefix layer for prefix-mlp) and the target's
  embeddings of the true next tokens x_{t+1..t+1+i} (teacher forcing, upstream's `torch.roll`) and
  predicts x_{t+2+i};
- loss: upstream's teacher loss, cross-entropy against the target's next-token distribution at
  position t+1+i (the target's own softmax is the label), heads weighted equally. With a reduced
  draft vocabulary (FR-Spec, as the EAGLE-3 recipe): each head's projection keeps only the K rows of
  the vocabulary, the label is the target's distribution over those K tokens, renormalized, and
  positions whose target argmax lies outside them are left out of the loss (not out of `acc_*`);
- upstream's module structure: the later ResBlocks of a head are ONE block repeated (weights shared),
  Dropout before every block and projection (prefix-mlp).

Initialization (our choice, for short budgets; upstream: `linear` zero, the rest default): ResBlock
`linear` zero (weight and bias), the grounded first block's `res_connection` passing h through (zero
on the embeddings), projections = the target's lm_head rows with zero bias, the prefix layer a copy
of the target's last layer with o_proj and down_proj zeroed (so it starts as norm(h)).

Saved as released (`hydra_lm_head.pt` + `config.json`, keys of `HydraModel.hydra_head.state_dict()`)
without the tensors that copy the target's (`input_embed_fn`, the prefix layer's unused
embed_tokens); with a reduced vocabulary the projections hold K rows and the file adds `draft_ids`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from methods.models.heads.hydra import HydraHeads

from .examples import Example, answer_mask


class HydraRecipe:
    kind = "hydra"

    def __init__(self, target, heads: int = 4, layers: int = 4, arch: str = "prefix-mlp", grounded: bool = True,
                 vocabulary=None, dropout: float = 0.2):
        lm_head = target.get_output_embeddings()
        hidden = lm_head.in_features
        self.ids = vocabulary.ids if vocabulary is not None else None
        rows = lm_head.weight.detach() if self.ids is None else lm_head.weight.detach()[self.ids]
        # tensors only (no modules of the target: the loop may move a recipe's attributes to a GPU)
        self.target_rows = rows  # the target's logits over the draft's rows: the teacher
        self.lm_weight = lm_head.weight.detach()  # the target's choice at each position
        self.embed_weight = target.get_input_embeddings().weight.detach()
        self.heads = HydraHeads(heads, layers, hidden, rows.shape[0], arch, grounded, target.config,
                                dropout=dropout, tie_blocks=True).float()
        if self.ids is not None:
            self.heads.draft_ids = self.ids.clone()
        with torch.no_grad():
            for i in range(heads):
                for block in self.heads.hydra_mlp[i]:
                    if hasattr(block, "linear"):
                        block.linear.weight.zero_()
                        block.linear.bias.zero_()
                        if isinstance(block.res_connection, torch.nn.Linear):
                            block.res_connection.weight.zero_()
                            block.res_connection.weight[:, :hidden].copy_(torch.eye(hidden))
                            block.res_connection.bias.zero_()
                projection = self.heads.projection(i)
                projection.weight.copy_(rows)
                projection.bias.zero_()
            if arch == "prefix-mlp":
                layer = self.heads.prefix_embeding_layer.layers[0]
                layer.load_state_dict(target.model.layers[-1].state_dict(), strict=False)
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        self.config = {"hydra_num_heads": heads, "hydra_num_layers": layers, "hydra_head_arch": arch,
                       "grounded_heads": grounded, "hidden_state_offset": 0,
                       "base_model_name_or_path": getattr(target.config, "_name_or_path", "") or "the suite's target"}
        self.heads.requires_grad_(True)
        self.heads.train()

    def parameters(self):
        return [p for p in self.heads.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        heads = self.heads
        heads.train(torch.is_grad_enabled())  # dropout while training; off under evaluate()'s no_grad
        device = self.target_rows.device
        ids, T = example.ids.to(device), len(example.ids)
        hidden = example.hidden.to(device, torch.float32)  # the cache may hold 16-bit rows
        with torch.no_grad():
            teacher = (hidden @ self.target_rows.T.float()).softmax(-1)  # [T, K] the label at each position
            top = getattr(example, "top", None)
            # [T] the target's choice
            top = (hidden @ self.lm_weight.T.float()).argmax(-1) if top is None else top.to(device)
            in_vocab = torch.ones(T, dtype=torch.bool, device=device) if self.ids is None else torch.isin(top, self.ids)
            embeds = self.embed_weight[ids].float()
        if noise:  # upstream's NEFTune-style noise on the base hidden states
            uniform = torch.rand(hidden.shape, generator=generator).to(device)
            hidden = hidden + (uniform * 2 - 1) * noise / math.sqrt(T * hidden.shape[-1])
        h = heads.base(hidden)
        total, stats = hidden.new_zeros(()), {}
        for i in range(heads.num_heads):
            offset = i + 2
            n = T - offset
            if n <= 0:
                break
            answer = answer_mask(example, offset).to(device)  # [n]: row t predicts x_{t+offset}, an answer token
            if not answer.any():
                continue
            x = torch.cat([h[:n], *[embeds[j + 1: j + 1 + n] for j in range(i + 1)]], -1) if heads.grounded else h[:n]
            logits = heads.logits(i, heads.features(i, x[answer])).float()
            # the position whose next-token distribution is the label
            where = torch.arange(n, device=device)[answer] + offset - 1
            keep = in_vocab[where].float()
            ce = -(teacher[where] * logits.log_softmax(-1)).sum(-1)
            total = total + (ce * keep).sum() / answer.sum()
            draft = logits.argmax(-1) if self.ids is None else self.ids[logits.argmax(-1)]
            stats[f"acc_{i + 1}"] = (draft == top[where]).float()
        return total, stats

    def save(self, out: Path) -> None:
        converted: dict[int, torch.Tensor] = {}  # tied blocks: one tensor under each of their keys, stored once
        state = {}
        for key, value in self.heads.state_dict(keep_vars=True).items():
            if "rotary_emb" in key:
                continue
            if id(value) not in converted:
                v = value.detach().cpu()
                converted[id(value)] = (v.to(torch.bfloat16) if v.is_floating_point() else v).clone()
            state[key] = converted[id(value)]
        torch.save(state, out / "hydra_lm_head.pt")
        (out / "config.json").write_text(json.dumps(self.config, indent=2))
