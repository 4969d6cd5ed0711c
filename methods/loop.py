"""The loop every method shares, over a batch of sequences; B = 1 is a batch of one.

    reserve(B)                                 the runner's cache for B sequences (one: the batch-1 cache)
    firsts = prefill(state) for each sequence  each prompt's own prefill into its cache row (no padding:
                                               `ModelRunner.prefill_rows`); every first token (TTFT ends here)
    start(state, first)                        the drafter's own prefill
    repeat until every sequence stopped:
        trees  = propose_batch(states, ...)    each sequence's draft tree rooted at its last token (an `auto`
                                               draft cut to the verify budget at B rows per token); the EAGLE
                                               family drafts the batch with one head forward per level
        out    = target.forward_batch(rows)    ONE forward over [B, R] rows, R the largest tree (with any
                                               extra rows a drafter adds, a Lookahead window)
        accept = accept_batch(states, ...)     greedy | speculative sampling (a method's own rule: `accept`),
                                               decided on the device, ONE read for the batch
        target.commit_batch(paths)             each sequence keeps its own accepted rows
        state.emit(tokens)                     output, stopping rule, statistics
        advance(state, tree, accept, out)      each drafter follows its own path
        sequences that stopped leave the batch (`target.keep_sequences`); finish(state)

`state` is the sequence's `DecodeState` (`state.py`): its prompt and output, sampling, generator,
statistics and drafter. A method subclasses `DraftVerifyDecoder` and writes `propose` (and
`start`/`advance`/`finish` when it keeps state, in the state); AR is the method that proposes nothing.

The runner's batch API is the only way to the model and its cache. At one sequence it runs the
batch-1 cache and forward (static steps, verify buckets, CUDA graphs): a prompt decoded alone is
the same arithmetic whatever called it. At B > 1 the cache (`kv_cache.BatchKVCache`) holds every
sequence in a row with its own length; positions and masks are per sequence, padding is masked out
and never committed (`ModelRunner.forward_batch`), so a sequence decodes at B the tokens it decodes
alone (greedy; sampled, from its own generator in the order it draws alone: the same tokens).

What a batch shares: each sequence drafts with its own drafter and values (a draft LM's or head's KV,
SAM's automaton, Lookahead's window and pool, Medusa's and Hydra's hidden state), so its drafts do
not depend on the batch, with two exceptions that follow upstream. Suffix Decoding runs one request
per sequence in one shared cache, as vLLM runs concurrent requests: running answers extend the global
tree, so a sequence also drafts from the answers beside it (`persist: false` gives each sequence its
own cache). REST's reader is shared, and draftretriever drafts at random, so its drafts differ from
run to run at any batch size. Greedy tokens, and the sampled distribution, are every sequence's own.

Finished sequences leave the batch at the next step (their cache rows dropped, the forward shrinks to
the sequences still running). A batch that starts together DRAINS: no prompt joins in their place
(`generate_batch`; the harness decodes its prompts B at a time, each group to the end: `batch_size`,
docs/batching.md). Continuous batching (`serve`, over `requests.Requests`): a request joins as soon as
it has arrived and the batch holds fewer than the concurrency; its prefill runs alone into a new last
row of the batch cache (`ModelRunner.join_rows`), as a step of its own between two of the batch's
forwards, and the batch drafters (a draft LM's, the EAGLE head's, PARD's) give it a row of theirs at the
next draft step. Its tokens are the ones it decodes alone, whatever else is in the batch.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any, ClassVar, Sequence

import torch

from .base import Decoder, batchable_methods, method_settings
from .engine.acceptance import (
    Acceptance,
    chosen_margins,
    greedy_accept_logits,
    greedy_batch_pending,
    greedy_pending,
    read_together,
    sample_accept,
    sample_pending,
)
from .engine.runner import ForwardOutput
from .engine.sampling import SamplingConfig, logits_to_probs
from .engine.stopping import StopCondition
from .engine.tree import Tree
from .requests import Requests
from .state import DecodeOutput, DecodeState, DecodeStats


class PhaseClock:
    """Accumulates wall time per phase; synchronizes CUDA so GPU work lands in its phase."""

    def __init__(self, device: torch.device, phases: dict[str, float]):
        self.cuda = device.type == "cuda"
        self.phases = phases
        self.last = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        now = self.now()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now


def logit_margins(rows: torch.Tensor, chosen: Sequence[int]) -> list[float]:
    """Per logits row [n, V] and the token it chose: the chosen token's logit minus the best other
    token's. When the row chose its argmax (greedy), this is the row's top-2 gap; a negative value
    means the row preferred another token by that much. One topk(2) on rows already computed."""
    return chosen_margins(rows, torch.as_tensor(list(chosen), device=rows.device)).tolist()


def row_output(out: ForwardOutput, row: int, n: int) -> ForwardOutput:
    """Sequence `row`'s first `n` rows of a batched forward, as its own forward's output."""
    return ForwardOutput(out.logits[row, :n], out.hidden[row, :n], None if out.layers is None else out.layers[row, :n])


class DraftVerifyDecoder(Decoder):
    """The draft -> verify -> accept -> commit loop. Subclasses supply the drafter: `propose` and, when
    it follows the accepted path, `start`/`advance`; each gets the sequence's `DecodeState`."""

    # whether the prefill counts as a decoding step in the records (`DecodeStats.prefill_step`)
    prefill_step: ClassVar[bool] = False
    def draft_state(self, index: int) -> Any:
        """The drafter sequence `index` of a batch drafts with (`DecodeState.draft`): a method whose
        drafter keeps per-sequence state (a draft LM's KV cache, a head's) gives each index its own, made
        once and reused; index 0 is the one a single sequence uses."""
        return None

    def new_state(self, index: int, prompt: list[int], stop: StopCondition, sampling: SamplingConfig,
                  generator: torch.Generator | None) -> DecodeState:
        return DecodeState(index, prompt, stop, sampling, generator, DecodeStats(prefill_step=self.prefill_step),
                           sequence=list(prompt), draft=self.draft_state(index))

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        """Called once after the target's prefill and the first token (e.g. to prefill a draft model)."""

    @abstractmethod
    def propose(self, state: DecodeState, root: int, budget: int) -> Tree:
        """A tree rooted at `root` (the last emitted token) with at most `budget` draft tokens
        along any path (more would be cut by the stopping rule anyway)."""

    def propose_batch(self, states: Sequence[DecodeState], budgets: Sequence[int]) -> list[Tree]:
        """Every running sequence's draft of a step, `budgets[b]` its most
        draft tokens along a path: `propose` for each, one after another, unless the method drafts
        the batch at once (the EAGLE family's dynamic trees: one head forward for every sequence)."""
        return [self.propose(state, state.tokens[-1], budget) for state, budget in zip(states, budgets)]

    def advance(self, state: DecodeState, tree: Tree, acceptance: Acceptance, verified: ForwardOutput) -> None:
        """Called after each commit, so the drafter can follow the accepted path."""

    def finish(self, state: DecodeState) -> None:
        """After the sequence stopped: the method's own statistics into `state.stats.extra`."""

    def prefill(self, state: DecodeState) -> ForwardOutput:
        """The sequence's prefill into the runner's cache (at B > 1 a scratch cache its row is copied
        from): the target's, unless the method's own first forward differs (Lookahead's window)."""
        return self.target.prefill(state.prompt)

    def accept(self, state: DecodeState, tree: Tree, logits: torch.Tensor,
               extra: torch.Tensor | None = None) -> Acceptance:
        """The sequence's acceptance rule over its tree's rows of `logits` (and its extra rows' `extra`,
        never accepted): greedy, or speculative sampling from its own generator. A method whose rule
        differs (Medusa's typical acceptance) overrides it; the loop then asks it per sequence."""
        if state.sampling.greedy:
            return greedy_accept_logits(tree, logits, extra)
        return self.sample_accept(tree, logits_to_probs(logits, state.sampling), state.generator, logits=logits,
                                  extra=extra)

    def accept_batch(self, states: Sequence[DecodeState], trees: Sequence[Tree], logits: torch.Tensor,
                     extras: Sequence[torch.Tensor | None] | None = None) -> list[Acceptance]:
        """Every sequence's rule on its own rows of `logits` [B, R, V] (`extras[b]`: its extra rows'),
        decided on the device, then one read for the batch. One sequence, a method's own rule or extra
        rows: `accept` per sequence. Else greedy (the batch shares its sampling): one vectorized pass
        (`greedy_batch_pending`); sampled: each sequence's rule in turn, drawing from its own generator
        as it draws alone."""
        extras = extras or [None] * len(states)
        if len(states) == 1 or type(self).accept is not DraftVerifyDecoder.accept or any(e is not None for e in extras):
            return [self.accept(state, tree, logits[row, : len(tree)], extras[row])
                    for row, (state, tree) in enumerate(zip(states, trees))]
        return self.standard_accept_batch(states, trees, logits)

    def standard_accept_batch(self, states: Sequence[DecodeState], trees: Sequence[Tree],
                              logits: torch.Tensor) -> list[Acceptance]:
        """Greedy or speculative sampling (never a method's own rule) for every sequence, one read."""
        if len(states) == 1:
            return [DraftVerifyDecoder.accept(self, states[0], trees[0], logits[0, : len(trees[0])])]
        if all(state.sampling.greedy for state in states):
            pending = greedy_batch_pending(trees, logits)
            return pending.parse(pending.values.tolist())
        pending = []
        for row, (state, tree) in enumerate(zip(states, trees)):
            rows = logits[row, : len(tree)]
            pending.append(greedy_pending(tree, rows) if state.sampling.greedy else
                           self.sample_pending(tree, logits_to_probs(rows, state.sampling), state.generator,
                                               logits=rows))
        return read_together(pending)

    # --------------------------------------------------------------------------------------
    def generate_batch(self, prompts, stops, sampling=SamplingConfig(), generators=None) -> list[DecodeOutput]:
        """One output per prompt, in order; `stops[b]` and `generators[b]` are prompt b's. Each
        output's `ttft` is the batch's prefill and its `total_time` the time until it stopped, from
        the start of the call; its `phase_time` the batch's phases until then."""
        prompts = [list(prompt) for prompt in prompts]
        if not prompts or any(not prompt for prompt in prompts):
            raise ValueError("empty prompt" if prompts else "no prompt to decode")
        if len(stops) != len(prompts):
            raise ValueError(f"{len(stops)} stop conditions for {len(prompts)} prompts")
        if len(prompts) > 1 and not method_settings(self.name).batchable:
            raise ValueError(f"method {self.name!r} does not decode at batch size > 1; "
                             f"methods that do: {', '.join(batchable_methods())}")
        generators = list(generators) if generators is not None else [None] * len(prompts)
        states = [self.new_state(b, prompt, stop, sampling, generator)
                  for b, (prompt, stop, generator) in enumerate(zip(prompts, stops, generators))]
        with self.target.linear.active():  # draft heads and models run on the same linear path
            return self._generate(states)

    def serve(self, requests: Requests) -> list[DecodeOutput]:
        """Continuous batching: the requests decoded at most `requests.concurrency` at a time, each joining
        the batch once it has arrived and the batch has room (a sequence that stops leaves at the next
        step). One output per request, in its order; its `ttft` and `total_time` count from its arrival
        (an open loop's: the wait for room included) or, in a closed loop, from when it joined; its
        `phase_time` is the loop's until it stopped. A request decodes
        the tokens it decodes alone (greedy; sampled, from its own generator)."""
        if requests.concurrency > 1 and not method_settings(self.name).batchable:
            raise ValueError(f"method {self.name!r} does not decode at batch size > 1; "
                             f"methods that do: {', '.join(batchable_methods())}")
        with self.target.linear.active():
            return self._generate([], requests)

    def _generate(self, states: list[DecodeState], requests: Requests | None = None) -> list[DecodeOutput]:
        """The one loop. `states`: a batch that starts together and drains. With `requests` (and no
        states): sequences join as their requests arrive and the batch has room, each prefilled alone
        into a new row (a step of its own, before the batch's next forward)."""
        target = self.target
        needs = [len(s.prompt) + s.stop.max_new_tokens for s in (requests.requests if requests else states)]
        for need in needs:
            target.check_room(need)
        room = max(needs)  # the most positions a sequence commits: every cache reserves it
        if requests is None:
            target.reserve_batch(len(states), room)
        else:
            target.reserve_batch(0, room, slots=requests.concurrency)
        for state in states:
            state.batch_room = room
        batch = _Batch(self, requests, room)
        if requests is None:
            batch.admit(states)
        together = len(states) > 1 or (requests is not None and requests.concurrency > 1)
        while batch.running() or (requests is not None and requests.next_arrival() is not None):
            batch.leave_stopped()
            if requests is not None and batch.take_arrivals():
                continue  # a joining request's prefill, or the wait for one, is a step of its own
            batch.step(together)
        return batch.results()

    def draft_step(self, states: list[DecodeState], together: bool, draft: bool = True) -> list[Tree]:
        """The running sequences' drafts for one step, each at most the tokens its stopping rule leaves
        along a path. At this batch size each greedy sequence's draft is cut to `Sizing.cut(B)` (`state.cut`:
        a chain's length, a tree's nodes; sampled drafts keep their batch-1 size: a seeded answer draws
        the same at any batch size). A batch drafts `together` (one draft forward per level for all its
        sequences, to its end); a batch of one, with its sequence's own drafter. Not `draft` (load-aware
        speculation above its batch size): every budget is 0, each tree its root alone."""
        cut = self.sizing.cut(len(states))
        budgets = []
        for state in states:
            state.batch = len(states)
            state.cut = cut if state.sampling.greedy else None
            budget = state.stop.max_new_tokens - len(state.tokens) - 1 if draft else 0
            budgets.append(budget if state.cut is None else min(budget, state.cut))
        if together:
            return self.propose_batch(states, budgets)
        return [self.propose(states[0], states[0].tokens[-1], budgets[0])]

    # Swappable so that tests can show a broken acceptor is caught.
    sample_accept = staticmethod(sample_accept)
    sample_pending = staticmethod(sample_pending)

    @staticmethod
    def count_acceptance(stats: DecodeStats, tree: Tree, acceptance: Acceptance) -> None:
        stats.drafted_tokens += len(tree) - 1
        stats.accepted_drafts += acceptance.accepted_drafts
        # a tree whose structure stayed on the device: read with the acceptance
        if acceptance.path_children is not None:
            stats.count_step(acceptance.tree_depth, acceptance.path_children, acceptance.accepted_drafts)
        else:
            stats.count_step(max(tree.depths), [bool(tree.children[n]) for n in acceptance.path],
                             acceptance.accepted_drafts)


