"""Token Recycling (Luo et al. 2024, arXiv 2408.08696, ACL 2025; Luowaterbi/TokenRecycling
`evaluation/inference_recycling.py`, `model/recycling/tree_template_.py`; the same code in Spec-Bench).

An adjacency matrix keeps, for every token of the vocabulary, the top-k tokens the target predicted
after it (k = 8): after every target forward, each forwarded token's row becomes the top-k of the
target's logits at that token (all tree nodes, accepted or not: the "trash" is recycled; a token
forwarded twice keeps its last node's). A draft is read off the matrix by BFS over a static tree
template: the node for path [i, j, ...] holds entry i of the root's row, then entry j of that
token's row, and so on (upstream's template "2.2.2": 80 nodes, depth 6). Verification is the
engine's: greedy match or rejection sampling with the draft as point masses (lossless; upstream
runs greedy only). The prefill's last-token logits fill that token's row as upstream's first tree
forward does.

The matrix starts as zeros (upstream) and PERSISTS ACROSS PROMPTS (upstream keeps one matrix for
the whole benchmark run, its warm-up included): `persist: false` resets it for every prompt, and
`reset()` clears it. Results record `adjacency_persists` and, per prompt, the rows filled before it
and after it (in the matrix it drafted from).

In a batch (`methods/batched.py`) each answer drafts from its own copy of the matrix as it stood when
the answer started, so no answer sees another's updates mid-answer (its drafts, and a seeded sampled
answer, are the same at any batch size); when it finishes, the rows it wrote are merged into the
shared matrix (a row two answers wrote keeps the one that finished last; at the same step, the later
of the batch). Alone this is upstream's one matrix. The copy costs one device copy of the matrix per
answer, (vocab + 1) x k int64 (9.7 MB for a 152k vocabulary at k = 8), and that much memory per
sequence of the batch.

Defaults: k = 8 (`--output-id-topk 8`, `topk(k=8)`), tree "2.2.2" (`--tree_version 2.2.2`).
`tree: auto` keeps the template's first nodes (its own, level-by-level order) up to what this
machine verifies nearly free (settings/sizing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BuildContext, register
from .engine.static_trees import StaticTree
from .engine.tree import Tree
from .loop import DraftVerifyDecoder
from .settings.params import BOOL, Settings, integer, one_of, paths, setting
from .settings.sizing import Sizing

# Luowaterbi/TokenRecycling, model/recycling/tree_template_.py, version "2.2.2" (verbatim): 80 nodes,
# 8/21/25/15/8/3 per depth.
TEMPLATE_2_2_2 = [
    [0], [1], [2], [3], [4], [5], [6], [7],
    [0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7], [1, 0], [1, 1], [1, 2], [1, 3], [2, 0], [2, 1],
    [2, 2], [3, 0], [3, 1], [4, 0], [5, 0], [6, 0], [7, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 0, 4], [0, 0, 5], [0, 0, 6], [0, 0, 7], [0, 1, 0], [0, 1, 1],
    [0, 1, 2], [0, 2, 0], [0, 2, 1], [0, 3, 0], [0, 4, 0], [0, 5, 0], [0, 6, 0], [0, 7, 0], [1, 0, 0], [1, 0, 1],
    [1, 1, 0], [2, 0, 0], [3, 0, 0], [4, 0, 0], [5, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 2, 0],
    [0, 0, 3, 0], [0, 0, 4, 0], [0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0],
    [0, 1, 0, 0, 0], [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0],
]
TEMPLATES = {"2.2.2": TEMPLATE_2_2_2}


@dataclass(frozen=True)
class RecyclingSettings(Settings):
    """Token Recycling: an adjacency matrix keeps each token's top-k successors from the target's own
    logits (every forwarded token, refreshed after every forward); drafts are read off it by BFS
    over upstream's static tree template. The matrix PERSISTS ACROSS PROMPTS, as upstream's."""

    paper = "Luo et al. 2024 (Luowaterbi/TokenRecycling)"
    size_setting, size_recorded, size_label = "tree", "tree_nodes", "tree size (nodes)"
    size_derived = ("tree_depth",)

    tree: str | list = setting("2.2.2", one_of("auto", *TEMPLATES) | paths(),
                               "upstream's template (80 nodes, depth 6); auto = its first nodes up to this machine's "
                               "verify budget; or a list of paths, e.g. [[0], [1], [0, 0]]")
    top_k: int = setting(8, integer(1), "successors kept per token (upstream's --output-id-topk 8)")
    persist: bool = setting(True, BOOL, "false = a fresh (zero) matrix for every prompt")

    batchable = True  # each answer drafts from its own copy of the matrix, merged back when it finishes


class TokenRecyclingDecoder(DraftVerifyDecoder):
    name = "recycling"

    def __init__(self, target, tree: StaticTree, top_k: int = RecyclingSettings.top_k,
                 persist: bool = RecyclingSettings.persist, sizing: Sizing | None = None):
        """`sizing`: how the tree was sized (its rule for a batch: `Sizing.cut`); None: the tree as given."""
        super().__init__(target, sizing or Sizing.fixed(len(tree) - 1))
        if tree.top_k() > top_k:
            raise ValueError(f"tree template uses successor rank {tree.top_k() - 1}; the matrix keeps top_k={top_k}")
        if top_k > target.vocab_size:
            raise ValueError(f"recycling top_k={top_k} exceeds the vocabulary ({target.vocab_size} tokens)")
        self.tree, self.top_k, self.persist = tree, top_k, persist
        self.layouts: dict[StaticTree, tuple] = {}  # a template's parents, ranks and levels on the device
        self.reset()

    def layout(self, tree: StaticTree) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The template's nodes' parents and successor ranks, and its nodes by depth, on the target's
        device; made once per template (the tree, and a batch's cut of it)."""
        if tree not in self.layouts:
            device = self.target.device
            self.layouts[tree] = (
                torch.tensor(tree.parents[1:], dtype=torch.long, device=device),
                torch.tensor(tree.ranks[1:], dtype=torch.long, device=device),
                [torch.tensor([n for n in range(1, len(tree)) if tree.depths[n] == d], device=device)
                 for d in range(1, tree.max_depth + 1)])
        return self.layouts[tree]

    def reset(self) -> None:
        """Forget every recycled successor: the matrix of zeros upstream starts from. It lives on the
        target's device (drafting and recycling read nothing back); its extra last row takes the
        writes that a later occurrence of the same token overrides."""
        self.adjacency, self.filled = self._zeros()

    def _zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        vocab, device = self.target.vocab_size, self.target.device
        return (torch.zeros(vocab + 1, self.top_k, dtype=torch.long, device=device),
                torch.zeros(vocab + 1, dtype=torch.bool, device=device))

    def describe(self):
        return {**super().describe(), "tree_nodes": len(self.tree), "tree_depth": self.tree.max_depth,
                "top_k": self.top_k, "adjacency_persists": self.persist}

    def recycle(self, matrix: dict, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Row of each token <- the top-k after it; for a repeated token the last node's wins (the
        earlier occurrences write the spare last row instead): on the device, no read back.
        `matrix`: the answer's copy (`adjacency`, `filled`) and the rows it wrote (`written`)."""
        adjacency = matrix["adjacency"]
        tokens = tokens.to(adjacency.device)
        successors = torch.topk(logits, self.top_k, dim=-1).indices
        same = tokens[:, None] == tokens[None, :]
        overridden = torch.triu(same, diagonal=1).any(dim=1)  # a later node holds the same token
        rows = torch.where(overridden, adjacency.shape[0] - 1, tokens)
        adjacency[rows] = successors
        matrix["filled"][rows] = True
        matrix["written"][rows] = True

    def answer_matrix(self) -> dict[str, torch.Tensor]:
        """The matrix an answer drafts from: a copy of the shared one as it stands now (zeros when the
        matrix does not persist), and the rows the answer wrote (none yet)."""
        adjacency, filled = (self.adjacency.clone(), self.filled.clone()) if self.persist else self._zeros()
        return {"adjacency": adjacency, "filled": filled, "written": torch.zeros_like(filled)}

    def start(self, state, prefill) -> None:
        matrix = state.values["matrix"] = self.answer_matrix()
        state.values["rows_before"] = int(matrix["filled"][:-1].sum())  # once per answer, for its statistics
        self.recycle(matrix, torch.tensor(state.prompt[-1:]), prefill.logits[-1:])

    def propose(self, state, root: int, budget: int) -> Tree:
        adjacency = state.values["matrix"]["adjacency"]
        tree = self.tree.cut(state.cut)
        parents, ranks, levels = self.layout(tree)
        depth = min(tree.max_depth, budget)
        count = 1 + sum(len(level) for level in levels[:depth])  # nodes are sorted by depth
        tokens = torch.empty(count, dtype=torch.long, device=adjacency.device)
        tokens[0] = root
        for nodes in levels[:depth]:  # BFS: one gather per depth
            tokens[nodes] = adjacency[tokens[parents[nodes - 1]], ranks[nodes - 1]]
        return Tree(tokens, tree.parents[:count])

    def advance(self, state, tree, acceptance, verified) -> None:
        self.recycle(state.values["matrix"], tree.tokens, verified.logits)

    def finish(self, state) -> None:
        """The rows the answer wrote merged into the shared matrix (the next answers start from it)."""
        matrix = state.values.get("matrix")
        if matrix is None:
            return
        if not self.persist:
            self.reset()
        written = matrix["written"]
        self.adjacency = torch.where(written[:, None], matrix["adjacency"], self.adjacency)
        self.filled |= written
        state.stats.extra.update({"adjacency_persists": self.persist,
                                  "adjacency_rows_before": state.values["rows_before"],
                                  "adjacency_rows_after": int(matrix["filled"][:-1].sum())})


@register("recycling", settings=RecyclingSettings)
def build(target, settings: RecyclingSettings, context: BuildContext) -> TokenRecyclingDecoder:
    choice, sizing = settings.tree, None
    if choice == "auto":  # upstream's template cut, in its own order, to this machine's verify budget
        sizing = context.sizing(target, "tree", "auto", len(TEMPLATE_2_2_2) + 1)
        tree = StaticTree.build(TEMPLATE_2_2_2, nodes=sizing.value - 1)
        sizing = sizing.choose(len(tree) - 1, chosen=f"2.2.2, first {len(tree) - 1} nodes")
    else:
        tree = StaticTree.build(TEMPLATES[choice] if isinstance(choice, str) else choice)
    return TokenRecyclingDecoder(target, tree, top_k=settings.top_k, persist=settings.persist, sizing=sizing)
