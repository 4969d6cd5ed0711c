"""MCSD: multi-candidate speculative decoding (arXiv 2401.06706).

A draft LM proposes a tree by a k-config (k_1, ..., k_L): every node at depth d-1 gets k_d
children sampled from the draft distribution (one draft forward per depth); the target verifies
the tree in one forward. Verification per depth tries the accepted node's children in sampled
order, accepting with probability p/q; on rejection p <- norm(max(0, p - q)), and without
replacement also q(x) <- 0, q <- norm(q) (`acceptance.sample_accept`). Greedy uses the top-k
children. Both caches keep only the accepted path.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import BuildContext, DraftVerifyDecoder, register
from .models.draft_lm import DraftLM
from .models.loading import load_draft_lm
from .engine.tree import Tree


class MultiCandidateDecoder(DraftVerifyDecoder):
    name = "mcsd"

    def __init__(self, target, draft_model, k_config: Sequence[int] = (4, 2, 1), replacement: bool = False):
        super().__init__(target)
        k_config = tuple(int(k) for k in k_config)
        if not k_config or min(k_config) < 1:
            raise ValueError(f"k_config must be a non-empty list of positive integers, got {list(k_config)}")
        self.k_config, self.replacement = k_config, replacement
        self.draft = DraftLM(draft_model, target.vocab_size)

    def describe(self):
        return {**super().describe(), "k_config": list(self.k_config), "replacement": self.replacement}

    def start(self, prompt, prefill) -> None:
        self.draft.reset()

    def propose(self, root: int, budget: int) -> Tree:
        k_config = self.k_config[:budget]
        if not k_config:
            return Tree(torch.tensor([root]), [-1])
        return self.draft.draft_tree(self.sequence, k_config, self.sampling, self.generator,
                                     without_replacement=not self.replacement)

    def advance(self, tree, acceptance, verified) -> None:
        self.draft.keep_path(tree, acceptance.path)


def parse_k_config(value) -> tuple[int, ...]:
    """`4,2,1`, `[4, 2, 1]` or `4`."""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if isinstance(value, int):
        value = [value]
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"k_config must look like 4,2,1 (children per depth), got {value!r}") from None


@register("mcsd")
def build(target, params: dict, context: BuildContext) -> MultiCandidateDecoder:
    spec = params.get("draft") or context.draft_spec("sps", "mcsd")
    return MultiCandidateDecoder(target, load_draft_lm(spec, context.target_model),
                                 k_config=parse_k_config(params.get("k_config", "4,2,1")),
                                 replacement=bool(params.get("replacement", False)))
