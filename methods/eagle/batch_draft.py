"""The EAGLE family's drafting for a batch (`methods/loop.py`): one head forward for every
sequence at each step of the draft, instead of one per sequence (EAGLE-1's template, EAGLE-2's and
EAGLE-3's dynamic trees).

Every running sequence's head KV (its committed (token, feature) pairs) sits in one row of a
`BatchKVCache`, as the target's does. A draft step is then:

  * the follow: each sequence's deferred accepted path (`EagleDrafter.defer`; an answer's first
    step has none: its root comes from the prompt's follow, which ran alone at `start`) is fed for
    the whole batch in one forward, rows padded to the longest path, each seeing its own committed
    pairs and its path causally; `commit_batch` moves each path to its sequence's length, and each
    root is its path's last row;
  * the levels: the decoder's draft loop runs for the batch at once, with a leading batch dimension
    (EAGLE-2's expansion, `Eagle2Decoder.expand`: top-k, cumulative values and frontier masks;
    EAGLE-1's template, `EagleDecoder._fill`), each level one forward of B × (the level's nodes)
    rows (`feed`): a node sees its sequence's committed pairs, its ancestors among the tree slots
    drafted so far and itself; the tree slots are dropped after the step.

A sequence's rows are computed from exactly what they compute from alone (its own pairs, its own
frontier), so a sequence drafts the candidates it drafts alone; its tree is then cut to its own
budget (EAGLE-2: reranked alone, `Eagle2Decoder.rerank`; EAGLE-1: the template cut at its depth).
On a CPU a head forward streams the head's weights once whatever its rows (to ~30 rows), so B
sequences draft for about the cost of one.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..engine.kv_cache import BatchKVCache, batch_change
from ..engine.tree import Tree, batch_mask


class BatchDraft:
    """The head's batch cache for one batch of sequences (their `DecodeState`s, by identity), made at
    the batch's first draft step from each sequence's own head cache (the prompt's pairs), shrunk as
    sequences leave."""

    def __init__(self, decoder):  # decoder: an `EagleBase` (its `draft_batch` drafts the levels)
        self.decoder = decoder
        self.states: list = []
        self.cache: BatchKVCache | None = None

    def _rows(self, states: Sequence) -> None:
        """The cache's rows for `states`: a new batch loads each sequence's head cache into a row; a
        batch that lost sequences keeps the rows of those still running; a sequence that joined
        (continuous batching) takes a new last row from its head cache."""
        change = batch_change(self.states, states) if self.cache is not None else None
        if change is not None:
            kept, joining = change
            if len(kept) != len(self.states):
                self.cache.keep_sequences(kept)
            for state in joining:
                state.draft.settle()  # what it accepted before its first draft step in the batch
                self.cache.add_sequence(self._committed(state.draft))
            self.states = list(states)
            return
        drafters = [state.draft for state in states]
        self.cache = BatchKVCache(len(states), max(d.cache.capacity or 0 for d in drafters) or None)
        for row, drafter in enumerate(drafters):
            drafter.settle()
            self.cache.load_row(row, self._committed(drafter))
        self.states = list(states)

    @staticmethod
    def _committed(drafter):
        """A drafter's head cache, which a batch row is made from: it must hold only committed pairs."""
        if drafter.pending is not None or drafter.cache.get_seq_length() != drafter.committed:
            raise RuntimeError("a batch's head cache is made from caches holding only committed pairs")
        return drafter.cache

    @torch.inference_mode()
    def roots(self, states: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's deferred path fed in one forward; the roots' hidden states [B, H] and
        draft logits [B, K]."""
        self._rows(states)
        drafters = [state.draft for state in states]
        pending = [d.pending for d in drafters]
        if any(p is not None for p in pending):
            head = drafters[0]
            sizes = [0 if p is None else len(p[0]) for p in pending]
            width, start = max(sizes), self.cache.get_seq_length()
            like = next(p[1] for p in pending if p is not None)
            tokens = torch.zeros(len(states), width, dtype=torch.long, device=head.device)
            features = like.new_zeros(len(states), width, *like.shape[1:])
            for b, p in enumerate(pending):
                if p is not None:
                    tokens[b, : sizes[b]] = torch.tensor(p[0], dtype=torch.long)
                    features[b, : sizes[b]] = p[1]
            causal = torch.ones(width, width, dtype=torch.bool, device=head.device).tril_()
            hidden = self._forward(head, tokens, head.follow_inputs(features),
                                   torch.arange(width, device=head.device), causal.expand(len(states), -1, -1))
            self.cache.commit_batch(start, [range(n) for n in sizes])
            last = torch.tensor([max(n - 1, 0) for n in sizes], device=head.device)
            roots = hidden[torch.arange(len(states), device=head.device), last]
            logits = head.draft_logits(roots)
            for b, (drafter, n) in enumerate(zip(drafters, sizes)):
                if n:
                    drafter.pending = None
                    drafter.committed += n
                    drafter.root_hidden, drafter.root_draft = roots[b], logits[b]
        return torch.stack([d.root_hidden for d in drafters]), torch.stack([d.root_draft for d in drafters])

    def feed(self, tokens: torch.Tensor, hidden: torch.Tensor, depth: int, seen: torch.Tensor) -> torch.Tensor:
        """One level of every sequence's tree: tokens [B, k] whose parents' outputs are `hidden`
        [B, k, H], at depth `depth`; `seen` [B, k, fed]: the tree slots drafted so far each node sees
        (its ancestors'). Their outputs [B, k, H]; their KV takes the next k tree slots."""
        head = self.states[0].draft
        k = tokens.shape[1]
        own = torch.eye(k, dtype=torch.bool, device=head.device).expand(tokens.shape[0], -1, -1)
        return self._forward(head, tokens, hidden, torch.full((k,), depth - 1, device=head.device),
                             torch.cat([seen, own], 2), tree=seen.shape[2])

    def _forward(self, head, tokens: torch.Tensor, features: torch.Tensor, depths: torch.Tensor,
                 visible: torch.Tensor, tree: int = 0) -> torch.Tensor:
        """The head's layer over rows [B, n] appended after the cache's filled length: row i of
        sequence b at position lengths[b] + depths[i], seeing b's committed pairs, the `tree` slots
        before the new rows as `visible[b, i, :tree]` says, and the new rows as its last n columns say."""
        cache, layer, rope = self.cache, head.fused.layer, head.fused.rope
        filled = cache.get_seq_length()
        lengths = torch.tensor(cache.lengths, device=head.device)
        positions = lengths[:, None] + depths[None]  # [B, n]
        mask = batch_mask(lengths, filled - tree, visible, head.dtype)
        x, attn_in = head.head.layer_inputs(tokens, features)
        cos, sin = rope.lookup(positions, x, max(cache.lengths) + int(depths.max()) + 1)
        return layer.forward(x, cos, sin, mask, cache, attn_in)

    def trees(self, states: Sequence, budgets: Sequence[int]) -> list[Tree]:
        """`EagleBase.propose_batch`: the roots for the batch at once, then the decoder's levels for the
        batch (`draft_batch`: each level one head forward, `feed`), the tree slots dropped after."""
        roots_hidden, roots_draft = self.roots(states)
        with torch.inference_mode():
            trees = self.decoder.draft_batch(states, budgets, roots_hidden, roots_draft, self.feed)
        self.drop_tree()
        return trees

    def drop_tree(self) -> None:
        """The tree slots a step drafted, dropped: the filled length back to the longest sequence."""
        self.cache.commit_batch(self.cache.get_seq_length(), [[] for _ in self.states])
