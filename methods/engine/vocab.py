"""Reduced-vocabulary drafting (FR-Spec, arXiv 2502.14856; EAGLE-3's `d2t` map is the same idea).

A draft that projects onto the vocabulary (a draft LM's lm_head, an EAGLE head through the target's
lm_head, Medusa heads) pays for every row of that projection at every drafted position: for a 135M
target with a 49k vocabulary the projection is a fifth of the model. Drafting over the K most
frequent tokens of the drafts' training corpus keeps only K rows.

The draft's logits outside the subset are -inf, so its distribution q is zero there. Nothing else
changes: the target verifies every drafted token, greedy decoding stays exact, and speculative
sampling stays lossless because the residual norm(max(0, p - q)) keeps the mass of the tokens the
draft cannot propose.

Frequencies are a JSON file `{"source": ..., "tokens": N, "counts": [[token_id, count], ...]}`
written from the drafts' training corpus (`python -m harness.training vocab`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..settings.params import integer, one_of, setting


def draft_vocab_setting(note: str = ""):
    """`method.draft_vocab` of the methods whose drafts project onto the vocabulary."""
    return setting("auto", one_of("auto", "full") | integer(1),
                   "auto = the model's draft_vocabulary (FR-Spec subset) if it names one; full; or a token count"
                   + note)


class DraftVocabulary:
    """The target ids a draft may propose, and its projection onto them."""

    def __init__(self, ids: torch.Tensor, full_size: int, source: str = "", rows_dtype: torch.dtype | None = None):
        """`rows_dtype`: bfloat16 = in an fp32 run, the draft's copy of the projection's rows is
        rounded to bf16 values, as the drafts themselves are stored (the engine's native kernel then
        streams it in half the bytes; the target's own lm_head is never touched); None = as the target's."""
        ids = torch.as_tensor(ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0 or int(ids[-1]) >= full_size or int(ids[0]) < 0:
            raise ValueError(f"draft vocabulary ids must lie in 0..{full_size - 1}")
        self.ids, self.full_size, self.source, self.rows_dtype = ids, full_size, source, rows_dtype
        self._heads: dict[int, tuple[torch.Tensor, nn.Linear]] = {}  # id(weight) -> (weight, projection on the subset)

    def __len__(self) -> int:
        return self.ids.numel()

    @classmethod
    def most_frequent(cls, file: str | Path, size: int, full_size: int, always: tuple[int, ...] = (),
                      rows_dtype: torch.dtype | None = None) -> "DraftVocabulary":
        """The `size` most frequent tokens of a frequency file, plus `always` (e.g. EOS ids). When
        the corpus showed fewer than `size` distinct tokens, the unseen ones follow in token-id
        order: for BPE vocabularies that is merge order, a proxy for frequency in the tokenizer's
        own corpus (with a small drafting corpus, 10-20% of a benchmark's tokens may be unseen)."""
        if size < 1:
            raise ValueError(f"draft_vocab={size}: must be a positive number of tokens, or full")
        data = json.loads(Path(file).read_text())
        ranked = [int(token) for token, _ in sorted(data["counts"], key=lambda tc: (-tc[1], tc[0]))
                  if token < full_size]
        seen = len(ranked)
        if seen < size:
            known = set(ranked)
            ranked += [t for t in range(full_size) if t not in known][: size - seen]
        chosen = ranked[:size]
        return cls(torch.tensor(chosen + [t for t in always if t not in chosen]), full_size,
                   f"{Path(file).name}: the {min(size, seen)} most frequent of {seen} tokens seen in "
                   f"{data.get('tokens', '?')}" + (f", then {size - seen} unseen in id order" if seen < size else ""),
                   rows_dtype)

    def head(self, weight: torch.Tensor) -> nn.Linear:
        """A Linear H -> K holding the rows of `weight` [V, H] for the subset, copied once
        (contiguous, so a drafted position streams K rows only; rounded to `rows_dtype` values in an
        fp32 run); it runs on the engine's linear path."""
        entry = self._heads.get(id(weight))
        if entry is None or entry[0] is not weight:
            rows = weight.detach().index_select(0, self.ids.to(weight.device)).contiguous()
            if self.rows_dtype is not None and rows.dtype == torch.float32:
                rows = rows.to(self.rows_dtype).float()
            head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
            head.weight = nn.Parameter(rows, requires_grad=False)
            entry = self._heads[id(weight)] = (weight, head)
        return entry[1]

    def project(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] logits (fp32) with -inf outside the subset."""
        return self.scatter(self.head(weight)(hidden).float())

    def scatter(self, sub: torch.Tensor) -> torch.Tensor:
        """[..., K] logits over the subset (in id order) -> [..., V] with -inf elsewhere (EAGLE-3's
        own draft-vocabulary lm_head comes through here too)."""
        out = sub.new_full((*sub.shape[:-1], self.full_size), float("-inf"))
        out[..., self.ids.to(sub.device)] = sub
        return out

    def subset(self, ids: torch.Tensor) -> "DraftVocabulary":
        """These of its ids only (a draft LM whose vocabulary is shorter), the same rows' precision."""
        return DraftVocabulary(ids, self.full_size, self.source, self.rows_dtype)

    def describe(self) -> dict:
        return {"draft_vocab": len(self), "of": self.full_size, "source": self.source,
                **({"rows_dtype": str(self.rows_dtype).replace("torch.", "")} if self.rows_dtype else {})}


def token_frequencies(sequences, vocab_size: int) -> list[list[int]]:
    """[[token_id, count], ...] of the tokens in `sequences`, most frequent first."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(counts, descending=True, stable=True)
    return [[int(t), int(counts[t])] for t in order if counts[t] > 0]
