"""Decoding B prompts together: the shared loop of `base.DraftVerifyDecoder` at batch size B.

    prefill(prompts)                         -> ONE forward over the prompts, padded to the longest;
                                                every sequence's first token (TTFT ends here)
    repeat until every sequence stopped:
        trees  = [lane.propose(...) ...]     # each sequence's own drafter state (`lane`)
        out    = target.forward_batch(rows)   # ONE forward over [B, R] rows, R the largest tree
        accept = read_together(decisions)     # each sequence's rule on the device, ONE read for the batch
        target.cache.commit_batch(paths)         # each sequence keeps its own accepted rows
        lane.advance(...)                        # each drafter follows its own path
        sequences that stopped leave the batch

The KV cache (`kv_cache.BatchKVCache`) holds every sequence in a row of [B, kv_heads, capacity,
head_dim] buffers with its own length; positions and masks are per sequence, padding slots and
padding rows are masked out and never committed (`ModelRunner.forward_batch`). Acceptance is
`acceptance.py`'s rules, per sequence, decided on the device (`greedy_pending`, `sample_pending`)
and read together once (`read_together`), so a sequence decodes the tokens it decodes alone
(greedy; sampled, from its own generator in the order it draws alone: the same tokens).

Finished sequences: the batch DRAINS. A sequence that stops leaves the batch at the next step (its
cache row is dropped, the forward shrinks to the sequences still running); no queued prompt joins
in its place. The caller decodes its prompts B at a time, each group to the end (the harness:
`batch_size`, docs/batching.md), so the last steps of a group run below B.

Which methods: those whose settings say `batchable` (AR, PLD with one branch, SpS, the EAGLE
family): a drafter whose per-sequence state is its attributes (`DraftVerifyDecoder.lane`; SpS's
draft LM and the EAGLE head get one cache per sequence, and draft one sequence at a time).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import DecodeOutput, DecodeStats, DraftVerifyDecoder, PhaseClock, available_methods, method_settings
from .engine.acceptance import greedy_pending, read_together, sample_pending
from .engine.runner import ForwardOutput
from .engine.sampling import SamplingConfig, logits_to_probs
from .engine.stopping import StopCondition
from .engine.tree import Tree


def batchable_methods() -> list[str]:
    """The registered methods that decode at batch_size > 1 (their default settings)."""
    return [name for name in available_methods() if method_settings(name).batchable]


def causal_rows(tokens: Sequence[int]) -> tuple:
    """A prompt's rows for `ModelRunner.forward_batch`: positions in order, each seeing those before it."""
    n = len(tokens)
    return tokens, range(n), torch.ones(n, n, dtype=torch.bool).tril_()


def row_output(out: ForwardOutput, row: int, n: int, logits: torch.Tensor | None = None) -> ForwardOutput:
    """Sequence `row`'s first `n` rows of a batched forward, as its own forward's output."""
    return ForwardOutput(out.logits[row, :n] if logits is None else logits, out.hidden[row, :n],
                         None if out.layers is None else out.layers[row, :n])


