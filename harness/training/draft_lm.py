"""Draft LM recipe (SpS, MCSD): the target's first `layers` decoder layers + final norm, fine-tuned
to predict the target's greedy tokens; embeddings and lm_head are the target's (frozen, tied).

`batch_loss` runs a mini-batch of conversations in one forward (right-padded: the attention is
causal, so no real position sees a pad). With a reduced `vocabulary` the cross-entropy runs over its
K rows of the lm_head, positions whose label lies outside them left out of the loss (not out of its
denominator); the saved layers are the same either way. Held-out `acc_1` (under no_grad): top-1 over
the vocabulary it drafts from against the target's own argmax."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from methods.models.loading import truncated_copy

from .examples import Example, draft_labels, mean_cross_entropy, offset_mask, pad_batch


class DraftLMRecipe:
    kind = "draft-lm"
    on_gpu = True  # batch_loss places each batch where the recipe is (`distributed.place`)

    def __init__(self, target, layers: int, vocabulary=None):
        # truncated_copy shares the target's tensors: copy them before training the layers
        self.model = copy.deepcopy(truncated_copy(target, layers)).float().train()
        self.model.requires_grad_(False)
        for module in (self.model.model.layers, self.model.model.norm):
            module.requires_grad_(True)
        self.layers = layers
        self.target = target
        self.ids = None if vocabulary is None else vocabulary.ids
        weight = self.model.lm_head.weight.detach()
        self.rows = weight if self.ids is None else weight[self.ids].contiguous()
        self.full_size = weight.shape[0]

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        return self.batch_loss([example], noise, [generator])

    def _top(self, example: Example) -> torch.Tensor:
        if example.top is None:
            with torch.no_grad():
                device = self.target.get_input_embeddings().weight.device
                example.top = self.target(input_ids=example.ids[None].to(device)).logits[0].argmax(-1).cpu()
        return example.top

    def batch_loss(self, examples: list[Example], noise: float, generators) -> tuple[torch.Tensor, dict]:
        """The sum over `examples` of each one's mean cross-entropy on its answer tokens."""
        device = self.rows.device
        ids, lengths, starts, _ = pad_batch(examples, device=device)
        width = ids.shape[1]
        hidden = self.model.model(input_ids=ids).last_hidden_state[:, :-1]
        mask = offset_mask(lengths, starts, width, 1)  # [B, width-1]
        owner = torch.arange(len(examples), device=device)[:, None].expand_as(mask)[mask]
        logits = hidden[mask].float() @ self.rows.T.float()  # the vocab projection on answer positions only
        labels = ids[:, 1:][mask]
        loss = mean_cross_entropy(logits, draft_labels(labels, self.ids, self.full_size), owner, len(examples))
        stats = {}
        if not torch.is_grad_enabled():
            tops = torch.zeros_like(ids)
            for b, e in enumerate(examples):
                tops[b, :len(e.ids)] = self._top(e).to(device)
            draft = logits.argmax(-1)
            if self.ids is not None:
                draft = self.ids.to(device)[draft]
            stats["acc_1"] = (draft == tops[:, :-1][mask]).float().cpu()
        return loss.sum(), stats

    def save(self, out: Path) -> None:
        state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in self.model.state_dict().items()
                 if k.startswith(("model.layers.", "model.norm."))}
        save_file(state, str(out / "model.safetensors"))
        config = self.model.config.to_dict()
        config["torch_dtype"] = "bfloat16"
        config["decodebench_shared_with_target"] = ["model.embed_tokens.weight", "lm_head.weight"]
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
