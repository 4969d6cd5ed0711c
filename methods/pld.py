"""Prompt lookup decoding (PLD; apoorvumang/prompt-lookup-decoding, `transformers`'
`PromptLookupCandidateGenerator`, Spec-Bench's `model/pld/pld.py`): the draft is copied from the text.

The last n tokens of prompt + output (n = `max_ngram` down to 1) are searched for earlier in the same
text; at the first (leftmost) occurrence with at least one token after it, the up to `num_draft`
tokens that followed it are the draft (a chain), cut before the first EOS token. No match: the step
is an AR step. This is `transformers`' rule (`generate(prompt_lookup_num_tokens=10,
max_matching_ngram_size=3)` proposes the same tokens; the tests check it token for token).

Upstream proposes ONE match (a chain). `branches: b > 1` (not upstream) also takes the next
matches (left to right, longest n-gram first) until b distinct continuations are found, merged
into a trie rooted at the last token. Verification is the engine's: greedy match, or rejection
sampling with the draft as a point mass (lossless at any temperature).

Settings and their defaults: `PLDSettings` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from .base import BuildContext, register
from .engine.tree import Tree
from .loop import DraftVerifyDecoder
from .settings.params import Settings, integer, one_of, setting
from .settings.sizing import Sizing

UPSTREAM_DRAFT = 10  # prompt-lookup-decoding's and Spec-Bench's draft_num_candidate_tokens


@dataclass(frozen=True)
class PLDSettings(Settings):
    """Prompt lookup decoding (PLD): the draft is copied from the text itself. The last n-gram of
    prompt + output (n = max_ngram .. 1) is found earlier in the text (leftmost occurrence first, as
    transformers' PromptLookupCandidateGenerator); the up to num_draft tokens after it are the draft."""

    paper = "Saxena 2023 (apoorvumang/prompt-lookup-decoding)"
    size_setting, size_label = "num_draft", "draft length γ"  # the longest draft it copies
    size_recorded = "draft_tokens"  # what `auto` resolved to

    max_ngram: int = setting(3, integer(1),
                             "longest n-gram looked up; Spec-Bench's draft_matching_window_size (transformers' own "
                             "default is 2)")
    num_draft: int | str = setting("auto", one_of("auto") | integer(1),
                                   "tokens per draft: auto = this machine's verify budget less the root (upstream's "
                                   "10 without a machine profile); 10 = transformers' prompt_lookup_num_tokens in its "
                                   "docs, Spec-Bench's draft_num_candidate_tokens")
    branches: int = setting(1, integer(1),
                            "upstream proposes one match (a chain); b > 1 adds the next matches as branches of a trie")

    batchable = True

    def batch_problem(self) -> str | None:
        return (
            "method.branches > 1 proposes tries; batch_size > 1 verifies chains (branches=1)"
            if self.branches > 1
            else None
        )


def lookup_continuations(sequence: Sequence[int], max_ngram: int, num_draft: int, eos: frozenset[int] = frozenset(),
                         branches: int = 1) -> list[list[int]]:
    """Up to `branches` distinct continuations of the last n-gram of `sequence` (token ids), in
    `transformers`' order: the longest n-gram first, then leftmost occurrence first. The first one
    is exactly what `PromptLookupCandidateGenerator.get_candidates` proposes. The text lives on the
    host (every emitted token comes back with the step's one read), so the search runs there, in
    numpy: it reads nothing from the device."""
    text = np.asarray(sequence, dtype=np.int64).reshape(-1)
    length = text.size
    found: list[list[int]] = []
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = sliding_window_view(text, n)  # [L - n + 1, n]
        matches = np.flatnonzero((windows == text[-n:]).all(axis=1))
        for index in matches.tolist():
            start = index + n
            end = min(start + num_draft, length)
            if start >= end:  # the n-gram itself, at the end of the text
                continue
            continuation = text[start:end].tolist()
            for i, token in enumerate(continuation):  # transformers cuts the draft before an EOS
                if token in eos:
                    continuation = continuation[:i]
                    break
            if not found and not continuation:
                return []  # transformers stops at the first match even when the EOS cut empties it
            if continuation and continuation not in found:
                found.append(continuation)
            if len(found) >= branches:
                return found
    return found


def trie(root: int, continuations: list[list[int]], nodes: int | None = None) -> Tree:
    """The continuations merged into a token trie rooted at `root` (shared prefixes once); with `nodes`,
    at most that many besides the root (the first continuations' first: a path stops where it would
    add one more)."""
    tokens, parents, children = [root], [-1], [{}]
    for continuation in continuations:
        node = 0
        for token in continuation:
            child = children[node].get(token)
            if child is None:
                if nodes is not None and len(tokens) > nodes:
                    break
                child = len(tokens)
                tokens.append(token)
                parents.append(node)
                children.append({})
                children[node][token] = child
            node = child
    return Tree(torch.tensor(tokens), parents)


class PromptLookupDecoder(DraftVerifyDecoder):
    name = "pld"

    def __init__(self, target, max_ngram: int = PLDSettings.max_ngram, num_draft: int | Sizing = UPSTREAM_DRAFT,
                 branches: int = PLDSettings.branches):
        """`num_draft`: the longest draft it copies, in tokens (`method.num_draft` settled: a `Sizing`)."""
        super().__init__(target, Sizing.of(num_draft))
        self.max_ngram, self.branches = max_ngram, branches

    def describe(self):
        setting = (self.sizing.source or {}).get("num_draft", self.sizing.value)  # `auto`, or the number given
        return {**super().describe(), "max_ngram": self.max_ngram, "num_draft": setting,
                "draft_tokens": self.sizing.value, "branches": self.branches}

    def finish(self, state) -> None:
        steps = state.stats.steps - 1  # verifications (the prefill proposes nothing)
        matched = state.values.get("matched_steps", 0)
        state.stats.extra["match_rate"] = matched / steps if steps else 0.0  # steps with a draft

    def propose(self, state, root: int, budget: int) -> Tree:
        if budget <= 0:
            return Tree.root(root)
        found = lookup_continuations(state.sequence, self.max_ngram, min(self.sizing.value, budget),
                                     state.stop.eos_token_ids, self.branches)
        state.values["matched_steps"] = state.values.get("matched_steps", 0) + bool(found)
        return trie(root, found, nodes=state.cut)


@register("pld", settings=PLDSettings)
def build(target, settings: PLDSettings, context: BuildContext) -> PromptLookupDecoder:
    sizing = context.draft_tokens(target, "num_draft", settings.num_draft, UPSTREAM_DRAFT)
    return PromptLookupDecoder(target, settings.max_ngram, sizing, settings.branches)
