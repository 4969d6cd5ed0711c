"""Medusa (FasterDecoding/Medusa): heads on the target's last hidden state propose a static tree.

Head d-1 ranks candidates for depth d; the node for path [i, j, ...] carries the i-th candidate of
head 0, the j-th of head 1, and so on (the same candidates under every parent, as in Medusa).
Verification is exact (greedy, or recursive rejection sampling over the tree, which preserves the
target distribution) unless `acceptance: typical`, Medusa's lossy typical acceptance, is chosen;
results then mark the run lossy.
"""

from __future__ import annotations

import torch

from .engine.acceptance import typical_accept
from .base import BuildContext, DraftVerifyDecoder, register
from .models.heads.medusa import MedusaHeads, load_medusa_heads
from .models.heads.source import head_spec
from .engine.sampling import logits_to_probs
from .engine.params import mapping, null, number, one_of, paths
from .engine.static_trees import NAMED_TREES, StaticTree
from .engine.vocab import DRAFT_VOCAB
from .engine.tree import Tree

ACCEPTANCE = ("exact", "typical")


class MedusaDecoder(DraftVerifyDecoder):
    name = "medusa"

    def __init__(self, target, heads: MedusaHeads, tree: StaticTree, acceptance: str = "exact",
                 typical_epsilon: float = 0.09, typical_delta: float = 0.3, vocabulary=None):
        super().__init__(target)
        self.vocabulary = vocabulary
        target.cover(heads, *([vocabulary.head(heads[0][-1].weight)] if vocabulary else []))
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"unknown medusa acceptance {acceptance!r}; valid: {', '.join(ACCEPTANCE)}")
        if tree.max_depth > len(heads):
            raise ValueError(f"tree of depth {tree.max_depth} needs {tree.max_depth} Medusa heads; these weights have {len(heads)}")
        self.heads, self.tree = heads, tree
        self.acceptance = acceptance
        self.lossless = acceptance == "exact"
        self.typical = (typical_epsilon, typical_delta)

    def describe(self):
        return {**super().describe(), "lossless": self.lossless, "acceptance": self.acceptance,
                "tree_nodes": len(self.tree), "tree_depth": self.tree.max_depth, "heads": len(self.heads),
                "draft_vocab": len(self.vocabulary) if self.vocabulary else None}

    def start(self, prompt, prefill) -> None:
        self.hidden = prefill.hidden[-1]

    @torch.inference_mode()
    def propose(self, root: int, budget: int) -> Tree:
        depth = min(self.tree.max_depth, budget)
        count = sum(1 for d in self.tree.depths if d <= depth)  # nodes are sorted by depth
        if depth == 0:
            return Tree(torch.tensor([root]), [-1])
        logits = self.heads.draft_logits(self.hidden, depth, self.vocabulary)  # [depth, V]
        candidates = [torch.topk(logits[d], self.tree.top_k(d + 1)).indices for d in range(depth)]
        tokens = [root] + [int(candidates[self.tree.depths[n] - 1][self.tree.ranks[n]]) for n in range(1, count)]
        return Tree(torch.tensor(tokens), self.tree.parents[:count])

    def advance(self, tree, acceptance, verified) -> None:
        self.hidden = verified.hidden[acceptance.path[-1]]

    def _accept(self, tree, logits):
        if self.acceptance == "typical" and not self.sampling.greedy:
            return typical_accept(tree, logits_to_probs(logits, self.sampling), *self.typical)
        return super()._accept(tree, logits)


@register("medusa", params={
    "tree": one_of("auto", *NAMED_TREES) | paths(), "acceptance": one_of(*ACCEPTANCE),
    "typical_epsilon": number(0, 1), "typical_delta": number(0), "head": null() | mapping(), "draft_vocab": DRAFT_VOCAB})
def build(target, params: dict, context: BuildContext) -> MedusaDecoder:
    heads = load_medusa_heads(head_spec(params, context, "medusa"), context.target_model)
    # auto: Medusa's tree (listed by estimated acceptance) cut to the machine's verify budget
    tree, sizing = context.static_tree(params, target, "medusa_mc_sim_7b_63", max_depth=len(heads))
    decoder = MedusaDecoder(target, heads, tree,
                            acceptance=params.get("acceptance", "exact"),
                            typical_epsilon=float(params.get("typical_epsilon", 0.09)),
                            typical_delta=float(params.get("typical_delta", 0.3)),
                            vocabulary=context.draft_vocabulary(params))
    decoder.sizing = sizing
    return decoder
