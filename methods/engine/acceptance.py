"""Verification rules: which draft nodes the target accepts, and the token it adds after them.

Written once for trees; a chain (SpS) and a root alone (AR) are special trees.

* `greedy_accept`: the longest root-to-node path whose every token equals the target's argmax at
  its parent, plus the target's argmax after it (the bonus). Lossless for greedy decoding.
  `greedy_accept_logits` is the same rule on the logits' device, with the accepted rows' logit
  margins, read back in one transfer (what the shared loop runs: one host read per greedy step).
* `sample_accept`: recursive rejection sampling over the children of the accepted node (SpS for a
  chain; SpecInfer / MCSD multi-candidate for trees). At a node with target distribution p and
  children x_1..x_k drawn from q, try the children in their drawn order: accept x with probability
  min(1, p(x)/q(x)); on rejection p <- norm(max(0, p - q)) and, when the children were drawn
  without replacement, q(x) <- 0, q <- norm(q). When no child is accepted, sample from the current p.
  EAGLE-1 at T > 0 (SafeAILab/EAGLE v1 `evaluate_posterior`) is this rule on children sampled
  from the head without replacement (`methods/eagle/template.py`).
  For deterministic drafts (no q: top-k trees, EAGLE-2) q is the point mass at x, which gives
  EAGLE-2's rule: accept x with probability p(x), else p(x) <- 0 and renormalize.
  This preserves the target's (processed) distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .tree import DeviceTree, Tree


@dataclass
class Acceptance:
    path: list[int]  # accepted node indices, from the root (always node 0)
    next_token: int  # the token the target adds after the path (bonus / correction)
    # when the rule computed them already: the tokens emitted (accepted drafts, then next_token)
    # and each path row's logit margin (chosen token's logit minus the best other's)
    emitted: list[int] | None = None
    margins: list[float] | None = None
    # for a tree with extra rows: each extra row's argmax, read with the rest (Lookahead's window)
    extra_argmax: list[int] | None = None
    # for a tree whose structure stays on the device (`DeviceTree`), read with the rest: its depth
    # and whether each path node has children (the per-position statistics)
    tree_depth: int | None = None
    path_children: list[bool] | None = None

    @property
    def accepted_drafts(self) -> int:
        return len(self.path) - 1


@dataclass
class PendingRead:
    """An acceptance decided on the device and not read yet: `values` [M] float64 there, and how
    their host copy becomes the `Acceptance`. `read()` is the step's one read; `read_together` reads
    a batch's acceptances in one transfer (`methods/loop.py`)."""

    values: torch.Tensor
    parse: Callable[[list[float]], Acceptance]

    def read(self) -> Acceptance:
        return self.parse(self.values.tolist())


def read_together(pending: list[PendingRead]) -> list[Acceptance]:
    """Every pending acceptance with ONE read."""
    values = torch.cat([p.values for p in pending]).tolist()
    out, at = [], 0
    for p in pending:
        n = p.values.numel()
        out.append(p.parse(values[at:at + n]))
        at += n
    return out


def greedy_accept(tree: Tree, target_argmax: list[int]) -> Acceptance:
    """`target_argmax[n]`: the target's greedy token after node n."""
    tokens = tree.tokens.tolist()
    node = 0
    while True:
        choice = target_argmax[node]
        child = next((c for c in tree.children[node] if tokens[c] == choice), None)
        if child is None:
            return Acceptance(tree.path_to(node), choice)
        node = child


def greedy_accept_logits(tree: Tree, logits: torch.Tensor, extra: torch.Tensor | None = None) -> Acceptance:
    """`greedy_accept(tree, logits.argmax(-1))`, computed where the logits [N, V] are: node i is on
    the greedy path when every node from the root to it (itself included) matches its parent's
    argmax and is the first child that does (the rule walks children in order); the accepted nodes
    form one chain. Argmax, path and margins come back in ONE read (`tolist` of a [3, N] tensor),
    with the argmax of each `extra` row [M, V] (a tree's extra rows) when given, and for a
    `DeviceTree` its depth and which nodes have children."""
    return greedy_pending(tree, logits, extra).read()


