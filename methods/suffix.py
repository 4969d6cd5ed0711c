"""Suffix Decoding (Oliaro et al., arXiv 2411.04975, NeurIPS 2025) as vLLM runs it (`method: "suffix"`,
`vllm/v1/spec_decode/suffix_decoding.py`), on upstream's own cache: Snowflake's `arctic-inference`
`SuffixDecodingCache` (`arctic_inference.suffix_decoding`, a C++ extension; pinned in pyproject.toml).

The cache holds suffix trees of token ids: one per active request over its prompt and output so far
(`start_request(id, prompt)`, then `add_active_response(id, new tokens)` after every step), and a
global one over the responses of earlier requests (each response enters it as it is generated, and
stays after `stop_request` until FIFO eviction past `max_cached_requests`). Each step, the last
`max_tree_depth` tokens of prompt + output are the pattern; `speculate` finds the longest suffix of
the pattern in either tree and expands the matched node by counts (a token's estimated probability
is its count over its parent's; tokens under `min_token_prob` are not proposed), at most
`max_spec_factor · match_len + max_spec_offset` tokens and at most `num_draft`; the draft of the
tree with the higher score (sum of probabilities) wins. vLLM speculates a chain (`use_tree_spec`
off, its verifier takes chains); `tree: true` is ArcticInference's own tree speculation (the
paper's), verified as a tree by the shared loop. Verification is the engine's: greedy match, or
rejection sampling with the draft as point masses (lossless at any temperature).

The cache PERSISTS ACROSS PROMPTS (vLLM keeps one for the engine's lifetime): answers of earlier
questions draft later ones, the harness's untimed warm-up answer included (as Token Recycling's
matrix). `persist: false` starts every prompt from an empty cache of its own; `reset()` clears the
shared one.

Batch size B > 1: each sequence is one request of the shared cache, as vLLM runs concurrent requests
(one request id per sequence, `start_request` when it starts, `add_active_response` before each of
its drafts, `stop_request` when it stops; its counters are in its `DecodeState`). A running answer
extends the global tree as it grows (arctic's `add_active_response` extends the request's own tree
and its slot in the global one), so a sequence also drafts from the answers decoded beside it: its
drafts, and with them its accepted lengths and a seeded sampled answer, depend on its batch, as in
vLLM; its greedy tokens do not, and sampled it keeps the target's distribution (lossless). With
`persist: false` each sequence drafts from its own empty cache, so it drafts at any batch size
what it drafts alone.

Defaults are vLLM's `SpeculativeConfig`: `suffix_decoding_max_tree_depth=24`,
`suffix_decoding_max_cached_requests=10000`, `suffix_decoding_max_spec_factor=1.0`,
`suffix_decoding_min_token_prob=0.1`, `num_speculative_tokens` = the tree depth when unset;
`max_spec_offset` is the cache's default 0 (vLLM does not pass it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import register
from .engine.tree import Tree
from .loop import DraftVerifyDecoder
from .settings.params import BOOL, Settings, integer, number, setting


@dataclass(frozen=True)
class SuffixSettings(Settings):
    """Suffix Decoding as vLLM runs it (method: suffix), on arctic-inference's SuffixDecodingCache: suffix
    trees over this prompt + output and over earlier answers; the longest suffix match of the last
    max_tree_depth tokens is expanded by counts into the draft. The global tree of earlier answers
    PERSISTS ACROSS PROMPTS, as vLLM's cache does for the engine's lifetime; at batch size > 1 it also
    holds the answers running beside a sequence, as vLLM's does for concurrent requests."""

    paper = "Oliaro et al. 2025 (snowflakedb/ArcticInference; vLLM method: suffix)"
    batchable = True  # one request of the cache per sequence, its counters in the sequence's DecodeState

    max_tree_depth: int = setting(24, integer(1),
                                  "vLLM's suffix_decoding_max_tree_depth: depth of the suffix trees (match + draft "
                                  "length) and the pattern's length")
    num_draft: int = setting(24, integer(1),
                             "vLLM's num_speculative_tokens (unset: the tree depth): most draft tokens per step")
    max_spec_factor: float = setting(1.0, number(0.0),
                                     "vLLM's suffix_decoding_max_spec_factor: draft tokens <= factor x match length "
                                     "+ offset")
    max_spec_offset: float = setting(0.0, number(),
                                     "the cache's max_spec_offset (vLLM leaves its default 0)")
    min_token_prob: float = setting(0.1, number(0.0, 1.0),
                                    "vLLM's suffix_decoding_min_token_prob: tokens whose count share is lower are "
                                    "not drafted")
    max_cached_requests: int = setting(10000, integer(-1),
                                       "vLLM's suffix_decoding_max_cached_requests: answers kept in the global tree "
                                       "(FIFO); 0 = no global tree, -1 = no limit")
    tree: bool = setting(False, BOOL,
                         "false = a chain (vLLM's: use_tree_spec off); true = ArcticInference's tree speculation")
    persist: bool = setting(True, BOOL, "false = an empty cache for every prompt (and every sequence of a batch)")


