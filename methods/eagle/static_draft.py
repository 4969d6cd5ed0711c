"""The head's draft depth loop as one static computation (`engine.cuda_graphs`): fed at device
positions over the head's reserved cache, captured as one CUDA graph on a GPU."""

from __future__ import annotations

import torch

from ..engine.graphs import capture


class StaticDraft:
    """A decoder's draft levels (`draft_levels`: EAGLE-2's expansion, EAGLE-1's template) as one
    static computation over the head's reserved cache, under `engine.cuda_graphs` on / auto on a
    GPU: the root's hidden state and logits and the committed count are copied into buffers of
    fixed address, and every level is fed at device positions (`EagleDrafter.feed_static`), so the
    whole depth loop reads nothing back. `key`: the loop's depth (levels for EAGLE-2, the depth
    limit for EAGLE-1). On a GPU the full depth is captured as one CUDA graph (a shorter one, near
    an answer's end, runs the same computation eagerly); on a CPU it runs eagerly, which is what the
    CPU tests compare."""

    def __init__(self, decoder, graphed: bool):  # decoder: its `decoder.EagleBase`
        self.decoder, self.graphed = decoder, graphed
        self.hidden = self.logits = self.start = None
        self.graph, self.outputs, self.addresses = None, None, []
        self.captures = 0

    def ready(self, key: int) -> bool:
        return self.decoder.drafter.static_room(self.decoder.drafted_entries(key))

    @torch.inference_mode()
    def run(self, key: int) -> tuple[torch.Tensor, ...]:
        drafter = self.decoder.drafter
        if (
            self.hidden is None
            or self.hidden.shape != drafter.root_hidden.shape
            or self.logits.shape != drafter.root_draft.shape
        ):
            self.hidden, self.logits = torch.empty_like(drafter.root_hidden), torch.empty_like(drafter.root_draft)
            self.start = torch.zeros(1, dtype=torch.long, device=drafter.device)
            self.graph = None
        self.hidden.copy_(drafter.root_hidden)
        self.logits.copy_(drafter.root_draft)
        self.start.fill_(drafter.committed)
        if not self.graphed or key != self.decoder.full_depth():
            return self.compute(key)
        rope, buffers = drafter.fused.rope, drafter.cache.layers[0]
        addresses = [buffers.key_buffer.data_ptr(), buffers.value_buffer.data_ptr(), rope.cos.data_ptr(),
                     rope.sin.data_ptr()]
        if self.graph is None or addresses != self.addresses:  # a new cache or table: capture again
            self.graph, self.outputs = capture(lambda: self.compute(key))
            self.addresses = addresses
            self.captures += 1
        self.graph.replay()
        return self.outputs

    def compute(self, key: int) -> tuple[torch.Tensor, ...]:
        drafter = self.decoder.drafter
        return self.decoder.draft_levels(
            self.hidden,
            self.logits,
            key,
            lambda tokens, hidden, depth, seen: drafter.feed_static(tokens, hidden, depth, seen, self.start),
        )
