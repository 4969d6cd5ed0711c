"""PARD: a parallel draft model (Zhang et al., "PARD: Accelerating LLM Inference with Low-Cost PARallel
Draft Model Adaptation", arXiv 2504.18583, ICLR 2026; AMD-AGI/PARD @ 6f279bf, `pard/pard_infer.py`,
`pard/pard_train.py`).

The draft is an ordinary small causal LM, adapted (`harness/training/pard.py`) so that K - 1 mask tokens
appended to its input make it predict the next K tokens in ONE forward. It reads no target feature:
one draft serves a whole model family. Upstream's parts, and where they are here:

- The checkpoint (`pard_train.py:28-29`): a Hugging Face causal LM whose config.json adds `pard_token`
  (the mask id, `unused_tokenids[0]`) and `spd_type: "pard"`. `load_pard_draft` reads `pard_token` as
  upstream's inference does (`pard_infer.py:54-55`), unless `method.mask_token` gives one, and refuses a
  config without one, and a PARD-2 draft (`spd_type: pard2`: it adds target features, not ported).
- The draft step (`pard_infer.py:171-183`): the tokens committed since the last step, then K - 1 copies
  of `pard_token`, at the positions that continue the sequence, causal (upstream passes no mask over a
  static cache); the drafts are the argmax of the last K logits (`logits[:, -K:]`): the last real
  token's next-token prediction, then each mask's. One draft forward per step (`ParallelDraft.logits`).
- The draft cache (`pard_infer.py:243-246`): `draft_len -= K - 1` after the forward, so it holds only
  committed tokens; the next step feeds the step's accepted drafts and the next token (`keep`,
  `pard_infer.py:244`). Here `ModelRunner.rollback` drops the K - 1 masks' KV; no draft ever enters it
  unverified, so nothing else is rolled back.
- Verification (`pard_infer.py:196-226`): the target verifies [last token] + K drafts as a chain, keeps
  the longest matching prefix and the target's next token: the shared loop's greedy match
  (`methods/loop.py`), with the target's KV committed along the accepted path (`pard_infer.py:232`).
- `draft_k` 12 (`pard_infer.py:23`, `config/eval/*.yaml`): `k: auto` is this machine's verify budget less
  the root, and upstream's 12 without a machine profile; at batch size > 1 a greedy sequence drafts at
  most the loop's cut (`state.cut`).

Differences from upstream, none of which changes a greedy token: upstream's first draft step drafts
from the prompt alone and merges the target's prefill with the first verification; the shared loop
prefills the target first (its first token), so the first draft step feeds the prompt and that token.
Upstream's inference is greedy only (`pard_infer.py:183, 210`); at temperature > 0 this port SAMPLES
each draft from its slot's processed distribution q_i (the sampling config applied to slot i's
logits) and verifies with the suite's speculative sampling (SpS's rule: accept d_i with probability
min(1, p_i(d_i) / q_i(d_i)), else draw from norm(max(0, p_i - q_i))). q_i depends on the committed
prefix alone (slot i sees masks, not d_1..d_{i-1}), which is a valid draft distribution for the rule,
so the output follows the target's distribution exactly (tests/test_pard.py: chi-square, and a broken
residual caught). (vLLM's parallel drafting instead verifies greedy drafts as point masses; both are
lossless.)

Batch size > 1 (`PardBatch`): every running sequence's new tokens and masks in one draft forward over
a batch cache of the committed tokens, each sequence's rows at its own positions, seeing its own
prefix; the masks' KV is dropped by the commit. A sequence drafts what it drafts alone (to rounding),
from its own generator in its own order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import AutoConfig

from .base import BuildContext, register
from .engine.kv_cache import batch_change
from .engine.sampling import draw_children, logits_to_probs
from .engine.tree import Tree
from .engine.vocab import draft_vocab_setting
from .loop import DraftVerifyDecoder
from .models.draft_lm import DraftLM
from .models.loading import from_pretrained, load_draft_lm, local_folder
from .models.specs import PROJECT_ROOT, ModelSpec, ModelUnavailableError
from .settings.params import Settings, integer, mapping, null, one_of, setting
from .settings.sizing import Sizing

UPSTREAM_K = 12  # pard_infer.py's --draft_k default, and every PARD-1 eval config's
TRAIN_COMMAND = "python -m harness.training pard --model {model}"


@dataclass(frozen=True)
class PardSettings(Settings):
    """PARD: a parallel draft LM proposes K tokens in ONE forward (the newly committed tokens, then K - 1
    mask tokens); the target verifies the chain in one forward (greedy match; at temperature > 0,
    speculative sampling with each draft slot's distribution)."""

    paper = "Zhang et al. 2025, ICLR 2026 (AMD-AGI/PARD)"
    draft_kind = "pard"
    size_setting, size_label = "k", "draft length γ"
    size_recorded = "draft_tokens"  # what `auto` resolved to

    k: int | str = setting("auto", one_of("auto") | integer(1),
                           "draft tokens per step (upstream's draft_k): auto = this machine's verify budget less the "
                           "root (upstream's 12 without a machine profile)")
    mask_token: int | None = setting(None, null() | integer(0),
                                     "null = the draft config's pard_token (the mask id it was trained with); or a "
                                     "token id")
    draft_vocab: int | str = draft_vocab_setting()
    draft: dict | None = setting(None, null() | mapping(),
                                 "null = the model's drafts.pard; or {path: <hub id or folder>} (a PARD checkpoint: "
                                 "config.json with pard_token)")

    batchable = True  # each sequence's draft KV in its DecodeState's DraftLM (alone) or a row of PardBatch's cache

    def check_model(self, model: dict) -> None:
        """Before anything loads: the model's own PARD draft, when it is a project folder not built yet."""
        if self.draft is None:
            missing_embedded_draft((model.get("drafts") or {}).get("pard") or {}, model.get("name"))


def missing_embedded_draft(spec: dict, model_name: str | None) -> None:
    """A project folder named by the model config (drafts/<model>/pard) that is not there yet: say how to
    build it instead of looking it up on the Hub."""
    path = str(spec.get("path") or "")
    if path.startswith("drafts/") and not (PROJECT_ROOT / path).exists():
        raise ModelUnavailableError(
            f"no PARD draft at {path} yet: build it with `{TRAIN_COMMAND.format(model=model_name)}` (COD "
            f"fine-tuning of drafts/{model_name}/draft-lm), or set method.draft.path=<a PARD checkpoint folder or "
            "Hub id>")


def draft_config(spec: dict, target_model):
    """The draft's config (no weights read): its folder's or Hub snapshot's config.json; a draft made of
    the target's layers (`{target_layers: k}`) has the target's."""
    if spec.get("target_layers"):
        return target_model.config
    model_spec = local_folder(ModelSpec.from_mapping(spec, override_hint="method.draft.path"))
    return from_pretrained(AutoConfig, model_spec, "PARD draft config")


def load_pard_draft(spec: dict, target_model, mask_token: int | None = None):
    """(the draft LM, its mask id): the id is `mask_token` when given, else the config's `pard_token`
    (upstream's `pard_train.py:28`; -1 there means none was set). A config without one is refused before
    its weights load, as is a PARD-2 draft."""
    config = draft_config(spec, target_model)
    where = spec.get("path") or f"target_layers={spec.get('target_layers')}"
    if getattr(config, "spd_type", None) == "pard2":
        raise ValueError(f"draft {where!r} is a PARD-2 draft (spd_type: pard2): it reads the target's features "
                         "(pard2_infer.py), which this port does not; use a PARD-1 draft (spd_type: pard)")
    token = mask_token if mask_token is not None else getattr(config, "pard_token", None)
    if token is None or int(token) < 0:
        raise ValueError(f"draft {where!r} has no pard_token in its config.json: not a PARD draft; use a PARD "
                         "checkpoint (e.g. amd/PARD-Llama-3.2-1B) or give its mask id as method.mask_token=<id>")
    draft = load_draft_lm(spec, target_model)
    rows = draft.get_input_embeddings().num_embeddings
    if not 0 <= int(token) < rows:
        raise ValueError(f"draft {where!r}: mask token {token} is outside its {rows}-row embedding")
    return draft, int(token)


class ParallelDraft:
    """One sequence's parallel drafting on its `DraftLM` (its own cache): the committed tokens not yet
    fed and K - 1 masks in one forward; the masks' KV rolled back at once (`pard_infer.py:243-246`)."""

    def __init__(self, lane: DraftLM, mask: int):
        self.lane, self.mask = lane, mask

    @torch.inference_mode()
    def logits(self, sequence: Sequence[int], k: int) -> torch.Tensor:
        """[k, V_target]: the next-token logits after the last committed token, then after each mask."""
        lane = self.lane
        new = list(sequence[len(lane.fed):])
        if not new:
            raise RuntimeError("the PARD draft has seen the whole sequence: nothing to feed")
        runner = lane.runner
        out = runner.forward(new + [self.mask] * (k - 1), logits_for=slice(-k, None))
        runner.rollback(runner.length - (k - 1))  # the draft cache holds committed tokens only
        lane.fed.extend(new)
        return lane.align(out.logits)


def chain(root: int, logits: torch.Tensor, state) -> Tree:
    """The chain [root, d_1..d_k] from the k draft slots' logits: argmax when greedy (upstream's); sampled,
    each d_i drawn from its slot's processed distribution q_i from the sequence's generator, q kept for
    verification (`Tree.draft_probs`: row i is the distribution of node i's child)."""
    device = logits.device
    if state.sampling.greedy:
        drafts = logits.argmax(-1)
        return Tree.chain(torch.cat([torch.tensor([root], device=device), drafts]))
    q = logits_to_probs(logits, state.sampling)
    drafts = draw_children(q, 1, False, state.generator)[:, 0]
    probs = torch.cat([q, q.new_zeros(1, q.shape[-1])])  # the leaf's row is never read
    return Tree.chain(torch.cat([torch.tensor([root], device=device), drafts]), probs)


class PardDecoder(DraftVerifyDecoder):
    name = "pard"

    def __init__(self, target, draft_model, mask_token: int, k: int | Sizing = UPSTREAM_K, vocabulary=None):
        """`draft_model`: the PARD draft (a model, or a `DraftLM`); `mask_token`: its `pard_token`; `k`: draft
        tokens per step (`method.k` settled: a `Sizing`)."""
        super().__init__(target, Sizing.of(k))
        if int(self.sizing.value) < 1:
            raise ValueError(f"k (draft tokens per step) must be >= 1, got {self.sizing.value}")
        self.k, self.mask, self.vocabulary = int(self.sizing.value), int(mask_token), vocabulary
        self.draft = DraftLM.of(draft_model, target, vocabulary)
        self.batch_draft = PardBatch(self.draft, self.mask)  # a batch's drafts in one forward (`propose_batch`)

    def describe(self):
        setting = (self.sizing.source or {}).get("k", self.sizing.value)  # `auto`, or the number given
        return {**super().describe(), "k": setting, "draft_tokens": self.k, "mask_token": self.mask,
                "draft_vocab": len(self.vocabulary) if self.vocabulary else None}

    @property
    def lane_drafts(self) -> list[DraftLM]:
        """The draft LMs the sequences of a batch have drafted with so far (`DraftLM.lanes`)."""
        return self.draft.lanes

    def draft_state(self, index: int) -> DraftLM:
        """Sequence `index`'s draft LM: its own cache over the same weights (index 0: `self.draft`)."""
        return self.draft.lane(index)

    def start(self, state, prefill) -> None:
        state.draft.reset()

    def draft_length(self, state, budget: int) -> int:
        """This step's K: the decoder's, at most what the stopping rule leaves and the batch's cut."""
        return min(self.k, budget, self.k if state.cut is None else state.cut)

    def propose(self, state, root: int, budget: int) -> Tree:
        k = self.draft_length(state, budget)
        if k <= 0:
            return Tree.root(root)
        return chain(root, ParallelDraft(state.draft, self.mask).logits(state.sequence, k), state)

    def propose_batch(self, states, budgets) -> list[Tree]:
        """A batch's chains with one draft forward for every sequence (`PardBatch`)."""
        ks = [max(0, self.draft_length(state, budget)) for state, budget in zip(states, budgets)]
        logits = self.batch_draft.logits(states, ks)
        return [Tree.root(state.sequence[-1]) if k == 0 else chain(state.sequence[-1], rows, state)
                for state, k, rows in zip(states, ks, logits)]


class PardBatch:
    """The parallel draft of a batch (`methods/loop.py`): one draft forward for every running sequence per
    step. Each sequence's committed tokens sit in one row of a `BatchKVCache` on a runner of its own (over
    the draft's weights). A new batch: each sequence's draft first takes its sequence but the last token
    alone (the batch-1 forward, no padding), its cache copied into its row. A step: sequence b's rows are
    its unfed tokens and k_b - 1 masks at positions lengths[b].., causal among themselves and seeing b's
    committed slots; padding rows see only themselves. The commit keeps each sequence's real rows at its
    length, so the masks' KV (and the padding) is dropped."""

    def __init__(self, draft: DraftLM, mask: int):
        self.draft, self.mask = draft, mask
        self.runner = None
        self.states: list = []

    def _rows(self, states: Sequence) -> None:
        """The cache's rows for `states`: those still running kept (a batch that lost sequences), each
        sequence that joined (continuous batching) a new last row, or a new batch made; a sequence new to
        the batch has its prefix fed alone and copied into its row."""
        change = batch_change(self.states, states) if self.runner is not None else None
        if change is not None:
            kept, joining = change
            if len(kept) != len(self.states):
                self.runner.cache.keep_sequences(kept)
            for state in joining:
                self.runner.cache.add_sequence(self._fed_alone(state))
            self.states = list(states)
            return
        if self.runner is None:
            self.runner = self.draft.another().runner
        self.runner.reserve_batch(len(states), max(s.room() for s in states),
                                  batch_cache=True)
        for row, state in enumerate(states):
            self.runner.cache.load_row(row, self._fed_alone(state))
        self.states = list(states)

    @staticmethod
    def _fed_alone(state):
        """The sequence's draft cache once its draft has taken the sequence but its last token alone."""
        lane = state.draft
        prefix = state.sequence[len(lane.fed):-1]
        if prefix:
            lane.runner.forward(prefix, logits_for=None)
            lane.fed.extend(prefix)
        return lane.runner.cache

    @torch.inference_mode()
    def logits(self, states: Sequence, ks: Sequence[int]) -> list[torch.Tensor]:
        """Per sequence, [k_b, V_target]: its k_b draft slots' logits (none for k_b = 0), every sequence's
        rows in one forward."""
        self._rows(states)
        runner, device = self.runner, self.runner.device
        news = [list(state.sequence[len(state.draft.fed):]) for state in states]
        if not all(news):
            raise RuntimeError("a sequence's PARD draft has seen all of it: nothing to feed")
        rows = [new + [self.mask] * max(0, k - 1) for new, k in zip(news, ks)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        visible = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1)  # padding rows: themselves
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row)
            visible[b, : len(row), : len(row)] = torch.ones(len(row), len(row), dtype=torch.bool).tril_()
        depths = torch.arange(width).repeat(len(rows), 1)
        start = runner.length
        out = runner.forward_rows(ids.to(device), depths.to(device), visible.to(device), reach=width)
        runner.cache.commit_batch(start, [range(len(new)) for new in news])
        for state, new in zip(states, news):
            state.draft.fed.extend(new)
        return [self.draft.align(out.logits[b, len(new) - 1: len(new) - 1 + k])
                for b, (new, k) in enumerate(zip(news, ks))]


@register("pard", settings=PardSettings)
def build(target, settings: PardSettings, context: BuildContext) -> PardDecoder:
    spec = settings.draft or context.draft_spec("pard", "pard")
    missing_embedded_draft(spec, context.model_name)
    draft, mask = load_pard_draft(spec, context.target_model, settings.mask_token)
    vocabulary = context.draft_vocabulary(settings.to_dict(), draft.get_output_embeddings().out_features)
    sizing = context.draft_tokens(target, "k", settings.k, UPSTREAM_K)
    return PardDecoder(target, draft, mask, k=sizing, vocabulary=vocabulary)