def draft_tree(root: int, token_ids, parents) -> Tree:
    """The cache's draft (token ids, parent indices with -1 for the root's children) as a tree
    rooted at `root`, in an order where every parent precedes its children."""
    order, placed = [], {-1: 0}
    pending = list(range(len(token_ids)))
    while pending:  # the cache emits parents first; this only reorders if it ever does not
        left = []
        for i in pending:
            if parents[i] in placed:
                placed[i] = len(order) + 1
                order.append(i)
            else:
                left.append(i)
        if len(left) == len(pending):
            raise ValueError(f"suffix draft with a cycle or a missing parent: {list(parents)}")
        pending = left
    return Tree(torch.tensor([root] + [int(token_ids[i]) for i in order]),
                [-1] + [placed[parents[i]] for i in order])


class SuffixDecoder(DraftVerifyDecoder):
    name = "suffix"

    def __init__(self, target, settings: SuffixSettings = SuffixSettings()):
        super().__init__(target)
        self.settings = settings
        self.requests = 0  # the next request id: every sequence of every call gets its own
        self.reset()

    def new_cache(self):
        """An empty cache: no prompt trees, an empty global tree."""
        # lazy: arctic-inference's C++ cache, only when a decoder is built
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        return SuffixDecodingCache(max_tree_depth=self.settings.max_tree_depth,
                                   max_cached_requests=self.settings.max_cached_requests)

    def reset(self) -> None:
        """Empties the shared cache (the one every prompt drafts from when the cache persists)."""
        self.cache = self.new_cache()

    def describe(self):
        return {**super().describe(), **self.settings.to_dict(), "cache": "arctic_inference SuffixDecodingCache"}

    def start(self, state, prefill) -> None:
        """The sequence's request: in the shared cache (vLLM's), or, `persist: false`, in a cache of its own."""
        cache = self.cache if self.settings.persist else self.new_cache()
        request, self.requests = self.requests, self.requests + 1
        finished = sum(1 for cached in cache.cached_requests if cached not in cache.active_requests)
        cache.start_request(request, state.prompt)
        state.values.update(cache=cache, request=request, added=len(state.prompt), cached_before=finished,
                            speculated=0, matched=0, match_lengths=0)

    def finish(self, state) -> None:
        """The answer's last tokens (after its last draft) into the cache, the request stopped (its answer
        stays in the global tree), the sequence's statistics."""
        values = state.values
        cache, request = values["cache"], values["request"]
        rest = state.tokens[values["added"] - len(state.prompt):]
        if rest:
            cache.add_active_response(request, rest)
        cache.stop_request(request)
        speculated, matched = values["speculated"], values["matched"]
        state.stats.extra.update({
            "cache_persists": self.settings.persist, "cached_answers_before": values["cached_before"],
            "match_rate": matched / speculated if speculated else 0.0,
            "mean_match_length": values["match_lengths"] / matched if matched else 0.0})

    def propose(self, state, root: int, budget: int) -> Tree:
        values, sequence = state.values, state.sequence  # prompt + output, `root` last
        cache, request = values["cache"], values["request"]
        if len(sequence) > values["added"]:  # what the last step emitted (vLLM: the sampled ids)
            cache.add_active_response(request, sequence[values["added"]:])
            values["added"] = len(sequence)
        if budget <= 0:
            return Tree.root(root)
        s = self.settings
        draft = cache.speculate(request, sequence[-s.max_tree_depth:],
                                max_spec_tokens=min(s.num_draft, budget), max_spec_factor=s.max_spec_factor,
                                max_spec_offset=s.max_spec_offset, min_token_prob=s.min_token_prob,
                                use_tree_spec=s.tree)
        values["speculated"] += 1
        if not draft.token_ids:
            return Tree.root(root)
        values["matched"] += 1
        values["match_lengths"] += draft.match_len
        return draft_tree(root, draft.token_ids, draft.parents)


@register("suffix", settings=SuffixSettings)
def build(target, settings: SuffixSettings, context) -> SuffixDecoder:
    return SuffixDecoder(target, settings)
