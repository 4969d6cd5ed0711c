"""Exact distributions of tiny models and a chi-square goodness-of-fit test against them."""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from scipy import stats

from methods.engine.sampling import SamplingConfig, logits_to_probs
from methods.engine.stopping import StopCondition

# The tiny-vocabulary setting of every sampling test: the joint distribution of the first tokens
# generated after PROMPT has few enough cells for a chi-square test with a few thousand samples.
VOCAB = 4
PROMPT = [0, 1, 2, 3, 1]
TEMPERATURE_1 = SamplingConfig(temperature=1.0)


def draw(decoder, n: int, length: int = 3, seed: int = 0, sampling: SamplingConfig = TEMPERATURE_1) -> list[tuple]:
    """n samples of the first `length` tokens, one seeded generator for the whole series."""
    generator = torch.Generator().manual_seed(seed)
    stop = StopCondition(length)
    return [tuple(decoder.generate(PROMPT, stop, sampling, generator).tokens) for _ in range(n)]


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
