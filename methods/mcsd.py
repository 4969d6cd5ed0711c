"""MCSD: multi-candidate speculative decoding (arXiv 2401.06706).

A draft LM proposes a tree by a k-config (k_1, ..., k_L): every node at depth d-1 gets k_d
children sampled from the draft distribution (one draft forward per depth); the target verifies
the tree in one forward. Verification per depth tries the accepted node's children in sampled
order, accepting with probability p/q; on rejection p <- norm(max(0, p - q)), and without
replacement also q(x) <- 0, q <- norm(q) (`acceptance.sample_accept`). Greedy uses the top-k
children. Both caches keep only the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .base import BuildContext, register
from .engine.params import BOOL, Settings, int_list, integer, mapping, null, one_of, setting
from .engine.tree import Tree
from .engine.vocab import draft_vocab_setting
from .loop import DraftVerifyDecoder
from .models.draft_lm import BatchDraftLM, DraftLM
from .models.loading import load_draft_lm

PAPER_K_CONFIG = (4, 2, 1)  # the paper's; `auto` without a machine profile

@dataclass(frozen=True)
class MCSDSettings(Settings):
    """MCSD: a draft LM proposes a multi-candidate tree (k_config children per depth), verified in one
    target forward with multi-candidate speculative sampling."""

    paper = "Yang et al. 2024 (NJUNLP/MCSD)"
    draft_kind = "sps"
    size_setting, size_label = "k_config", "draft tree nodes"

    @classmethod
    def size_in(cls, config: dict) -> tuple[str, Any] | None:
        """The tree's node count: k_config [4, 2, 1] drafts 4 + 8 + 8 nodes."""
        found = super().size_in(config)
        return found if found is None or not isinstance(found[1], list) else (cls.size_label, tree_nodes(found[1]))

    k_config: list | int | str = setting("auto", one_of("auto") | int_list(1) | integer(1),
                                         "children per node at each depth, e.g. [4, 2, 1]; auto = the largest tree "
                                         "this machine verifies nearly free")
    draft_vocab: int | str = draft_vocab_setting()
    replacement: bool = setting(False, BOOL, "false = sample candidates without replacement (and verify accordingly)")
    draft: dict | None = setting(None, null() | mapping(),
                                 "null = the model's drafts.sps; or {path: ...} / {target_layers: k}")

    batchable = True


