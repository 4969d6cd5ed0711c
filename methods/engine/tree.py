"""Token trees: what a drafter proposes and the target verifies in one forward.

A tree is given by its tokens and the parent index of each node, in topological order
(`parents[0] == -1` is the root, every other parent index is smaller than its child's). The root
is the last emitted token, not yet in the target's KV cache; every other node is a draft token. A
chain (SpS) is the tree with `parents == [-1, 0, 1, 2, ...]`; AR is the root alone.

From the parents follow, once per tree: the depth of each node (its position offset), the
ancestors-and-self attention mask, the children of each node, and the root-to-leaf paths.

A tree may carry `extra_rows`: inputs of the same verify forward that are not candidates (Lookahead
decoding's window of Jacobi guesses). They follow the tree nodes in the forward, with their own
positions and visibility; their logits come back after the nodes' and are never accepted, and
since `commit` keeps only accepted nodes their KV is dropped. Tree nodes never see them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch


@dataclass
class Tree:
    tokens: torch.Tensor  # [N] long, node 0 = root
    parents: Sequence[int]  # [N], parents[0] == -1
    # Distribution the children of each node were sampled from, when the drafter sampled them:
    # [N, V] fp32 rows (rows of leaves are unused). None for deterministic drafts (greedy / top-k).
    draft_probs: torch.Tensor | None = None
    # Whether the children of a node were drawn without replacement (MCSD variant).
    without_replacement: bool = False
    extras: dict = field(default_factory=dict)  # drafter-specific data (e.g. EAGLE features)
    extra_rows: "ExtraRows | None" = None  # non-candidate inputs of the verify forward (Lookahead's window)

    def __post_init__(self):
        parents = list(self.parents)
        if not parents or parents[0] != -1:
            raise ValueError("tree root must have parent -1")
        for node, parent in enumerate(parents[1:], start=1):
            if not 0 <= parent < node:
                raise ValueError(f"node {node} has parent {parent}: parents must precede their children")
        if self.tokens.numel() != len(parents):
            raise ValueError(f"{self.tokens.numel()} tokens for {len(parents)} parents")
        self.parents = parents
        if self.extra_rows is not None:
            self.extra_rows.check(len(parents))

    @classmethod
    def root(cls, token: int) -> "Tree":
        """The root alone: a step that drafts nothing verifies (and commits) one token."""
        return cls(torch.tensor([token]), [-1])

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> "Tree":
        return cls(tokens, [-1] + list(range(tokens.numel() - 1)), draft_probs)

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    @cached_property
    def depths(self) -> list[int]:
        depths = [0] * len(self.parents)
        for node, parent in enumerate(self.parents[1:], start=1):
            depths[node] = depths[parent] + 1
        return depths

    @cached_property
    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents[1:], start=1):
            children[parent].append(node)
        return children

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
        return ancestor_matrix(self.parents)

    @cached_property
    def parent_rows(self) -> torch.Tensor:
        """[N] long: each node's parent, the root's taken as itself (row 0), for gathering the
        parents' rows of a per-node tensor on its device."""
        return torch.tensor([0] + self.parents[1:])

    @cached_property
    def earlier_siblings(self) -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True when j < i and j has i's parent (greedy acceptance
        takes the first matching child)."""
        return earlier_siblings(torch.tensor(self.parents))

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths."""
        result = []
        for leaf, kids in enumerate(self.children):
            if not kids:
                path = [leaf]
                while self.parents[path[-1]] != -1:
                    path.append(self.parents[path[-1]])
                result.append(path[::-1])
        return result

    def path_to(self, node: int) -> list[int]:
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def forward_rows(self) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """What one verify forward feeds: tokens, position offsets from the root and the [T, T] bool
        visibility (self included) of the tree nodes followed by the extra rows, if any."""
        if self.extra_rows is None:
            return self.tokens, self.depths, self.ancestors
        extra, n = self.extra_rows, len(self)
        visible = torch.zeros(n + len(extra), n + len(extra), dtype=torch.bool)
        visible[:n, :n] = self.ancestors
        visible[n:] = extra.visible
        return torch.cat([self.tokens, extra.tokens]), self.depths + list(extra.depths), visible


