"""EAGLE-3 decoding (arXiv 2503.01840; SafeAILab/EAGLE main): the EAGLE-3 head drafts EAGLE-2's
dynamic tree (`dynamic.Eagle2Decoder`: the same expansion, rerank and sizing) from the target's
hidden states at three depths.

The target runner also returns the hidden states entering its layers 2, L//2 and L-3
(`ModelRunner.capture_inputs`, forward hooks that only this method's runner installs); the head fuses
them with `fc` into one feature per position. As in EAGLE, the head's cache holds the pairs
(x_{i+1}, g_i) of the accepted sequence; tree levels feed the head's own output at the parent
(not fused again). Its own lm_head covers a draft vocabulary of `draft_vocab_size` tokens mapped to
target ids by `d2t`: the logits are -inf elsewhere (q = 0 there), so the target's verification keeps
greedy output exact and sampling lossless (EAGLE-2's rule, as `eagle2`).
"""

from __future__ import annotations

import torch

from ..base import BuildContext, register
from ..models.heads.eagle3 import Eagle3Head, load_eagle3_head
from ..models.heads.source import head_spec
from ..settings.sizing import Sizing
from .drafter import EagleDrafter
from .dynamic import UPSTREAM_TOTAL, Eagle2Decoder, build_dynamic
from .settings import Eagle3Settings


class Eagle3Drafter(EagleDrafter):
    """EAGLE's drafter (head cache, follow, tree levels) with EAGLE-3's fused features and own lm_head."""

    def __init__(self, head: Eagle3Head):
        super().__init__(head, None, head.vocabulary)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.head.draft_logits(hidden)

    def follow_inputs(self, features: torch.Tensor) -> torch.Tensor:
        """`features` [n, 3·H_t]: the target's three layers' inputs along the accepted tokens, fused."""
        return self.head.fuse(features)


class Eagle3Decoder(Eagle2Decoder):
    name = "eagle3"

    def __init__(self, target, head: Eagle3Head, total_tokens: int | Sizing = UPSTREAM_TOTAL,
                 depth: int = Eagle3Settings.depth, top_k: int = Eagle3Settings.top_k,
                 verify_seconds: dict[int, float] | None = None):
        super().__init__(target, head, total_tokens=total_tokens, depth=depth, top_k=top_k,
                         verify_seconds=verify_seconds)
        target.capture_inputs(head.layers)

    def make_drafter(self, head: Eagle3Head, vocabulary) -> Eagle3Drafter:
        drafter = Eagle3Drafter(head)
        self.target.cover(head, *drafter.linears)
        return drafter

    def features(self, out) -> torch.Tensor:
        return out.layers

    def describe(self):
        return {**super().describe(), "feature_layers": list(self.drafter.head.layers),
                "draft_vocab": self.drafter.head.lm_head.out_features}


@register("eagle3", settings=Eagle3Settings)
def build_eagle3(target, settings: Eagle3Settings, context: BuildContext) -> Eagle3Decoder:
    head = load_eagle3_head(head_spec({"name": "eagle3", **settings.to_dict()}, context, "eagle3"),
                            context.target_model)
    return build_dynamic(Eagle3Decoder, target, head, settings, context)
