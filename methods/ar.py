"""Autoregressive decoding: the baseline every speedup is measured against.

It runs through the same loop as the speculative methods with a tree that is the root alone, so
it pays the same per-step bookkeeping, and each step is one single-token target forward (no
mask, logits of one position).
"""

from __future__ import annotations

import torch

from .base import DraftVerifyDecoder, register
from .engine.tree import Tree


class AutoregressiveDecoder(DraftVerifyDecoder):
    name = "ar"

    def propose(self, root: int, budget: int) -> Tree:
        return Tree(torch.tensor([root]), [-1])


@register("ar")
def build(target, params=None, context=None) -> AutoregressiveDecoder:
    return AutoregressiveDecoder(target)
