"""Medusa (FasterDecoding/Medusa): heads on the target's last hidden state propose a static tree.

Head d-1 ranks candidates for depth d; the node for path [i, j, ...] carries the i-th candidate of
head 0, the j-th of head 1, and so on (the same candidates under every parent, as in Medusa).
Verification is exact (greedy, or recursive rejection sampling over the tree, which preserves the
target distribution) unless `acceptance: typical`, Medusa's lossy typical acceptance, is chosen;
results then mark the run lossy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BuildContext, register
from .engine.acceptance import typical_accept
from .engine.sampling import logits_to_probs
from .engine.static_trees import NAMED_TREES, StaticTree, template_tokens
from .engine.tree import Tree
from .engine.vocab import draft_vocab_setting
from .loop import DraftVerifyDecoder
from .models.heads.medusa import MedusaHeads, load_medusa_heads
from .models.heads.source import head_setting, head_spec
from .settings.params import Settings, number, one_of, paths, setting
from .settings.sizing import Sizing

ACCEPTANCE = ("exact", "typical")


@dataclass(frozen=True)
class MedusaSettings(Settings):
    """Medusa: heads on the target's last hidden state propose a static tree, verified in one forward."""

    paper = "Cai et al. 2024 (FasterDecoding/Medusa)"
    batchable = True  # the heads' input (the last accepted hidden state) is in each sequence's DecodeState
    draft_kind = "medusa"
    lossless = "yes (not `acceptance=typical`)"
    size_setting, size_recorded, size_label = "tree", "tree_nodes", "tree size (nodes)"
    size_derived = ("tree_depth",)

    tree: str | list = setting(
        "auto",
        one_of("auto", *NAMED_TREES) | paths(),
        "auto = Medusa's mc_sim_7b_63 (listed by estimated acceptance) cut to what this machine "
        "verifies nearly free; medusa_mc_sim_7b_63 (whole); or a list of paths, e.g. [[0], [1], [0, 0]]",
    )
    draft_vocab: int | str = draft_vocab_setting()
    acceptance: str = setting("exact", one_of(*ACCEPTANCE),
                              "exact (greedy / lossless sampling) | typical (Medusa's, LOSSY: marked in results)")
    typical_epsilon: float = setting(0.09, number(0, 1), "typical acceptance's epsilon (Medusa's)")
    typical_delta: float = setting(0.3, number(0), "typical acceptance's delta (Medusa's)")
    head: dict | None = head_setting("medusa")


class MedusaDecoder(DraftVerifyDecoder):
    name = "medusa"

    def __init__(self, target, heads: MedusaHeads, tree: StaticTree, acceptance: str = MedusaSettings.acceptance,
                 typical_epsilon: float = MedusaSettings.typical_epsilon,
                 typical_delta: float = MedusaSettings.typical_delta,
                 vocabulary=None, sizing: Sizing | None = None):
        """`sizing`: how the tree was sized (its rule for a batch: `Sizing.cut`); None: the tree as given."""
        super().__init__(target, sizing or Sizing.fixed(len(tree) - 1))
        self.vocabulary = vocabulary
        target.cover(heads, *([vocabulary.head(heads[0][-1].weight)] if vocabulary else []))
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"unknown medusa acceptance {acceptance!r}; valid: {', '.join(ACCEPTANCE)}")
        if tree.max_depth > len(heads):
            raise ValueError(f"tree of depth {tree.max_depth} needs {tree.max_depth} Medusa heads; these weights have "
                             f"{len(heads)}")
        self.heads, self.tree = heads, tree
        self.acceptance = acceptance
        self.lossless = acceptance == "exact"
        self.typical = (typical_epsilon, typical_delta)

    def describe(self):
        return {**super().describe(), "lossless": self.lossless, "acceptance": self.acceptance,
                "tree_nodes": len(self.tree), "tree_depth": self.tree.max_depth, "heads": len(self.heads),
                "draft_vocab": len(self.vocabulary) if self.vocabulary else None}

    def start(self, state, prefill) -> None:
        state.values["hidden"] = prefill.hidden[-1]  # the last accepted token's: the heads' input

    @torch.inference_mode()
    def propose(self, state, root: int, budget: int) -> Tree:
        tree = self.tree.cut(state.cut)
        depth = min(tree.max_depth, budget)
        count = sum(1 for d in tree.depths if d <= depth)  # nodes are sorted by depth
        if depth == 0:
            return Tree.root(root)
        logits = self.heads.draft_logits(state.values["hidden"], depth, self.vocabulary)  # [depth, V]
        candidates = [torch.topk(logits[d], tree.top_k(d + 1)).indices for d in range(depth)]
        return Tree(template_tokens(root, candidates, tree, count), tree.parents[:count])

    def advance(self, state, tree, acceptance, verified) -> None:
        state.values["hidden"] = verified.hidden[acceptance.path[-1]]

    def accept(self, state, tree, logits, extra=None):
        if self.acceptance == "typical" and not state.sampling.greedy:
            return typical_accept(tree, logits_to_probs(logits, state.sampling), *self.typical, logits=logits)
        return super().accept(state, tree, logits, extra)


@register("medusa", settings=MedusaSettings)
def build(target, settings: MedusaSettings, context: BuildContext) -> MedusaDecoder:
    params = {"name": "medusa", **settings.to_dict()}
    heads = load_medusa_heads(head_spec(params, context, "medusa"), context.target_model)
    # auto: Medusa's tree (listed by estimated acceptance) cut to the machine's verify budget
    tree, sizing = context.static_tree(params, target, "medusa_mc_sim_7b_63", max_depth=len(heads))
    decoder = MedusaDecoder(target, heads, tree, acceptance=settings.acceptance,
                            typical_epsilon=float(settings.typical_epsilon),
                            typical_delta=float(settings.typical_delta),
                            vocabulary=context.draft_vocabulary(params), sizing=sizing)
    return decoder
