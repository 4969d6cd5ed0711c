"""Static draft trees, given as lists of paths.

A path `[i, j, k]` is the node reached by taking the i-th ranked candidate at depth 1, then the
j-th at depth 2, then the k-th at depth 3 (ranks are 0-based top-k positions). Every prefix of a
path must be in the list. The built-in trees are the published ones, verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

import torch

from .tree import ancestor_matrix

# FasterDecoding/Medusa, medusa/model/medusa_choices.py: 63 nodes, 10/28/23/2 per depth.
MEDUSA_MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
    [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
    [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
    [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1],
    [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]

# SafeAILab/EAGLE, eagle/model/choices.py (EAGLE's own, not Medusa's): 25 nodes, 4/8/8/3/2.
EAGLE_MC_SIM_7B_63 = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]

# zankner/Hydra, hydra/model/hydra_choices.py: `mc_sim_7b_63` (upstream's default, the same paths as
# Medusa's, in the same order) and `single` (one head, one candidate).
HYDRA_MC_SIM_7B_63 = MEDUSA_MC_SIM_7B_63
HYDRA_SINGLE = [[0]]

NAMED_TREES = {"medusa_mc_sim_7b_63": MEDUSA_MC_SIM_7B_63, "eagle_mc_sim_7b_63": EAGLE_MC_SIM_7B_63,
               "hydra_mc_sim_7b_63": HYDRA_MC_SIM_7B_63, "hydra_single": HYDRA_SINGLE}


@dataclass(frozen=True)
class StaticTree:
    """A tree template: node 0 is the root; node n > 0 is `paths[n - 1]` in depth-then-rank order."""

    paths: tuple[tuple[int, ...], ...]
    # the paths in the order they were given (a published tree's: by estimated acceptance), for `cut`
    order: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def build(cls, spec: str | Sequence[Sequence[int]], nodes: int | None = None) -> "StaticTree":
        """A named tree or a list of paths; with `nodes`, only the first `nodes` paths in the list's
        own order (the published trees list nodes by estimated acceptance or by depth, so a prefix
        is the best smaller tree of the same shape)."""
        if isinstance(spec, str):
            if spec not in NAMED_TREES:
                raise ValueError(f"unknown tree {spec!r}; valid: {', '.join(sorted(NAMED_TREES))} or a list of paths")
            spec = NAMED_TREES[spec]
        if nodes is not None:
            spec = list(spec)[:max(1, nodes)]
        order = tuple(dict.fromkeys(tuple(int(i) for i in p) for p in spec))
        paths = sorted(order, key=lambda p: (len(p), p))
        if not paths:
            raise ValueError("a static tree needs at least one path")
        known = set(paths)
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"invalid tree path {list(path)}: ranks must be >= 0")
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"tree path {list(path)} has no parent {list(path[:-1])} in the tree")
        return cls(tuple(paths), order)

    def cut(self, nodes: int | None) -> "StaticTree":
        """The tree of its first `nodes` paths in the order it was given (a batch's cut, `Sizing.cut`:
        the best smaller tree of the same shape); itself when `nodes` is None or it has no more."""
        if nodes is None or nodes >= len(self.paths):
            return self
        return first_paths(self, nodes)

    @cached_property
    def parents(self) -> list[int]:
        index = {path: node for node, path in enumerate(self.paths, start=1)}
        return [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in self.paths]

    @cached_property
    def ranks(self) -> list[int]:
        return [-1] + [p[-1] for p in self.paths]

    @cached_property
    def depths(self) -> list[int]:
        return [0] + [len(p) for p in self.paths]

    @property
    def max_depth(self) -> int:
        return len(self.paths[-1])

    def top_k(self, depth: int | None = None) -> int:
        """Candidates needed per parent (at one depth, or anywhere)."""
        ranks = [p[-1] for p in self.paths if depth is None or len(p) == depth]
        return max(ranks) + 1 if ranks else 0

    @cached_property
    def ancestors(self) -> torch.Tensor:
        return ancestor_matrix(self.parents)

    def __len__(self) -> int:
        return len(self.paths) + 1


def template_tokens(root: int, candidates: Sequence[torch.Tensor], tree: StaticTree, count: int) -> torch.Tensor:
    """Medusa's tree (every parent at depth d gets the same children): node n > 0 is the
    `ranks[n]`-th of `candidates[depths[n] - 1]` (each a head's top-k, on its device). The first
    `count` nodes' tokens, gathered on that device: nothing is read back to the host."""
    device = candidates[0].device
    flat = torch.cat([torch.as_tensor([root], device=device), *candidates])
    offsets = [1]
    for c in candidates:
        offsets.append(offsets[-1] + len(c))
    index = [0] + [offsets[tree.depths[n] - 1] + tree.ranks[n] for n in range(1, count)]
    return flat[index]


@lru_cache(maxsize=64)
def first_paths(tree: StaticTree, nodes: int) -> StaticTree:
    """`StaticTree.cut`, made once per tree and size (every step of a batch asks)."""
    return StaticTree.build(tree.order or tree.paths, nodes)