class BatchedDecoder:
    """Decodes several prompts at once with a `DraftVerifyDecoder` of a batchable method."""

    # Swappable so that tests can show a broken acceptor is caught.
    sample_pending = staticmethod(sample_pending)

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
        with self.decoder.target.linear.active():
            return self._generate(prompts, list(stops), sampling, generators)

    def _accept(self, trees: list[Tree], logits: torch.Tensor, sampling: SamplingConfig, generators: list):
        """Each sequence's rule on its own rows of `logits` [B, R, V], then one read for the batch."""
        pending = []
        for row, (tree, generator) in enumerate(zip(trees, generators)):
            rows = logits[row, : len(tree)]
            pending.append(greedy_pending(tree, rows) if sampling.greedy else
                           self.sample_pending(tree, logits_to_probs(rows, sampling), generator, logits=rows))
        return read_together(pending)

    def _generate(self, prompts, stops, sampling, generators) -> list[DecodeOutput]:
        decoder, target = self.decoder, self.decoder.target
        for prompt, stop in zip(prompts, stops):
            target.check_room(len(prompt) + stop.max_new_tokens)
        target.reserve_batch(len(prompts), max(len(p) + s.max_new_tokens for p, s in zip(prompts, stops)))
        phases: dict[str, float] = {}
        clock = PhaseClock(target.device, phases)
        begin = clock.last
        lanes = [decoder.lane(b, stop) for b, stop in enumerate(stops)]
        stats = [DecodeStats(prefill_step=decoder.prefill_step) for _ in prompts]
        outputs: list[DecodeOutput | None] = [None] * len(prompts)

        first = target.forward_batch([causal_rows(prompt) for prompt in prompts], last_logits=True)  # logits [B, V]
        target.cache.commit_batch(0, [range(len(prompt)) for prompt in prompts])
        roots = [Tree(torch.tensor([prompt[-1]]), [-1]) for prompt in prompts]  # the first token: a root's choice
        chosen = self._accept(roots, first.logits[:, None], sampling, generators)
        ttft = clock.now() - begin
        clock.lap("prefill")
        tokens = [[acceptance.next_token] for acceptance in chosen]
        for b, (lane, prompt) in enumerate(zip(lanes, prompts)):
            stats[b].ttft = ttft
            stats[b].logit_margins.extend(chosen[b].margins)
            stats[b].accepted_lengths.append(1)
            lane.sampling, lane.generator = sampling, generators[b]
            lane.sequence = prompt + tokens[b]  # prompt and output; the last token is not in the target KV
            lane.start(prompt, row_output(first, b, len(prompt), logits=first.logits[b:b + 1]))
        clock.lap("draft")

        def finish(b: int, done: tuple[int, str]) -> None:
            keep, stats[b].stop_reason = done
            del tokens[b][keep:]
            del stats[b].logit_margins[keep:]
            stats[b].new_tokens = len(tokens[b])
            stats[b].steps = len(stats[b].accepted_lengths)
            lanes[b].finish(stats[b])
            clock.lap("other")
            stats[b].total_time = clock.last - begin
            stats[b].phase_time = dict(phases)
            outputs[b] = DecodeOutput(tokens=tokens[b], stats=stats[b])

        rows = list(range(len(prompts)))  # the sequences in the cache, by row
        for b in rows:
            done = stops[b].cut(tokens[b], 0)
            if done is not None:
                finish(b, done)
        while True:
            running = [b for b in rows if outputs[b] is None]
            if not running:
                break
            if running != rows:  # sequences that stopped leave the batch
                target.cache.keep_sequences([rows.index(b) for b in running])
                rows = running
                clock.lap("commit")
            trees = [lanes[b].propose(tokens[b][-1], stops[b].max_new_tokens - len(tokens[b]) - 1) for b in rows]
            clock.lap("draft")
            start = target.length
            verified = target.forward_batch([tree.forward_rows() for tree in trees])
            clock.lap("verify")
            acceptances = self._accept(trees, verified.logits, sampling, [generators[b] for b in rows])
            clock.lap("accept")
            target.cache.commit_batch(start, [acceptance.path for acceptance in acceptances])
            clock.lap("commit")
            followed = []
            for row, (b, tree, acceptance) in enumerate(zip(rows, trees, acceptances)):
                checked = len(tokens[b])
                tokens[b].extend(acceptance.emitted)
                lanes[b].sequence.extend(acceptance.emitted)
                stats[b].logit_margins.extend(acceptance.margins)
                done = stops[b].cut(tokens[b], checked)
                stats[b].accepted_lengths.append(len(acceptance.emitted) if done is None else done[0] - checked)
                decoder.count_acceptance(stats[b], tree, acceptance)
                if done is None:
                    followed.append((b, tree, acceptance, row))
                else:
                    finish(b, done)
            clock.lap("other")
            for b, tree, acceptance, row in followed:
                lanes[b].advance(tree, acceptance, row_output(verified, row, len(tree)))
            clock.lap("draft")
        return outputs
