"""Turning logits into the distribution that decoding samples from.

The same processing (temperature, then top-k, then top-p, as in `transformers`) is applied to the
target's and the drafter's logits: speculative sampling is exact only for the processed
distributions of both. Probabilities are computed in fp32 whatever the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities of the processed distribution."""
    logits = logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / config.temperature
    if 0 < config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def draw_children(q: torch.Tensor, k: int, without_replacement: bool,
                  generator: torch.Generator | None) -> torch.Tensor:
    """k tokens per row of q [m, V], in draw order, on q's device (nothing read back). With
    replacement: independent draws. Without: the Gumbel top-k of log q, which is k sequential draws
    without replacement (Kool et al. 2019) and, unlike `torch.multinomial`, needs no count of q's
    nonzero tokens on the host: where q has fewer than k, the extra children get tokens of
    probability 0. Such a child is never accepted and changes nothing (the rule has exhausted q by
    then: `acceptance.tree_decisions`)."""
    if not without_replacement:
        return torch.multinomial(q, k, replacement=True, generator=generator)
    u = torch.rand(q.shape, generator=generator, device=generator.device if generator is not None
                   else q.device).to(q.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
    return torch.topk(torch.log(q) + gumbel, k, dim=-1).indices
