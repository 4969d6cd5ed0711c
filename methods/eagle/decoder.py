"""What the EAGLE family's decoders share: one drafter per sequence of a batch, the head following the
prefill and every accepted path with the target's features, and the draft step `StaticDraft` runs
(under `engine.cuda_graphs`, the follow of the accepted path and the depth loop in one computation)."""

from __future__ import annotations

import torch

from ..engine.tree import Tree
from ..loop import DraftVerifyDecoder
from ..models.heads.eagle import EagleHead
from ..settings.sizing import Sizing
from .batch_draft import BatchDraft
from .drafter import EagleDrafter
from .static_draft import StaticDraft


class EagleBase(DraftVerifyDecoder):
    def __init__(self, target, head: EagleHead, vocabulary=None, sizing: Sizing | None = None):
        super().__init__(target, sizing)
        self.drafter = self.make_drafter(head, vocabulary)
        self.lane_drafters = [self.drafter]  # sequence i of a batch drafts with lane_drafters[i] (`draft_state`)
        # `engine.cuda_graphs`: the draft step as a static computation (a CUDA graph on a GPU; `engine.compile`)
        self.static = None if target.graph_mode == "off" else \
            StaticDraft(self, target.graph_mode == "graphs", target.compiled)
        self.batch_draft = BatchDraft(self)  # the head's cache of a batch's sequences (`propose_batch`)

    # the draft loop a `StaticDraft` runs: its levels from the root's state, fed by `feed`; the head
    # entries a loop of depth `key` feeds; the depth a graph is captured at
    def draft_levels(self, root_hidden: torch.Tensor, root_draft: torch.Tensor, key: int,
                     feed) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def drafted_entries(self, key: int) -> int:
        raise NotImplementedError

    # a batch's draft (`propose_batch`): the levels for every sequence at once from the roots [B, H] / [B, K],
    # each level fed by `feed(tokens [B, n], parent_hidden [B, n, H], depth, seen [B, n, fed])`
    def draft_batch(self, states, budgets, roots_hidden: torch.Tensor, roots_draft: torch.Tensor,
                    feed) -> list[Tree]:
        raise NotImplementedError

    def full_depth(self) -> int:
        raise NotImplementedError

    def propose_batch(self, states, budgets) -> list[Tree]:
        """A batch's drafts with one head forward per step of the draft for all its sequences
        (`batch_draft.py`) where the head's layer runs on the fused forward; else one after another. A
        step with nothing to draft (load-aware speculation off at this batch size) runs no head forward:
        the accepted paths wait (`EagleDrafter.defer`) for the next step that drafts."""
        if not any(budgets):
            return [Tree.root(state.sequence[-1]) for state in states]
        if self.drafter.fused is None:
            return super().propose_batch(states, budgets)
        return self.batch_draft.trees(states, budgets)

    def draft_state(self, index: int) -> EagleDrafter:
        """Sequence `index`'s drafter (the head's own cache; index 0: `self.drafter`, the one the static
        draft loop runs; the others draft eagerly)."""
        while len(self.lane_drafters) <= index:
            self.lane_drafters.append(self.make_drafter(self.drafter.head, self.drafter.vocabulary))
        return self.lane_drafters[index]

    def static_for(self, state, depth: int, usable: bool = True) -> StaticDraft | None:
        """The static draft step when this sequence's drafter is the one it runs, it is ready at `depth`
        and the caller can use it (`usable`); else None, and the drafter's root is current (a deferred
        follow fed now: `EagleDrafter.settle`)."""
        static = self.static
        if usable and static is not None and state.draft is self.drafter and static.ready(depth):
            return static
        state.draft.settle()
        return None

    def make_drafter(self, head, vocabulary) -> EagleDrafter:
        drafter = EagleDrafter(head, self.target.lm_head, vocabulary)
        self.target.cover(head, *drafter.linears,
                          *([vocabulary.head(self.target.lm_head.weight)] if vocabulary else []))
        return drafter

    def features(self, out) -> torch.Tensor:
        """[n, .] the target features the head reads at each position of a target forward: EAGLE's
        last hidden state (EAGLE-3 overrides: three layers' inputs)."""
        return out.hidden

    def describe(self):
        vocabulary = self.drafter.vocabulary
        return {**super().describe(), "draft_vocab": len(vocabulary) if vocabulary else None}

    def start(self, state, prefill) -> None:
        state.draft.reset(self.target.cache.capacity)  # the target's reserved capacity
        # pairs (x_{i+1}, f_i) for every prompt position: the tokens are shifted by one
        state.draft.follow(state.sequence[1:], self.features(prefill))

    def advance(self, state, tree, acceptance, verified) -> None:
        path = acceptance.path
        # the emitted tokens are on the host already (the step's one read): no second read of the tree
        tokens = acceptance.emitted or tree.tokens[path[1:]].tolist() + [acceptance.next_token]
        # fed by the next draft step: inside its static computation, in its batch's one forward, or
        # alone first (`static_for` settles it)
        state.draft.defer(tokens, self.features(verified)[path])


def one_sequence(feed):
    """A one-sequence feed (`EagleDrafter.feed_level`, `feed_static`: tokens [k], hidden [k, H], seen
    [k, fed]) as the batched draft loops call it (a leading batch dimension of 1)."""
    return lambda tokens, hidden, depth, seen: feed(tokens[0], hidden[0], depth, seen[0])[None]
