"""Hydra and Hydra++ (zankner/Hydra, arXiv 2402.05109): Medusa's static tree drafted by heads that
see the tokens drafted before them on their path ("grounded" heads).

With the last verified hidden state h (the target's at the last accepted position, whose logits
gave the root x_{t+1}), head d (0-based) reads concat(h, e(x_{t+1}), e(x_{t+2}), ..., e(x_{t+1+d}))
along a tree path and ranks the candidates for depth d+1. Drafting walks the static tree level by
level, as upstream's `_grounded_proposal` (`hydra/model/hydra_heads/mlp_head.py`): one batched call
of head d over the nodes of depth d that have children, the r-th ranked candidate of a node going
to its child [.., r]. Ungrounded heads (`grounded_heads: false`) read h alone: the Medusa tree.

Hydra++ (`hydra_head_arch: prefix-mlp`) first passes the target's hidden states through one extra
Llama decoder layer + norm (`PrefixLayer`); its KV cache holds the accepted sequence: the prompt at
the start, then after each verification the target's hidden states of the accepted path (root
included), as upstream's `update_inference_inputs` keeps them. The layer never sees tree nodes.

Verification is the suite's: greedy (exact) or recursive rejection sampling over the tree with
deterministic (top-k) drafts, which preserves the target distribution. `acceptance: typical` is
upstream's sampling rule (`hydra/model/utils.py` `evaluate_posterior`, Medusa's typical acceptance:
LOSSY, marked so in results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BuildContext, register
from .engine.acceptance import typical_accept
from .engine.kv_cache import TreeKVCache
from .engine.sampling import logits_to_probs
from .engine.static_trees import NAMED_TREES, StaticTree, template_tokens
from .engine.tree import Tree, attention_mask
from .engine.vocab import draft_vocab_setting
from .loop import DraftVerifyDecoder
from .models.heads.hydra import HydraHeads, load_hydra_heads
from .models.heads.source import head_setting, head_spec
from .models.specs import PROJECT_ROOT, ModelUnavailableError
from .settings.params import Settings, number, one_of, paths, setting
from .settings.sizing import Sizing

ACCEPTANCE = ("exact", "typical")


@dataclass(frozen=True)
class HydraSettings(Settings):
    """Hydra / Hydra++ (zankner/Hydra): Medusa-style heads on the target's last hidden state, each grounded on
    the tokens drafted before it on its path; the static tree is drafted level by level, verified in one forward."""

    paper = "Ankner et al. 2024 (zankner/Hydra)"
    batchable = True  # h and Hydra++'s prefix-layer cache are in each sequence's DecodeState
    draft_kind = "hydra"
    lossless = "yes (not `acceptance=typical`)"
    size_setting, size_recorded, size_label = "tree", "tree_nodes", "tree size (nodes)"
    size_derived = ("tree_depth",)

    tree: str | list = setting(
        "auto",
        one_of("auto", *NAMED_TREES) | paths(),
        "auto = Hydra's mc_sim_7b_63 (upstream's default; listed by estimated acceptance) cut "
        "to what this machine verifies nearly free; hydra_mc_sim_7b_63 (whole); or a list of paths",
    )
    draft_vocab: int | str = draft_vocab_setting(
        " (heads saved with their own reduced projection, `draft_ids`, use theirs)"
    )
    head: dict | None = head_setting("hydra")
    acceptance: str = setting("exact", one_of(*ACCEPTANCE),
                              "exact (greedy / lossless sampling) | typical (upstream's sampling rule, Medusa's; "
                              "LOSSY: marked in results)")
    typical_epsilon: float = setting(0.09, number(0, 1), "typical acceptance's epsilon (upstream's)")
    typical_delta: float = setting(0.3, number(0), "typical acceptance's delta (upstream's)")


class HydraDecoder(DraftVerifyDecoder):
    name = "hydra"

    def __init__(self, target, heads: HydraHeads, tree: StaticTree, hidden_state_offset: int = 0, vocabulary=None,
                 acceptance: str = HydraSettings.acceptance, typical_epsilon: float = HydraSettings.typical_epsilon,
                 typical_delta: float = HydraSettings.typical_delta, sizing: Sizing | None = None):
        """`sizing`: how the tree was sized (its rule for a batch: `Sizing.cut`); None: the tree as given."""
        super().__init__(target, sizing or Sizing.fixed(len(tree) - 1))
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"unknown hydra acceptance {acceptance!r}; valid: {', '.join(ACCEPTANCE)}")
        self.acceptance, self.lossless = acceptance, acceptance == "exact"
        self.typical = (typical_epsilon, typical_delta)
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"tree of depth {tree.max_depth} needs {tree.max_depth} Hydra heads; "
                             f"these weights have {heads.num_heads}")
        self.heads, self.tree = heads, tree
        if heads.draft_ids is not None:
            vocabulary = None  # the heads' own reduced projection (their rows are the draft vocabulary)
        self.vocabulary = vocabulary
        self.offset = int(hidden_state_offset)
        if self.offset:
            layers = target.config.num_hidden_layers
            if not 0 < self.offset < layers:
                raise ValueError(f"hidden_state_offset={self.offset}: the target has {layers} layers")
            target.capture_inputs([layers - self.offset])  # upstream's hidden_states[-(offset + 1)]
        self._bias: dict[int, torch.Tensor] = {}
        projections = [heads.projection(i) for i in range(heads.num_heads)]
        target.cover(heads, *([vocabulary.head(p.weight) for p in projections] if vocabulary else []))

    def describe(self):
        heads = self.heads
        vocab = len(heads.draft_ids) if heads.draft_ids is not None else (len(self.vocabulary) if self.vocabulary
                                                                          else None)
        return {**super().describe(), "lossless": self.lossless, "acceptance": self.acceptance,
                "tree_nodes": len(self.tree), "tree_depth": self.tree.max_depth,
                "heads": heads.num_heads, "head_layers": heads.num_layers, "head_arch": heads.arch,
                "grounded": heads.grounded, "hidden_state_offset": self.offset, "draft_vocab": vocab}

    # ---------------------------------------------------------------------------------------
    def features(self, out) -> torch.Tensor:
        return out.hidden if not self.offset else out.layers

    @torch.inference_mode()
    def _follow(self, state, hidden: torch.Tensor) -> None:
        """The accepted positions' target hidden states: through the prefix layer (the sequence's
        cache of it extended by them) for Hydra++; h = the last one's."""
        values = state.values
        if self.heads.arch != "prefix-mlp":
            values["h"] = hidden[-1]
            return
        n, committed = hidden.shape[0], values["committed"]
        device, dtype = hidden.device, self.heads.hydra_mlp[0][1].linear.weight.dtype
        positions = torch.arange(committed, committed + n, device=device)
        causal = torch.ones(n, n, dtype=torch.bool).tril_()
        mask = attention_mask(causal, committed, dtype, device) if n > 1 else None
        out = self.heads.base(hidden.to(dtype), positions, mask, values["cache"])
        values["committed"] = committed + n
        values["h"] = out[-1]

    def start(self, state, prefill) -> None:
        # the sequence's prefix-layer cache (Hydra++), its committed length and the heads' input h
        state.values.update(cache=TreeKVCache(), committed=0)
        self._follow(state, self.features(prefill))

    def advance(self, state, tree, acceptance, verified) -> None:
        self._follow(state, self.features(verified)[acceptance.path])

    def accept(self, state, tree, logits, extra=None):
        if self.acceptance == "typical" and not state.sampling.greedy:
            return typical_accept(tree, logits_to_probs(logits, state.sampling), *self.typical, logits=logits)
        return super().accept(state, tree, logits, extra)

    # ---------------------------------------------------------------------------------------
    def _logits(self, i: int, features: torch.Tensor) -> torch.Tensor:
        """[m, H] -> [m, V] fp32 logits of head i (-inf outside the draft vocabulary, if any)."""
        heads = self.heads
        if heads.draft_ids is not None:
            sub = heads.logits(i, features).float()
            out = sub.new_full((*sub.shape[:-1], heads.embed.num_embeddings), float("-inf"))
            out[..., heads.draft_ids] = sub
            return out
        if self.vocabulary is None:
            return heads.logits(i, features).float()
        linear = heads.projection(i)
        if i not in self._bias:
            self._bias[i] = linear.bias.detach().index_select(0, self.vocabulary.ids.to(linear.bias.device)).float()
        return self.vocabulary.scatter(self.vocabulary.head(linear.weight)(features).float() + self._bias[i])

    @torch.inference_mode()
    def propose(self, state, root: int, budget: int) -> Tree:
        tree = self.tree.cut(state.cut)
        depth_limit = min(tree.max_depth, budget)
        count = sum(1 for d in tree.depths if d <= depth_limit)  # nodes are sorted by depth
        parents = tree.parents[:count]
        if depth_limit <= 0:
            return Tree.root(root)
        if not self.heads.grounded:
            return self._ungrounded(state, root, depth_limit, count, tree)
        children = [[] for _ in range(count)]
        for node in range(1, count):
            children[parents[node]].append(node)
        embed = self.heads.embed
        h = state.values["h"].to(self.heads.hydra_mlp[0][0 if self.heads.arch == "mlp" else 1].linear.weight.dtype)
        device = h.device
        # the tokens stay on the device: the verification's one read brings back the accepted ones
        tokens = torch.empty(count, dtype=torch.long, device=device)
        tokens[0] = root
        inputs = {0: torch.cat([h, embed(tokens[:1])[0]])}  # node -> concat(h, e(path))
        for depth in range(depth_limit):
            frontier = [n for n in range(count) if tree.depths[n] == depth and children[n]]
            if not frontier:
                break
            x = torch.stack([inputs.pop(n) for n in frontier])  # [m, H * (depth + 2)]
            logits = self._logits(depth, self.heads.features(depth, x))
            ranked = torch.topk(logits, tree.top_k(depth + 1)).indices  # [m, k]
            kids = [(row, child) for row, node in enumerate(frontier) for child in children[node]]
            tokens[[c for _, c in kids]] = ranked[[r for r, _ in kids], [tree.ranks[c] for _, c in kids]]
            expand = [(child, row) for row, child in kids if children[child]]
            if expand:
                embedded = embed(tokens[[c for c, _ in expand]])
                for (child, row), e in zip(expand, embedded):
                    inputs[child] = torch.cat([x[row], e])
        return Tree(tokens, parents)

    def _ungrounded(self, state, root: int, depth: int, count: int, tree: StaticTree) -> Tree:
        """Medusa's tree: head d-1's r-th candidate under every parent at depth d."""
        dtype = self.heads.projection(0).weight.dtype
        candidates = [torch.topk(self._logits(d, self.heads.features(d, state.values["h"].to(dtype)[None]))[0],
                                 tree.top_k(d + 1)).indices
                      for d in range(depth)]
        return Tree(template_tokens(root, candidates, tree, count), tree.parents[:count])


