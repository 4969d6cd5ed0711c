"""SpS: speculative sampling with a draft LM (Leviathan et al. 2023; Chen et al. 2023).

The draft proposes a chain of γ tokens, one single-token draft forward each; the target verifies
the chain in one forward; acceptance is greedy (argmax match) or speculative sampling with the
residual distribution (`acceptance.sample_accept` on a chain). The draft's cache then drops the
rejected tokens.
"""

from __future__ import annotations

import torch

from .base import BuildContext, DraftVerifyDecoder, register
from .draft_lm import DraftLM
from .loading import load_draft_lm
from .sampling import logits_to_probs, sample
from .tree import Tree


class SpeculativeSamplingDecoder(DraftVerifyDecoder):
    name = "sps"

    def __init__(self, target, draft_model, gamma: int = 4):
        super().__init__(target)
        if gamma < 1:
            raise ValueError(f"gamma (draft length) must be >= 1, got {gamma}")
        self.gamma = gamma
        self.draft = DraftLM(draft_model, target.vocab_size)

    def describe(self):
        return {**super().describe(), "gamma": self.gamma}

    def start(self, prompt, prefill) -> None:
        self.draft.reset()

    def propose(self, root: int, budget: int) -> Tree:
        gamma = min(self.gamma, budget)
        tokens, probs = [root], []
        logits = self.draft.catch_up(self.sequence) if gamma > 0 else None
        for i in range(gamma):
            if self.sampling.greedy:
                token = int(logits.argmax())
            else:
                q = logits_to_probs(logits, self.sampling)
                probs.append(q)
                token = sample(q, self.generator)
            tokens.append(token)
            if i + 1 < gamma:
                logits = self.draft.feed([token])
        draft_probs = torch.stack(probs) if probs else None
        return Tree.chain(torch.tensor(tokens), draft_probs)

    def advance(self, tree, acceptance, verified) -> None:
        self.draft.follow(self.sequence)


@register("sps")
def build(target, params: dict, context: BuildContext) -> SpeculativeSamplingDecoder:
    spec = params.get("draft") or context.draft_spec("sps", "sps")
    draft_model = load_draft_lm(spec, context.target_model)
    return SpeculativeSamplingDecoder(target, draft_model, gamma=int(params.get("gamma", 4)))
