"""Medusa heads recipe: `heads` ResBlocks on the last hidden state, head k trained on the target's
token k+2 ahead (loss weight 0.8^k), vocab projection frozen to the target's lm_head and left out."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .examples import Example, answer_mask


class MedusaRecipe:
    kind = "medusa"

    def __init__(self, target, heads: int):
        from methods.models.heads.medusa import MedusaHeads

        lm_head = target.get_output_embeddings()
        self.heads = MedusaHeads(heads, 1, lm_head.in_features, lm_head.out_features).float()
        with torch.no_grad():
            for head in self.heads:  # Medusa's init: the ResBlock starts as the identity
                head[0].linear.weight.zero_()
                head[0].linear.bias.zero_()
                head[-1].weight = lm_head.weight
        self.heads.requires_grad_(True)
        for head in self.heads:
            head[-1].requires_grad_(False)
        self.heads.train()

    def parameters(self):
        return [p for p in self.heads.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        total, stats = 0.0, {}
        for k, head in enumerate(self.heads):
            offset = k + 2
            if len(example.ids) <= offset:
                break
            keep = answer_mask(example, offset)
            if not keep.any():
                continue
            logits = head(example.hidden[:-offset][keep]).float()
            labels = example.ids[offset:][keep]
            total = total + 0.8 ** k * F.cross_entropy(logits, labels)
            stats[f"acc_{k + 1}"] = (logits.argmax(-1) == labels).float()
        return total, stats

    def save(self, out: Path) -> None:
        state = {k: v.detach().float().clone() for k, v in self.heads.state_dict().items()
                 if not k.endswith(f".{self.heads.num_layers}.weight")}
        torch.save(state, out / "medusa_lm_head.pt")
        config = {"medusa_num_heads": len(self.heads), "medusa_num_layers": self.heads.num_layers,
                  "base_model_name_or_path": "smollm2-135m (the suite's embedded default)"}
        (out / "config.json").write_text(json.dumps(config, indent=2))
