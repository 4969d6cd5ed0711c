"""Jacobi decoding, and CLLMs (arXiv 2403.00835): greedy fixed-point iteration over blocks.

A block of n tokens starts with the last emitted token and n-1 guessed tokens. Each iteration is
one target forward over the unconverged part of the block (a chain); the longest prefix whose
tokens equal the target's argmax after their predecessors converges (at least one token: the
target's own next token), the KV of the rest is dropped, and the target's predictions for the
remaining positions become their next guess. When the whole block has converged a new block
starts. The output equals greedy AR by construction. CLLMs are models fine-tuned so that many
tokens converge per iteration; they use this same decoder with their own block size n.

Statistics: τ is tokens converged per iteration (= per target forward); `iterations_per_block`
is recorded per block.

Batches (`methods/batched.py`): a block's guesses and its random draws are the sequence's own
(`DecodeState.values`; each sequence draws from its own `random.Random(seed)`), so a prompt
converges the same blocks, with the same guesses, alone and in a batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .base import BuildContext, register
from .engine.tree import Tree
from .loop import DraftVerifyDecoder
from .settings.params import Settings, integer, null, one_of, setting
from .settings.sizing import Sizing

# sequence: random tokens of the prompt and the output so far, as upstream's chat and speedup
# scripts draw them (`random.choices(generation[0], k=n-1)`); prompt: of the prompt only
INITIAL_GUESSES = ("sequence", "prompt", "repeat", "pad")
CLLM_BLOCK = 16  # CLLMs' n_token_seq_length; `auto` without a machine profile


@dataclass(frozen=True)
class JacobiSettings(Settings):
    """Jacobi decoding (greedy fixed-point iteration over blocks); with a CLLM model this is CLLM decoding."""

    paper = "Santilli et al. 2023; CLLM, Kou et al. 2024"
    lossless = "yes (greedy only)"
    size_setting, size_label = "block_size", "Jacobi block size n"

    block_size: int | str | None = setting(None, null() | one_of("auto") | integer(2),
                                           "n tokens per block; null = the model's jacobi_block_size (CLLMs), else "
                                           "auto: the longest block this machine verifies nearly free (machine "
                                           "profile)")
    initial_guess: str = setting("sequence", one_of(*INITIAL_GUESSES),
                                 "sequence (random tokens of prompt + output so far, as upstream CLLM scripts) | "
                                 "prompt (of the prompt only) | repeat (the last token) | pad")
    seed: int = setting(0, integer(), "for the random initial guesses")

    batchable = True  # a block's guesses and random draws are in each sequence's DecodeState


class JacobiDecoder(DraftVerifyDecoder):
    name = "jacobi"

    def __init__(self, target, block_size: int | Sizing = CLLM_BLOCK, initial_guess: str = JacobiSettings.initial_guess,
                 pad_token: int = 0, seed: int = JacobiSettings.seed):
        """`block_size`: n, the block's tokens with its root (`method.block_size` settled: a `Sizing`; under
        a batch's cut a new block holds at most the cut's guesses)."""
        super().__init__(target, Sizing.of(block_size))
        block_size = int(self.sizing.value)
        if block_size < 2:
            raise ValueError(f"jacobi block_size must be >= 2, got {block_size}")
        if initial_guess not in INITIAL_GUESSES:
            raise ValueError(f"unknown jacobi initial_guess {initial_guess!r}; valid: {', '.join(INITIAL_GUESSES)}")
        self.block_size, self.initial_guess, self.pad_token, self.seed = block_size, initial_guess, pad_token, seed

    def describe(self):
        return {**super().describe(), "block_size": self.block_size, "initial_guess": self.initial_guess}

    def new_state(self, index, prompt, stop, sampling, generator):
        if not sampling.greedy:  # before the prefill, alone and in a batch
            raise ValueError("jacobi decoding is greedy only; run it with temperature=0")
        return super().new_state(index, prompt, stop, sampling, generator)

    def start(self, state, prefill) -> None:
        # guesses for the positions after the root, in the current block: on the target's device, so
        # that the next iteration's block never comes back to the host
        state.values["guess"] = torch.empty(0, dtype=torch.long, device=self.target.device)
        state.values["remaining"] = 0  # unconverged positions of the current block after the root
        state.values["rng"] = random.Random(self.seed)  # the host's: the guesses are drawn from the host's tokens
        state.values["iterations_per_block"] = []

    def finish(self, state) -> None:
        state.stats.extra["iterations_per_block"] = state.values.get("iterations_per_block", [])

    def new_block(self, state, root: int) -> None:
        values = state.values
        values["iterations_per_block"].append(0)
        remaining = values["remaining"] = self.block_size - 1 if state.cut is None else \
            min(self.block_size - 1, state.cut)
        if self.initial_guess in ("sequence", "prompt"):  # uniform draws, with replacement
            pool, rng = state.sequence if self.initial_guess == "sequence" else state.prompt, values["rng"]
            guess = [pool[rng.randrange(len(pool))] for _ in range(remaining)]
        elif self.initial_guess == "repeat":
            guess = [root] * remaining
        else:
            guess = [self.pad_token] * remaining
        values["guess"] = torch.tensor(guess, dtype=torch.long, device=self.target.device)

    def propose(self, state, root: int, budget: int) -> Tree:
        values = state.values
        if values["remaining"] <= 0:
            self.new_block(state, root)
        values["iterations_per_block"][-1] += 1
        guess = values["guess"][: min(values["remaining"], budget)]
        return Tree.chain(torch.cat([guess.new_tensor([root]), guess]))

    def advance(self, state, tree, acceptance, verified) -> None:
        values = state.values
        converged = acceptance.accepted_drafts + 1  # accepted guesses and the target's next token
        remaining = values["remaining"] = values["remaining"] - converged
        # the target's argmax after each unaccepted node: the next guesses for the positions after
        # the new root (conditioned on the old guesses, as Jacobi iteration does)
        guess = verified.logits.argmax(-1)[len(acceptance.path):][: max(remaining, 0)]
        if len(guess) < remaining:  # the budget had cut the block short
            guess = torch.cat([guess, guess.new_full((remaining - len(guess),), self.pad_token)])
        values["guess"] = guess


@register("jacobi", settings=JacobiSettings)
def build(target, settings: JacobiSettings, context: BuildContext) -> JacobiDecoder:
    # a CLLM's own block size wins over `auto` (it was trained for it); else the machine's verify budget
    block = settings.block_size or context.model_config.get("jacobi_block_size") or "auto"
    sizing = context.sizing(target, "block_size", block, CLLM_BLOCK)
    if block == "auto":
        sizing = sizing.choose(sizing.value, chosen=sizing.value)
    pad = getattr(context.target_model.config, "pad_token_id", None) or 0
    return JacobiDecoder(target, block_size=sizing, initial_guess=settings.initial_guess, pad_token=int(pad),
                         seed=settings.seed)
