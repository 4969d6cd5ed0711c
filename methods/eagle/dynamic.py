"""EAGLE (static tree) and EAGLE-2 (dynamic tree) decoding with the EAGLE draft head.

The head drafts from (token, target feature) pairs. With the target's cache holding T positions
and the root x_T pending, the head's cache holds the T pairs (x_{i+1}, f_i), i < T, and its last
output predicts the root's children. A tree node at depth d is fed at head position T + d - 1
with its token and the head's own output at its parent (tree mask over the head's cache). After
verification the head's tree entries are dropped and the accepted path is fed with the target's
true features, so the head's cache always equals the one built along the accepted sequence.

* `eagle`: EAGLE-1's static tree (default `eagle_mc_sim_7b_63`: 25 nodes, 4/8/8/3/2 per depth);
  node [.., r] carries the r-th ranked candidate of its parent; one head forward per level.
* `eagle2`: EAGLE-2's dynamic tree: expand the top-k frontier by cumulative log-probability for
  `depth` steps (k² candidates per step), then keep the best `total_tokens - 1` candidates,
  ancestors before descendants. `total_tokens: auto` times target forwards at 40..60 tokens and
  picks the size as EAGLE-2's `-1` does. `total_tokens: adaptive` times target forwards of 1..64
  tokens once and sizes every tree for the most expected tokens per second: with the candidates'
  values (the head's path probabilities, EAGLE-2's estimate of acceptance) sorted, keep the n that
  maximizes (1 + p_1 + ... + p_n) / (draft time + verify time of n + 1 tokens). On hardware where a
  forward's cost grows with its tokens (CPUs) it keeps small trees; where it is flat, large ones.
  On the device: the expansion, the rerank and, at a fixed size, the tree's structure
  (`tree.DeviceTree`) never come back to the host, so a greedy step reads once (the acceptance);
  the adaptive size is the host's choice, from one more read.
Under `engine.cuda_graphs` both depth loops (EAGLE-1's template, EAGLE-2's expansion) run over the
head's reserved cache at device positions (`StaticDraft`), captured as one CUDA graph on a GPU.
Sampling (temperature > 0), `method.sampling_rule`:
* `eagle1` (`eagle`'s default), EAGLE-1's own (SafeAILab/EAGLE v1: `cnets.py` `Model.sample` /
  `topK_genrate`, `utils.py` `evaluate_posterior`): each expanded node's children are *sampled*
  from the head's processed distribution q (temperature, top-k, top-p, as the target's), without
  replacement, the j-th draw going to the node's j-th child; the tree carries q. Verification is
  SpecInfer's multi-candidate rule (`acceptance.sample_accept` with the draft's q, children drawn
  without replacement): try the children in drawn order, accept x with probability min(1, p(x)/q(x));
  on rejection p <- norm(max(p - q, 0)) and x leaves q (q(x) <- 0, renormalized); the bonus comes
  from the final p. A node whose q has fewer tokens than it has children keeps only as many
  children as q can give (the others and their subtrees leave the tree).
* `eagle2`, and always for `eagle2` / `eagle3`: drafts stay deterministic (top-k) and are verified
  with EAGLE-2's rule (accept x with probability p(x), else zero it and renormalize).
Both preserve the target distribution. Greedy decoding (temperature 0) is the same for both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..base import BuildContext, DraftVerifyDecoder, register
from ..engine.graphs import capture, static_layer, static_mask
from ..engine.hardware import forward_latency, latency_curve
from ..engine.kv_cache import TreeKVCache
from ..engine.params import Settings, integer, one_of, paths, setting
from ..engine.sampling import draw_children, logits_to_probs
from ..engine.sizing import verify_cost
from ..engine.static_trees import NAMED_TREES, StaticTree
from ..engine.tree import DeviceTree, Tree, ancestors_of, attention_mask, level_mask
from ..engine.vocab import draft_vocab_setting
from ..models.heads.eagle import EagleHead, load_eagle_head
from ..models.heads.source import head_setting, head_spec


class EagleDrafter:
    """The head, its KV cache (committed pairs + the current tree's entries) and the target's lm_head
    (over the draft vocabulary's tokens only, when one is given)."""

    def __init__(self, head: EagleHead, lm_head, vocabulary=None):
        self.head, self.lm_head, self.vocabulary = head, lm_head, vocabulary
        self.device = head.fc.weight.device
        self.dtype = head.fc.weight.dtype
        # the head's layer on the engine's fused forward where it runs (EAGLE's and EAGLE-3's)
        self.fused = head.fused()
        self.linears = [self.fused[0].qkv, self.fused[0].gate_up] if self.fused else []
        self._reserved: TreeKVCache | None = None  # the last reserved head cache, reused while large enough
        self.reset()

    def reset(self, capacity: int | None = None) -> None:
        """An empty head cache; with `capacity` (the target's reserved one: it holds the committed pairs
        and a tree's entries), its buffers are allocated once at that size and the RoPE table as long,
        and the next answer reuses them while they are large enough (as `ModelRunner.reserve`)."""
        self.committed = 0
        if capacity is None:
            self.cache = TreeKVCache()
            return
        self.cache = self._reserved = TreeKVCache.reserved(self._reserved, capacity)
        if self.fused is not None:
            self.fused[1].reserve(self.cache.capacity, self.dtype, self.device)  # (a table already that long is kept)

    @torch.inference_mode()
    def _feed(self, tokens: Sequence[int] | torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None, bound: int) -> torch.Tensor:
        """`bound`: the positions are below it (known on the host: the RoPE table is not read back)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if self.fused is None:
            return self.head(tokens, features, positions, mask, self.cache)
        layer, rope = self.fused
        x, attn_in = self.head.layer_inputs(tokens, features)
        cos, sin = rope.lookup(positions.view(1, -1), x, bound)
        return layer.forward(x[None], cos, sin, mask, self.cache, None if attn_in is None else attn_in[None])[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            if self.vocabulary is not None:
                return self.vocabulary.project(hidden, self.lm_head.weight)
            return self.lm_head(hidden).float()

    def follow(self, tokens: Sequence[int], features: torch.Tensor) -> None:
        """Drop the tree entries; append pairs (tokens[i], features[i]) of the accepted sequence.
        Sets `root_hidden` / `root_logits`: the head's prediction for the new root's children."""
        self.cache.rollback(self.committed)
        n = len(tokens)
        positions = torch.arange(self.committed, self.committed + n, device=self.device)
        causal = torch.ones(n, n, dtype=torch.bool).tril_()
        mask = attention_mask(causal, self.committed, self.dtype, self.device) if n > 1 else None
        hidden = self._feed(tokens, features, positions, mask, self.committed + n)
        self.committed += n
        self.root_hidden = hidden[-1]
        self.root_logits = self.logits(hidden[-1])

    def feed_level(self, tokens: Sequence[int] | torch.Tensor, parent_hidden: torch.Tensor, depth: int,
                   visible: list[list[int]] | torch.Tensor) -> torch.Tensor:
        """Feed tree nodes of one depth. `visible[i]`: tree-entry slots (0-based, after the
        committed pairs) that node i may attend to besides itself (its ancestors), as lists or as a
        bool tensor [n, drafted] on the device (`level_mask`). Returns their
        outputs; the new nodes take the next slots in order."""
        drafted = self.cache.get_seq_length() - self.committed
        mask = level_mask(self.committed, drafted, visible, self.dtype, self.device)
        n = len(tokens)
        positions = torch.full((n,), self.committed + depth - 1, device=self.device)
        return self._feed(tokens, parent_hidden, positions, mask, self.committed + depth)

    def static_room(self, drafted: int) -> bool:
        """Whether `drafted` tree entries can be fed at device positions after the committed pairs
        (`feed_static`): a fused layer over a reserved cache whose buffers exist, with room for them."""
        capacity, layers = self.cache.capacity, self.cache.layers
        return (self.fused is not None and capacity is not None and len(layers) == 1 and layers[0]._keys is not None
                and layers[0]._keys.shape[-2] == capacity and self.committed + drafted <= capacity
                and self.fused[1]._cos is not None and self.fused[1]._cos.shape[0] >= capacity)

    def feed_static(self, tokens: torch.Tensor, parent_hidden: torch.Tensor, depth: int, visible: torch.Tensor,
                    start: torch.Tensor) -> torch.Tensor:
        """`feed_level` at device positions, what a CUDA graph captures (`StaticDraft`): `start` [1]
        holds the committed pairs' count on the device; the nodes' keys/values go to the slots after
        the `visible.shape[1]` drafted ones (`graphs.static_layer`), attention reads the whole buffer
        under a mask built on the device. Nothing is read back, and the cache's length does not move:
        the next `follow` writes over these entries."""
        layer, rope = self.fused
        n, drafted = tokens.shape[0], visible.shape[1]
        x, attn_in = self.head.layer_inputs(tokens, parent_hidden)
        positions = (start + (depth - 1)).expand(n)
        cos, sin = rope._cos[positions].view(1, n, 1, -1), rope._sin[positions].view(1, n, 1, -1)
        slots = start + drafted + torch.arange(n, device=self.device)
        own = torch.cat([visible, torch.eye(n, dtype=torch.bool, device=self.device)], 1)
        columns = torch.arange(self.cache.capacity, device=self.device)
        buffers = self.cache.layers[0]
        return static_layer(layer, x[None], cos, sin, buffers._keys, buffers._values, slots,
                            static_mask(columns, start, own, self.dtype), None if attn_in is None else attn_in[None])[0]


class StaticDraft:
    """A decoder's draft levels (`draft_levels`: EAGLE-2's expansion, EAGLE-1's template) as one
    static computation over the head's reserved cache, under `engine.cuda_graphs` on / auto on a
    GPU: the root's hidden state and logits and the committed count are copied into buffers of
    fixed address, and every level is fed at device positions (`EagleDrafter.feed_static`), so the
    whole depth loop reads nothing back. `key`: the loop's depth (levels for EAGLE-2, the depth
    limit for EAGLE-1). On a GPU the full depth is captured as one CUDA graph (a shorter one, near
    an answer's end, runs the same computation eagerly); on a CPU it runs eagerly, which is what the
    CPU tests compare."""

    def __init__(self, decoder: "_EagleBase", graphed: bool):
        self.decoder, self.graphed = decoder, graphed
        self.hidden = self.logits = self.start = None
        self.graph, self.outputs, self.addresses = None, None, []
        self.captures = 0

    def ready(self, key: int) -> bool:
        return self.decoder.drafter.static_room(self.decoder.drafted_entries(key))

    @torch.inference_mode()
    def run(self, key: int) -> tuple[torch.Tensor, ...]:
        drafter = self.decoder.drafter
        if (
            self.hidden is None
            or self.hidden.shape != drafter.root_hidden.shape
            or self.logits.shape != drafter.root_logits.shape
        ):
            self.hidden, self.logits = torch.empty_like(drafter.root_hidden), torch.empty_like(drafter.root_logits)
            self.start = torch.zeros(1, dtype=torch.long, device=drafter.device)
            self.graph = None
        self.hidden.copy_(drafter.root_hidden)
        self.logits.copy_(drafter.root_logits)
        self.start.fill_(drafter.committed)
        if not self.graphed or key != self.decoder.full_depth():
            return self.compute(key)
        rope = drafter.fused[1]
        addresses = [drafter.cache.layers[0]._keys.data_ptr(), drafter.cache.layers[0]._values.data_ptr(),
                     rope._cos.data_ptr(), rope._sin.data_ptr()]
        if self.graph is None or addresses != self.addresses:  # a new cache or table: capture again
            self.graph, self.outputs = capture(lambda: self.compute(key))
            self.addresses = addresses
            self.captures += 1
        self.graph.replay()
        return self.outputs

    def compute(self, key: int) -> tuple[torch.Tensor, ...]:
        drafter = self.decoder.drafter
        return self.decoder.draft_levels(
            self.hidden,
            self.logits,
            key,
            lambda tokens, hidden, depth, seen: drafter.feed_static(tokens, hidden, depth, seen, self.start),
        )


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


class _EagleBase(DraftVerifyDecoder):
    def __init__(self, target, head: EagleHead, vocabulary=None):
        super().__init__(target)
        self.drafter = self.make_drafter(head, vocabulary)
        self.lane_drafters = [self.drafter]  # lane i of a batch drafts with lane_drafters[i] (`lane`)
        # `engine.cuda_graphs`: the draft depth loop as a static computation (a CUDA graph on a GPU)
        self.static = None if target.graph_mode == "off" else StaticDraft(self, target.graph_mode == "graphs")

    # the draft loop a `StaticDraft` runs: its levels from the root's state, fed by `feed`; the head
    # entries a loop of depth `key` feeds; the depth a graph is captured at
    def draft_levels(self, root_hidden: torch.Tensor, root_logits: torch.Tensor, key: int,
                     feed) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def drafted_entries(self, key: int) -> int:
        raise NotImplementedError

    def full_depth(self) -> int:
        raise NotImplementedError

    def lane(self, index, stop):
        """Sequence `index` of a batch: its own drafter (the head's cache), drafting eagerly."""
        lane = super().lane(index, stop)
        while len(self.lane_drafters) <= index:
            self.lane_drafters.append(self.make_drafter(self.drafter.head, self.drafter.vocabulary))
        lane.drafter = self.lane_drafters[index]
        lane.static = None
        return lane

    def make_drafter(self, head, vocabulary) -> EagleDrafter:
        drafter = EagleDrafter(head, self.target.lm_head, vocabulary)
        self.target.cover(head, *drafter.linears,
                          *([vocabulary.head(self.target.lm_head.weight)] if vocabulary else []))
        return drafter

    def features(self, out) -> torch.Tensor:
        """[n, .] the target features the head reads at each position of a target forward: EAGLE's
        last hidden state (EAGLE-3 overrides: three layers' inputs)."""
        return out.hidden

    def describe(self):
        vocabulary = self.drafter.vocabulary
        return {**super().describe(), "draft_vocab": len(vocabulary) if vocabulary else None}

    def start(self, prompt, prefill) -> None:
        self.drafter.reset(self.target.cache.capacity)  # the target's reserved capacity
        # pairs (x_{i+1}, f_i) for every prompt position: the tokens are shifted by one
        self.drafter.follow(self.sequence[1:], self.features(prefill))

    def advance(self, tree, acceptance, verified) -> None:
        path = acceptance.path
        # the emitted tokens are on the host already (the step's one read): no second read of the tree
        tokens = acceptance.emitted or tree.tokens[path[1:]].tolist() + [acceptance.next_token]
        self.drafter.follow(tokens, self.features(verified)[path])


# `method.sampling_rule` of `eagle` at temperature > 0: EAGLE-1's sampled drafts + multi-candidate
# rule with the draft's q (default), or EAGLE-2's deterministic top-k + point-mass rule
SAMPLING_RULES = ("eagle1", "eagle2")


@dataclass(frozen=True)
class EagleSettings(Settings):
    """EAGLE (EAGLE-1): the EAGLE head drafts a static tree from the target's features."""

    paper = "Li et al. 2024 (SafeAILab/EAGLE)"
    draft_kind = "eagle"

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


@dataclass(frozen=True)
class Eagle2Settings(DynamicTreeSettings):
    """EAGLE-2: the EAGLE head drafts a dynamic tree (expand the top-k frontier by cumulative
    log-probability, then keep the best total_tokens - 1 nodes)."""

    paper = "Li et al. 2024 (SafeAILab/EAGLE)"
    draft_kind = "eagle"

    draft_vocab: int | str = draft_vocab_setting()
    head: dict | None = head_setting("eagle")


class EagleDecoder(_EagleBase):
    name = "eagle"

    def __init__(self, target, head: EagleHead, tree: StaticTree, vocabulary=None,
                 sampling_rule: str = EagleSettings.sampling_rule):
        if sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"eagle sampling_rule={sampling_rule!r}; valid: {', '.join(SAMPLING_RULES)}")
        super().__init__(target, head, vocabulary)
        self.tree = tree
        self.sampling_rule = sampling_rule
        self._plans: dict[int, tuple] = {}  # depth limit -> the template's levels on the device (`plan`)

    def describe(self):
        return {**super().describe(), "tree_nodes": len(self.tree), "tree_depth": self.tree.max_depth,
                "top_k": self.tree.top_k(), "sampling_rule": self.sampling_rule}

    def _sampled(self) -> bool:
        """Whether this step's children are sampled (EAGLE-1 at temperature > 0)."""
        sampling = getattr(self, "sampling", None)
        return self.sampling_rule == "eagle1" and sampling is not None and not sampling.greedy

    def propose(self, root: int, budget: int) -> Tree:
        depth_limit = min(self.tree.max_depth, budget)
        sampled = self._sampled()
        drafter = self.drafter
        if not sampled and self.static is not None and self.static.ready(depth_limit):
            tokens, _ = self.static.run(depth_limit)
            draft_probs = None
        else:
            with torch.inference_mode():
                tokens, draft_probs = self._fill(drafter.root_hidden, drafter.root_logits, depth_limit,
                                                 drafter.feed_level, sampled)
        _, parents, _ = self.plan(depth_limit)
        tokens = torch.cat([tokens.new_tensor([root]), tokens[1:]])
        return Tree(tokens, parents, draft_probs, without_replacement=sampled)

    def plan(self, depth_limit: int) -> tuple[int, list[int], list[TemplateLevel]]:
        """The template cut at `depth_limit`: its node count, parents and levels (made once)."""
        plans = self._plans
        if depth_limit in plans:
            return plans[depth_limit]
        tree, device = self.tree, self.drafter.device
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
        plans[depth_limit] = count, parents, levels
        return plans[depth_limit]

    def _fill(self, root_hidden: torch.Tensor, root_logits: torch.Tensor, depth_limit: int, feed,
              sampled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The template filled level by level on the head's device (`plan`'s index tensors: nothing
        read, nothing sent), the tokens never coming back to the host (the verification's read
        brings the accepted ones). Greedy (or the `eagle2` rule): each parent's top-k children by
        rank. EAGLE-1 sampling: each parent's children drawn from its q without replacement, in draw
        order (`sampling.draw_children`; where q has fewer tokens than children, the extra ones
        hold tokens of probability 0 and are never accepted), q kept for verification. Rows are in
        node order: node n's token, hidden state and logits are row n (row 0's token: the root's,
        set by the caller). Returns the tokens and, sampled, each node's q."""
        count, _, levels = self.plan(depth_limit)
        tokens = torch.zeros(count, dtype=torch.long, device=root_logits.device)
        hidden = torch.cat([root_hidden[None], root_hidden.new_empty(count - 1, root_hidden.shape[-1])])
        logits = torch.cat([root_logits[None], root_logits.new_empty(count - 1, root_logits.shape[-1])])
        draft_probs = torch.zeros(count, logits.shape[-1], device=logits.device) if sampled else None
        for level in levels:
            parent_logits = logits.index_select(0, level.rows)
            if sampled:  # a child's place among its parent's children is its draw
                q = logits_to_probs(parent_logits, self.sampling)
                draft_probs.index_copy_(0, level.rows, q)
                drawn = draw_children(q, level.width, True, self.generator)
                tokens.index_copy_(0, level.nodes, drawn[level.row_of, level.draw])
            else:
                ranked = torch.topk(parent_logits, level.top_k).indices  # [parents, k]
                tokens.index_copy_(0, level.nodes, ranked[level.row_of, level.rank])
            if level.expand is None:
                break
            out = feed(tokens.index_select(0, level.expand), hidden.index_select(0, level.expand_parents), level.depth,
                       level.visible)
            hidden.index_copy_(0, level.expand, out)
            logits.index_copy_(0, level.expand, self.drafter.logits(out))
        return tokens, draft_probs

    def draft_levels(self, root_hidden, root_logits, key, feed):
        return self._fill(root_hidden, root_logits, key, feed, False)

    def drafted_entries(self, key: int) -> int:
        return sum(len(level.expand) for level in self.plan(key)[2] if level.expand is not None)

    def full_depth(self) -> int:
        return self.tree.max_depth


class Eagle2Decoder(_EagleBase):
    name = "eagle2"

    def __init__(self, target, head: EagleHead, total_tokens: int = 60, depth: int = Eagle2Settings.depth,
                 top_k: int = Eagle2Settings.top_k, vocabulary=None):
        super().__init__(target, head, vocabulary)
        if total_tokens < 2 or depth < 0 or top_k < 1:
            raise ValueError(f"eagle2 needs total_tokens >= 2, depth >= 0, top_k >= 1; got {total_tokens}, {depth}, "
                             f"{top_k}")
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.total_tokens_timing: dict | None = None
        self.verify_seconds: dict[int, float] | None = None  # adaptive sizing: target forward seconds by tokens
        self.draft_seconds = 0.0  # adaptive sizing: running mean of one step's drafting time
        self._follow_seconds = 0.0

    def describe(self):
        return {**super().describe(), "total_tokens": "adaptive" if self.verify_seconds else self.total_tokens,
                "depth": self.depth, "top_k": self.top_k, "total_tokens_auto": self.total_tokens_timing}

    def propose(self, root: int, budget: int) -> Tree:
        started = time.perf_counter()
        tree = self._propose(root, budget)
        # this step's drafting: the head following the last accepted path, then this tree
        if self.verify_seconds is not None:
            step = time.perf_counter() - started + self._follow_seconds
            self.draft_seconds += 0.1 * (step - self.draft_seconds)
        return tree

    def advance(self, tree, acceptance, verified) -> None:
        started = time.perf_counter()
        super().advance(tree, acceptance, verified)
        self._follow_seconds = time.perf_counter() - started

    def draft_levels(self, root_hidden, root_logits, key, feed):
        return self._expand(root_hidden, root_logits, key, feed)

    def drafted_entries(self, key: int) -> int:
        return (key - 1) * self.branching()

    def full_depth(self) -> int:
        return self.depth + 1

    def branching(self) -> int:
        """Children per expanded node: top_k, or the whole draft vocabulary when it is smaller."""
        return min(self.top_k, self.drafter.root_logits.shape[-1])

    def _propose(self, root: int, budget: int) -> Tree:
        levels = min(self.depth + 1, budget)  # draft tokens along a path
        if levels <= 0:
            return Tree(torch.tensor([root]), [-1])
        if self.static is not None and self.static.ready(levels):
            tokens, parents, values = self.static.run(levels)
        else:
            drafter = self.drafter
            tokens, parents, values = self._expand(drafter.root_hidden, drafter.root_logits, levels, drafter.feed_level)
        return self._rerank(root, tokens, parents, values, levels)

    def _expand(self, root_hidden: torch.Tensor, root_logits: torch.Tensor, levels: int,
                feed) -> tuple[torch.Tensor, ...]:
        """EAGLE-2's expansion: the top-k children of the root, then per level the top-k children of
        the k best frontier nodes, of which the k best by path value form the next frontier. Returns
        every candidate's token, parent (-1: the root) and path value (cumulative log-probability),
        in creation order (ancestors before descendants). All on the device, nothing read back:
        `feed(tokens, parent_hidden, depth, seen)` feeds a level into the head (`feed_level`, or
        `feed_static` at device positions) with the frontier's level mask `seen`."""
        k = self.branching()
        device = root_logits.device
        top = torch.topk(torch.log_softmax(root_logits, -1), k)
        tokens, parents, values = [top.indices], [torch.full((k,), -1, device=device)], [top.values]
        frontier_ids = torch.arange(k, device=device)  # candidate ids of the nodes fed next
        frontier_values, frontier_hidden = top.values, root_hidden.expand(k, -1)
        # frontier node -> the drafted slots it sees (its ancestors'): level l's frontier sits in slots
        # (l - 1) k .. l k - 1, so a child of frontier node j sees its parent's row and slot j of that level
        seen = torch.zeros(k, 0, dtype=torch.bool, device=device)
        count = k
        for level in range(1, levels):
            hidden = feed(torch.cat(tokens)[frontier_ids], frontier_hidden, level, seen)
            child = torch.topk(torch.log_softmax(self.drafter.logits(hidden), -1), k)  # [k, k]
            cumulative = (frontier_values[:, None] + child.values).flatten()
            tokens.append(child.indices.flatten())
            parents.append(frontier_ids.repeat_interleave(k))
            values.append(cumulative)
            best = torch.topk(cumulative, k).indices
            parent = best // k  # each new frontier node's parent, a row of this level
            # (one_hot reads its bounds)
            seen = torch.cat([seen[parent], parent[:, None] == torch.arange(k, device=device)], 1)
            frontier_ids = best + count
            count += k * k
            frontier_values = cumulative[best]
            frontier_hidden = hidden[parent]
        return torch.cat(tokens), torch.cat(parents), torch.cat(values)

    def _rerank(self, root: int, tokens: torch.Tensor, parents: torch.Tensor, values: torch.Tensor,
                levels: int) -> Tree:
        """Keep the best `total_tokens - 1` candidates; ties go to the earlier candidate (a stable
        sort), so a kept node's ancestors (never worth less) are kept too; the kept candidates in
        creation order (ancestors before descendants) are the tree's nodes.
        A fixed size builds the tree on the device (`DeviceTree`: nothing is read back). The
        adaptive size is the host's choice from the best candidates' path probabilities: the one
        read that brings them brings their ids and parents too, and the host builds the structure."""
        keep = min(self.total_tokens - 1, tokens.numel())
        order = torch.sort(values, descending=True, stable=True).indices[:keep]
        if self.verify_seconds is None:
            return self._device_tree(root, tokens, parents, order.sort().values, levels)
        ids, ups, probabilities = torch.stack([order.double(), parents[order].double(),
                                               values[order].exp().double()]).tolist()
        ids = ids[:self.adaptive_size(probabilities)]
        kept = sorted(int(c) for c in ids)
        # candidate -> its node (the root's children: parent 0)
        node_of = {c: node for node, c in enumerate(kept, start=1)}
        parent_of = dict(zip((int(c) for c in ids), (int(p) for p in ups)))
        tree_parents = [node_of.get(parent_of[c], 0) for c in kept]
        chosen = tokens[torch.tensor(kept, dtype=torch.long, device=tokens.device)]
        return Tree(torch.cat([tokens.new_tensor([root]), chosen]), [-1] + tree_parents)

    def _device_tree(self, root: int, tokens: torch.Tensor, parents: torch.Tensor, kept: torch.Tensor,
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

    def adaptive_size(self, probabilities: list[float]) -> int:
        """How many of the best candidates (path probabilities, best first) to verify: the n with
        the most expected tokens, 1 + sum of the first n, per second of drafting + verifying."""
        expected, best, best_rate = 1.0, 0, 1.0 / (self.draft_seconds + self.verify_time(1))
        for n, p in enumerate(probabilities, start=1):
            expected += p
            rate = expected / (self.draft_seconds + self.verify_time(n + 1))
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def verify_time(self, tokens: int) -> float:
        """Seconds of a target forward of `tokens` tokens, interpolated from the measured sizes."""
        return verify_cost(self.verify_seconds, tokens) * self.verify_seconds[min(self.verify_seconds)]

    def measure_verify_latency(self, model_name: str, sizes=(1, 2, 4, 8, 16, 32, 64)) -> None:
        """`total_tokens: adaptive`: the target's forward latency curve from the hardware profile
        (measured once per machine, model and dtype, then reused)."""
        self.verify_seconds = latency_curve(self.target, model_name, sizes)
        self.total_tokens = max(self.total_tokens, max(sizes))
        self.total_tokens_timing = {"adaptive": True, "seconds_by_size": self.verify_seconds}

    def auto_total_tokens(self, sizes=(40, 48, 50, 56, 60), weights=(1, 1.05, 1.07, 1.1, 1.13),
                          prefix: int = 128, repeats: int = 3) -> int:
        """EAGLE-2's `total_token=-1`: time target forwards of each size and take the size with the
        least time per weight (weights credit larger trees with the extra tokens they accept)."""
        timings = forward_latency(self.target, sizes, prefix, repeats)
        best = min(sizes, key=lambda s: timings[s] / weights[sizes.index(s)])
        self.total_tokens = best
        self.total_tokens_timing = {"chosen": best, "seconds_by_size": timings, "weights": dict(zip(sizes, weights))}
        return best


@register("eagle", settings=EagleSettings)
def build_eagle(target, settings: EagleSettings, context: BuildContext) -> EagleDecoder:
    params = {"name": "eagle", **settings.to_dict()}
    head = load_eagle_head(head_spec(params, context, "eagle"), context.target_model)
    # auto: EAGLE's own tree, cut to what one verification may hold on this machine
    tree, sizing = context.static_tree(params, target, "eagle_mc_sim_7b_63")
    decoder = EagleDecoder(target, head, tree, vocabulary=context.draft_vocabulary(params),
                           sampling_rule=settings.sampling_rule)
    decoder.sizing = sizing
    return decoder


def build_dynamic(decoder_class, target, head, settings: DynamicTreeSettings, context: BuildContext,
                  **extra) -> Eagle2Decoder:
    """An EAGLE-2-tree decoder with `method.total_tokens` (a number, `auto` or `adaptive`), `depth`, `top_k`."""
    total = settings.total_tokens
    decoder = decoder_class(target, head, total_tokens=60 if isinstance(total, str) else int(total),
                            depth=settings.depth, top_k=settings.top_k, **extra)
    if total == "auto":
        decoder.auto_total_tokens()
    elif total == "adaptive":
        decoder.measure_verify_latency(context.model_name)
    return decoder


@register("eagle2", settings=Eagle2Settings)
def build_eagle2(target, settings: Eagle2Settings, context: BuildContext) -> Eagle2Decoder:
    params = {"name": "eagle2", **settings.to_dict()}
    head = load_eagle_head(head_spec(params, context, "eagle"), context.target_model)
    return build_dynamic(Eagle2Decoder, target, head, settings, context, vocabulary=context.draft_vocabulary(params))
