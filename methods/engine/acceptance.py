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
  from the head without replacement (`methods/eagle.py`).
  For deterministic drafts (no q: top-k trees, EAGLE-2) q is the point mass at x, which gives
  EAGLE-2's rule: accept x with probability p(x), else p(x) <- 0 and renormalize.
  This preserves the target's (processed) distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import sample, uniform
from .tree import Tree


@dataclass
class Acceptance:
    path: list[int]  # accepted node indices, from the root (always node 0)
    next_token: int  # the token the target adds after the path (bonus / correction)
    # when the rule computed them already: the tokens emitted (accepted drafts, then next_token)
    # and each path row's logit margin (chosen token's logit minus the best other's)
    emitted: list[int] | None = None
    margins: list[float] | None = None
    # greedy, for a tree with extra rows: each extra row's argmax, read with the rest (Lookahead's window)
    extra_argmax: list[int] | None = None

    @property
    def accepted_drafts(self) -> int:
        return len(self.path) - 1


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
    with the argmax of each `extra` row [M, V] (a tree's extra rows) when given."""
    n, device = len(tree), logits.device
    argmax = logits.argmax(-1)
    if logits.shape[-1] > 1:
        top = logits.topk(2, dim=-1).values
        margin = (top[:, 0] - top[:, 1]).double()  # a greedy row chose its argmax: its top-2 gap
    else:
        margin = torch.full((n,), float("inf"), dtype=torch.float64, device=device)
    if n == 1:
        on_path = torch.ones(1, dtype=torch.bool, device=device)
    else:
        parents = torch.tensor([0] + list(tree.parents[1:]), device=device)
        match = tree.tokens.to(device) == argmax[parents]
        match[0] = True
        first = match & ~(tree.earlier_siblings.to(device) & match[None, :]).any(-1)
        on_path = ~(tree.ancestors.to(device) & ~first[None, :]).any(-1)
    rows = torch.stack([on_path.double(), argmax.double(), margin]).flatten()
    if extra is not None:
        rows = torch.cat([rows, extra.argmax(-1).double()])
    values = rows.tolist()
    accepted, chosen, margins = values[:n], values[n:2 * n], values[2 * n:3 * n]
    path = [node for node in range(n) if accepted[node]]
    emitted = [int(chosen[node]) for node in path]  # the row of each path node chose the token after it
    return Acceptance(path, emitted[-1], emitted, [margins[node] for node in path],
                      None if extra is None else [int(v) for v in values[3 * n:]])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after a rejection. Where nothing is left (only
    through rounding when p == q: rejection then has probability 0), p itself; decided on p's
    device, without a read."""
    residual = (p - q).clamp_min_(0)
    total = residual.sum(-1, keepdim=True)
    usable = torch.isfinite(total) & (total > 1e-12)
    return torch.where(usable, residual / torch.where(usable, total, torch.ones_like(total)), p)


# (p, q) -> the residual distribution, row by row over the last dimension ([V] or [n, V])
ResidualFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sample_accept(
    tree: Tree,
    target_probs: torch.Tensor,  # [N, V] fp32, the processed target distribution after each node
    generator: torch.Generator | None,
    residual: ResidualFn = residual_distribution,
) -> Acceptance:
    if tree.is_chain:
        return _sample_accept_chain(tree, target_probs, generator, residual)
    tokens = tree.tokens.tolist()
    node = 0
    while True:
        p = target_probs[node]
        children = tree.children[node]
        q = None if tree.draft_probs is None or not children else tree.draft_probs[node]
        accepted = None
        for child in children:
            x = tokens[child]
            q_x = 1.0 if q is None else float(q[x])
            p_x = float(p[x])
            if q_x > 0 and uniform(generator) * q_x < p_x:  # u < p(x)/q(x), without dividing
                accepted = child
                break
            if q is None:
                point = torch.zeros_like(p)
                point[x] = 1.0
                p = residual(p, point)
            else:
                p = residual(p, q)
                if tree.without_replacement:
                    q = q.clone()
                    q[x] = 0
                    q = q / q.sum() if q.sum() > 0 else q
        if accepted is None:
            return Acceptance(tree.path_to(node), sample(p, generator))
        node = accepted


def _sample_accept_chain(tree: Tree, target_probs: torch.Tensor, generator: torch.Generator | None,
                         residual: ResidualFn) -> Acceptance:
    """`sample_accept` on a chain (AR, SpS, PLD's single match), on the probabilities' device with
    one read: draft i + 1 is accepted with probability min(1, p_i(x) / q_i(x)) (q: the draft's
    distribution, or a point mass at x), the first rejection at node k samples the residual
    norm(max(0, p_k - q_k)), and a chain accepted whole samples p at its end. The same law as the
    node-by-node rule; the uniforms are drawn for every draft at once (other draws of the stream)."""
    n, device = len(tree), target_probs.device
    if n == 1:
        token = sample(target_probs[0], generator)
        return Acceptance([0], token, [token])
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
    token = torch.multinomial(after.index_select(0, k.view(1))[0], 1, generator=generator)[0]  # (after[k] reads k)
    read = torch.cat([torch.stack([k, token]), drafts]).tolist()  # the step's one read
    k, token = read[0], read[1]
    return Acceptance(list(range(k + 1)), token, read[2:2 + k] + [token])


def typical_accept(tree: Tree, target_probs: torch.Tensor, epsilon: float = 0.09, delta: float = 0.3) -> Acceptance:
    """Medusa's typical acceptance (LOSSY), as upstream's default fast path (`evaluate_posterior`
    with `fast=True`, FasterDecoding/Medusa): a draft token x is acceptable after its parent when
    p(x) > min(epsilon, delta * exp(-H(p))), with H from log(p + 1e-5); a node is accepted when its
    whole path is. The deepest accepted node wins; among equally deep ones, the path of the highest
    likelihood (the sum of log p of its tokens). The next token is the argmax of p there (upstream
    takes the argmax when `fast`, its default). `target_probs` [N, V]: fp32, temperature applied."""
    entropy = -(target_probs * torch.log(target_probs + 1e-5)).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    parents = torch.tensor(tree.parents[1:], dtype=torch.long)
    token_probs = target_probs[parents, tree.tokens[1:]]
    acceptable = [True] + (token_probs > threshold[parents]).tolist()
    log_likelihood = [0.0] + torch.log(token_probs).tolist()
    best, best_key = 0, (0, 0.0)
    for node in range(1, len(tree)):
        parent = tree.parents[node]
        acceptable[node] = acceptable[node] and acceptable[parent]
        log_likelihood[node] += log_likelihood[parent]
        key = (tree.depths[node], log_likelihood[node])
        if acceptable[node] and key > best_key:
            best, best_key = node, key
    return Acceptance(tree.path_to(best), int(target_probs[best].argmax()))
