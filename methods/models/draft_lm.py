"""A small LM that drafts for a target (SpS, MCSD): its own runner and KV cache, kept in step with
the target's sequence, and its logits mapped onto the target's vocabulary.

It drafts a tree by a k-config `(k_1, ..., k_L)`: every node at depth d-1 gets k_d children, drawn
from the draft distribution q at that node (with or without replacement; top-k when greedy), with
one draft forward per depth over all nodes of that depth (tree mask). SpS is the chain
`(1, ..., 1)`. After verification the draft cache keeps only the accepted path's entries.
"""

from __future__ import annotations

from typing import Sequence

import torch

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

    def another(self) -> "DraftLM":
        """A draft LM over the same model and vocabulary with its own cache (one per sequence of a batch)."""
        runner = self.runner
        return DraftLM(runner.model, self.target_vocab_size, runner.vocabulary, **runner.engine_settings())

    def reset(self) -> None:
        self.runner.reset()
        self.fed = []
        self._slots, self._base = {}, None

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
        device = root_logits.device
        sizes = [1]
        for k in k_config:
            sizes.append(sizes[-1] * k)
        tokens = torch.empty(sum(sizes), dtype=torch.long, device=device)
        tokens[0] = sequence[-1]
        draft_probs = None if sampling.greedy else torch.zeros(sum(sizes), self.target_vocab_size, device=device)
        parents, previous, logits = [-1], [0], root_logits[None]
        self._slots = {}
        for depth, k in enumerate(k_config, start=1):
            level = list(range(len(parents), len(parents) + len(previous) * k))
            parents.extend(p for p in previous for _ in range(k))
            if sampling.greedy:
                children = torch.topk(logits, k).indices
            else:
                q = logits_to_probs(logits, sampling)
                draft_probs[previous[0]: previous[-1] + 1] = q
                children = draw_children(q, k, without_replacement, generator)
            tokens[level[0]: level[-1] + 1] = children.reshape(-1)
            if depth == len(k_config):
                break
            visible = [[self._slots[a] for a in ancestors_of(parents, n)] for n in level]
            mask = level_mask(base, len(self._slots), visible, self.runner.dtype, self.runner.device)
            positions = torch.full((len(level),), base - 1 + depth, device=self.runner.device)
            logits = self.align(self.runner.forward(tokens[level[0]: level[-1] + 1], positions=positions, mask=mask,
                                                     bound=base + depth).logits)
            for node in level:
                self._slots[node] = len(self._slots)
            previous = level
        self._base = base
        return Tree(tokens, parents, draft_probs, without_replacement=without_replacement and not sampling.greedy)

    def keep_path(self, tree: Tree, path: Sequence[int], emitted: Sequence[int] | None = None) -> None:
        """After verification: keep the cache entries of the accepted nodes that were fed.
        `emitted`: the step's tokens, already on the host (the path's drafts, then the next token)."""
        if self._base is None:  # no tree was drafted this step
            return
        fed = [i for i, node in enumerate(path[1:]) if node in self._slots]
        self.runner.commit(self._base, [self._slots[path[1 + i]] for i in fed])
        tokens = emitted if emitted is not None else tree.tokens[path[1:]].tolist()
        self.fed.extend(tokens[i] for i in fed)
        self._slots, self._base = {}, None

