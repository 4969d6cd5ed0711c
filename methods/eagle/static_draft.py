"""The head's whole draft step as one static computation (`engine.cuda_graphs`): the follow of the
accepted path and the draft depth loop, fed at device positions over the head's reserved cache,
captured as one CUDA graph on a GPU."""

from __future__ import annotations

import torch

from ..engine.graphs import capture, compiled


class StaticDraft:
    """A decoder's draft step as one static computation over the head's reserved cache, under
    `engine.cuda_graphs` on / auto on a GPU:

      * the follow: the accepted path the last step deferred (`EagleDrafter.defer`: its tokens and
        the target's features) is copied into buffers of fixed address, padded to `rows` (the
        longest path a step accepts), with its length and the committed count as one-element device
        tensors; the head feeds it (`EagleDrafter.follow_static`) and takes the root from its last
        real row;
      * the depth loop (`draft_levels`: EAGLE-2's expansion, EAGLE-1's template) from that root,
        every level fed at device positions after the path (`EagleDrafter.feed_static`).

    So the whole step reads nothing back. `key`: the loop's depth (levels for EAGLE-2, the depth
    limit for EAGLE-1). The full depth with a follow, the step of every answer but its first and
    last few, is compiled under `engine.compile` (`graphs.compiled`) and on a GPU captured as one
    CUDA graph; the first step of an answer (its root from the prompt's follow, eager) and a shorter
    depth near an answer's end run the same computation eagerly, as everything does on a CPU
    without `engine.compile`, which is what the CPU tests compare."""

    def __init__(self, decoder, graphed: bool, compile_: str | None = None):  # decoder: its `decoder.EagleBase`
        self.decoder, self.graphed, self.compile = decoder, graphed, compile_
        self.step = None  # the full step (`compiled`), made at its first run
        self.tokens = self.features = self.hidden = self.logits = None
        self.start = self.count = None
        self.graph, self.outputs, self.addresses = None, None, []
        self.captures = 0

    @property
    def rows(self) -> int:
        """The follow's rows: the longest path a step accepts (a node at every level) and the bonus token."""
        return self.decoder.full_depth() + 1

    def ready(self, key: int) -> bool:
        """Whether the step at depth `key` fits: the deferred path (at most `rows`) and the levels'
        entries after it, every padded row included, in the head's reserved cache."""
        drafter = self.decoder.drafter
        pending = 0 if drafter.pending is None else len(drafter.pending[0])
        if pending > self.rows:
            return False
        slots = max(self.rows, pending + self.decoder.drafted_entries(key)) if pending else \
            self.decoder.drafted_entries(key)
        return drafter.static_room(slots)

    @torch.inference_mode()
    def run(self, key: int) -> tuple[torch.Tensor, ...]:
        """The draft step at depth `key`: the deferred follow (if any) and the levels; what
        `draft_levels` returns. The host then moves the head's committed count past the path."""
        drafter = self.decoder.drafter
        follow = self.stage()
        drafter.cache.rollback(drafter.committed)  # tree entries an eager step fed (a static one moves nothing)
        full = follow and key == self.decoder.full_depth()
        if full and self.step is None:
            self.step = compiled(lambda: self.compute(key, True), self.compile)
        if not full:
            outputs = self.compute(key, follow)
        elif not self.graphed:
            outputs = self.step()
        else:
            rope, buffers = drafter.fused.rope, drafter.cache.layers[0]
            addresses = [buffers.key_buffer.data_ptr(), buffers.value_buffer.data_ptr(), rope.cos.data_ptr(),
                         rope.sin.data_ptr(), self.tokens.data_ptr(), self.features.data_ptr()]
            if self.graph is None or addresses != self.addresses:  # a new cache, table or buffer: capture again
                self.graph, self.outputs = capture(self.step)
                self.addresses = addresses
                self.captures += 1
            self.graph.replay()
            outputs = self.outputs
        if follow:
            n = len(drafter.pending[0])
            drafter.pending = None
            drafter.cache.advance(0, n)
            drafter.committed += n
            drafter.root_hidden, drafter.root_draft = outputs[0], outputs[1]
        return outputs[2:]

    def stage(self) -> bool:
        """The step's inputs into their buffers: the deferred path (True), or, with none, the root the
        drafter holds (False). Host-to-device copies and device copies only."""
        drafter = self.decoder.drafter
        if self.start is None:
            self.start = torch.zeros(1, dtype=torch.long, device=drafter.device)
            self.count = torch.ones(1, dtype=torch.long, device=drafter.device)
        self.start.fill_(drafter.committed)
        if drafter.pending is None:
            if self.hidden is None or self.hidden.shape != drafter.root_hidden.shape \
                    or self.logits.shape != drafter.root_draft.shape:
                self.hidden, self.logits = torch.empty_like(drafter.root_hidden), torch.empty_like(drafter.root_draft)
            self.hidden.copy_(drafter.root_hidden)
            self.logits.copy_(drafter.root_draft)
            return False
        tokens, features = drafter.pending
        n = len(tokens)
        if self.features is None or self.features.shape[1:] != features.shape[1:] \
                or self.features.dtype != features.dtype:
            self.tokens = torch.zeros(self.rows, dtype=torch.long, device=drafter.device)
            self.features = features.new_zeros(self.rows, *features.shape[1:])
        self.tokens[:n].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        self.features[:n].copy_(features)
        self.count.fill_(n)
        return True

    def compute(self, key: int, follow: bool) -> tuple[torch.Tensor, ...]:
        """(root hidden, root draft logits, *`draft_levels`' outputs) from the staged buffers."""
        drafter = self.decoder.drafter
        if follow:
            hidden, logits = drafter.follow_static(self.tokens, self.features, self.start, self.count)
            start = self.start + self.count
        else:
            hidden, logits, start = self.hidden, self.logits, self.start
        levels = self.decoder.draft_levels(
            hidden, logits, key,
            lambda tokens, parent, depth, seen: drafter.feed_static(tokens, parent, depth, seen, start),
        )
        return (hidden, logits, *levels)
