"""The EAGLE head as a drafter: its KV cache of (token, feature) pairs along the accepted sequence,
the tree levels fed over it, and its logits over the (draft) vocabulary.

A draft level works in the draft vocabulary's space: its logits are the K draft tokens' (the
reduced LM head's rows), its log-probabilities a log_softmax over those K (the -inf of every other
target token adds nothing to it), its top-k mapped to target ids through `ids`. Only EAGLE-1's
sampled children, whose q verification reads, scatter logits onto the full vocabulary (`full`)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..engine.graphs import static_layer, static_mask
from ..engine.kv_cache import TreeKVCache
from ..engine.tree import attention_mask, level_mask
from ..models.heads.eagle import EagleHead


class EagleDrafter:
    """The head, its KV cache (committed pairs + the current tree's entries) and the target's lm_head
    (over the draft vocabulary's tokens only, when one is given)."""

    def __init__(self, head: EagleHead, lm_head, vocabulary=None):
        self.head, self.lm_head, self.vocabulary = head, lm_head, vocabulary
        self.device = head.fc.weight.device
        self.dtype = head.fc.weight.dtype
        # the target id of each draft token (None: the draft vocabulary is the target's, in order)
        self.ids = None if vocabulary is None else vocabulary.ids.to(self.device)
        # the head's layer on the engine's fused forward where it runs (EAGLE's and EAGLE-3's)
        self.fused = head.fused()
        self.linears = [self.fused.layer.qkv, self.fused.layer.gate_up] if self.fused else []
        self._reserved: TreeKVCache | None = None  # the last reserved head cache, reused while large enough
        self.reset()

    def reset(self, capacity: int | None = None) -> None:
        """An empty head cache; with `capacity` (the target's reserved one: it holds the committed pairs
        and a tree's entries), its buffers are allocated once at that size and the RoPE table as long,
        and the next answer reuses them while they are large enough (as `ModelRunner.reserve`)."""
        self.committed = 0
        # an accepted path not yet fed (`defer`): (tokens, features), fed by `settle` or inside the
        # static draft step (`StaticDraft`), which folds it into the levels that follow
        self.pending: tuple[list[int], torch.Tensor] | None = None
        if capacity is None:
            self.cache = TreeKVCache()
            return
        self.cache = self._reserved = TreeKVCache.reserved(self._reserved, capacity)
        if self.fused is not None:
            self.fused.rope.reserve(self.cache.capacity, self.dtype, self.device)  # (a table already that long is kept)

    @torch.inference_mode()
    def _feed(self, tokens: Sequence[int] | torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None, bound: int) -> torch.Tensor:
        """`bound`: the positions are below it (known on the host: the RoPE table is not read back)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if self.fused is None:
            return self.head(tokens, features, positions, mask, self.cache)
        layer, rope = self.fused.layer, self.fused.rope
        x, attn_in = self.head.layer_inputs(tokens, features)
        cos, sin = rope.lookup(positions.view(1, -1), x, bound)
        return layer.forward(x[None], cos, sin, mask, self.cache, None if attn_in is None else attn_in[None])[0]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K] fp32 logits over the draft vocabulary (draft index i is target id `ids[i]`)."""
        with torch.inference_mode():
            if self.vocabulary is not None:
                return self.vocabulary.head(self.lm_head.weight)(hidden).float()
            return self.lm_head(hidden).float()

    def full(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., K] onto the target's vocabulary [..., V], -inf elsewhere."""
        return draft_logits if self.vocabulary is None else self.vocabulary.scatter(draft_logits)

    def top(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely draft tokens of each row: (log-probabilities [..., k], target ids [..., k]),
        on the device."""
        top = torch.topk(torch.log_softmax(draft_logits, -1), k)
        return top.values, self.target_ids(top.indices)

    def target_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft indices -> target token ids."""
        return indices if self.ids is None else self.ids[indices]

    @property
    def root_logits(self) -> torch.Tensor:
        """The head's logits for the root's children over the target's vocabulary (`full` of `root_draft`)."""
        return self.full(self.root_draft)

    def follow_inputs(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features along the accepted tokens -> what the head's layer reads with them
        (EAGLE: the features themselves; EAGLE-3 fuses its three layers')."""
        return features

    def follow(self, tokens: Sequence[int], features: torch.Tensor) -> None:
        """Drop the tree entries; append pairs (tokens[i], features[i]) of the accepted sequence.
        Sets `root_hidden` / `root_draft` (draft-vocabulary logits): the head's prediction for the new
        root's children."""
        self.settle()
        self.cache.rollback(self.committed)
        n = len(tokens)
        positions = torch.arange(self.committed, self.committed + n, device=self.device)
        causal = torch.ones(n, n, dtype=torch.bool).tril_()
        mask = attention_mask(causal, self.committed, self.dtype, self.device) if n > 1 else None
        with torch.inference_mode():
            features = self.follow_inputs(features)
        hidden = self._feed(tokens, features, positions, mask, self.committed + n)
        self.committed += n
        self.root_hidden = hidden[-1]
        self.root_draft = self.draft_logits(hidden[-1])

    def defer(self, tokens: Sequence[int], features: torch.Tensor) -> None:
        """`follow` left for the next draft step: the static draft step (`StaticDraft`) feeds the path
        and drafts the levels in one computation; any other reader of the root calls `settle` first.
        Paths of steps that drafted nothing (load-aware speculation off, or another drafter's turn in
        SAM) join the one deferred: the next draft step feeds them all, in one forward."""
        if self.pending is not None:
            tokens, features = self.pending[0] + list(tokens), torch.cat([self.pending[1], features])
        self.pending = (list(tokens), features)

    def settle(self) -> None:
        """Feed a deferred accepted path now (`follow`), so that `root_hidden` / `root_draft` are current."""
        if self.pending is not None:
            tokens, features = self.pending
            self.pending = None
            self.follow(tokens, features)

    def feed_level(self, tokens: Sequence[int] | torch.Tensor, parent_hidden: torch.Tensor, depth: int,
                   visible: list[list[int]] | torch.Tensor) -> torch.Tensor:
        """Feed tree nodes of one depth. `visible[i]`: tree-entry slots (0-based, after the
        committed pairs) that node i may attend to besides itself (its ancestors), as lists or as a
        bool tensor [n, drafted] on the device (`level_mask`). Returns their
        outputs; the new nodes take the next slots in order."""
        drafted = self.cache.get_seq_length() - self.committed
        mask = level_mask(self.committed, drafted, visible, self.dtype, self.device)
        n = len(tokens)
        positions = torch.full((n,), self.committed + depth - 1, device=self.device)
        return self._feed(tokens, parent_hidden, positions, mask, self.committed + depth)

    def static_room(self, slots: int) -> bool:
        """Whether `slots` positions after the committed pairs can be written at device positions
        (`follow_static`, `feed_static`): a fused layer over a reserved cache whose buffers exist, with
        room for them."""
        capacity, layers = self.cache.capacity, self.cache.layers
        return (self.fused is not None and capacity is not None and len(layers) == 1
                and layers[0].key_buffer is not None and layers[0].key_buffer.shape[-2] == capacity
                and self.committed + slots <= capacity
                and self.fused.rope.cos is not None and self.fused.rope.cos.shape[0] >= capacity)

    def follow_static(self, tokens: torch.Tensor, features: torch.Tensor, start: torch.Tensor,
                      count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`follow` at device positions, what the static draft step runs before its levels: the first
        `count` [1] of the `rows` pairs (tokens [rows], features [rows, .]; the rest is padding) are
        written at slots `start` [1] onwards, causally, over the committed pairs; the padding rows
        write slots the levels then overwrite (or that stay hidden). Returns the root's hidden state
        and draft logits (the last real row's); the caller moves `committed` and the cache's length."""
        layer, rope = self.fused.layer, self.fused.rope
        rows = tokens.shape[0]
        x, attn_in = self.head.layer_inputs(tokens, self.follow_inputs(features))
        slots = start + torch.arange(rows, device=self.device)
        cos, sin = rope.cos[slots].view(1, rows, 1, -1), rope.sin[slots].view(1, rows, 1, -1)
        causal = torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril_()
        columns = torch.arange(self.cache.capacity, device=self.device)
        buffers = self.cache.layers[0]
        hidden = static_layer(layer, x[None], cos, sin, buffers.key_buffer, buffers.value_buffer, slots,
                              static_mask(columns, start, causal, self.dtype),
                              None if attn_in is None else attn_in[None])[0]
        root = hidden.index_select(0, count - 1)[0]
        return root, self.draft_logits(root)

    def feed_static(self, tokens: torch.Tensor, parent_hidden: torch.Tensor, depth: int, visible: torch.Tensor,
                    start: torch.Tensor) -> torch.Tensor:
        """`feed_level` at device positions, what a CUDA graph captures (`StaticDraft`): `start` [1]
        holds the committed pairs' count on the device; the nodes' keys/values go to the slots after
        the `visible.shape[1]` drafted ones (`graphs.static_layer`), attention reads the whole buffer
        under a mask built on the device. Nothing is read back, and the cache's length does not move:
        the next `follow` writes over these entries."""
        layer, rope = self.fused.layer, self.fused.rope
        n, drafted = tokens.shape[0], visible.shape[1]
        x, attn_in = self.head.layer_inputs(tokens, parent_hidden)
        positions = (start + (depth - 1)).expand(n)
        cos, sin = rope.cos[positions].view(1, n, 1, -1), rope.sin[positions].view(1, n, 1, -1)
        slots = start + drafted + torch.arange(n, device=self.device)
        own = torch.cat([visible, torch.eye(n, dtype=torch.bool, device=self.device)], 1)
        columns = torch.arange(self.cache.capacity, device=self.device)
        buffers = self.cache.layers[0]
        return static_layer(layer, x[None], cos, sin, buffers.key_buffer, buffers.value_buffer, slots,
                            static_mask(columns, start, own, self.dtype), None if attn_in is None else attn_in[None])[0]
