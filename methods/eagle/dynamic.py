"""`eagle2`: EAGLE-2's dynamic tree (the top-k frontier expanded by cumulative log-probability, the
best candidates kept: `total_tokens` fixed, `auto` or `adaptive`), drafted by the EAGLE head; `eagle3`
drafts the same tree with its own head (`eagle3.py`)."""

from __future__ import annotations

import time

import torch

from ..base import BuildContext, register
from ..engine.tree import DeviceTree, Tree
from ..models.heads.eagle import EagleHead, load_eagle_head
from ..models.heads.source import head_spec
from ..settings.sizing import Sizing, verify_costs
from .decoder import EagleBase, one_sequence
from .settings import DynamicTreeSettings, Eagle2Settings

UPSTREAM_TOTAL = 60  # upstream's total_token; `auto` and `adaptive` without a machine profile


class Eagle2Decoder(EagleBase):
    name = "eagle2"

    def __init__(self, target, head: EagleHead, total_tokens: int | Sizing = UPSTREAM_TOTAL,
                 depth: int = Eagle2Settings.depth, top_k: int = Eagle2Settings.top_k, vocabulary=None,
                 verify_seconds: dict[int, float] | None = None):
        """`total_tokens`: the tree's most tokens with the root (`method.total_tokens` settled: a `Sizing`);
        `verify_seconds`: the target's latency curve (the machine profile's) for the adaptive size; None: the
        size is `total_tokens`."""
        super().__init__(target, head, vocabulary, Sizing.of(total_tokens))
        total_tokens = self.sizing.value
        if total_tokens < 2 or depth < 0 or top_k < 1:
            raise ValueError(f"eagle2 needs total_tokens >= 2, depth >= 0, top_k >= 1; got {total_tokens}, {depth}, "
                             f"{top_k}")
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.verify_seconds = verify_seconds  # adaptive sizing: target forward seconds by tokens
        self.draft_seconds = 0.0  # adaptive sizing: running mean of one step's drafting time
        self.verify_tables: dict[int, tuple[dict, list[float]]] = {}  # batch -> (the curve, `verify_times`)

    def describe(self):
        return {**super().describe(), "total_tokens": "adaptive" if self.verify_seconds else self.total_tokens,
                "depth": self.depth, "top_k": self.top_k}

    def propose(self, state, root: int, budget: int) -> Tree:
        started = time.perf_counter()
        tree = self._propose(state, root, budget)
        # this step's drafting: the head following the last accepted path (deferred to here), then this tree
        self._time_draft(time.perf_counter() - started)
        return tree

    def propose_batch(self, states, budgets) -> list[Tree]:
        """`EagleBase.propose_batch`; each sequence is charged its share of the batch's time (one after
        another, each `propose` charges its own)."""
        if self.drafter.fused is None or not any(budgets):  # (a step that drafts nothing is not timed)
            return super().propose_batch(states, budgets)
        started = time.perf_counter()
        trees = super().propose_batch(states, budgets)
        self._time_draft((time.perf_counter() - started) / len(states))
        return trees

    def draft_batch(self, states, budgets, roots_hidden, roots_draft, feed) -> list[Tree]:
        """Every level for the batch at once (`expand`), then each sequence's candidates cut to its own
        levels and reranked alone."""
        levels = [min(self.depth + 1, budget) for budget in budgets]
        deepest = max(levels)
        if deepest <= 0:
            return [Tree.root(state.tokens[-1]) for state in states]
        tokens, parents, values = self.expand(roots_hidden, roots_draft, deepest, feed, states[0].draft)
        k = self.branching()
        trees = []
        for b, (state, depth) in enumerate(zip(states, levels)):
            root = state.tokens[-1]
            if depth <= 0:
                trees.append(Tree.root(root))
                continue
            count = k + (depth - 1) * k * k  # the candidates of its own levels: a prefix
            greedy = state.sampling.greedy
            trees.append(self.rerank(root, tokens[b, :count], parents[b, :count], values[b, :count], depth, greedy,
                                      state.batch if greedy else 1, state.cut))
        return trees

    def _time_draft(self, seconds: float) -> None:
        if self.verify_seconds is not None:
            self.draft_seconds += 0.1 * (seconds - self.draft_seconds)

    def draft_levels(self, root_hidden, root_draft, key, feed):
        expanded = self.expand(root_hidden[None], root_draft[None], key, one_sequence(feed), self.drafter)
        return tuple(t[0] for t in expanded)

    def drafted_entries(self, key: int) -> int:
        return (key - 1) * self.branching()

    def full_depth(self) -> int:
        return self.depth + 1

    def branching(self) -> int:
        """Children per expanded node: top_k, or the whole draft vocabulary when it is smaller."""
        return min(self.top_k, self.drafter.root_draft.shape[-1])

    def _propose(self, state, root: int, budget: int) -> Tree:
        levels = min(self.depth + 1, budget)  # draft tokens along a path
        if levels <= 0:
            return Tree.root(root)
        static = self.static_for(state, levels)
        if static is not None:
            tokens, parents, values = static.run(levels)
        else:
            drafter = state.draft
            tokens, parents, values = (t[0] for t in self.expand(
                drafter.root_hidden[None], drafter.root_draft[None], levels, one_sequence(drafter.feed_level), drafter))
        greedy = state.sampling.greedy
        return self.rerank(root, tokens, parents, values, levels, greedy, state.batch if greedy else 1, state.cut)

    def expand(self, root_hidden: torch.Tensor, root_draft: torch.Tensor, levels: int, feed,
                drafter) -> tuple[torch.Tensor, ...]:
        """EAGLE-2's expansion for B sequences at once (each its own tree; B = 1 alone): the top-k
        children of the root, then per level the top-k children of the k best frontier nodes, of which
        the k best by path value form the next frontier. `root_hidden` [B, H], `root_draft` [B, K].
        Returns every candidate's token, parent (-1: the root) and path value (cumulative
        log-probability), [B, C] each, in creation order (ancestors before descendants): k at the first
        level, k·k at each next one, so a sequence that drafts fewer levels takes a prefix. All on the
        device, nothing read back: `feed(tokens [B, k], parent_hidden [B, k, H], depth, seen [B, k, fed])`
        feeds a level into the head (one forward for the batch: `BatchDraft.feed`; one sequence's
        `feed_level` or `feed_static` through `one_sequence`) with the frontier's level mask `seen`;
        `root_draft` and each level's logits are over the draft vocabulary, ranked there
        (`EagleDrafter.top`)."""
        k = self.branching()
        batch, width = root_hidden.shape
        device = root_draft.device
        top_values, top_tokens = drafter.top(root_draft, k)  # [B, k]
        tokens, parents, values = [top_tokens], [torch.full((batch, k), -1, device=device)], [top_values]
        ranks = torch.arange(k, device=device)
        frontier_ids, frontier_tokens = ranks.expand(batch, k), top_tokens  # candidate ids and tokens fed next
        frontier_values, frontier_hidden = top_values, root_hidden[:, None].expand(batch, k, width)
        # frontier node -> the drafted slots it sees (its ancestors'): level l's frontier sits in slots
        # (l - 1) k .. l k - 1, so a child of frontier node j sees its parent's row and slot j of that level
        seen = torch.zeros(batch, k, 0, dtype=torch.bool, device=device)
        count = k
        for level in range(1, levels):
            hidden = feed(frontier_tokens, frontier_hidden, level, seen)  # [B, k, H]
            child_values, child_tokens = drafter.top(drafter.draft_logits(hidden), k)  # [B, k, k]
            cumulative = (frontier_values[..., None] + child_values).flatten(1)
            child_tokens = child_tokens.flatten(1)
            tokens.append(child_tokens)
            parents.append(frontier_ids.repeat_interleave(k, dim=1))
            values.append(cumulative)
            frontier_values, best = torch.topk(cumulative, k)
            parent = best // k  # each new frontier node's parent, a row of this level
            # (one_hot reads its bounds)
            seen = torch.cat([seen.gather(1, parent[..., None].expand(-1, -1, seen.shape[-1])),
                              parent[..., None] == ranks], 2)
            frontier_ids = best + count
            frontier_tokens = child_tokens.gather(1, best)
            count += k * k
            frontier_hidden = hidden.gather(1, parent[..., None].expand(-1, -1, width))
        return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(values, 1)

    def rerank(self, root: int, tokens: torch.Tensor, parents: torch.Tensor, values: torch.Tensor,
                levels: int, greedy: bool, batch: int = 1, cut: int | None = None) -> Tree:
        """Keep the best `total_tokens - 1` candidates (at most `cut`: the batch's, `Sizing.cut`); ties go
        to the earlier candidate (a stable sort), so a kept node's ancestors (never worth less) are kept
        too; the kept candidates in creation order (ancestors before descendants) are the tree's nodes.
        A fixed size builds the tree on the device (`DeviceTree`: nothing is read back). The
        adaptive size is the host's choice from the best candidates' path probabilities: the one
        read that brings them brings their ids and parents too, and the host builds the structure."""
        keep = min(self.total_tokens - 1, tokens.numel(), *([cut] if cut is not None else []))
        order = torch.sort(values, descending=True, stable=True).indices[:keep]
        if self.verify_seconds is None:
            return self.device_tree(root, tokens, parents, order.sort().values, levels)
        ids, ups, probabilities = torch.stack([order.double(), parents[order].double(),
                                               values[order].exp().double()]).tolist()
        ids = ids[:self.adaptive_size(probabilities, greedy, batch)]
        kept = sorted(int(c) for c in ids)
        # candidate -> its node (the root's children: parent 0)
        node_of = {c: node for node, c in enumerate(kept, start=1)}
        parent_of = dict(zip((int(c) for c in ids), (int(p) for p in ups)))
        tree_parents = [node_of.get(parent_of[c], 0) for c in kept]
        chosen = tokens[torch.tensor(kept, dtype=torch.long, device=tokens.device)]
        return Tree(torch.cat([tokens.new_tensor([root]), chosen]), [-1] + tree_parents)

    def device_tree(self, root: int, tokens: torch.Tensor, parents: torch.Tensor, kept: torch.Tensor,
                     levels: int) -> DeviceTree:
        """The tree of the `kept` candidates (ids, ascending) built where they are: a node's parent
        is its parent candidate's place among them, its depth the level its candidate was drafted at."""
        k = self.branching()
        up = parents.index_select(0, kept)  # each kept candidate's parent candidate, -1: the root
        node_parents = torch.where(up < 0, 0, torch.searchsorted(kept, up.clamp_min(0)) + 1)
        # candidates 0..k-1 are the root's children (depth 1); level l >= 1 drafted k * k of them at depth l + 1
        depths = torch.where(kept < k, 1, (kept - k).div(k * k, rounding_mode="floor") + 2)
        zero = kept.new_zeros(1)
        return DeviceTree(torch.cat([tokens.new_tensor([root]), tokens.index_select(0, kept)]),
                          torch.cat([zero, node_parents]), torch.cat([zero, depths]), height=levels)

    def adaptive_size(self, probabilities: list[float], greedy: bool = True, batch: int = 1) -> int:
        """How many of the best candidates (path probabilities, best first) to verify: the n with
        the most expected tokens, 1 + sum of the first n, per second of drafting + verifying.
        Sampled (temperature > 0), drafting is not charged: its time is the wall clock's (a running
        mean), and the size decides how many uniforms a step draws and which child each tests, so a
        seeded answer would depend on timing (on the run, and on the batch size: `batched.py`
        promises B = 1's tokens). The verify curve is measured once and kept: the size depends on
        the head's path probabilities and the curve only. Greedy output does not depend on the size.
        `batch`: the sequences verified together (greedy at B > 1, `methods/loop.py`): each pays its
        share of a forward over B times its rows, t(B n) / B, as if every sequence drafted as many."""
        draft = self.draft_seconds if greedy else 0.0
        seconds = self.verify_times(len(probabilities) + 1, batch)
        expected, best, best_rate = 1.0, 0, 1.0 / (draft + seconds[1])
        for n, p in enumerate(probabilities, start=1):
            expected += p
            rate = expected / (draft + seconds[n + 1])
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def verify_time(self, tokens: int, batch: int = 1) -> float:
        """Seconds of a target forward of `tokens` tokens, interpolated from the measured sizes; with
        `batch`, one sequence's share of a forward of `batch` x `tokens` rows."""
        return self.verify_times(tokens, batch)[tokens]

    def verify_times(self, largest: int, batch: int = 1) -> list[float]:
        """`verify_time` of 0 .. `largest` tokens at `batch`, made once per curve and batch size (and
        again only for a longer list): every step's adaptive size reads it."""
        curve, table = self.verify_tables.get(batch, (None, []))
        if curve is not self.verify_seconds or len(table) <= largest:
            curve, one = self.verify_seconds, self.verify_seconds[min(self.verify_seconds)]
            size = max(largest + 1, self.total_tokens + 1)
            table = [cost * one / batch for cost in verify_costs(curve, [batch * n for n in range(size)])]
            self.verify_tables[batch] = curve, table
        return table


