"""Autoregressive decoding: the baseline every speedup is measured against.

It runs through the same loop as the speculative methods with a tree that is the root alone, so
it pays the same per-step bookkeeping, and each step is one single-token target forward (no
mask, logits of one position).

Its records count every forward as a decoding step, the prefill included (one token each, τ = 1),
as Spec-Bench's baseline records `model.generate` (docs/benchmarks.md, "τ").
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .engine.tree import Tree
from .loop import DraftVerifyDecoder
from .settings.params import Settings


@dataclass(frozen=True)
class ARSettings(Settings):
    """Autoregressive decoding: one target forward per token. The baseline of every speedup."""

    paper = "the baseline"

    batchable = True


class AutoregressiveDecoder(DraftVerifyDecoder):
    name = "ar"
    prefill_step = True  # the prefill is AR's first decoding step: accept lengths [1, 1, …]

    def propose(self, state, root: int, budget: int) -> Tree:
        return Tree.root(root)


@register("ar", settings=ARSettings)
def build(target, settings: ARSettings, context) -> AutoregressiveDecoder:
    return AutoregressiveDecoder(target)
