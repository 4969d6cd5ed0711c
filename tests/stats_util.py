"""Exact distributions of tiny models and a chi-square goodness-of-fit test against them."""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from scipy import stats

from methods.sampling import SamplingConfig, logits_to_probs


def exact_joint(model, prompt: list[int], length: int, sampling: SamplingConfig) -> dict[tuple, float]:
    """P(first `length` generated tokens) under the processed target distribution, by enumeration."""
    vocab = model.config.vocab_size
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length):
            ids = torch.tensor([prompt + list(seq[:-1])])
            probs = logits_to_probs(model(input_ids=ids).logits[0, len(prompt) - 1 :], sampling)
            joint[seq] = float(torch.prod(probs[torch.arange(length), torch.tensor(seq)]))
    return joint


def chi_square_pvalue(samples: list[tuple], expected: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Goodness of fit of `samples` to the distribution `expected`; cells with few expected counts
    are pooled. A sample in a cell of probability 0 gives p-value 0."""
    n = len(samples)
    counts = Counter(samples)
    if any(expected.get(cell, 0.0) == 0.0 for cell in counts):
        return 0.0
    observed, predicted, pool_obs, pool_exp = [], [], 0, 0.0
    for cell, prob in sorted(expected.items(), key=lambda kv: -kv[1]):
        if prob * n >= min_expected:
            observed.append(counts.get(cell, 0))
            predicted.append(prob * n)
        else:
            pool_obs += counts.get(cell, 0)
            pool_exp += prob * n
    if pool_exp > 0:
        observed.append(pool_obs)
        predicted.append(pool_exp)
    scale = sum(observed) / sum(predicted)
    return float(stats.chisquare(observed, [e * scale for e in predicted]).pvalue)