def auto_total_tokens(profile, target, sizes=(40, 48, 50, 56, 60), weights=(1, 1.05, 1.07, 1.1, 1.13),
                      prefix: int = 128, repeats: int = 3) -> tuple[int, dict]:
    """EAGLE-2's `total_token=-1`: target forwards of each size timed (by the machine profile), and the
    size with the least time per weight (weights credit larger trees with the extra tokens they accept)."""
    timings = profile.forward_latency(target, sizes, "EAGLE-2's total_tokens=auto", prefix, repeats)
    best = min(sizes, key=lambda s: timings[s] / weights[sizes.index(s)])
    return best, {"total_tokens": "auto", "chosen": best, "seconds_by_size": timings,
                  "weights": dict(zip(sizes, weights))}


def build_dynamic(decoder_class, target, head, settings: DynamicTreeSettings, context: BuildContext,
                  **extra) -> Eagle2Decoder:
    """An EAGLE-2-tree decoder with `method.total_tokens` (a number, `auto` or `adaptive`), `depth`, `top_k`:
    `auto` and `adaptive` read the machine profile (`context.profile`), and take upstream's 60 without one."""
    total, profile, verify_seconds = settings.total_tokens, context.profile, None
    if isinstance(total, str) and profile is None:
        sizing = Sizing(UPSTREAM_TOTAL, {"total_tokens": total, "profile": f"none: upstream's {UPSTREAM_TOTAL}"})
    elif total == "auto":  # a batch's tree cut to the verify budget at B rows per node (`Sizing.cut`)
        sizing = Sizing(*auto_total_tokens(profile, target), context.latency_curve(target))
    elif total == "adaptive":
        # the whole curve: every size a CPU verifies (the step in it at 9 rows is not between 8 and 16); the
        # adaptive size is its own rule at every batch size (`adaptive_size`)
        verify_seconds = profile.latency_curve(target, context.model_name)
        sizing = Sizing(max(verify_seconds), {"total_tokens": "adaptive", "seconds_by_size": verify_seconds})
    else:
        sizing = Sizing.fixed(total)
    return decoder_class(target, head, total_tokens=sizing, depth=settings.depth, top_k=settings.top_k,
                         verify_seconds=verify_seconds, **extra)


@register("eagle2", settings=Eagle2Settings)
def build_eagle2(target, settings: Eagle2Settings, context: BuildContext) -> Eagle2Decoder:
    params = {"name": "eagle2", **settings.to_dict()}
    head = load_eagle_head(head_spec(params, context, "eagle"), context.target_model)
    return build_dynamic(Eagle2Decoder, target, head, settings, context, vocabulary=context.draft_vocabulary(params))
