"""DFlash (Chen, Liang and Liu 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036;
z-lab/dflash): a block-diffusion drafter. A few draft layers read the target's hidden features (projected by
`fc` and injected as extra keys and values) and fill a whole block [last token, mask, mask, ...] in ONE
forward, attending non-causally inside the block; the target's embedding and lm_head are shared; the
target verifies the block as a chain. The draft module and its loader: `models/heads/dflash.py`.

Each part against upstream's `dflash/model.py` (`dflash_generate`, lines 62-169; z-lab/dflash @ 44947fb):

- prefill (model.py:87-100): the loop's target prefill; the runner also returns the inputs of layers
  k + 1 for k in `target_layer_ids` (`ModelRunner.capture_inputs`), i.e. the outputs of layers k,
  `extract_context_feature`'s `hidden_states[k + 1]` (model.py:39-45); the first token is the loop's.
  `start` keeps every prompt position's features as the draft's pending context.
- the block (model.py:108-109): [the last emitted token, mask_token_id x (bs - 1)] at positions
  start .. start + bs - 1, start = the last token's position (`propose_batch`).
- the draft forward (model.py:111-119): the target's `embed_tokens` of the block (unscaled), the pending
  context features (positions cache_len .. start - 1) and the draft cache, not causal
  (`DFlashDraft.draft`); draft logits = the target's lm_head over the block's rows 1 .. (same-position
  prediction: row i drafts the token at start + i), only the rows this step verifies.
- the draft cache (model.py:120, `crop(start)`): `ContextCache.length` counts the context positions only;
  the block's K/V are written past it for that forward and never kept.
- drafts (model.py:121): argmax, at any temperature (upstream's `sample(draft_logits)` with its default
  temperature 0).
- verify (model.py:126-134): the loop's one target forward over the chain [last token, drafts].
- accept (model.py:134-138): greedy, the longest prefix whose drafts equal the target's argmax, then the
  target's token after it. At T > 0 upstream samples the target at every position of the block and keeps
  the longest prefix where the drafts equal those samples: draft x is kept with probability p(x), and the
  first mismatch emits a sample of p given that it is not x. That is speculative sampling with the draft
  as a point mass q = one-hot(x) (accept with min(1, p(x)/q(x)) = p(x); on rejection the residual
  norm(max(0, p - q)) = p with x removed), which the engine's `sample_accept` runs for a chain without
  draft probabilities: the same law, lossless (`tests/test_dflash.py` checks it with a chi-square test).
- the target cache (model.py:139, `crop(start)`): the loop's commit of the accepted path.
- the next context (model.py:142-143): the features of the verified rows up to the last accepted one
  (the old last token and the accepted drafts), `advance`; the new last token is the next block's slot 0.
- stop (model.py:145-155): the loop's stopping rule.

Sizes: `block_size: auto` drafts the draft's own block (its config's `block_size`, 16 for the released
drafts: upstream's default) and verifies its first drafts up to this machine's verify budget (all of
them without a machine profile); an integer b is upstream's `block_size` argument (benchmark.py's
`--block-size`): a block of b drafted and verified. At B > 1 a greedy sequence's chain is cut further to
`state.cut`; the block drafted is the same, so a sequence drafts at B what it drafts alone. A batch
drafts in one forward: the projections and MLPs for all its blocks at once, each block attending over
its own context cache (`DFlashDraft.draft`).

Settings and their defaults: `DFlashSettings` below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BuildContext, register
from .engine.tree import Tree
from .engine.vocab import draft_vocab_setting
from .loop import DraftVerifyDecoder
from .models.heads.dflash import ContextCache, DFlashDraft, load_dflash_draft
from .models.heads.source import head_setting, head_spec
from .models.specs import PROJECT_ROOT, ModelUnavailableError
from .settings.params import ConfigError, Settings, integer, one_of, setting
from .settings.sizing import Sizing


def missing_draft(path: str | None, model_name: str | None) -> str | None:
    """Why a model config's `drafts.dflash` cannot load yet: a project folder (drafts/<model>/dflash) that
    the suite's recipe has not written; None when nothing is missing."""
    if path and str(path).startswith("drafts/") and not (PROJECT_ROOT / str(path)).exists():
        return (f"no DFlash draft at {path} yet: train it with `python -m harness.training dflash --model "
                f"{model_name}` (on the corpus of `python -m harness.training data --model {model_name}`), or set "
                "method.head.path=<a DFlash draft folder or Hub id>")
    return None