def greedy_pending(tree: Tree, logits: torch.Tensor, extra: torch.Tensor | None = None) -> PendingRead:
    """`greedy_accept_logits`' decision, not read yet: `greedy_batch_pending` for one tree."""
    pending = greedy_batch_pending([tree], logits[None], extra)
    return PendingRead(pending.values, lambda values: pending.parse(values)[0])


def greedy_batch_pending(trees: Sequence[Tree], logits: torch.Tensor,
                         extra: torch.Tensor | None = None) -> PendingRead:
    """The greedy rule for B trees verified together in one pass over their logits [B, R, V] (tree b
    on its first len(trees[b]) rows; `methods/loop.py`): argmax and top-2 margins over the whole
    batch, then the path rule on the trees' structures padded to R rows (a padding node matches
    nothing and sees only itself), [B, R] tensors throughout; one tensor to read, whose parse gives
    each tree's `Acceptance`. A single tree (B = 1) uses its structures as they are. `extra`: one
    tree's extra rows [M, V] (B = 1 only: Lookahead's window)."""
    batch, rows, vocab = logits.shape
    device = logits.device
    sizes = [len(tree) for tree in trees]
    argmax = logits.argmax(-1)  # [B, R]
    if vocab > 1:
        top = logits.topk(2, dim=-1).values
        margin = (top[..., 0] - top[..., 1]).double()  # a greedy row chose its argmax: its top-2 gap
    else:
        margin = torch.full((batch, rows), float("inf"), dtype=torch.float64, device=device)
    if rows == 1:
        on_path = torch.ones(batch, 1, dtype=torch.bool, device=device)
    else:
        tokens, parents, ancestors, earlier = _padded_structures(trees, rows, device)
        match = tokens == argmax.gather(1, parents)
        match[:, 0] = True
        first = match & ~(earlier & match[:, None, :]).any(-1)
        on_path = ~(ancestors & ~first[:, None, :]).any(-1)
    parts = [on_path.double(), argmax.double(), margin]
    shaped = [isinstance(tree, DeviceTree) for tree in trees]
    if any(shaped):  # a tree kept on the device: which nodes have children, and its depth
        children = torch.zeros(batch, rows, dtype=torch.bool, device=device)
        depths = torch.zeros(batch, rows, dtype=torch.long, device=device)
        for b, tree in enumerate(trees):
            if shaped[b]:
                children[b, : sizes[b]] = tree.has_children
                depths[b, 0] = tree.node_depths.max()
        parts += [children.double(), depths.double()]
    values = torch.stack(parts, 1).flatten()  # [B · parts · R]
    if extra is not None:
        values = torch.cat([values, extra.argmax(-1).double()])
    stride = len(parts) * rows

    def parse(host: list[float]) -> list[Acceptance]:
        out = []
        for b, n in enumerate(sizes):
            row = host[b * stride: (b + 1) * stride]
            accepted, chosen, margins = row[:n], row[rows: rows + n], row[2 * rows: 2 * rows + n]
            path = [node for node in range(n) if accepted[node]]
            emitted = [int(chosen[node]) for node in path]  # the row of each path node chose the token after it
            acceptance = Acceptance(path, emitted[-1], emitted, [margins[node] for node in path],
                                    None if extra is None else [int(v) for v in host[batch * stride:]])
            if shaped[b]:
                acceptance.path_children = [bool(row[3 * rows + node]) for node in path]
                acceptance.tree_depth = int(row[4 * rows])
            out.append(acceptance)
        return out

    return PendingRead(values, parse)


