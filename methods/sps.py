"""SpS: speculative sampling with a draft LM (Leviathan et al. 2023; Chen et al. 2023).

The draft proposes a chain of γ tokens, one draft forward each; the target verifies the chain in
one forward; acceptance is greedy (argmax match) or speculative sampling with the residual
distribution. A chain is the multi-candidate tree with k-config (1, ..., 1), so SpS is MCSD's
code with that configuration.
"""

from __future__ import annotations

from .base import BuildContext, Decoder, register
from .engine.params import integer, mapping, null, one_of
from .engine.sizing import chain_length, draft_cost, held_out_acceptance
from .engine.vocab import DRAFT_VOCAB
from .models.specs import ModelSpec
from .models.loading import load_draft_lm
from .mcsd import MultiCandidateDecoder


class SpeculativeSamplingDecoder(MultiCandidateDecoder):
    name = "sps"

    def __init__(self, target, draft_model, gamma: int = 4, vocabulary=None):
        super().__init__(target, draft_model, k_config=(1,), replacement=True, vocabulary=vocabulary)
        self.set_gamma(gamma)

    def set_gamma(self, gamma: int) -> None:
        if gamma < 1:
            raise ValueError(f"gamma (draft length) must be >= 1, got {gamma}")
        self.gamma, self.k_config = gamma, (1,) * gamma

    def describe(self):
        return {**Decoder.describe(self), "gamma": self.gamma,
                "draft_vocab": len(self.vocabulary) if self.vocabulary else None}


@register("sps", params={"gamma": one_of("auto") | integer(1), "draft": null() | mapping(), "draft_vocab": DRAFT_VOCAB})
def build(target, params: dict, context: BuildContext) -> SpeculativeSamplingDecoder:
    gamma = params.get("gamma", "auto")
    spec = params.get("draft") or context.draft_spec("sps", "sps")
    draft = load_draft_lm(spec, context.target_model)
    decoder = SpeculativeSamplingDecoder(target, draft, gamma=1 if gamma == "auto" else gamma,
                                         vocabulary=context.draft_vocabulary(params, draft.get_output_embeddings().out_features))
    if gamma == "auto":  # the chain length with the most expected tokens per second on this machine
        curve = context.latency_curve(target)
        cost = draft_cost(decoder.draft.runner, curve)
        alpha = held_out_acceptance(ModelSpec.from_mapping(spec).path if spec.get("path") else None)
        best, record = chain_length(curve, cost, alpha)
        decoder.set_gamma(best)
        decoder.sizing = {"gamma": "auto", "chosen": best, **record}
    return decoder
