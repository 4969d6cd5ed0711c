"""A small LM that drafts for a target (SpS, MCSD): its own runner and KV cache, kept in step with
the target's sequence, and its logits mapped onto the target's vocabulary.

It drafts a tree by a k-config `(k_1, ..., k_L)`: every node at depth d-1 gets k_d children, drawn
from the draft distribution q at that node (with or without replacement; top-k when greedy), with
one draft forward per depth over all nodes of that depth (tree mask). SpS is the chain
`(1, ..., 1)`. After verification the draft cache keeps only the accepted path's entries.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..engine.kv_cache import batch_change
from ..engine.runner import ModelRunner
from ..engine.sampling import SamplingConfig, draw_children, logits_to_probs
from ..engine.tree import Tree, ancestors_of, level_mask


class DraftLM:
    def __init__(self, model, target_vocab_size: int, vocabulary=None, **engine):
        """`engine`: the target runner's `engine_settings()` (its linear path, forward and machine profile)."""
        self.runner = ModelRunner(model, **engine)
        self.runner.restrict_vocabulary(vocabulary)
        self.target_vocab_size = target_vocab_size
        self.fed: list[int] = []  # tokens whose KV the draft cache holds (committed part), in order
        self._slots: dict[int, int] = {}  # tree node -> slot after the committed part
        self._base: int | None = None  # committed length when the current tree was drafted
        self.batch: BatchDraftLM | None = None  # the batch drafting for this sequence, if any (`BatchDraftLM`)
        self.kept: list[int] = []  # in a batch: the last step's accepted tree slots, committed at the next step
        self.lanes: list[DraftLM] = [self]  # sequence i of a batch drafts with lanes[i] (`lane`)

    @classmethod
    def of(cls, draft, target, vocabulary=None) -> "DraftLM":
        """A decoder's draft LM: `draft` itself when it is one (a factory built it to time it), else one over
        the model `draft` on the target runner's engine settings."""
        return draft if isinstance(draft, DraftLM) else cls(draft, target.vocab_size, vocabulary,
                                                              **target.engine_settings())

    def lane(self, index: int) -> "DraftLM":
        """Sequence `index`'s draft LM in a batch: its own cache over the same weights, made once and reused
        (index 0: this one)."""
        while len(self.lanes) <= index:
            self.lanes.append(self.another())
        return self.lanes[index]

    def another(self) -> "DraftLM":
        """A draft LM over the same model and vocabulary with its own cache (one per sequence of a batch)."""
        runner = self.runner
        return DraftLM(runner.model, self.target_vocab_size, runner.vocabulary, **runner.engine_settings())

    def reset(self) -> None:
        self.runner.reset()
        self.fed = []
        self._slots, self._base = {}, None
        self.batch, self.kept = None, []

    def align(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V_target]: a draft may have a padded or shorter embedding
        (e.g. Qwen2-0.5B vs 7B); ids beyond the draft's vocabulary get probability 0."""
        extra = self.target_vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.target_vocab_size]
        if extra > 0:
            pad = logits.new_full((*logits.shape[:-1], extra), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def catch_up(self, sequence: Sequence[int]) -> torch.Tensor:
        """Feed what the draft has not seen of `sequence` (at least its last token); logits
        [V_target] after the last token."""
        if len(self.fed) >= len(sequence):
            self.follow(sequence[:-1])
        new = list(sequence[len(self.fed):])
        out = self.runner.forward(new, logits_for=slice(-1, None))
        self.fed.extend(new)
        return self.align(out.logits[-1])

    def follow(self, sequence: Sequence[int]) -> None:
        """Drop cached tokens that left the sequence."""
        keep = min(len(self.fed), len(sequence))
        if self.fed[:keep] != list(sequence[:keep]):
            keep = next(i for i, (a, b) in enumerate(zip(self.fed, sequence)) if a != b)
        if keep < len(self.fed):
            self.runner.rollback(keep)
            del self.fed[keep:]

    @torch.inference_mode()
    def draft_tree(self, sequence: Sequence[int], k_config: Sequence[int], sampling: SamplingConfig,
                   generator: torch.Generator | None, without_replacement: bool = False) -> Tree:
        """A tree rooted at `sequence[-1]` with k_config[d-1] children per node at depth d-1 (parent
        by parent, in rank or draw order), fed level by level, on the draft's device: the tokens never
        come back to the host (the verification's one read brings the accepted ones, `keep_path`'s
        `emitted`). Sampled, each node's q is kept for verification (`Tree.draft_probs`)."""
        root_logits = self.catch_up(sequence)
        base = len(self.fed)
        growing = GrowingTree(sequence[-1], k_config, sampling, generator, without_replacement, root_logits,
                              self.target_vocab_size)
        self._slots = {}
        while (level := growing.grow()) is not None:
            visible = [[self._slots[a] for a in ancestors_of(growing.parents, n)] for n in level]
            mask = level_mask(base, len(self._slots), visible, self.runner.dtype, self.runner.device)
            positions = torch.full((len(level),), base - 1 + growing.depth, device=self.runner.device)
            out = self.runner.forward(growing.tokens[level[0]: level[-1] + 1], positions=positions, mask=mask,
                                      bound=base + growing.depth)
            growing.logits = self.align(out.logits)
            for node in level:
                self._slots[node] = len(self._slots)
        self._base = base
        return growing.tree()

    def keep_path(self, tree: Tree, path: Sequence[int], emitted: Sequence[int] | None = None) -> None:
        """After verification: keep the cache entries of the accepted nodes that were fed.
        `emitted`: the step's tokens, already on the host (the path's drafts, then the next token).
        In a batch (`BatchDraftLM`) the kept slots are committed with the next step's catch-up."""
        if self._base is None:  # no tree was drafted this step
            return
        fed = [i for i, node in enumerate(path[1:]) if node in self._slots]
        kept = [self._slots[path[1 + i]] for i in fed]
        if self.batch is None:
            self.runner.commit(self._base, kept)
        else:
            self.kept = kept
        tokens = emitted if emitted is not None else tree.tokens[path[1:]].tolist()
        self.fed.extend(tokens[i] for i in fed)
        self._slots, self._base = {}, None


class GrowingTree:
    """A draft tree by a k-config, grown level by level from the draft's logits: `grow` draws the
    next level's children (top-k greedy; sampled, from each parent's q, with or without
    replacement, q kept for verification) and returns the nodes to feed (None after the last
    level, which is never fed); the caller sets `logits` to the fed nodes' [n, V_target]."""

    def __init__(self, root: int, k_config: Sequence[int], sampling: SamplingConfig,
                 generator: torch.Generator | None, without_replacement: bool, root_logits: torch.Tensor,
                 vocab_size: int):
        self.k_config, self.sampling, self.generator = tuple(k_config), sampling, generator
        self.without_replacement = without_replacement
        count = sum(math.prod(self.k_config[:d]) for d in range(len(self.k_config) + 1))
        self.tokens = torch.empty(count, dtype=torch.long, device=root_logits.device)
        self.tokens[0] = root
        self.draft_probs = None if sampling.greedy else torch.zeros(count, vocab_size, device=root_logits.device)
        self.parents, self.previous, self.logits = [-1], [0], root_logits[None]
        self.depth = 0

    def grow(self) -> list[int] | None:
        if self.depth == len(self.k_config):
            return None
        k = self.k_config[self.depth]
        self.depth += 1
        previous, parents = self.previous, self.parents
        level = list(range(len(parents), len(parents) + len(previous) * k))
        parents.extend(p for p in previous for _ in range(k))
        if self.sampling.greedy:
            children = torch.topk(self.logits, k).indices
        else:
            q = logits_to_probs(self.logits, self.sampling)
            self.draft_probs[previous[0]: previous[-1] + 1] = q
            children = draw_children(q, k, self.without_replacement, self.generator)
        self.tokens[level[0]: level[-1] + 1] = children.reshape(-1)
        self.previous = level
        return None if self.depth == len(self.k_config) else level

    def tree(self) -> Tree:
        if len(self.parents) == 1:  # an empty k-config: the root alone
            return Tree(self.tokens, self.parents)
        return Tree(self.tokens, self.parents, self.draft_probs,
                    without_replacement=self.without_replacement and not self.sampling.greedy)


class BatchDraftLM:
    """The draft LM drafting for a batch (`methods/loop.py`): one draft forward for every sequence
    at each step of the draft, instead of one per sequence.

    Every running sequence's draft KV sits in one row of a `BatchKVCache` on a runner of its own
    (over the same weights), as the target's does. The batch is made at its first draft step: each
    sequence's draft catches up alone (its prompt, the batch-1 forward: no padding) and its cache
    is copied into its row. A draft step is then:

      * the catch-up: the tokens each draft has not seen (the step's next token, and an accepted
        draft of the last level, which was never fed) in one forward, rows padded to the longest,
        each seeing its committed slots and the slots of the last step's accepted nodes (still in
        the tree region after them: `DraftLM.keep_path` leaves them there); one `commit_batch` moves
        those kept slots and the new rows to each sequence's length; the roots' logits are each
        sequence's last new row's;
      * the levels: sequence b's level-d nodes (by its own k-config, cut to its budget) are rows of
        one forward per depth for the whole batch, at position lengths[b] + d - 1, each seeing b's
        committed slots, its ancestors' tree slots and itself.

    A sequence's rows see exactly what its rows see alone, in the same order (its prefix, the
    accepted nodes, the new rows), and its children are drawn from its own generator in its own
    order, so it drafts the trees it drafts alone (their q equal to rounding: a forward over more rows
    may round differently in the last bit)."""

    def __init__(self, draft: DraftLM):
        self.draft = draft  # the model, vocabulary and engine settings of the batch's runner
        self.runner: ModelRunner | None = None
        self.states: list = []
        self.tree_start = 0  # the filled length where this step's tree slots begin

    @torch.inference_mode()
    def draft_trees(self, states: Sequence, k_configs: Sequence[Sequence[int]],
                    without_replacement: bool = False) -> list[Tree]:
        """Each sequence's tree by its k-config (an empty one: the root alone), as `DraftLM.draft_tree`
        drafts it, on every `DecodeState`'s own draft (`state.draft`, a `DraftLM`)."""
        roots = self._rows(states)
        if roots is None:
            roots = self._catch_up(states)
        runner = self.runner
        self.tree_start = runner.length
        lanes = [state.draft for state in states]
        growing = [GrowingTree(state.sequence[-1], k_config, state.sampling, state.generator, without_replacement,
                               roots[b], self.draft.target_vocab_size)
                   for b, (state, k_config) in enumerate(zip(states, k_configs))]
        for lane, k_config in zip(lanes, k_configs):
            lane._slots, lane._base = {}, (len(lane.fed) if k_config else None)
        drafted, device = 0, runner.device
        while True:
            feeding = [(b, level) for b, tree in enumerate(growing) if (level := tree.grow()) is not None]
            if not feeding:
                break
            width = max(len(level) for _, level in feeding)
            ids = torch.zeros(len(states), width, dtype=torch.long, device=device)
            visible = torch.zeros(len(states), width, drafted + width, dtype=torch.bool)
            visible[:, :, drafted:] = torch.eye(width, dtype=torch.bool)  # each row itself (padding: only that)
            depth = growing[feeding[0][0]].depth  # (every tree still growing is as deep)
            for b, level in feeding:
                tree, slots = growing[b], lanes[b]._slots
                ids[b, : len(level)] = tree.tokens[level[0]: level[-1] + 1]
                for i, node in enumerate(level):
                    visible[b, i, [slots[a] for a in ancestors_of(tree.parents, node)]] = True
            depths = torch.full((len(states), width), depth - 1, device=device)
            logits = runner.forward_rows(ids, depths, visible.to(device), drafted, reach=depth).logits
            for b, level in feeding:
                growing[b].logits = self.draft.align(logits[b, : len(level)])
                lanes[b]._slots.update((node, drafted + i) for i, node in enumerate(level))
            drafted += width
        return [tree.tree() for tree in growing]

    def _rows(self, states: Sequence) -> torch.Tensor | None:
        """The cache's rows for `states`. A new batch: each sequence's draft catches up alone, its cache
        copied into its row; returns the roots' logits [B, V]. A batch that lost sequences: the kept
        slots of the last step committed, then the rows of those still running kept; None (the step's
        catch-up gives the roots). Sequences that joined (continuous batching): the others catch up in
        one forward first, then each new one catches up alone into a new last row; the roots' logits."""
        change = batch_change(self.states, states) if self.runner is not None else None
        if change is not None:
            kept, joining = change
            if len(kept) != len(self.states):
                self._commit([state.draft.kept if state.draft.batch is self else [] for state in self.states])
                self.runner.cache.keep_sequences(kept)
                self.states, self.tree_start = list(states[: len(kept)]), self.runner.length
            if not joining:
                return None
            roots = [*self._catch_up(self.states), *(self._join(state) for state in joining)]
            self.states = list(states)
            return torch.stack(roots)
        if self.runner is None:
            self.runner = self.draft.another().runner
        runner = self.runner
        runner.reserve_batch(len(states), max(s.room() for s in states),
                             batch_cache=True)
        roots = []
        for row, state in enumerate(states):
            lane = state.draft
            roots.append(lane.catch_up(state.sequence))
            runner.cache.load_row(row, lane.runner.cache)
            lane.batch, lane.kept = self, []
        self.states = list(states)
        return torch.stack(roots)

    def _join(self, state) -> torch.Tensor:
        """A sequence joining the batch: its draft catches up alone, its cache copied into a new last row;
        its root's logits."""
        lane = state.draft
        root = lane.catch_up(state.sequence)
        self.runner.cache.add_sequence(lane.runner.cache)
        lane.batch, lane.kept = self, []
        return root

    def _catch_up(self, states: Sequence) -> torch.Tensor:
        """Every sequence's unseen tokens in one forward, committed with its kept slots; the roots'
        logits [B, V]."""
        runner, lanes = self.runner, [state.draft for state in states]
        tree = runner.length - self.tree_start
        news = [state.sequence[len(lane.fed):] for state, lane in zip(states, lanes)]
        if not all(news):
            raise RuntimeError("a sequence's draft has seen all of it: nothing to catch up")
        width = max(len(new) for new in news)
        ids = torch.zeros(len(states), width, dtype=torch.long)
        depths = torch.zeros(len(states), width, dtype=torch.long)
        visible = torch.zeros(len(states), width, tree + width, dtype=torch.bool)
        visible[:, :, tree:] = torch.ones(width, width, dtype=torch.bool).tril_()
        for b, (new, lane) in enumerate(zip(news, lanes)):
            ids[b, : len(new)] = torch.tensor(new)
            depths[b] = len(lane.kept) + torch.arange(width)
            visible[b, :, lane.kept] = True
        out = runner.forward_rows(ids.to(runner.device), depths.to(runner.device), visible.to(runner.device), tree,
                                  logits_at=torch.tensor([len(new) - 1 for new in news], device=runner.device),
                                  reach=max(len(lane.kept) for lane in lanes) + width)
        self._commit([lane.kept + [tree + i for i in range(len(new))] for lane, new in zip(lanes, news)])
        for lane, new in zip(lanes, news):
            lane.fed.extend(new)
        return self.draft.align(out.logits[:, 0])

    def _commit(self, paths: Sequence[Sequence[int]]) -> None:
        """Sequence b keeps `paths[b]` of the columns after `tree_start` at its length; every lane's kept
        slots are then spent."""
        self.runner.cache.commit_batch(self.tree_start, paths)
        for state in self.states:
            if state.draft.batch is self:
                state.draft.kept = []
        self.tree_start = self.runner.length
