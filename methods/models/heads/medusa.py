"""Medusa heads (FasterDecoding/Medusa): head i predicts the token i+2 positions after the last
verified one, from the target's last hidden state (after the final norm).

    head i = Sequential(ResBlock x n_layers, Linear(H -> V, bias=False)),  ResBlock(x) = x + SiLU(Linear(H, H)(x))

Released format: `medusa_lm_head.pt` (or `.safetensors`) with keys `{i}.{j}.linear.weight`,
`{i}.{j}.linear.bias` (ResBlock j of head i) and `{i}.{n_layers}.weight` (its vocab projection),
and a `config.json` with `medusa_num_heads` / `medusa_num_layers`, which may be wrong (the
released `medusa-vicuna-7b-v1.3` says 2 heads and holds 5): the loader counts heads and layers from
the keys. A head saved without its vocab projection gets a copy of the target's lm_head.

Medusa-2 releases the whole fine-tuned model (`save_pretrained` of upstream's `MedusaModel`): the
heads are its `medusa_head.{i}.…` tensors, in `model.safetensors` or shards with an index; the
loader reads those tensors only. The target is that same checkpoint (its backbone was trained with
the heads): point `model.path` and `method.head.path` at the same folder or Hub id.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from ..specs import ModelSpec
from .checkpoints import SHARD_INDEXES, checkpoint_folder, read_config, read_prefixed, read_state_dict

log = logging.getLogger(__name__)
WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")
FULL_MODEL_PREFIX = "medusa_head."  # Medusa-2: the heads inside the whole model's weights
HUB_FILES = (*WEIGHT_FILES, *SHARD_INDEXES, "model-*.safetensors", "pytorch_model-*.bin")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """`heads[i](hidden)` -> logits of the token i+2 positions ahead. State keys as released."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int):
        super().__init__(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                          nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        )
        self.num_layers = num_layers

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[H] or [n, H] -> [num_heads, ..., V]"""
        return torch.stack([head(hidden) for head in self])

    def draft_logits(self, hidden: torch.Tensor, heads: int, vocabulary=None) -> torch.Tensor:
        """[H] -> [heads, V] fp32 logits of the first `heads` heads. Heads that share one vocab
        projection (the target's lm_head) are projected together: one pass over its weight for
        all of them (a skinny GEMM) instead of one per head; over `vocabulary`'s tokens only
        when one is given (-inf elsewhere)."""
        used = [self[i] for i in range(heads)]
        features = torch.stack([head[:-1](hidden) for head in used])  # [heads, H]
        weights = [head[-1].weight for head in used]
        if all(w is weights[0] for w in weights):
            if vocabulary is not None:
                return vocabulary.project(features, weights[0])
            return self[0][-1](features).float()
        if vocabulary is not None:
            return torch.cat([vocabulary.project(f[None], w) for f, w in zip(features, weights)])
        return torch.stack([head[-1](f) for head, f in zip(used, features)]).float()


def count_heads_and_layers(state: dict[str, torch.Tensor], prefix: str = "", kind: str = "Medusa") -> tuple[int, int]:
    """Heads and ResBlocks per head of a checkpoint whose blocks are `{prefix}{head}.{index}.linear.*`
    (Medusa's; Hydra's with `prefix="hydra_mlp."`, whose prefix-mlp heads put Dropouts between the
    blocks: the blocks are counted, not their largest index)."""
    heads, layers = set(), set()
    for key in state:
        match = re.fullmatch(re.escape(prefix) + r"(\d+)\.(\d+)\.linear\.weight", key)
        if match:
            heads.add(int(match[1]))
            layers.add(int(match[2]))
    if not heads:
        raise ValueError(f"no {kind} ResBlock keys ('{prefix}{{i}}.{{j}}.linear.weight') in the checkpoint")
    return max(heads) + 1, len(layers)


def load_medusa_heads(spec: ModelSpec, target_model) -> MedusaHeads:
    folder = checkpoint_folder(spec, HUB_FILES)
    state, file = read_prefixed(folder, FULL_MODEL_PREFIX), "the model's medusa_head.* tensors"
    if state is None:
        state, file = read_state_dict(folder, WEIGHT_FILES)
    num_heads, num_layers = count_heads_and_layers(state)
    declared = read_config(folder).get("medusa_num_heads")
    if declared is not None and declared != num_heads:
        log.warning("%s: config.json says medusa_num_heads=%s, the weights hold %d heads; using %d",
                    spec.describe(), declared, num_heads, num_heads)
    lm_head = target_model.get_output_embeddings()
    heads = MedusaHeads(num_heads, num_layers, lm_head.in_features, lm_head.out_features)
    shared = [i for i in range(num_heads) if f"{i}.{num_layers}.weight" not in state]
    for i in shared:  # vocab projection left out of the file: the target's lm_head, shared below
        state[f"{i}.{num_layers}.weight"] = lm_head.weight.detach()
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder} ({file}): not a Medusa checkpoint (missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]})")
    param = next(target_model.parameters())
    heads = heads.to(device=param.device, dtype=param.dtype).eval().requires_grad_(False)
    for i in shared:
        heads[i][-1].weight = lm_head.weight
    return heads