class DeviceTree(Tree):
    """A tree whose structure lives on a device with its tokens (EAGLE-2's reranked tree): each
    node's parent row (the root's: itself) and depth as [N] long tensors there, and what the
    verification and greedy acceptance need built there too (the ancestors-and-self matrix, the
    earlier siblings, which nodes have children), so that drafting, verifying and accepting it
    reads nothing back but the acceptance's one read. The host structure (`parents`, `depths`,
    `children`, paths) is read from the device once, the first time something asks for it (the
    sampled rule walks it on the host side; tests inspect it)."""

    def __init__(self, tokens: torch.Tensor, parent_rows: torch.Tensor, depths: torch.Tensor, height: int):
        """`height`: a host-side bound on the depths (the drafter knows how deep it drafted)."""
        if not tokens.numel() == parent_rows.numel() == depths.numel():
            raise ValueError(f"{tokens.numel()} tokens, {parent_rows.numel()} parents, {depths.numel()} depths")
        self.tokens, self.node_depths, self.height = tokens, depths, height
        self.__dict__["parent_rows"] = parent_rows
        self.draft_probs, self.without_replacement, self.extras, self.extra_rows = None, False, {}, None

    def __len__(self) -> int:
        return self.tokens.numel()

    @cached_property
    def parents(self) -> list[int]:  # type: ignore[override]
        """The host structure: one read of the parent rows."""
        return [-1] + self.parent_rows[1:].tolist()

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool on the device: a node's row is itself plus its parent's row, `height` times."""
        n, rows = len(self), self.parent_rows
        eye = torch.eye(n, dtype=torch.bool, device=rows.device)
        matrix = eye
        for _ in range(self.height):
            matrix = eye | matrix.index_select(0, rows)
        return matrix

    @cached_property
    def earlier_siblings(self) -> torch.Tensor:
        rows = self.parent_rows
        return earlier_siblings(torch.cat([rows.new_full((1,), -1), rows[1:]]))  # the root's parent: none

    @cached_property
    def has_children(self) -> torch.Tensor:
        """[N] bool on the device: whether each node has a child."""
        rows = self.parent_rows
        return torch.zeros(len(self), dtype=torch.bool, device=rows.device).index_fill_(0, rows[1:], True)

    def forward_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens, self.node_depths, self.ancestors


@dataclass
class ExtraRows:
    """Inputs a drafter adds to the verify forward besides its candidates (a Lookahead window):
    row i holds `tokens[i]` at position prefix + `depths[i]` and attends to the prefix and to the
    forward's rows j (tree nodes first, then extra rows) where `visible[i, j]` (itself included)."""

    tokens: torch.Tensor  # [M] long
    depths: Sequence[int]  # [M] position offsets from the root
    visible: torch.Tensor  # [M, N + M] bool over the tree's N nodes and these M rows

    def __len__(self) -> int:
        return self.tokens.numel()

    def check(self, nodes: int) -> None:
        m = len(self)
        if len(self.depths) != m or tuple(self.visible.shape) != (m, nodes + m):
            raise ValueError(f"extra rows: {m} tokens, {len(self.depths)} depths, visibility "
                             f"{tuple(self.visible.shape)}; "
                             f"expected [{m}, {nodes + m}] for a tree of {nodes} nodes")
        if not bool(self.visible[:, nodes:].diagonal().all()):
            raise ValueError("extra rows must see themselves")


def earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool on the parents' device, from each node's parent [N] (the root's: -1): entry
    (i, j) is True when j < i and j has i's parent."""
    n = parents.numel()
    return (parents[:, None] == parents[None, :]) & torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)


def ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    n = len(parents)
    matrix = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):
        matrix[node] |= matrix[parents[node]]
    return matrix


def attention_mask(ancestors: torch.Tensor, prefix_length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Float 4D mask `[1, 1, N, prefix_length + N]`: 0 where a node may attend (the whole prefix,
    its ancestors and itself), the dtype's minimum elsewhere. A bool mask would be silently wrong
    under eager attention in transformers 5."""
    n = ancestors.shape[0]
    mask = torch.zeros(1, 1, n, prefix_length + n, dtype=dtype, device=device)
    mask[0, 0, :, prefix_length:].masked_fill_(~ancestors.to(device), torch.finfo(dtype).min)
    return mask


def batch_mask(lengths: torch.Tensor, slots: int, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float mask [B, 1, n, slots + m] for B sequences' new rows over a batch cache
    (`kv_cache.BatchKVCache`): row i of sequence b sees, among the first `slots` slots, b's own
    committed ones (those below `lengths[b]`; the others hold other sequences' rows or padding), and
    the m columns after them as `visible` [B, n, m] says; the dtype's minimum elsewhere."""
    batch, n, _ = visible.shape
    prefix = torch.arange(slots, device=visible.device)[None, :] < lengths[:, None]  # [B, slots]
    seen = torch.cat([prefix[:, None, :].expand(batch, n, slots), visible], -1)
    mask = torch.zeros(batch, 1, n, seen.shape[-1], dtype=dtype, device=visible.device)
    return mask.masked_fill_(~seen[:, None], torch.finfo(dtype).min)


def level_mask(prefix_length: int, drafted: int, visible: Sequence[Sequence[int]] | torch.Tensor, dtype,
               device) -> torch.Tensor:
    """Mask for feeding one level of a draft tree into a drafter's cache, which holds
    `prefix_length` committed entries and then `drafted` entries of this tree's earlier levels.
    New node i sees the prefix, the earlier-level slots in `visible[i]` (its ancestors) and itself.
    `visible` as a bool tensor [n, drafted] (on the drafter's device): built there, nothing read back."""
    n = len(visible)
    if isinstance(visible, torch.Tensor):
        if tuple(visible.shape) != (n, drafted):
            raise ValueError(f"level visibility {tuple(visible.shape)}; expected [{n}, {drafted}]")
        allowed = torch.cat([visible.to(device, torch.bool), torch.eye(n, dtype=torch.bool, device=device)], 1)
    else:
        allowed = torch.zeros(n, drafted + n, dtype=torch.bool)
        for i, slots in enumerate(visible):
            allowed[i, list(slots)] = True
            allowed[i, drafted + i] = True
    mask = torch.zeros(1, 1, n, prefix_length + drafted + n, dtype=dtype, device=device)
    mask[0, 0, :, prefix_length:].masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask


def ancestors_of(parents: Sequence[int], node: int, stop_at: int = 0) -> list[int]:
    """Ancestors of `node`, nearest first, excluding `stop_at`: the root (0) for trees, or -1 for
    candidate lists whose top nodes have parent -1."""
    result = []
    node = parents[node]
    while node != stop_at and node != -1:
        result.append(node)
        node = parents[node]
    return result
