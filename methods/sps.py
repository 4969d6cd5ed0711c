"""SpS: speculative sampling with a draft LM (Leviathan et al. 2023; Chen et al. 2023).

The draft proposes a chain of γ tokens, one draft forward each; the target verifies the chain in
one forward; acceptance is greedy (argmax match) or speculative sampling with the residual
distribution. A chain is the multi-candidate tree with k-config (1, ..., 1), so SpS is MCSD's
code with that configuration.
"""

from __future__ import annotations

from .base import BuildContext, Decoder, register
from .models.loading import load_draft_lm
from .mcsd import MultiCandidateDecoder


class SpeculativeSamplingDecoder(MultiCandidateDecoder):
    name = "sps"

    def __init__(self, target, draft_model, gamma: int = 4):
        if gamma < 1:
            raise ValueError(f"gamma (draft length) must be >= 1, got {gamma}")
        super().__init__(target, draft_model, k_config=(1,) * gamma, replacement=True)
        self.gamma = gamma

    def describe(self):
        return {**Decoder.describe(self), "gamma": self.gamma}


@register("sps")
def build(target, params: dict, context: BuildContext) -> SpeculativeSamplingDecoder:
    spec = params.get("draft") or context.draft_spec("sps", "sps")
    return SpeculativeSamplingDecoder(target, load_draft_lm(spec, context.target_model), gamma=int(params.get("gamma", 4)))
