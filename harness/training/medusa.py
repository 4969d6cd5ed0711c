"""Medusa heads recipe: `heads` ResBlocks on the last hidden state, head k trained on the target's
token k+2 ahead (loss weight 0.8^k), vocab projection frozen to the target's lm_head and left out.

`batch_loss` takes a mini-batch of conversations at once (their answer positions concatenated: the
heads see one position at a time). With a reduced `vocabulary` (FR-Spec, as the heads draft at
inference) the cross-entropy runs over its K rows of the lm_head only, and positions whose label
lies outside them are left out of the loss (not out of its denominator). The saved heads are the
same either way. Held-out `acc_k` (under no_grad): head k's top-1 (over the vocabulary it drafts
from) against the target's own argmax at that position."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from methods.models.heads.medusa import MedusaHeads

from .examples import Example, draft_labels, mean_cross_entropy, target_top


class MedusaRecipe:
    kind = "medusa"
    on_gpu = True  # batch_loss places each batch where the recipe is (`distributed.place`)

    def __init__(self, target, heads: int, vocabulary=None):
        lm_head = target.get_output_embeddings()
        self.lm_head = lm_head
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
        self.ids = None if vocabulary is None else vocabulary.ids
        weight = lm_head.weight.detach()
        self.rows = weight if self.ids is None else weight[self.ids].contiguous()  # the projection trained through
        self.full_size = weight.shape[0]

    def parameters(self):
        return [p for p in self.heads.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        return self.batch_loss([example], noise, [generator])

    def batch_loss(self, examples: list[Example], noise: float, generators) -> tuple[torch.Tensor, dict]:
        """The sum over `examples` of each one's loss (sum over heads of 0.8^k x its mean cross-entropy)."""
        evaluating = not torch.is_grad_enabled()
        device = self.rows.device
        total, stats = self.rows.new_zeros((), dtype=torch.float32), {}
        for k, head in enumerate(self.heads):
            offset = k + 2
            parts, labels, owner, wanted = [], [], [], []
            for b, e in enumerate(examples):
                T = len(e.ids)
                if T <= offset:
                    continue
                first = max(0, e.answer_start - offset)  # position t predicts token t + offset of the answer
                if first >= T - offset:
                    continue
                parts.append(e.hidden[first:T - offset])
                labels.append(e.ids[first + offset:])
                owner.append(torch.full((T - offset - first,), b))
                if evaluating:
                    wanted.append(target_top(e, self.lm_head)[first + offset - 1:T - 1])
            if not parts:
                continue
            features = head[:-1](torch.cat(parts).to(device).float())
            logits = features @ self.rows.T
            labels, owner = torch.cat(labels).to(device), torch.cat(owner).to(device)
            loss = mean_cross_entropy(logits, draft_labels(labels, self.ids, self.full_size), owner, len(examples))
            total = total + 0.8 ** k * loss.sum()
            if evaluating:
                draft = logits.argmax(-1)
                if self.ids is not None:
                    draft = self.ids.to(device)[draft]
                stats[f"acc_{k + 1}"] = (draft.cpu() == torch.cat(wanted).cpu()).float()
        return total, stats

    def save(self, out: Path) -> None:
        state = {k: v.detach().to(torch.bfloat16).cpu().clone() for k, v in self.heads.state_dict().items()
                 if not k.endswith(f".{self.heads.num_layers}.weight")}
        torch.save(state, out / "medusa_lm_head.pt")
        config = {"medusa_num_heads": len(self.heads), "medusa_num_layers": self.heads.num_layers,
                  "base_model_name_or_path": "smollm2-135m (the suite's embedded default)"}
        (out / "config.json").write_text(json.dumps(config, indent=2))
