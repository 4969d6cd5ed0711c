"""Draft LM recipe (SpS, MCSD): the target's first `layers` decoder layers + final norm, fine-tuned
to predict the target's greedy tokens; embeddings and lm_head are the target's (frozen, tied)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .examples import Example, answer_mask


class DraftLMRecipe:
    kind = "draft-lm"

    def __init__(self, target, layers: int):
        import copy

        from methods.models.loading import truncated_copy

        # truncated_copy shares the target's tensors: copy them before training the layers
        self.model = copy.deepcopy(truncated_copy(target, layers)).float().train()
        self.model.requires_grad_(False)
        for module in (self.model.model.layers, self.model.model.norm):
            module.requires_grad_(True)
        self.layers = layers

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        hidden = self.model.model(input_ids=example.ids[None]).last_hidden_state[0, :-1]
        mask = answer_mask(example, 1)
        logits = self.model.lm_head(hidden[mask]).float()  # the vocab projection on answer positions only
        labels = example.ids[1:][mask]
        loss = F.cross_entropy(logits, labels)
        correct = (logits.argmax(-1) == labels).float()
        return loss, {"acc_1": correct}

    def save(self, out: Path) -> None:
        from safetensors.torch import save_file

        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.model.state_dict().items()
                 if k.startswith(("model.layers.", "model.norm."))}
        save_file(state, str(out / "model.safetensors"))
        config = self.model.config.to_dict()
        config["torch_dtype"] = "bfloat16"
        config["decodebench_shared_with_target"] = ["model.embed_tokens.weight", "lm_head.weight"]
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
