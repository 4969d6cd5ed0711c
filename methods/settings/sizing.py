"""Method sizes that fit the machine: derived from the machine profile when a method's size is `auto`.

The profile (`methods/machine/profile.py`, `latency_curve`) gives v(n) = t(n) / t(1), the cost of
verifying n tokens in one target forward in units of a one-token forward (made non-decreasing in n:
`envelope`); a drafter's cost per drafted token (or level),
c, is measured by the profile in the same unit. With a per-position acceptance estimate α:

* a chain of γ drafted tokens (SpS) yields on average E(γ) = (1 - α^(γ+1)) / (1 - α) tokens per step
  (Leviathan et al. 2023) and costs γ·c + v(γ + 1): γ maximises E / cost;
* a tree (EAGLE, Medusa static trees, MCSD, Jacobi blocks) is kept to the largest size whose
  verification costs at most `VERIFY_BUDGET` one-token forwards: trees grow while verifying stays
  nearly free, and stop where the curve bends.

An explicit value in the config always wins; the chosen size and the numbers behind it go into
the method's description (and so into every results folder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERIFY_BUDGET = 1.3  # a tree may cost at most this many one-token forwards to verify
DEFAULT_ALPHA = 0.6  # per-position acceptance assumed for a draft without a model card


def relative(curve: dict[int, float]) -> dict[int, float]:
    one = curve[min(curve)]
    return {n: s / one for n, s in sorted(curve.items())}


def envelope(curve: dict[int, float]) -> dict[int, float]:
    """The curve relative to t(1), each size at least as costly as every smaller one: a forward over
    more tokens does the smaller one's work and more, so a measured dip (t(16) under t(9) in one
    run's curve) is noise, and sizing on it would take the largest size the dip allows."""
    out, high = {}, 0.0
    for n, v in relative(curve).items():
        high = out[n] = max(high, v)
    return out


def verify_cost(curve: dict[int, float], tokens: int) -> float:
    """v(tokens) on the curve's `envelope`, linearly interpolated between the measured sizes
    (extrapolated past the last)."""
    return verify_costs(curve, [tokens])[0]


def verify_costs(curve: dict[int, float], tokens) -> list[float]:
    """`verify_cost` at each of `tokens`, the envelope made once (a step's sizing asks for dozens)."""
    rel = envelope(curve)
    sizes = sorted(rel)
    out = []
    for n in tokens:
        if n <= sizes[0]:
            out.append(rel[sizes[0]])
            continue
        for low, high in zip(sizes, sizes[1:]):
            if n <= high:
                w = (n - low) / (high - low)
                out.append((1 - w) * rel[low] + w * rel[high])
                break
        else:
            low, high = sizes[-2], sizes[-1]
            out.append(rel[high] + (rel[high] - rel[low]) / (high - low) * (n - high))
    return out


def chain_length(curve: dict[int, float], draft_cost: float, alpha: float, longest: int = 8) -> tuple[int, dict]:
    """SpS γ: the chain length with the most expected tokens per unit of time."""
    alpha = min(max(alpha, 0.0), 0.99)
    rates = {}
    for gamma in range(1, longest + 1):
        expected = (1 - alpha ** (gamma + 1)) / (1 - alpha)
        rates[gamma] = expected / (gamma * draft_cost + verify_cost(curve, gamma + 1))
    best = max(rates, key=rates.get)
    return best, {"alpha": alpha, "draft_cost": draft_cost, "expected_tokens_per_t1": rates}


def tree_budget(curve: dict[int, float], budget: float = VERIFY_BUDGET, largest: int = 64) -> int:
    """The most tokens one verification may hold: the largest n with v(n) <= budget (at least 2), the root
    and the draft of one sequence verified alone (`batch_draft_tokens` at B = 1)."""
    return 1 + batch_draft_tokens(curve, 1, budget, largest - 1)


def batch_draft_tokens(curve: dict[int, float], batch: int, budget: float = VERIFY_BUDGET, largest: int = 64) -> int:
    """Draft tokens per sequence (besides its root) when `batch` sequences verify together, each with a
    draft of n: the largest n (at least 1) whose forward over batch x (n + 1) rows costs at most `budget`
    times AR's at the same batch size, v(B (n + 1)) <= budget v(B) (at B = 1, v(1) = 1). A batch's
    forward holds B times the rows, so on a CPU, where v bends past ~8 rows, the draft shrinks as B
    grows (docs/batching.md)."""
    ar, *costs = verify_costs(curve, [batch] + [batch * (n + 1) for n in range(1, largest + 1)])
    return max([1] + [n for n, cost in enumerate(costs, start=1) if cost <= budget * ar])


def held_out_acceptance(draft_folder: str | None, default: float = DEFAULT_ALPHA) -> float:
    """A draft's first-position acceptance estimate: its model card's held-out teacher-forced
    agreement (`training.json`, the suite's recipes write it), else `default`."""
    file = Path(draft_folder or "") / "training.json"
    if draft_folder and file.is_file():
        return float(json.loads(file.read_text()).get("held_out_acceptance", {}).get("acc_1", default))
    return default


@dataclass(frozen=True)
class Sizing:
    """A decoder's size, settled once when it is built (`BuildContext.sizing`): `value`, its size for one
    sequence in the method's own unit (draft tokens, tree nodes, a k-config, a window); `source`, where
    that came from (the config's number, or how `auto` read the machine profile: it goes into every
    record); and its rule for a batch, `cut(B)`, read from `curve` (the latency curve an `auto` size was
    chosen by; None: the same size at every batch size)."""

    value: Any
    source: dict | None = None
    curve: dict[int, float] | None = None
    cuts: dict[int, int] = field(default_factory=dict, compare=False, repr=False)  # made once per batch size

    @classmethod
    def fixed(cls, value: Any) -> "Sizing":
        """A size the config gave (or the method's only one): no machine reading, no cut."""
        return cls(value)

    @classmethod
    def of(cls, size: Any) -> "Sizing":
        """A decoder's size argument: a `Sizing`, or a plain value (a fixed size)."""
        return size if isinstance(size, Sizing) else cls.fixed(size)

    def choose(self, value: Any, **noted: Any) -> "Sizing":
        """The same budget and rule with the method's own size chosen within it (`noted` goes to `source`)."""
        return Sizing(value, {**(self.source or {}), **noted}, self.curve)

    def cut(self, batch: int) -> int | None:
        """The most draft tokens (nodes besides the root) one sequence drafts when `batch` sequences
        verify together: the machine's verify budget at B rows per token (`batch_draft_tokens`); None:
        no cut (one sequence, or a size not read from the machine). Chains and trees alike are cut to it."""
        if batch <= 1 or self.curve is None:
            return None
        if batch not in self.cuts:
            self.cuts[batch] = batch_draft_tokens(self.curve, batch)
        return self.cuts[batch]

    def describe(self) -> dict | None:
        """`source`, with the cut each batch size took in this run."""
        if not self.source and not self.cuts:
            return None
        return {**(self.source or {}), **({"batch_draft_tokens": dict(sorted(self.cuts.items()))} if self.cuts else {})}