@dataclass(frozen=True)
class DFlashSettings(Settings):
    """DFlash: a block-diffusion draft (a few layers reading the target's features) fills a block
    [last token, mask, ...] in one forward; the target verifies it as a chain (greedy match; at T > 0
    upstream's sample-and-match, i.e. speculative sampling with the draft as a point mass)."""

    paper = "Chen et al. 2026 (z-lab/dflash)"
    draft_kind = "dflash"
    size_setting, size_label = "block_size", "block size"
    size_recorded = "verify_block"  # the tokens one verification holds, the root included

    block_size: int | str = setting("auto", one_of("auto") | integer(2),
                                    "tokens per block, the last token included: auto = the draft's own block "
                                    "(its config's block_size, upstream's default) verified up to this machine's "
                                    "verify budget (whole without a machine profile); b = upstream's block_size "
                                    "(a block of b drafted and verified)")
    draft_vocab: int | str = draft_vocab_setting()
    head: dict | None = head_setting("dflash")

    batchable = True

    def check_model(self, model: dict) -> None:
        if self.head:
            return
        why = missing_draft(((model.get("drafts") or {}).get("dflash") or {}).get("path"), model.get("name"))
        if why:
            raise ConfigError("model", model.get("name"), f"a model whose DFlash draft is there: {why}")


class DFlashLane:
    """One sequence's drafter state (`DecodeState.draft`): its context cache and the target features not
    in it yet (the positions from the cache's length up to the block's start)."""

    def __init__(self):
        self.cache = ContextCache()
        self.pending: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        features = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        self.pending = []
        return features


