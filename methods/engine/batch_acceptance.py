"""The verification rules of `acceptance.py` for a batch of chains (`methods/batched.py`): every
sequence's decision on the device, then ONE read for the whole batch per step.

Chain b has `len(trees[b])` nodes (root first) and its logits are rows [b, :len] of a [B, R, V]
tensor padded to the longest chain; padding rows are never accepted.

* `greedy_accept_chains`: per chain, `greedy_accept_logits`' rule: the drafts that equal the
  target's argmax at their parent, up to the first that does not, then the argmax after them.
* `sample_accept_chains`: per chain, `sample_accept`'s chain rule (draft i + 1 accepted with
  probability min(1, p_i(x) / q_i(x)), the first rejection samples norm(max(0, p_k - q_k)), a chain
  accepted whole samples p at its end), each sequence drawing from its own generator in the order
  the B = 1 rule draws (its uniforms, then its token).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .acceptance import Acceptance, ResidualFn, chosen_margins, residual_distribution
from .tree import Tree


def _padded_tokens(trees: Sequence[Tree], device) -> torch.Tensor:
    """[B, R] the chains' tokens, -1 past each chain's end (a token no row chooses)."""
    for tree in trees:
        if not tree.is_chain:
            raise ValueError("batched decoding verifies chains; a drafter proposed a tree with branches")
    return torch.nn.utils.rnn.pad_sequence([tree.tokens.to(device) for tree in trees], batch_first=True, padding_value=-1)


def _acceptances(read: list[float], batch: int, rows: int, emitted_at: int, margins_at: int) -> list[Acceptance]:
    """Per sequence b from one read: its accepted drafts k (read[b]), its emitted tokens (rows
    `emitted_at + b * rows ..`, k + 1 of them) and their margins (from `margins_at` likewise)."""
    out = []
    for b in range(batch):
        k = int(read[b])
        emitted = [int(v) for v in read[emitted_at + b * rows: emitted_at + b * rows + k + 1]]
        margins = read[margins_at + b * rows: margins_at + b * rows + k + 1]
        out.append(Acceptance(list(range(k + 1)), emitted[-1], emitted, margins))
    return out


def greedy_accept_chains(trees: Sequence[Tree], logits: torch.Tensor) -> list[Acceptance]:
    """`greedy_accept_logits` for every chain of the batch; logits [B, R, V]."""
    batch, rows, vocab = logits.shape
    tokens = _padded_tokens(trees, logits.device)
    argmax = logits.argmax(-1)  # [B, R]
    if vocab > 1:
        top = logits.topk(2, dim=-1).values
        margin = (top[..., 0] - top[..., 1]).double()
    else:
        margin = torch.full((batch, rows), float("inf"), dtype=torch.float64, device=logits.device)
    accepted = (tokens[:, 1:] == argmax[:, :-1]).long().cumprod(1).sum(1)  # [B] drafts before the first miss
    read = torch.cat([accepted.double(), argmax.double().flatten(), margin.flatten()]).tolist()
    return _acceptances(read, batch, rows, batch, batch + batch * rows)


def sample_accept_chains(trees: Sequence[Tree], target_probs: torch.Tensor, generators: Sequence[torch.Generator | None],
                         logits: torch.Tensor, residual: ResidualFn = residual_distribution) -> list[Acceptance]:
    """`sample_accept` for every chain of the batch; target_probs [B, R, V] fp32 (the processed
    distribution after each row) of `logits` [B, R, V] (the path rows' margins come back in the
    same read), `generators[b]` sequence b's."""
    batch, rows, vocab = target_probs.shape
    device = target_probs.device
    tokens = _padded_tokens(trees, device)
    sizes = torch.tensor([len(tree) for tree in trees], device=device)
    offsets = torch.arange(rows, device=device)
    is_draft_row = offsets < (sizes - 1)[:, None]  # [B, R]: a row whose child is a draft token
    nxt = torch.cat([tokens[:, 1:], tokens.new_full((batch, 1), -1)], 1).clamp_min(0)  # each row's child
    q = torch.zeros_like(target_probs).scatter_(2, nxt[..., None], 1.0)  # a point mass at each draft,
    for b, tree in enumerate(trees):  # or the draft's own distribution where it sampled
        if tree.draft_probs is not None and len(tree) > 1:
            q[b, : len(tree) - 1] = tree.draft_probs[:-1].to(device)
    q = q * is_draft_row[..., None]
    p_x = target_probs.gather(2, nxt[..., None])[..., 0]
    q_x = q.gather(2, nxt[..., None])[..., 0]
    draws = torch.zeros(batch, rows, device=device)
    for b, (tree, generator) in enumerate(zip(trees, generators)):
        draws[b, : len(tree) - 1] = torch.rand(len(tree) - 1, generator=generator,
                                               device=generator.device if generator is not None else device).to(device)
    accepted = is_draft_row & (q_x > 0) & (draws * q_x < p_x)  # u < p(x)/q(x), without dividing
    k = accepted.long().cumprod(1).sum(1)  # [B] drafts accepted before the first rejection
    after = torch.where(is_draft_row[..., None], residual(target_probs, q), target_probs)
    final = after[torch.arange(batch, device=device), k]  # [B, V]
    token = torch.cat([torch.multinomial(final[b], 1, generator=generator) for b, generator in enumerate(generators)])
    chosen = torch.where(offsets[None, :] == k[:, None], token[:, None], nxt)  # what each path row chose
    margins = chosen_margins(logits.flatten(0, 1), chosen.flatten()).view(batch, rows)
    read = torch.cat([k.double(), chosen.double().flatten(), margins.flatten()]).tolist()
    return _acceptances(read, batch, rows, batch, batch + batch * rows)