def _missing_embedded_heads(spec, context: BuildContext) -> None:
    """A project folder named by the model config (e.g. drafts/<model>/hydra) that is not there yet:
    say how to train it instead of looking it up on the Hub."""
    path = str(spec.path)
    if path.startswith("drafts/") and not (PROJECT_ROOT / path).exists():
        raise ModelUnavailableError(
            f"no Hydra heads at {path} yet: train them with `python -m harness.training hydra --model "
            f"{context.model_name}` "
            f"(on the corpus of `python -m harness.training data --model {context.model_name}`), or set "
            f"method.head.path=<a Hydra checkpoint folder or Hub id>")


@register("hydra", settings=HydraSettings)
def build(target, settings: HydraSettings, context: BuildContext) -> HydraDecoder:
    params = {"name": "hydra", **settings.to_dict()}
    spec = head_spec(params, context, "hydra")
    _missing_embedded_heads(spec, context)
    heads, config = load_hydra_heads(spec, context.target_model)
    # auto: upstream's default tree (hydra_choices.mc_sim_7b_63), cut to this machine's verify budget
    tree, sizing = context.static_tree(params, target, "hydra_mc_sim_7b_63", max_depth=heads.num_heads)
    decoder = HydraDecoder(target, heads, tree, hidden_state_offset=int(config.get("hidden_state_offset", 0) or 0),
                           vocabulary=context.draft_vocabulary(params), acceptance=settings.acceptance,
                           typical_epsilon=float(settings.typical_epsilon), typical_delta=float(settings.typical_delta),
                           sizing=sizing)
    return decoder
