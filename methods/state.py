"""One sequence's decoding: its statistics (`DecodeStats`), its state through the loop (`DecodeState`:
prompt, output, sampling, generator, the method's per-sequence drafter and values) and its output
(`DecodeOutput`). The loop (`loop.py`) holds one `DecodeState` per sequence of its batch and hands it
to the method at every call; a decoder keeps no per-call state of its own."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from .engine.sampling import SamplingConfig
from .engine.stopping import StopCondition


@dataclass
class DecodeStats:
    new_tokens: int = 0
    steps: int = 0  # target forward passes, prefill included (= len(accepted_lengths))
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted by each forward, the prefill's first
    # the prefill counts as a decoding step (AR, as Spec-Bench's baseline counts it); else the
    # prefill's token is folded into the first verification's accept length (Spec-Bench's EAGLE and
    # Medusa scripts). `decoding_steps`, `accept_lengths` and τ follow: docs/benchmarks.md, "τ".
    prefill_step: bool = False
    # per generated token, from the target forward that chose it: the chosen token's logit minus the
    # best other token's (the row's top-2 gap when it chose its argmax, negative when it did not);
    # the fidelity check classifies a divergence from AR with it (harness/stats.py, `fidelity`)
    logit_margins: list[float] = field(default_factory=list)
    drafted_tokens: int = 0  # draft tokens proposed (tree nodes other than roots)
    accepted_drafts: int = 0  # draft tokens accepted
    # per draft position d (index d-1): steps whose tree reached depth d, steps in which a depth-d
    # candidate was tested (all depths before it accepted), and steps in which one was accepted
    position_proposed: list[int] = field(default_factory=list)
    position_tested: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    ttft: float = 0.0  # seconds from the call to the first token
    total_time: float = 0.0  # seconds for the whole call
    # seconds per phase, covering total_time: prefill, draft (draft model and tree building),
    # verify (target forward), accept, commit (cache), other (the loop's own overhead)
    phase_time: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific statistics

    @property
    def decoding_steps(self) -> int:
        """Spec-Bench's decoding steps: the verifications (target forwards after the prefill), or
        every forward for a decoder whose prefill is a step (AR); a turn that ended at the
        prefill's token has one step."""
        return self.steps if self.prefill_step or self.steps <= 1 else self.steps - 1

    @property
    def accept_lengths(self) -> list[int]:
        """Spec-Bench's accept lengths, one per decoding step, summing to `new_tokens`: the
        prefill's token is folded into the first verification's (as `decoding_steps` counts)."""
        lengths = list(self.accepted_lengths)
        if self.prefill_step or len(lengths) <= 1:
            return lengths
        return [lengths[0] + lengths[1], *lengths[2:]]

    @property
    def tau(self) -> float:
        """Mean accepted tokens (Spec-Bench's): new tokens per decoding step."""
        return self.new_tokens / self.decoding_steps if self.decoding_steps else 0.0

    def count_step(self, tree_depth: int, path_children: list[bool], accepted_depth: int) -> None:
        """One verification: the tree's depth, whether each node of the accepted path had
        children (then the next depth was tested), and how many draft tokens were accepted."""
        while len(self.position_proposed) < tree_depth:
            for counts in (self.position_proposed, self.position_tested, self.position_accepted):
                counts.append(0)
        for depth in range(tree_depth):
            self.position_proposed[depth] += 1
        for depth, tested in enumerate(path_children):
            if tested:
                self.position_tested[depth] += 1
                self.position_accepted[depth] += int(depth < accepted_depth)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DecodeState:
    """One sequence's decoding: the loop's per-call state, handed to the method at every call
    (`prefill`, `start`, `propose`, `accept`, `advance`, `finish`) instead of being kept on the
    decoder. At batch size B the loop (`loop.py`) holds B of them, one per sequence; alone, one."""

    index: int  # the sequence's row in its batch (0 alone): which per-sequence drafter it drafts with
    prompt: list[int]
    stop: StopCondition
    sampling: SamplingConfig
    generator: torch.Generator | None
    stats: DecodeStats
    tokens: list[int] = field(default_factory=list)  # the output so far
    sequence: list[int] = field(default_factory=list)  # prompt and output; the last token is not in the target KV
    draft: Any = None  # the method's drafter for this sequence (`DraftVerifyDecoder.draft_state`): a draft LM, a head
    batch: int = 1  # the sequences verified together this step (the loop sets it)
    # the most draft tokens (nodes besides the root) this step's draft may hold: the decoder's
    # `Sizing.cut` at this batch size, for a greedy sequence; None: the batch-1 size (the loop sets it)
    cut: int | None = None
    values: dict[str, Any] = field(default_factory=dict)  # the method's own per-sequence values (SpS's heuristic γ)
    # seconds after the loop began that the sequence's request arrived (continuous batching: `Requests`;
    # 0 for a batch that starts together); its TTFT and total time count from then
    arrival: float = 0.0
    # the most positions a sequence of its batch (or serving run) commits, prompt and new tokens (the loop
    # sets it): a batch drafter's cache reserves `room()` once, for sequences that join later too
    batch_room: int = 0

    def room(self) -> int:
        """The positions a batch drafter's cache reserves for the batch this sequence is in."""
        return max(self.batch_room, len(self.prompt) + self.stop.max_new_tokens)

    def emit(self, emitted: Sequence[int], margins: Sequence[float]) -> tuple[int, str] | None:
        """The step's tokens and their margins appended; the stopping rule's verdict on them (None: go on).
        The step's accepted length is what the rule kept of them."""
        checked = len(self.tokens)
        self.tokens.extend(emitted)
        self.sequence.extend(emitted)
        self.stats.logit_margins.extend(margins)
        done = self.stop.cut(self.tokens, checked)
        self.stats.accepted_lengths.append(len(emitted) if done is None else done[0] - checked)
        return done

    def conclude(self, done: tuple[int, str]) -> "DecodeOutput":
        """The output, cut where the stopping rule said, with its statistics."""
        keep, self.stats.stop_reason = done
        del self.tokens[keep:]
        del self.stats.logit_margins[keep:]
        self.stats.new_tokens = len(self.tokens)
        self.stats.steps = len(self.stats.accepted_lengths)
        return DecodeOutput(tokens=self.tokens, stats=self.stats)


@dataclass
class DecodeOutput:
    tokens: list[int]  # generated token ids (EOS / stop-string token included when it stopped there)
    stats: DecodeStats