def _padded_structures(trees: Sequence[Tree], rows: int, device) -> tuple[torch.Tensor, ...]:
    """The trees' tokens, parent rows, ancestor and earlier-sibling matrices as [B, R] / [B, R, R]
    tensors on `device`; a tree of R nodes alone uses its own (no copy)."""
    if len(trees) == 1 and len(trees[0]) == rows:
        tree = trees[0]
        return tuple(t.to(device)[None] for t in (tree.tokens, tree.parent_rows, tree.ancestors, tree.earlier_siblings))
    batch = len(trees)
    tokens = torch.full((batch, rows), -1, dtype=torch.long, device=device)
    parents = torch.zeros(batch, rows, dtype=torch.long, device=device)
    ancestors = torch.eye(rows, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    earlier = torch.zeros(batch, rows, rows, dtype=torch.bool, device=device)
    for b, tree in enumerate(trees):
        n = len(tree)
        tokens[b, :n] = tree.tokens
        parents[b, :n] = tree.parent_rows
        ancestors[b, :n, :n] = tree.ancestors
        earlier[b, :n, :n] = tree.earlier_siblings
    return tokens, parents, ancestors, earlier


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after a rejection. Where nothing is left (only
    through rounding when p == q: rejection then has probability 0), p itself; decided on p's
    device, without a read."""
    residual = (p - q).clamp_min_(0)
    total = residual.sum(-1, keepdim=True)
    usable = torch.isfinite(total) & (total > 1e-12)
    return torch.where(usable, residual / torch.where(usable, total, torch.ones_like(total)), p)


def chosen_margins(rows: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per logits row [n, V] and the token it chose [n] (on the rows' device): the chosen token's
    logit minus the best other token's, fp64, without a read. A row that chose its argmax gets its
    top-2 gap; a negative value means the row preferred another token by that much."""
    if rows.shape[-1] < 2:
        return torch.full(chosen.shape, float("inf"), dtype=torch.float64, device=rows.device)
    top = rows.topk(2, dim=-1)
    picked = rows.gather(-1, chosen[:, None])[:, 0]
    other = torch.where(top.indices[:, 0] == chosen, top.values[:, 1], top.values[:, 0])
    return (picked - other).float().double()


# (p, q) -> the residual distribution, row by row over the last dimension ([V] or [n, V])
ResidualFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sample_accept(
    tree: Tree,
    target_probs: torch.Tensor,  # [N, V] fp32, the processed target distribution after each node
    generator: torch.Generator | None,
    residual: ResidualFn = residual_distribution,
    logits: torch.Tensor | None = None,  # [N, V]: the path rows' margins come back in the same read
    extra: torch.Tensor | None = None,  # [M, V]: a tree's extra rows, whose argmax comes back too
) -> Acceptance:
    return sample_pending(tree, target_probs, generator, residual, logits, extra).read()


def sample_pending(tree: Tree, target_probs: torch.Tensor, generator: torch.Generator | None,
                   residual: ResidualFn = residual_distribution, logits: torch.Tensor | None = None,
                   extra: torch.Tensor | None = None) -> PendingRead:
    """`sample_accept`'s decision, not read yet (its draws are made: the generator has moved)."""
    if tree.is_chain:
        return _sample_accept_chain(tree, target_probs, generator, residual, logits, extra)
    n, device = len(tree), target_probs.device
    width = max(len(kids) for kids in tree.children)
    draws = torch.rand(n, width, generator=generator, device=generator.device if generator is not None else device)
    on_path, end, final = tree_decisions(tree, target_probs, draws.to(device), residual)
    token = torch.multinomial(final, 1, generator=generator)
    return _read_path(on_path, token, tree.tokens.to(device), logits, tree.parent_rows.to(device), end.view(1), extra)


def _read_path(on_path: torch.Tensor, token: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor | None,
               parents: torch.Tensor, end: torch.Tensor, extra: torch.Tensor | None = None) -> PendingRead:
    """A sampled step's one read: the path [N] bool, the next token [1] and the tree's tokens [N],
    with logits, each node's margin as its parent's choice and the end row's for the token, and
    with extra rows, their argmax."""
    n = len(tokens)
    parts = [on_path.double(), token.double(), tokens.double()]
    if logits is not None:
        parts += [chosen_margins(logits.index_select(0, parents), tokens),
                  chosen_margins(logits.index_select(0, end), token)]
    if extra is not None:
        parts.append(extra.argmax(-1).double())

    def parse(read: list[float]) -> Acceptance:
        path = [node for node in range(n) if read[node]]
        emitted = [int(read[n + 1 + node]) for node in path[1:]] + [int(read[n])]
        margins = None if logits is None else [read[2 * n + 1 + node] for node in path[1:]] + [read[3 * n + 1]]
        extra_argmax = None if extra is None else [int(v) for v in read[len(read) - len(extra):]]
        return Acceptance(path, emitted[-1], emitted, margins, extra_argmax)

    return PendingRead(torch.cat(parts), parse)


def tree_decisions(tree: Tree, target_probs: torch.Tensor, draws: torch.Tensor,
                   residual: ResidualFn = residual_distribution) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_accept`'s decisions for a whole tree on the probabilities' device, without a read:
    the accepted path as an [N] bool, its last node (0-d) and the [V] distribution the next token
    is drawn from there.
    `draws[node, j]` is the uniform that tests the node's j-th child. Every node's children are
    tested at once, sibling rank by sibling rank (rank j for every node with more than j children):
    the node-by-node walk only ever reads the decisions of the nodes on its path, and a node's
    decisions depend on its own row alone (p after each rejection: the residual; q: zeroed at the
    rejected token when drawn without replacement)."""
    n, device = len(tree), target_probs.device
    inner = [node for node in range(n) if tree.children[node]]
    width = max(len(tree.children[node]) for node in inner)
    row_of = {node: row for row, node in enumerate(inner)}
    tokens, inner_rows = tree.tokens.to(device), torch.tensor(inner, device=device)
    p = target_probs.index_select(0, inner_rows)
    q = None if tree.draft_probs is None else tree.draft_probs.to(device).index_select(0, inner_rows)
    first = torch.full((len(inner),), width, dtype=torch.long, device=device)  # rank of the accepted child
    for rank in range(width):
        nodes = [node for node in inner if len(tree.children[node]) > rank]
        rows = torch.tensor([row_of[node] for node in nodes], device=device)
        kids = torch.tensor([tree.children[node][rank] for node in nodes], device=device)
        x = tokens.index_select(0, kids)[:, None]
        p_rows = p.index_select(0, rows)
        if q is None:  # a deterministic draft: q is the point mass at x
            q_rows = torch.zeros_like(p_rows).scatter_(1, x, 1.0)
        else:
            q_rows = q.index_select(0, rows)
        p_x, q_x = p_rows.gather(1, x)[:, 0], q_rows.gather(1, x)[:, 0]
        u = draws.index_select(0, torch.tensor(nodes, device=device))[:, rank]
        passed = (q_x > 0) & (u * q_x < p_x)  # u < p(x)/q(x), without dividing
        untaken = first.index_select(0, rows) == width
        first.index_copy_(0, rows, torch.where(passed & untaken, rank, first.index_select(0, rows)))
        # the distribution after this rejection; rows that accepted are never read again
        p.index_copy_(0, rows, residual(p_rows, q_rows))
        if q is not None and tree.without_replacement:
            q_rows = q_rows.scatter(1, x, 0.0)
            total = q_rows.sum(-1, keepdim=True)
            q.index_copy_(0, rows, torch.where(total > 0, q_rows / torch.where(total > 0, total, 1.0), q_rows))
    # each inner node's accepted child (-1: none), then whether each node is its parent's accepted child
    table = torch.tensor([tree.children[node] + [-1] * (width + 1 - len(tree.children[node])) for node in inner],
                         device=device)
    taken = torch.full((n,), -1, dtype=torch.long, device=device)
    taken.index_copy_(0, inner_rows, table.gather(1, first[:, None])[:, 0])
    chosen = taken.index_select(0, tree.parent_rows.to(device)) == torch.arange(n, device=device)
    chosen[0] = True
    on_path = ~(tree.ancestors.to(device) & ~chosen[None, :]).any(-1)
    end = (on_path.long() * torch.arange(n, device=device)).max()  # the deepest: the largest index on a chain
    # where the walk stops: an inner node's p after rejecting all its children, or a leaf's p
    slot = torch.tensor([row_of.get(node, len(inner) + node) for node in range(n)], device=device)
    final = torch.cat([p, target_probs]).index_select(0, slot.index_select(0, end.view(1)))[0]
    return on_path, end, final


def _sample_accept_chain(tree: Tree, target_probs: torch.Tensor, generator: torch.Generator | None,
                         residual: ResidualFn, logits: torch.Tensor | None = None,
                         extra: torch.Tensor | None = None) -> PendingRead:
    """`sample_accept` on a chain (AR, SpS, PLD's single match), on the probabilities' device with
    one read: draft i + 1 is accepted with probability min(1, p_i(x) / q_i(x)) (q: the draft's
    distribution, or a point mass at x), the first rejection at node k samples the residual
    norm(max(0, p_k - q_k)), and a chain accepted whole samples p at its end. The same law as the
    node-by-node rule; the uniforms are drawn for every draft at once (other draws of the stream)."""
    n, device = len(tree), target_probs.device
    if n == 1:
        token = torch.multinomial(target_probs[0], 1, generator=generator)
        return _read_path(torch.ones(1, dtype=torch.bool, device=device), token, tree.tokens.to(device), logits,
                          tree.parent_rows.to(device), torch.zeros(1, dtype=torch.long, device=device), extra)
    drafts = tree.tokens[1:].to(device)
    p_x = target_probs[:-1].gather(1, drafts[:, None])[:, 0]
    if tree.draft_probs is None:  # a point mass at each draft
        q = torch.zeros_like(target_probs[:-1]).scatter_(1, drafts[:, None], 1.0)
    else:
        q = tree.draft_probs[:-1].to(device)
    q_x = q.gather(1, drafts[:, None])[:, 0]
    draws = torch.rand(n - 1, generator=generator, device=generator.device if generator is not None else device)
    accepted = (q_x > 0) & (draws.to(device) * q_x < p_x)  # u < p(x)/q(x), without dividing
    k = accepted.long().cumprod(0).sum()  # drafts accepted before the first rejection
    after = torch.cat([residual(target_probs[:-1], q), target_probs[-1:]])  # each node's residual, then the end's p
    token = torch.multinomial(after.index_select(0, k.view(1))[0], 1, generator=generator)  # (after[k] reads k)
    on_path = torch.arange(n, device=device) <= k
    return _read_path(on_path, token, tree.tokens.to(device), logits, tree.parent_rows.to(device), k.view(1), extra)


def typical_accept(tree: Tree, target_probs: torch.Tensor, epsilon: float = 0.09, delta: float = 0.3,
                   logits: torch.Tensor | None = None) -> Acceptance:
    """Medusa's typical acceptance (LOSSY), as upstream's default fast path (`evaluate_posterior`
    with `fast=True`, FasterDecoding/Medusa): a draft token x is acceptable after its parent when
    p(x) > min(epsilon, delta * exp(-H(p))), with H from log(p + 1e-5); a node is accepted when its
    whole path is. The deepest accepted node wins; among equally deep ones, the path of the highest
    likelihood (the sum of log p of its tokens). The next token is the argmax of p there (upstream
    takes the argmax when `fast`, its default). `target_probs` [N, V]: fp32, temperature applied.
    Computed on the probabilities' device and read once (the path, its next token, the tree's
    tokens and, with `logits`, the path rows' margins); path likelihoods are summed in fp64 from the root down, as the
    rule's walk does."""
    n, device = len(tree), target_probs.device
    tokens = tree.tokens.to(device)
    entropy = -(target_probs * torch.log(target_probs + 1e-5)).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    parents = tree.parent_rows.to(device)
    token_probs = target_probs[parents, tokens]  # row 0 (the root) is unused
    root = torch.arange(n, device=device) == 0
    acceptable = root | (token_probs > threshold[parents])
    on_path = ~(tree.ancestors.to(device) & ~acceptable[None, :]).any(-1)  # every node to the root acceptable
    own = torch.where(root, 0.0, torch.log(token_probs).double())
    likelihood = own
    for _ in range(max(tree.depths)):  # a node's path sum: its own term plus its parent's path sum
        likelihood = own + torch.where(root, 0.0, likelihood[parents])
    depths = torch.tensor(tree.depths, device=device)
    deepest = on_path & (depths == torch.where(on_path, depths, -1).max())
    score = torch.where(deepest, likelihood, float("-inf"))
    best = (deepest & (score == score.max())).long().argmax()  # the first of the most likely (the walk's strict >)
    token = target_probs.index_select(0, best.view(1))[0].argmax().view(1)
    on_path = tree.ancestors.to(device).index_select(0, best.view(1))[0]
    return _read_path(on_path, token, tokens, logits, parents, best.view(1)).read()