class MultiCandidateDecoder(DraftVerifyDecoder):
    name = "mcsd"

    def __init__(self, target, draft_model, k_config: Sequence[int] = PAPER_K_CONFIG,
                 replacement: bool = MCSDSettings.replacement,
                 vocabulary=None, sizing: dict | None = None):
        super().__init__(target, sizing)
        k_config = tuple(int(k) for k in k_config)
        if not k_config or min(k_config) < 1:
            raise ValueError(f"k_config must be a non-empty list of positive integers, got {list(k_config)}")
        self.k_config, self.replacement = k_config, replacement
        self.draft = DraftLM(draft_model, target.vocab_size, vocabulary, **target.engine_settings())
        self.vocabulary = vocabulary
        self.lane_drafts = [self.draft]  # sequence i of a batch drafts with lane_drafts[i] (`draft_state`)
        self.batch_draft = BatchDraftLM(self.draft)  # a batch's drafts, one draft forward per depth (`propose_batch`)
        # `k_config: auto` keeps the curve it was chosen by (`batch_curve`), so that a batch's tree is chosen
        # at B rows per node (`batch_k_config`); the configurations chosen, by batch size
        self.batch_k_configs: dict[int, tuple[int, ...]] = {}

    def describe(self):
        described = {**super().describe(), "k_config": list(self.k_config), "replacement": self.replacement,
                     "draft_vocab": len(self.vocabulary) if self.vocabulary else None}
        if self.batch_k_configs:
            described["batch_k_configs"] = {b: list(k) for b, k in sorted(self.batch_k_configs.items())}
        return described

    def draft_state(self, index: int) -> DraftLM:
        """Sequence `index`'s draft LM: its own cache over the same weights (index 0: `self.draft`)."""
        while len(self.lane_drafts) <= index:
            self.lane_drafts.append(self.draft.another())
        return self.lane_drafts[index]

    def start(self, state, prefill) -> None:
        state.draft.reset()

    def k_config_of(self, state) -> tuple[int, ...]:
        """Children per depth of this sequence's next tree: the decoder's, or, with `k_config: auto`, a
        greedy sequence of a batch gets the batch size's (`batch_k_config`). A sampled one keeps the
        batch-1 tree: a seeded answer draws the same at any batch size."""
        if state.batch > 1 and state.sampling.greedy and self.batch_curve is not None:
            return self.batch_k_config(state.batch)
        return self.k_config

    def batch_k_config(self, batch: int) -> tuple[int, ...]:
        """`auto`'s choice at `batch` sequences: the largest of `AUTO_K_CONFIGS` whose nodes fit the
        verify budget at B rows per node (`batch_budget`, the chains' cut, in nodes), at most the
        batch-1 tree; made once per batch size."""
        if batch not in self.batch_k_configs:
            nodes = min(tree_nodes(self.k_config), self.batch_budget(batch))
            fitting = [k for k in AUTO_K_CONFIGS if tree_nodes(k) <= nodes] or AUTO_K_CONFIGS[:1]
            self.batch_k_configs[batch] = fitting[-1]
        return self.batch_k_configs[batch]

    def propose(self, state, root: int, budget: int) -> Tree:
        k_config = self.k_config_of(state)[:budget]
        if not k_config:
            return Tree(torch.tensor([root]), [-1])
        return state.draft.draft_tree(state.sequence, k_config, state.sampling, state.generator,
                                      without_replacement=not self.replacement)

    def propose_batch(self, states, budgets) -> list[Tree]:
        """A batch's trees with one draft forward per depth for all its sequences (`BatchDraftLM`)."""
        return self.batch_draft.draft_trees(states, [self.k_config_of(state)[:budget]
                                                     for state, budget in zip(states, budgets)],
                                            without_replacement=not self.replacement)

    def advance(self, state, tree, acceptance, verified) -> None:
        state.draft.keep_path(tree, acceptance.path, acceptance.emitted)


def parse_k_config(value) -> tuple[int, ...]:
    """`4,2,1`, `[4, 2, 1]` or `4`."""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if isinstance(value, int):
        value = [value]
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"k_config must look like 4,2,1 (children per depth), got {value!r}") from None


# `k_config: auto`: the largest of these whose tree (root included) fits the machine's verify budget
AUTO_K_CONFIGS = [(1, 1), (2, 1), (2, 1, 1), (2, 2, 1), (3, 2, 1), (4, 2, 1), (4, 2, 2, 1), (5, 3, 2, 1), (8, 4, 2, 1)]


def tree_nodes(k_config) -> int:
    nodes, width = 0, 1
    for k in k_config:
        width *= k
        nodes += width
    return nodes


@register("mcsd", settings=MCSDSettings)
def build(target, settings: MCSDSettings, context: BuildContext) -> MultiCandidateDecoder:
    spec = settings.draft or context.draft_spec("sps", "mcsd")
    choice, sizing = settings.k_config, None
    if choice == "auto":
        budget, sizing = context.tree_budget(target, "k_config", tree_nodes(PAPER_K_CONFIG) + 1)
        fitting = [k for k in AUTO_K_CONFIGS if tree_nodes(k) + 1 <= budget] or AUTO_K_CONFIGS[:1]
        choice = fitting[-1]
        sizing["chosen"] = list(choice)
    draft = load_draft_lm(spec, context.target_model)
    decoder = MultiCandidateDecoder(target, draft, k_config=parse_k_config(choice),
                                    replacement=settings.replacement,
                                    vocabulary=context.draft_vocabulary(settings.to_dict(),
                                                                        draft.get_output_embeddings().out_features),
                                    sizing=sizing)
    if settings.k_config == "auto":
        decoder.batch_curve = context.latency_curve(target)  # (None without a profile: the paper's tree)
    return decoder
