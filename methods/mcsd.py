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

from .base import BuildContext, register
from .engine.tree import Tree
from .engine.vocab import draft_vocab_setting
from .loop import DraftVerifyDecoder
from .models.draft_lm import BatchDraftLM, DraftLM
from .models.loading import load_draft_lm
from .settings.params import BOOL, Settings, int_list, integer, mapping, null, one_of, setting
from .settings.sizing import Sizing

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

    def __init__(self, target, draft_model, k_config: Sequence[int] | Sizing = PAPER_K_CONFIG,
                 replacement: bool = MCSDSettings.replacement, vocabulary=None):
        """`draft_model`: the draft LM (a model, or a `DraftLM` the factory built to time it); `k_config`:
        children per depth (`method.k_config` settled: a `Sizing`, whose batch rule picks a smaller one)."""
        super().__init__(target, Sizing.of(k_config))
        k_config = tuple(int(k) for k in self.sizing.value)
        if not k_config or min(k_config) < 1:
            raise ValueError(f"k_config must be a non-empty list of positive integers, got {list(k_config)}")
        self.k_config, self.replacement = k_config, replacement
        self.draft = DraftLM.of(draft_model, target, vocabulary)
        self.vocabulary = vocabulary
        self.batch_draft = BatchDraftLM(self.draft)  # a batch's drafts, one draft forward per depth (`propose_batch`)
        self.batch_k_configs: dict[int, tuple[int, ...]] = {}  # a batch's cut (`batch_k_config`), by nodes

    def describe(self):
        described = {**super().describe(), "k_config": list(self.k_config), "replacement": self.replacement,
                     "draft_vocab": len(self.vocabulary) if self.vocabulary else None}
        if self.batch_k_configs:
            described["batch_k_configs"] = {n: list(k) for n, k in sorted(self.batch_k_configs.items())}
        return described

    @property
    def lane_drafts(self) -> list[DraftLM]:
        """The draft LMs the sequences of a batch have drafted with so far (`DraftLM.lanes`)."""
        return self.draft.lanes

    def draft_state(self, index: int) -> DraftLM:
        """Sequence `index`'s draft LM: its own cache over the same weights (index 0: `self.draft`)."""
        return self.draft.lane(index)

    def start(self, state, prefill) -> None:
        state.draft.reset()

    def k_config_of(self, state) -> tuple[int, ...]:
        """Children per depth of this sequence's next tree: the decoder's, or, under a batch's cut
        (`state.cut`, set for greedy sequences only: a seeded answer draws the same at any batch size),
        the largest that fits it (`batch_k_config`)."""
        return self.k_config if state.cut is None else self.batch_k_config(state.cut)

    def batch_k_config(self, nodes: int) -> tuple[int, ...]:
        """The largest of `AUTO_K_CONFIGS` with at most `nodes` nodes (a batch's cut, `Sizing.cut`),
        at most the batch-1 tree; made once per cut."""
        if nodes not in self.batch_k_configs:
            nodes_at_most = min(tree_nodes(self.k_config), nodes)
            fitting = [k for k in AUTO_K_CONFIGS if tree_nodes(k) <= nodes_at_most] or AUTO_K_CONFIGS[:1]
            self.batch_k_configs[nodes] = fitting[-1]
        return self.batch_k_configs[nodes]

    def propose(self, state, root: int, budget: int) -> Tree:
        k_config = self.k_config_of(state)[:budget]
        if not k_config:
            return Tree.root(root)
        return state.draft.draft_tree(state.sequence, k_config, state.sampling, state.generator,
                                      without_replacement=not self.replacement)

    def propose_batch(self, states, budgets) -> list[Tree]:
        """A batch's trees with one draft forward per depth for all its sequences (`BatchDraftLM`). A step
        with nothing to draft (load-aware speculation off at this batch size) runs no draft forward: the
        draft catches up on the tokens it missed at the next step that drafts, in one forward."""
        k_configs = [self.k_config_of(state)[:budget] for state, budget in zip(states, budgets)]
        if not any(k_configs):
            return [Tree.root(state.sequence[-1]) for state in states]
        return self.batch_draft.draft_trees(states, k_configs, without_replacement=not self.replacement)

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
    if settings.k_config == "auto":  # (the paper's tree without a profile)
        sizing = context.sizing(target, "k_config", "auto", tree_nodes(PAPER_K_CONFIG) + 1)
        fitting = [k for k in AUTO_K_CONFIGS if tree_nodes(k) + 1 <= sizing.value] or AUTO_K_CONFIGS[:1]
        sizing = sizing.choose(fitting[-1], chosen=list(fitting[-1]))
    else:
        sizing = Sizing.fixed(parse_k_config(settings.k_config))
    draft = load_draft_lm(spec, context.target_model)
    return MultiCandidateDecoder(target, draft, k_config=sizing, replacement=settings.replacement,
                                 vocabulary=context.draft_vocabulary(settings.to_dict(),
                                                                     draft.get_output_embeddings().out_features))