class _Batch:
    """The sequences of one `_generate` call: every sequence admitted (in the order it joined), the rows
    of the cache (indices into `admitted`), each one's output once it stopped, and in a serving run the
    drafter slots (`draft_state`: a slot is free again once a draft step ran without its last sequence,
    which a batch drafter may hold until then, so 2 x concurrency always suffice) and each sequence's
    request."""

    def __init__(self, decoder: DraftVerifyDecoder, requests: Requests | None, room: int):
        self.decoder, self.target, self.requests, self.room = decoder, decoder.target, requests, room
        self.phases: dict[str, float] = {}
        self.clock = PhaseClock(self.target.device, self.phases)
        self.begin = self.clock.last
        self.admitted: list[DecodeState] = []
        self.done: dict[int, tuple[int, str] | None] = {}
        self.outputs: dict[int, DecodeOutput] = {}
        self.rows: list[int] = []
        self.free = list(range(2 * requests.concurrency)) if requests else []
        self.leaving: list[int] = []
        self.request_of: dict[int, int] = {}  # admitted sequence -> its request

    def running(self) -> list[int]:
        return [b for b in self.rows if b not in self.outputs]

    def finish(self, b: int) -> None:
        state, clock = self.admitted[b], self.clock
        self.outputs[b] = state.conclude(self.done[b])
        self.decoder.finish(state)
        clock.lap("other")
        state.stats.total_time = clock.last - self.begin - state.arrival
        state.stats.phase_time = dict(self.phases)
        if self.requests:
            self.leaving.append(state.index)

    def admit(self, new: list[DecodeState]) -> None:
        """Each new sequence prefilled alone into its row, its first token chosen, its drafter started."""
        decoder, clock = self.decoder, self.clock
        firsts = (self.target.join_rows if self.requests else self.target.prefill_rows)(new, decoder.prefill)
        roots = [Tree.root(s.prompt[-1]) for s in new]  # the first token: a root's choice
        chosen = decoder.standard_accept_batch(new, roots, torch.stack([first.logits[-1:] for first in firsts]))
        first_token = clock.now() - self.begin
        clock.lap("prefill")
        joined = []
        for state, first, pick in zip(new, firsts, chosen):
            b = len(self.admitted)
            self.admitted.append(state)
            self.rows.append(b)
            joined.append(b)
            state.stats.ttft = first_token - state.arrival
            self.done[b] = state.emit([pick.next_token], pick.margins)
            decoder.start(state, first)
        clock.lap("draft")
        for b in joined:
            if self.done[b] is not None:
                self.finish(b)

    def leave_stopped(self) -> None:
        """Sequences that stopped leave the batch: their cache rows are dropped."""
        running = self.running()
        if running != self.rows:
            self.target.keep_sequences([self.rows.index(b) for b in running])
            self.rows[:] = running
            self.clock.lap("commit")

    def take_arrivals(self) -> bool:
        """The requests that have arrived, as many as the batch has room for, admitted; with none and an
        empty batch, the wait for the next. Whether it did either (else the batch steps)."""
        requests, clock = self.requests, self.clock
        if not self.rows:  # no batch drafter holds a slot of a sequence that left
            self.free.extend(self.leaving)
            self.leaving.clear()
        new = []
        for index in requests.due(clock.now() - self.begin, requests.concurrency - len(self.rows)):
            request = requests.requests[index]
            state = self.decoder.new_state(self.free.pop(0), list(request.prompt), request.stop, request.sampling,
                                           request.generator)
            # a closed loop's request is sent now, as the batch has room; an open loop's arrived at its time
            state.arrival = clock.now() - self.begin if request.arrival is None else request.arrival
            state.batch_room = self.room
            self.request_of[len(self.admitted) + len(new)] = index
            new.append(state)
        if new:
            self.admit(new)
            return True
        if not self.rows:  # nothing to decode until the next request arrives
            time.sleep(max(0.0, requests.next_arrival() - (clock.now() - self.begin)))
            clock.lap("idle")
            return True
        return False

    def step(self, together: bool) -> None:
        """One step of the running sequences: draft, verify in one forward, accept, commit, emit, advance."""
        decoder, target, clock, rows = self.decoder, self.target, self.clock, self.rows
        limit = self.requests.speculate_up_to if self.requests is not None else None
        quiet = limit is not None and len(rows) > limit  # load-aware: no draft above that batch size
        trees = decoder.draft_step([self.admitted[b] for b in rows], together, draft=not quiet)
        self.free.extend(self.leaving)  # the drafters have drafted without them
        self.leaving.clear()
        clock.lap("draft")
        start = target.length
        verified = target.forward_batch([tree.forward_rows() for tree in trees])
        clock.lap("verify")
        # extra rows are never accepted; at temperature 0 their argmax comes back with the step's read
        extras = [None if t.extra_rows is None else verified.logits[row, len(t):len(t) + len(t.extra_rows)]
                  for row, t in enumerate(trees)]
        acceptances = decoder.accept_batch([self.admitted[b] for b in rows], trees, verified.logits, extras)
        clock.lap("accept")
        target.commit_batch(start, [acceptance.path for acceptance in acceptances])
        clock.lap("commit")
        followed = []
        for row, (b, tree, acceptance) in enumerate(zip(rows, trees, acceptances)):
            # the row of each accepted node chose the token after it: its accepted child, or the next token
            emitted = acceptance.emitted or tree.tokens[acceptance.path[1:]].tolist() + [acceptance.next_token]
            margins = acceptance.margins or logit_margins(verified.logits[row, acceptance.path], emitted)
            self.done[b] = self.admitted[b].emit(emitted, margins)
            decoder.count_acceptance(self.admitted[b].stats, tree, acceptance)
            if self.done[b] is None:
                followed.append((b, tree, acceptance, row))
            else:
                self.finish(b)
        clock.lap("other")  # emitting, stop checks, statistics: the loop's own overhead
        for b, tree, acceptance, row in followed:
            decoder.advance(self.admitted[b], tree, acceptance, row_output(verified, row, len(tree)))
        clock.lap("draft")

    def results(self) -> list[DecodeOutput]:
        """One output per sequence given (a drained batch) or per request (a serving run), in their order."""
        if self.requests is None:
            return [self.outputs[b] for b in range(len(self.admitted))]
        by_request = {self.request_of[b]: self.outputs[b] for b in self.outputs}
        return [by_request[i] for i in range(len(self.requests.requests))]
