"""`eagle`: EAGLE-1's static template tree filled by the EAGLE head, level by level on the head's
device; at temperature > 0 by default EAGLE-1's own sampling (children drawn from the head's q)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import BuildContext, register
from ..engine.sampling import draw_children, logits_to_probs
from ..engine.static_trees import StaticTree
from ..engine.tree import Tree, ancestors_of
from ..models.heads.eagle import EagleHead, load_eagle_head
from ..models.heads.source import head_spec
from ..settings.sizing import Sizing
from .decoder import EagleBase, one_sequence
from .settings import SAMPLING_RULES, EagleSettings


@dataclass(frozen=True)
class TemplateLevel:
    """One depth of EAGLE-1's template tree, as index tensors on the head's device (made once per
    depth limit: `EagleDecoder.plan`), so that filling it reads and sends nothing."""

    depth: int
    rows: torch.Tensor  # the parents of this level's nodes, each once (node ids)
    nodes: torch.Tensor  # this level's nodes
    row_of: torch.Tensor  # each node's parent's place in `rows`
    rank: torch.Tensor  # each node's rank in its parent's top-k (greedy)
    draw: torch.Tensor  # each node's place among its parent's children (its draw, sampled)
    top_k: int
    width: int  # the most children of one parent
    expand: torch.Tensor | None  # the nodes fed to the head after this level (those with children)
    expand_parents: torch.Tensor | None
    visible: torch.Tensor | None  # [expand, fed so far] bool: each fed node's ancestors among the fed nodes


class EagleDecoder(EagleBase):
    name = "eagle"

    def __init__(self, target, head: EagleHead, tree: StaticTree, vocabulary=None,
                 sampling_rule: str = EagleSettings.sampling_rule, sizing: Sizing | None = None):
        """`sizing`: how the tree was sized (its rule for a batch: `Sizing.cut`); None: the tree as given."""
        if sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"eagle sampling_rule={sampling_rule!r}; valid: {', '.join(SAMPLING_RULES)}")
        super().__init__(target, head, vocabulary, sizing or Sizing.fixed(len(tree) - 1))
        self.tree = tree
        self.sampling_rule = sampling_rule
        # (template nodes, depth limit) -> the template's levels on the device (`plan`)
        self._plans: dict[tuple[int, int], tuple] = {}

    def describe(self):
        described = {**super().describe(), "tree_nodes": len(self.tree), "tree_depth": self.tree.max_depth,
                     "top_k": self.tree.top_k(), "sampling_rule": self.sampling_rule}
        return described

    def propose(self, state, root: int, budget: int) -> Tree:
        tree = self.tree.cut(state.cut)  # a batch's cut of the template (`Sizing.cut`)
        depth_limit = min(tree.max_depth, budget)
        # EAGLE-1 at temperature > 0: each parent's children are sampled
        sampled = self.sampling_rule == "eagle1" and not state.sampling.greedy
        drafter = state.draft
        static = self.static_for(state, depth_limit, usable=not sampled and tree is self.tree)
        if static is not None:
            tokens, _ = static.run(depth_limit)
            draft_probs = None
        else:
            with torch.inference_mode():
                tokens, draft_probs = self._fill(drafter.root_hidden[None], drafter.root_draft[None], depth_limit,
                                                 one_sequence(drafter.feed_level), drafter,
                                                 [state] if sampled else None, tree=tree)
            tokens, draft_probs = tokens[0], None if draft_probs is None else draft_probs[0]
        _, parents, _ = self.plan(depth_limit, tree)
        tokens = torch.cat([tokens.new_tensor([root]), tokens[1:]])
        return Tree(tokens, parents, draft_probs, without_replacement=sampled)

    def draft_batch(self, states, budgets, roots_hidden, roots_draft, feed) -> list[Tree]:
        """The template for every sequence at once, filled to the deepest sequence's depth limit (a
        shallower one's tree is a prefix: the template lists nodes by depth), then each cut at its own."""
        greedy = states[0].sampling.greedy
        tree = self.tree.cut(states[0].cut)  # (the batch shares its sampling, so its cut)
        limits = [min(tree.max_depth, budget) for budget in budgets]
        sampled = self.sampling_rule == "eagle1" and not greedy
        tokens, draft_probs = self._fill(roots_hidden, roots_draft, max(limits), feed, states[0].draft,
                                         states if sampled else None, limits, tree)
        trees = []
        for b, (state, limit) in enumerate(zip(states, limits)):
            count, parents, _ = self.plan(limit, tree)
            own = torch.cat([tokens.new_tensor([state.tokens[-1]]), tokens[b, 1:count]])
            trees.append(Tree(own, parents, None if draft_probs is None else draft_probs[b, :count],
                              without_replacement=sampled))
        return trees

    def plan(self, depth_limit: int, tree: StaticTree | None = None) -> tuple[int, list[int], list[TemplateLevel]]:
        """The template (the tree, or a batch's cut of it: `StaticTree.cut`) cut at `depth_limit`: its node
        count, parents and levels (made once)."""
        tree = tree or self.tree
        key = len(tree), depth_limit  # (every template of the decoder is a prefix of one path list)
        plans = self._plans
        if key in plans:
            return plans[key]
        device = self.drafter.device
        count = sum(1 for d in tree.depths if d <= depth_limit)
        parents = tree.parents[:count]
        children = [[] for _ in range(count)]
        for node in range(1, count):
            children[parents[node]].append(node)  # in rank order: the template lists paths by (depth, ranks)
        levels, slot_of = [], {}

        def index(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        for depth in range(1, depth_limit + 1):
            level = [n for n in range(1, count) if tree.depths[n] == depth]
            if not level:
                break
            rows = list(dict.fromkeys(parents[n] for n in level))
            expand = [n for n in level if children[n]] if depth < depth_limit else []
            visible = torch.zeros(len(expand), len(slot_of), dtype=torch.bool)
            for i, node in enumerate(expand):
                visible[i, [slot_of[a] for a in ancestors_of(parents, node)]] = True
            for node in expand:
                slot_of[node] = len(slot_of)
            levels.append(TemplateLevel(
                depth, index(rows), index(level), index([rows.index(parents[n]) for n in level]),
                index([tree.ranks[n] for n in level]), index([children[parents[n]].index(n) for n in level]),
                tree.top_k(depth), max(len(children[p]) for p in rows),
                index(expand) if expand else None, index([parents[n] for n in expand]) if expand else None,
                visible.to(device) if expand else None))
        plans[key] = count, parents, levels
        return plans[key]

    def _fill(self, root_hidden: torch.Tensor, root_draft: torch.Tensor, depth_limit: int, feed, drafter,
              sampled_for=None, limits=None,
              tree: StaticTree | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The template filled level by level for B sequences at once (B = 1 alone) on the head's
        device (`plan`'s index tensors: nothing read, nothing sent), the tokens never coming back to
        the host (the verification's read brings the accepted ones). `root_hidden` [B, H],
        `root_draft` [B, K]; `feed(tokens [B, n], parent_hidden [B, n, H], depth, seen [B, n, fed])`
        feeds a level (one head forward for the batch: `BatchDraft.feed`; one sequence's `feed_level`
        or `feed_static` through `one_sequence`). Greedy (or the `eagle2` rule): each parent's top-k
        children by rank. EAGLE-1 sampling: each parent's children drawn from its q without
        replacement, in draw order (`sampling.draw_children`; where q has fewer tokens than children,
        the extra ones hold tokens of probability 0 and are never accepted), q kept for verification.
        Rows are in node order: node n's token, hidden state and logits are row n of each sequence
        (row 0's token: the root's, set by the caller). `sampled_for`: the sequences' `DecodeState`s
        when their children are sampled (each draws from its own generator, only down to its own
        depth limit `limits[b]`, as alone), else None; `tree`: the template (`template`). Logits are
        kept over the draft vocabulary (`root_draft`, `drafter.draft_logits`): greedy ranks there,
        sampling draws from q over the target's vocabulary (`drafter.full`). Returns the tokens
        [B, nodes] and, sampled, each node's q [B, nodes, V]."""
        sampled = sampled_for is not None
        count, _, levels = self.plan(depth_limit, tree)
        batch = root_draft.shape[0]
        tokens = torch.zeros(batch, count, dtype=torch.long, device=root_draft.device)
        hidden = torch.cat([root_hidden[:, None], root_hidden.new_empty(batch, count - 1, root_hidden.shape[-1])], 1)
        logits = torch.cat([root_draft[:, None], root_draft.new_empty(batch, count - 1, root_draft.shape[-1])], 1)
        vocab = root_draft.shape[-1] if drafter.vocabulary is None else drafter.vocabulary.full_size
        draft_probs = torch.zeros(batch, count, vocab, device=root_draft.device) if sampled else None
        for level in levels:
            parent_logits = logits.index_select(1, level.rows)  # [B, parents, K]
            if sampled:  # a child's place among its parent's children is its draw
                for b, state in enumerate(sampled_for):
                    if limits is not None and level.depth > limits[b]:
                        continue
                    q = logits_to_probs(drafter.full(parent_logits[b]), state.sampling)
                    draft_probs[b].index_copy_(0, level.rows, q)
                    drawn = draw_children(q, level.width, True, state.generator)
                    tokens[b].index_copy_(0, level.nodes, drawn[level.row_of, level.draw])
            else:
                ranked = drafter.target_ids(torch.topk(parent_logits, level.top_k).indices)  # [B, parents, k]
                tokens.index_copy_(1, level.nodes, ranked[:, level.row_of, level.rank])
            if level.expand is None:
                break
            out = feed(tokens.index_select(1, level.expand), hidden.index_select(1, level.expand_parents), level.depth,
                       level.visible.expand(batch, -1, -1))
            hidden.index_copy_(1, level.expand, out)
            logits.index_copy_(1, level.expand, drafter.draft_logits(out))
        return tokens, draft_probs

    def draft_levels(self, root_hidden, root_draft, key, feed):
        tokens, _ = self._fill(root_hidden[None], root_draft[None], key, one_sequence(feed), self.drafter)
        return tokens[0], None

    def drafted_entries(self, key: int) -> int:
        return sum(len(level.expand) for level in self.plan(key)[2] if level.expand is not None)

    def full_depth(self) -> int:
        return self.tree.max_depth


@register("eagle", settings=EagleSettings)
def build_eagle(target, settings: EagleSettings, context: BuildContext) -> EagleDecoder:
    params = {"name": "eagle", **settings.to_dict()}
    head = load_eagle_head(head_spec(params, context, "eagle"), context.target_model)
    # auto: EAGLE's own tree, cut to what one verification may hold on this machine
    tree, sizing = context.static_tree(params, target, "eagle_mc_sim_7b_63")
    return EagleDecoder(target, head, tree, vocabulary=context.draft_vocabulary(params),
                        sampling_rule=settings.sampling_rule, sizing=sizing)
