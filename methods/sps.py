"""SpS: speculative sampling with a draft LM (Leviathan et al. 2023; Chen et al. 2023).

The draft proposes a chain of γ tokens, one draft forward each; the target verifies the chain in
one forward; acceptance is greedy (argmax match) or speculative sampling with the residual
distribution. A chain is the multi-candidate tree with k-config (1, ..., 1), so SpS is MCSD's
code with that configuration.

`gamma: auto` sizes the chain for the most expected tokens per unit of time on this machine
(`settings/sizing.py`: the target's latency curve, the draft's measured cost per token) and keeps
doing so as the run goes: the acceptance estimate starts at the draft's model-card value (worth
`PRIOR_TESTS` tested positions) and follows the positions actually tested and accepted, so a
draft that accepts less on the benchmark than on its training answers gets shorter chains.

`gamma: heuristic` is γ as Spec-Bench runs SpS: `transformers` assisted generation (4.37.1, the
version Spec-Bench pins) with its `heuristic` schedule: γ starts at 5 (`num_assistant_tokens`) in
every generate call (every turn), grows by 2 after a step whose drafts were all accepted and shrinks
by 1 (to at least 1) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import BuildContext, Decoder, register
from .engine.vocab import draft_vocab_setting
from .mcsd import MultiCandidateDecoder
from .models.draft_lm import DraftLM
from .models.loading import load_draft_lm
from .models.specs import ModelSpec
from .settings.params import Settings, integer, mapping, null, one_of, setting
from .settings.sizing import Sizing, chain_length, held_out_acceptance, relative

PRIOR_TESTS = 20  # weight of the model card's acceptance in the running estimate, in tested positions
HEURISTIC_START = 5  # transformers 4.37.1's num_assistant_tokens default (Spec-Bench's SpS)
FIXED_GAMMA = 4  # `gamma: auto` without a machine profile: the decoder's default chain length


@dataclass(frozen=True)
class SpSSettings(Settings):
    """SpS: a draft LM proposes a chain of `gamma` tokens; the target verifies them in one forward
    (speculative sampling with the residual distribution; greedy acceptance at temperature 0)."""

    paper = "Leviathan et al. 2023; Chen et al. 2023"
    draft_kind = "sps"
    size_setting, size_label = "gamma", "draft length γ"

    gamma: int | str = setting("auto", one_of("auto", "heuristic") | integer(1),
                               "draft length; auto = the most expected tokens per second on this machine (machine "
                               "profile); heuristic = Spec-Bench's (transformers 4.37.1 assisted generation: 5, +2 / "
                               "-1); or N")
    draft_vocab: int | str = draft_vocab_setting()
    draft: dict | None = setting(
        None,
        null() | mapping(),
        "null = the model's own drafts.sps; or {path: <hub id or folder>} / {target_layers: k}",
    )

    batchable = True


class SpeculativeSamplingDecoder(MultiCandidateDecoder):
    name = "sps"

    def __init__(self, target, draft_model, gamma: int | str | Sizing = FIXED_GAMMA, vocabulary=None):
        """`gamma`: the chain length, `heuristic`, or `auto`'s `Sizing` (`auto_gamma`: the latency curve, the
        draft's cost per token and its acceptance prior, from which γ is chosen and then follows the run's
        acceptance)."""
        gamma = Sizing.of(gamma)
        super().__init__(target, draft_model, k_config=Sizing((1,), None, gamma.curve), replacement=True,
                         vocabulary=vocabulary)
        self.sizing = gamma
        self.heuristic = gamma.value == "heuristic"
        self.set_gamma(HEURISTIC_START if self.heuristic else gamma.value)
        source = gamma.source or {}
        # gamma=auto: the curve, the draft's cost, the acceptance counts
        self.auto = None if "draft_cost" not in source else \
            {"curve": gamma.curve, "cost": source["draft_cost"], "prior": source["alpha_prior"], "tested": 0,
             "accepted": 0}
        self.steps_by_gamma: dict[int, int] = {}

    def start(self, state, prefill) -> None:
        super().start(state, prefill)
        # the sequence's γ: heuristic, transformers' per call (a new candidate generator at γ = 5);
        # else the decoder's (fixed, or `auto`'s from the acceptance of every sequence so far)
        state.values["gamma"] = HEURISTIC_START if self.heuristic else self.gamma

    def k_config_of(self, state) -> tuple[int, ...]:
        return (1,) * state.values["gamma"]

    def advance(self, state, tree, acceptance, verified) -> None:
        super().advance(state, tree, acceptance, verified)
        if len(tree) <= 1:
            return
        gamma = state.values["gamma"]
        self.steps_by_gamma[gamma] = self.steps_by_gamma.get(gamma, 0) + 1
        if self.heuristic:  # all of the γ asked for accepted: +2, else -1
            state.values["gamma"] = gamma + 2 if acceptance.accepted_drafts == gamma else max(1, gamma - 1)
        if self.auto is not None:
            auto = self.auto
            auto["accepted"] += acceptance.accepted_drafts
            auto["tested"] += min(acceptance.accepted_drafts + 1, len(tree) - 1)
            self.set_gamma(chain_length(auto["curve"], auto["cost"], self.alpha_estimate())[0])
            state.values["gamma"] = self.gamma

    def alpha_estimate(self) -> float:
        auto = self.auto
        return (auto["prior"] * PRIOR_TESTS + auto["accepted"]) / (PRIOR_TESTS + auto["tested"])

    def set_gamma(self, gamma: int) -> None:
        if gamma < 1:
            raise ValueError(f"gamma (draft length) must be >= 1, got {gamma}")
        self.gamma, self.k_config = gamma, (1,) * gamma

    def describe(self):
        described = {**Decoder.describe(self), "gamma": self.gamma,
                     "draft_vocab": len(self.vocabulary) if self.vocabulary else None}
        if self.heuristic:
            described["gamma"] = "heuristic"
            described["sizing"] = {"gamma": "heuristic", "start": HEURISTIC_START,
                                   "steps_by_gamma": dict(sorted(self.steps_by_gamma.items()))}
        if self.auto is not None:
            auto = self.auto
            described["gamma"] = "auto"
            described["sizing"] = {"gamma": "auto", "draft_cost": auto["cost"], "alpha_prior": auto["prior"],
                                   "alpha_measured": self.alpha_estimate(), "tested": auto["tested"],
                                   "steps_by_gamma": dict(sorted(self.steps_by_gamma.items())),
                                   "curve_t1": {n: round(v, 3) for n, v in relative(auto["curve"]).items()},
                                   **({"batch_draft_tokens": dict(sorted(self.sizing.cuts.items()))}
                                      if self.sizing.cuts else {})}
        return described


@register("sps", settings=SpSSettings)
def build(target, settings: SpSSettings, context: BuildContext) -> SpeculativeSamplingDecoder:
    gamma = settings.gamma
    spec = settings.draft or context.draft_spec("sps", "sps")
    draft = load_draft_lm(spec, context.target_model)
    vocabulary = context.draft_vocabulary(settings.to_dict(), draft.get_output_embeddings().out_features)
    draft_lm = DraftLM.of(draft, target, vocabulary)
    curve = context.latency_curve(target) if gamma == "auto" else None
    if gamma == "auto" and curve is None:
        gamma = Sizing(FIXED_GAMMA, {"gamma": "auto", "profile": f"none: the fixed {FIXED_GAMMA}"})
    elif gamma == "auto":  # the chain length with the most expected tokens per second on this machine
        token = context.profile.forward_latency(draft_lm.runner, (1,), "the draft LM's token")[1]
        gamma = auto_gamma(curve, token / curve[min(curve)],
                           held_out_acceptance(ModelSpec.from_mapping(spec).path if spec.get("path") else None))
    return SpeculativeSamplingDecoder(target, draft_lm, gamma=gamma, vocabulary=vocabulary)


def auto_gamma(curve: dict[int, float], cost: float, alpha: float) -> Sizing:
    """`gamma: auto` settled: the chain length with the most expected tokens per unit of time for a draft
    costing `cost` one-token target forwards per token with acceptance `alpha` (`chain_length`)."""
    return Sizing(chain_length(curve, cost, alpha)[0], {"gamma": "auto", "draft_cost": cost, "alpha_prior": alpha},
                  curve)
