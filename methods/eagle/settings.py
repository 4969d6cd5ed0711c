"""The EAGLE family's settings: `eagle`'s (EAGLE-1's static tree), the dynamic tree's that `eagle2`
and `eagle3` share, and each method's own (the `conf/method/<name>.yaml` files are written from them)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.static_trees import NAMED_TREES
from ..engine.vocab import draft_vocab_setting
from ..models.heads.source import head_setting
from ..settings.params import Settings, integer, one_of, paths, setting

# `method.sampling_rule` of `eagle` at temperature > 0: EAGLE-1's sampled drafts + multi-candidate
# rule with the draft's q (default), or EAGLE-2's deterministic top-k + point-mass rule
SAMPLING_RULES = ("eagle1", "eagle2")


@dataclass(frozen=True)
class EagleSettings(Settings):
    """EAGLE (EAGLE-1): the EAGLE head drafts a static tree from the target's features."""

    paper = "Li et al. 2024 (SafeAILab/EAGLE)"
    draft_kind = "eagle"
    size_setting, size_recorded, size_label = "tree", "tree_nodes", "tree size (nodes)"
    size_derived = ("tree_depth", "top_k")

    tree: str | list = setting("auto", one_of("auto", *NAMED_TREES) | paths(),
                               "auto = EAGLE's own 25-node tree cut to what this machine verifies nearly free; "
                               "eagle_mc_sim_7b_63 (upstream's, whole); or a list of paths")
    draft_vocab: int | str = draft_vocab_setting()
    head: dict | None = head_setting("eagle")
    sampling_rule: str = setting("eagle1", one_of(*SAMPLING_RULES),
                                 "temperature > 0 only: eagle1 = EAGLE-1's (children sampled from the head without "
                                 "replacement, multi-candidate verification with the head's q); eagle2 = top-k "
                                 "children, EAGLE-2's rule (accept x with probability p(x)). Greedy: the same")

    batchable = True


@dataclass(frozen=True)
class DynamicTreeSettings(Settings):
    """EAGLE-2's dynamic tree (EAGLE-3 drafts the same tree)."""

    total_tokens: int | str = setting("adaptive", one_of("adaptive", "auto") | integer(2),
                                      "adaptive = sized per step from the machine's latency curve and the path "
                                      "probabilities; 60 (upstream's 7B default), or auto (EAGLE-2's -1: times target "
                                      "forwards at 40..60)")
    depth: int = setting(5, integer(0), "expansion steps (up to depth + 1 draft tokens per path)")
    top_k: int = setting(10, integer(1), "children kept per expanded node")

    batchable = True
    size_setting, size_label = "total_tokens", "tree size (total tokens)"


@dataclass(frozen=True)
class Eagle2Settings(DynamicTreeSettings):
    """EAGLE-2: the EAGLE head drafts a dynamic tree (expand the top-k frontier by cumulative
    log-probability, then keep the best total_tokens - 1 nodes)."""

    paper = "Li et al. 2024 (SafeAILab/EAGLE)"
    draft_kind = "eagle"

    draft_vocab: int | str = draft_vocab_setting()
    head: dict | None = head_setting("eagle")


@dataclass(frozen=True)
class Eagle3Settings(DynamicTreeSettings):
    """EAGLE-3: the EAGLE-3 head (fc over the inputs of the target's layers 2, L//2 and L-3, one decoder
    layer, its own lm_head over a reduced draft vocabulary mapped by d2t) drafts EAGLE-2's dynamic tree."""

    paper = "Li et al. 2025 (SafeAILab/EAGLE)"
    draft_kind = "eagle3"

    depth: int = setting(7, integer(0),
                         "expansion steps (up to depth + 1 draft tokens per path); upstream's EAGLE-3 default")
    head: dict | None = head_setting("eagle3")
