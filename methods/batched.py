"""Decoding B prompts together: the shared loop of `base.DraftVerifyDecoder` at batch size B.

    prefill(prompts)                         -> each prompt's own prefill into its cache row (no padding:
                                                `ModelRunner.prefill_rows`); every first token (TTFT ends here)
    repeat until every sequence stopped:
        trees  = decoder.propose_batch(states, ...)  # each sequence's `DecodeState` (its own drafter in it), an
                                                    # `auto` draft cut to the verify budget at B rows per token;
                                                    # the EAGLE family: one head forward for the batch per
                                                    # draft level; SpS/MCSD: one draft-LM forward per depth
        out    = target.forward_batch(rows)          # ONE forward over [B, R] rows, R the largest tree
        accept = decoder.accept_batch(...)           # each sequence's rule on the device, ONE read for the batch
        target.cache.commit_batch(paths)             # each sequence keeps its own accepted rows
        decoder.advance(state, ...)                  # each drafter follows its own path
        sequences that stopped leave the batch

The KV cache (`kv_cache.BatchKVCache`) holds every sequence in a row of [B, kv_heads, capacity,
head_dim] buffers with its own length; positions and masks are per sequence, padding slots and
padding rows are masked out and never committed (`ModelRunner.forward_batch`). Acceptance is
`acceptance.py`'s rules decided on the device (greedy: one pass for the batch, `greedy_batch_pending`;
sampled: per sequence, `sample_pending`) and read together once (`DraftVerifyDecoder.accept_batch`),
so a sequence decodes the tokens it decodes alone (greedy; sampled, from its own generator in the
order it draws alone: the same tokens).

Finished sequences: the batch DRAINS. A sequence that stops leaves the batch at the next step (its
cache row is dropped, the forward shrinks to the sequences still running); no queued prompt joins
in its place. The caller decodes its prompts B at a time, each group to the end (the harness:
`batch_size`, docs/batching.md), so the last steps of a group run below B.

Which methods: those whose settings say `batchable` (listed, from the settings, in docs/batching.md): a
drafter whose per-sequence state is in the sequence's `DecodeState` (SpS's
draft LM and the EAGLE head get one drafter per sequence, `DraftVerifyDecoder.draft_state`; the
batch then drafts with one forward per draft level for all its sequences, each sequence's KV in a
row of one batch cache: `models.draft_lm.BatchDraftLM`, `eagle.batch_draft.BatchDraft`; SAM's
dynamic automaton is the sequence's, PLD's lookup the sequence's own). Not Suffix Decoding: its global
tree takes every running answer, so a sequence's drafts would depend on the others in its batch. Not
REST: draftretriever breaks ties by a hash order that differs between readers, so its drafts, and
with them a seeded sampled answer, already differ from run to run at batch size 1.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import DecodeOutput, DecodeState, DraftVerifyDecoder, PhaseClock, available_methods, method_settings
from .engine.runner import ForwardOutput
from .engine.sampling import SamplingConfig
from .engine.stopping import StopCondition
from .engine.tree import Tree


def batchable_methods() -> list[str]:
    """The registered methods that decode at batch_size > 1 (their default settings)."""
    return [name for name in available_methods() if method_settings(name).batchable]


def row_output(out: ForwardOutput, row: int, n: int) -> ForwardOutput:
    """Sequence `row`'s first `n` rows of a batched forward, as its own forward's output."""
    return ForwardOutput(out.logits[row, :n], out.hidden[row, :n], None if out.layers is None else out.layers[row, :n])


class BatchedDecoder:
    """Decodes several prompts at once with a `DraftVerifyDecoder` of a batchable method."""

    def __init__(self, decoder: DraftVerifyDecoder):
        if not isinstance(decoder, DraftVerifyDecoder) or not method_settings(decoder.name).batchable:
            raise ValueError(f"method {decoder.name!r} does not decode at batch size > 1; "
                             f"methods that do: {', '.join(batchable_methods())}")
        self.decoder = decoder
        self.name = decoder.name

    def generate(self, prompts: Sequence[Sequence[int]], stops: Sequence[StopCondition],
                 sampling: SamplingConfig = SamplingConfig(),
                 generators: Sequence[torch.Generator | None] | None = None) -> list[DecodeOutput]:
        """One output per prompt, in order; `stops[b]` and `generators[b]` are prompt b's. Each
        output's `ttft` is the batch's prefill and its `total_time` the time until it stopped,
        from the start of the call; its `phase_time` the batch's phases until then."""
        prompts = [list(prompt) for prompt in prompts]
        if not prompts or any(not prompt for prompt in prompts):
            raise ValueError("batched decoding needs at least one prompt, and no empty prompt")
        if len(stops) != len(prompts):
            raise ValueError(f"{len(stops)} stop conditions for {len(prompts)} prompts")
        generators = list(generators) if generators is not None else [None] * len(prompts)
        states = [self.decoder.new_state(b, prompt, stop, sampling, generator)
                  for b, (prompt, stop, generator) in enumerate(zip(prompts, stops, generators))]
        with self.decoder.target.linear.active():
            return self._generate(states)

    def _generate(self, states: list[DecodeState]) -> list[DecodeOutput]:
        decoder, target = self.decoder, self.decoder.target
        for state in states:
            target.check_room(len(state.prompt) + state.stop.max_new_tokens)
        target.reserve_batch(len(states), max(len(s.prompt) + s.stop.max_new_tokens for s in states))
        phases: dict[str, float] = {}
        clock = PhaseClock(target.device, phases)
        begin = clock.last
        outputs: list[DecodeOutput | None] = [None] * len(states)

        firsts = target.prefill_rows([s.prompt for s in states])
        roots = [Tree(torch.tensor([s.prompt[-1]]), [-1]) for s in states]  # the first token: a root's choice
        chosen = decoder.accept_batch(states, roots, torch.stack([first.logits for first in firsts]))  # [B, 1, V]
        ttft = clock.now() - begin
        clock.lap("prefill")
        done = {}
        for b, state in enumerate(states):
            state.stats.ttft = ttft
            done[b] = state.emit([chosen[b].next_token], chosen[b].margins)
            decoder.start(state, firsts[b])
        clock.lap("draft")

        def finish(b: int) -> None:
            outputs[b] = states[b].conclude(done[b])
            decoder.finish(states[b])
            clock.lap("other")
            states[b].stats.total_time = clock.last - begin
            states[b].stats.phase_time = dict(phases)

        rows = list(range(len(states)))  # the sequences in the cache, by row
        for b in rows:
            if done[b] is not None:
                finish(b)
        while True:
            running = [b for b in rows if outputs[b] is None]
            if not running:
                break
            if running != rows:  # sequences that stopped leave the batch
                target.cache.keep_sequences([rows.index(b) for b in running])
                rows = running
                clock.lap("commit")
            # an `auto` draft at this batch size: each greedy sequence's cut to the verify budget at B rows per token
            # (sampled drafts keep their batch-1 size: a seeded answer draws the same at any batch size)
            cut = decoder.batch_budget(len(rows))
            budgets = []
            for b in rows:
                state = states[b]
                state.batch = len(rows)
                budget = state.stop.max_new_tokens - len(state.tokens) - 1
                if cut is not None and state.sampling.greedy:
                    budget = min(budget, cut)
                budgets.append(budget)
            trees = decoder.propose_batch([states[b] for b in rows], budgets)
            clock.lap("draft")
            start = target.length
            verified = target.forward_batch([tree.forward_rows() for tree in trees])
            clock.lap("verify")
            acceptances = decoder.accept_batch([states[b] for b in rows], trees, verified.logits)
            clock.lap("accept")
            target.cache.commit_batch(start, [acceptance.path for acceptance in acceptances])
            clock.lap("commit")
            followed = []
            for row, (b, tree, acceptance) in enumerate(zip(rows, trees, acceptances)):
                done[b] = states[b].emit(acceptance.emitted, acceptance.margins)
                decoder.count_acceptance(states[b].stats, tree, acceptance)
                if done[b] is None:
                    followed.append((b, tree, acceptance, row))
                else:
                    finish(b)
            clock.lap("other")
            for b, tree, acceptance, row in followed:
                decoder.advance(states[b], tree, acceptance, row_output(verified, row, len(tree)))
            clock.lap("draft")
        return outputs