class DFlashDecoder(DraftVerifyDecoder):
    name = "dflash"

    def __init__(self, target, draft: DFlashDraft, block_size: int | None = None,
                 num_draft: int | Sizing | None = None, vocabulary=None):
        """`block_size`: the block the draft fills (default its config's); `num_draft`: the drafts verified per
        step (default block_size - 1; `auto`'s `Sizing`)."""
        block = int(block_size or draft.block_size)
        super().__init__(target, Sizing.of(block - 1 if num_draft is None else num_draft))
        if self.sizing.value > block - 1:
            raise ValueError(f"{self.sizing.value} drafts per step from a block of {block}: at most {block - 1}")
        self.draft, self.block, self.vocabulary = draft, block, vocabulary
        self.embed = target.model.get_input_embeddings()
        target.capture_inputs(draft.feature_layers)
        self.projection = None if vocabulary is None else vocabulary.head(target.lm_head.weight)
        target.cover(draft, *([self.projection] if self.projection is not None else []))
        self.ids = None if vocabulary is None else vocabulary.ids.to(self.embed.weight.device)
        self.lanes: list[DFlashLane] = []

    def draft_state(self, index: int) -> DFlashLane:
        """Sequence `index`'s drafter state, made once and reused (its cache's buffer with it)."""
        while len(self.lanes) <= index:
            self.lanes.append(DFlashLane())
        return self.lanes[index]

    def start(self, state, prefill) -> None:
        lane = state.draft
        lane.cache.reset(len(state.prompt) + state.stop.max_new_tokens + self.block + 1, self.draft)
        lane.pending = [prefill.layers]  # every prompt position's features (model.py:99)
        state.values["draft_forwards"] = 0

    def propose(self, state, root: int, budget: int) -> Tree:
        return self.propose_batch([state], [budget])[0]

    def propose_batch(self, states, budgets) -> list[Tree]:
        """Every sequence's chain [last token, its first drafts]: `min(sizing, budget)` drafts (`budget`
        holds the batch's cut), the blocks of all sequences that draft filled by one draft forward."""
        counts = [min(self.sizing.value, budget) for budget in budgets]
        trees: list[Tree | None] = [None] * len(states)
        drafting = [i for i, count in enumerate(counts) if count > 0]
        for i in set(range(len(states))) - set(drafting):  # nothing left to draft: the last token alone
            trees[i] = Tree.root(states[i].tokens[-1])
        if drafting:
            roots, drafts = self.draft_blocks([states[i] for i in drafting], max(counts[i] for i in drafting))
            for row, i in enumerate(drafting):
                trees[i] = Tree.chain(torch.cat([roots[row:row + 1], drafts[row, : counts[i]]]))
        return trees

    @torch.inference_mode()
    def draft_blocks(self, states, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward for these sequences' blocks (model.py:108-121): their last tokens [A] and the
        argmax drafts of block rows 1 .. count [A, count], on the target's device (nothing read back)."""
        device = self.embed.weight.device
        lanes = [state.draft for state in states]
        roots = torch.tensor([state.tokens[-1] for state in states], device=device)
        block = torch.full((len(states), self.block), self.draft.mask_token_id, device=device)
        block[:, 0] = roots
        pending = [lane.take() for lane in lanes]
        features = torch.nn.utils.rnn.pad_sequence(pending, batch_first=True)
        hidden = self.draft.draft(self.embed(block), features, [len(p) for p in pending],
                                  [len(state.sequence) - 1 for state in states], [lane.cache for lane in lanes])
        for state in states:
            state.values["draft_forwards"] += 1
        return roots, self.argmax(hidden[:, 1:1 + count])

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> the target's lm_head's argmax [...] (over the draft vocabulary where one is set)."""
        if self.projection is None:
            return self.target.lm_head(hidden).argmax(-1)
        return self.ids[self.projection(hidden).argmax(-1)]

    def advance(self, state, tree, acceptance, verified) -> None:
        # the features of the verified rows up to the last accepted one: the last token and the accepted drafts
        state.draft.pending.append(verified.layers[: len(acceptance.path)])

    def finish(self, state) -> None:
        state.stats.extra["draft_forwards"] = state.values.get("draft_forwards", 0)

    def describe(self):
        setting_value = (self.sizing.source or {}).get("block_size", self.block)
        return {**super().describe(), "block_size": setting_value, "draft_block": self.block,
                "draft_tokens": self.sizing.value, "verify_block": self.sizing.value + 1,
                "target_layer_ids": self.draft.target_layer_ids, "mask_token_id": self.draft.mask_token_id,
                "draft_layers": len(self.draft.layers),
                "draft_vocab": len(self.vocabulary) if self.vocabulary is not None else None}


@register("dflash", settings=DFlashSettings)
def build(target, settings: DFlashSettings, context: BuildContext) -> DFlashDecoder:
    params = {"name": "dflash", **settings.to_dict()}
    if not settings.head:
        why = missing_draft((context.drafts.get("dflash") or {}).get("path"), context.model_name)
        if why:
            raise ModelUnavailableError(why)
    draft = load_dflash_draft(head_spec(params, context, "dflash"), context.target_model)
    if settings.block_size == "auto":  # the draft's own block, its drafts cut to this machine's verify budget
        block = draft.block_size
        budget = context.draft_tokens(target, "block_size", "auto", block - 1)
        count = min(budget.value, block - 1)
        sizing = budget.choose(count, draft_tokens=count, chosen=f"the draft's block of {block}, its first {count} "
                                                                 "drafts verified")
    else:
        block, sizing = settings.block_size, Sizing.fixed(settings.block_size - 1)
    return DFlashDecoder(target, draft, block, sizing, context.draft_vocabulary(params))

