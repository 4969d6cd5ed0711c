"""A small LM that drafts for a target (SpS, MCSD): its own runner and KV cache, kept in step
with the target's sequence, and its logits mapped onto the target's vocabulary."""

from __future__ import annotations

from typing import Sequence

import torch

from .runner import ModelRunner


class DraftLM:
    def __init__(self, model, target_vocab_size: int):
        self.runner = ModelRunner(model)
        self.target_vocab_size = target_vocab_size
        self.fed: list[int] = []  # tokens whose KV the draft cache holds, in order

    def reset(self) -> None:
        self.runner.reset()
        self.fed = []

    def align(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V_target]: a draft may have a padded or shorter embedding
        (e.g. Qwen2-0.5B vs 7B); ids beyond the draft's vocabulary get probability 0."""
        extra = self.target_vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.target_vocab_size]
        if extra > 0:
            pad = logits.new_full((*logits.shape[:-1], extra), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens causally; logits [V_target] after the last one."""
        out = self.runner.forward(tokens, logits_for=slice(-1, None))
        self.fed.extend(tokens)
        return self.align(out.logits[-1])

    def catch_up(self, sequence: Sequence[int]) -> torch.Tensor:
        """Feed what the draft has not seen of `sequence` (at least its last token)."""
        if len(self.fed) >= len(sequence):
            self.follow(sequence[:-1])
        return self.feed(sequence[len(self.fed):])

    def follow(self, sequence: Sequence[int]) -> None:
        """Drop cached tokens that left the sequence (rejected drafts)."""
        keep = min(len(self.fed), len(sequence))
        if self.fed[:keep] != list(sequence[:keep]):
            keep = next(i for i, (a, b) in enumerate(zip(self.fed, sequence)) if a != b)
        if keep < len(self.fed):
            self.runner.rollback(keep)
            del self.fed[keep:]
