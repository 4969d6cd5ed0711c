"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057; hao-ai-lab/LookaheadDecoding `lade/decoding.py`
`jacobi_greedy_search_multilevel`, `lade/models/modeling_llama.py` `jforward_multilevel` and
`j_make_causal_mask_multilevel`).

Every step is ONE target forward holding two branches beside the root (the last emitted token):

* the lookahead branch: a 2-D window of Jacobi guesses, N - 1 levels of W columns (level 0 is the
  root and W - 1 guesses; level l, column k sits at position root + l + k). A token at level l,
  column k sees the prefix, level 0's columns 0..k and column k of levels 1..l (its own Jacobi
  trajectory) - the mask of the paper's Figure 5 / upstream's `j_make_causal_mask_multilevel`. The
  argmax of the last level becomes a new level; the window slides one column per step whatever was
  accepted (upstream's ALWAYS_FWD_ONE). Each column's trajectory (the token before it, the
  tokens of levels 1..N-2 and the new prediction) is an N-gram for the pool.
* the verification branch: the up to G pool n-grams that start with the root (N - 1 tokens after
  it), verified as candidates. Upstream verifies each n-gram as its own chain; here they are merged
  into a trie (shared prefixes once; same accepted tokens, fewer rows).

The window rows are `Tree.extra_rows` (engine/tree.py): in the verify forward, never accepted,
their KV dropped by the commit. The pool is an LRU list of at most G n-grams per first token, kept
across the steps of one generation and reset per prompt (as upstream). The window starts as random
prompt tokens and fills one level per step (N - 2 warm-up steps, the first one inside the prefill,
as upstream's first forward); the verification branch starts once it is full. A step with nothing to
speculate (a sequence's last token, or load-aware speculation off at its batch size) forwards the root
alone: the window waits, its levels kept for the next step that speculates.

Differences from upstream, none affecting the output: the n-grams are a trie; when a whole n-gram
is accepted the target's next token is emitted too (upstream drops it); with `pool_from_prompt`
the generated n-grams are the text's (upstream appends a repeated token there). Greedy output
equals AR's; sampling is verified by the engine's rejection sampling with the n-grams as point
masses (lossless), the window still follows the argmax as upstream's (TEMP_FOR_GUESS = 0).

Defaults N = 5, W = 15, G = 15: upstream's 7B setting (`applications/run_mtbench.sh` LEVEL=5
WIN=15 GUESS=15 for llama-2-7b-chat; `applications/chatbot.py` "A100"). Spec-Bench ran 5/7/7.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BuildContext, register
from .engine.runner import ForwardOutput
from .engine.tree import ExtraRows, Tree
from .loop import DraftVerifyDecoder
from .pld import trie
from .settings.params import BOOL, Settings, integer, one_of, setting
from .settings.sizing import Sizing

AUTO = one_of("auto")
UPSTREAM_WINDOW = UPSTREAM_GUESS = 15  # upstream's 7B setting; `auto`'s budget without a machine profile


@dataclass(frozen=True)
class LookaheadSettings(Settings):
    """Lookahead decoding: one forward per step holds the lookahead branch (a window of W columns x
    N-1 levels of Jacobi guesses, whose trajectories feed an n-gram pool) and the verification
    branch (up to G pool n-grams starting with the last token), with the paper's combined mask."""

    paper = "Fu et al. 2024 (hao-ai-lab)"
    batchable = True  # the window, the pool and the counters are in each sequence's DecodeState

    level: int = setting(
        5, integer(3), "N (n-gram size); upstream's 7B setting (applications/run_mtbench.sh: LEVEL=5 WIN=15 GUESS=15)"
    )
    window: int | str = setting(UPSTREAM_WINDOW, AUTO | integer(1),
                                "W; auto = W and G sharing this machine's verify budget, (N-1)(W+G) rows")
    guess: int | str = setting(
        UPSTREAM_GUESS,
        AUTO | integer(0),
        "G, n-grams kept (LRU) per first token and verified per step; 0 = window only; auto as above",
    )
    pool_from_prompt: bool = setting(False, BOOL,
                                     "upstream's POOL_FROM_PROMPT: seed the pool with the prompt's n-grams")
    seed: int = setting(0, integer(), "for the window's initial random prompt tokens")


class LookaheadDecoder(DraftVerifyDecoder):
    name = "lookahead"

    def __init__(self, target, window: int = LookaheadSettings.window, level: int = LookaheadSettings.level,
                 guess: int = LookaheadSettings.guess, pool_from_prompt: bool = LookaheadSettings.pool_from_prompt,
                 seed: int = LookaheadSettings.seed, sizing: Sizing | None = None):
        """`sizing`: how `auto` shared the verify budget between the window and the n-grams; the window is
        each sequence's state from its prefill on, so a batch keeps the batch-1 size (no cut)."""
        super().__init__(target, sizing)
        if level < 3 or window < 1 or guess < 0:
            raise ValueError(f"lookahead needs level >= 3, window >= 1, guess >= 0; got {level}, {window}, {guess}")
        self.window, self.level, self.guess = window, level, guess
        self.pool_from_prompt, self.seed = pool_from_prompt, seed
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def describe(self):
        return {**super().describe(), "level": self.level, "window": self.window, "guess": self.guess,
                "pool_from_prompt": self.pool_from_prompt}

    # --------------------------------------------------------------------------------------
    def prefill(self, state) -> ForwardOutput:
        """The prompt and level 0 of the window in one causal forward (upstream's first step); the
        cache keeps the prompt only. The sequence's pool, window and counters start here."""
        prompt = state.prompt
        rng = torch.Generator().manual_seed(self.seed)
        picks = torch.randint(len(prompt), (self.window + self.level - 3,), generator=rng).tolist()
        levels: list[list[int] | None] = [[prompt[i] for i in picks]] + [None] * (self.level - 2)
        out = self.target.forward(list(prompt) + levels[0], logits_for=slice(len(prompt) - 1, None))
        self.target.rollback(len(prompt))
        # the window's levels (the last filled one: `filled`), the n-gram pool, and the counters
        state.values.update(levels=levels, first_window=out.logits[1:].argmax(-1).tolist(), filled=1, pool={},
                            rows=0, candidates=0, with_guesses=0)
        if self.pool_from_prompt:
            for end in range(self.level, len(prompt) + 1):
                self.remember(state, prompt[end - self.level], tuple(prompt[end - self.level + 1 : end]))
        return ForwardOutput(logits=out.logits[:1], hidden=out.hidden[: len(prompt)])

    def start(self, state, prefill) -> None:
        levels = state.values["levels"]
        levels[0] = levels[0][1:]
        levels[1] = state.values.pop("first_window")

    def finish(self, state) -> None:
        values = state.values
        steps = max(state.stats.steps - 1, 1)
        state.stats.extra.update({
            "window_rows_per_step": values["rows"] / steps,  # lookahead-branch rows besides the root
            "candidate_rows_per_step": values["candidates"] / steps,  # verification-branch rows (trie nodes)
            "steps_with_ngrams": values["with_guesses"] / steps,
            "pool_ngrams": sum(len(v) for v in values["pool"].values()),
        })

    # --------------------------------------------------------------------------------------
    def remember(self, state, first: int, ngram: tuple[int, ...]) -> None:
        """Upstream's LRU pool (the sequence's): at most G n-grams per first token, a repeated one moves to the end."""
        if self.guess <= 0:
            return
        entries = state.values["pool"].setdefault(first, [])
        if ngram in entries:
            entries.remove(ngram)
        elif len(entries) >= self.guess:
            del entries[0]
        entries.append(ngram)

    def _window_mask(self, size0: int, filled: int) -> torch.Tensor:
        """[M, 1 + M] visibility of the window rows over (root, window rows): level 0 (`size0`
        guesses after the root) causal; level l >= 1, column k: root, level 0's columns < k and
        column k of levels 1..l."""
        key = (size0, filled)
        if key not in self._masks:
            width = size0 + 1  # the columns of every level >= 1
            m = size0 + filled * width
            visible = torch.zeros(m, 1 + m, dtype=torch.bool)
            visible[:, 0] = True  # the root
            visible[:size0, 1 : 1 + size0] = torch.ones(size0, size0, dtype=torch.bool).tril()
            for level in range(1, filled + 1):
                for column in range(width):
                    row = size0 + (level - 1) * width + column
                    visible[row, 1 : 1 + min(column, size0)] = True
                    for earlier in range(1, level + 1):
                        visible[row, 1 + size0 + (earlier - 1) * width + column] = True
            ExtraRows(torch.empty(m, dtype=torch.long), [0] * m, visible).check(1)  # once per shape
            self._masks[key] = visible
        return self._masks[key]

    def propose(self, state, root: int, budget: int) -> Tree:
        values = state.values
        levels, filled = values["levels"], values["filled"]
        full = levels[-1] is not None
        ngrams = values["pool"].get(root, []) if full and self.guess > 0 else []
        values["with_guesses"] += bool(ngrams and budget > 0)
        tree = trie(root, [list(g[:budget]) for g in ngrams] if budget > 0 else [])
        if budget <= 0:  # nothing to speculate (its last token, or drafting off at this load): no window rows
            return tree
        size0 = len(levels[0])
        width = size0 + 1
        tokens = list(levels[0])
        depths = list(range(1, size0 + 1))
        for level in range(1, filled + 1):
            tokens += levels[level]
            depths += [level + k for k in range(width)]
        n, m = len(tree), len(tokens)
        limit = self.target.max_positions
        if limit and self.target.length + n + m > limit:  # no room for the window near the model's end
            return tree
        window = self._window_mask(size0, filled)
        visible = torch.zeros(m, n + m, dtype=torch.bool)
        visible[:, 0] = window[:, 0]
        visible[:, n:] = window[:, 1:]
        tree.extra_rows = ExtraRows(torch.tensor(tokens, dtype=torch.long), depths, visible)  # the mask checked once
        values["rows"] += m
        values["candidates"] += n - 1
        return tree

    def advance(self, state, tree, acceptance, verified) -> None:
        if tree.extra_rows is not None:
            self._slide(state, tree, acceptance, verified)
        if self.pool_from_prompt:
            emitted = len(acceptance.path)  # accepted drafts and the next token
            text = state.sequence
            for end in range(len(text) - emitted + 1, len(text) + 1):
                if end >= self.level:
                    self.remember(state, text[end - self.level], tuple(text[end - self.level + 1 : end]))

    def _slide(self, state, tree, acceptance, verified) -> None:
        """The last level's argmax becomes a new level (warm-up) or, once warm, each column's
        trajectory goes to the pool and the window slides one column."""
        values = state.values
        levels = values["levels"]
        width = len(levels[0]) + 1
        newest = acceptance.extra_argmax[len(tree.extra_rows) - width:]  # the last level's, read with the acceptance
        if levels[-1] is None:  # warm-up: one more level
            for level in range(values["filled"] + 1):
                levels[level] = levels[level][1:]
            values["filled"] += 1
            levels[values["filled"]] = newest[1:]
        else:
            root = state.sequence[-len(acceptance.path) - 1]  # the step's root: the token before the emitted ones
            for column in range(self.window):
                first = root if column == 0 else levels[0][column - 1]
                self.remember(state, first, tuple(levels[row][column] for row in range(1, self.level - 1))
                               + (newest[column],))
            levels[0] = levels[1][1:]
            for level in range(1, self.level - 2):
                levels[level] = levels[level + 1]
            levels[-1] = newest


@register("lookahead", settings=LookaheadSettings)
def build(target, settings: LookaheadSettings, context: BuildContext) -> LookaheadDecoder:
    level, window, guess, sizing = settings.level, settings.window, settings.guess, None
    if "auto" in (window, guess):
        # auto: the window and the n-grams share this machine's verify budget, (N-1)(W + G) rows
        budget = context.sizing(target, "window/guess", "auto", (level - 1) * (UPSTREAM_WINDOW + UPSTREAM_GUESS))
        share = max(1, budget.value // (2 * (level - 1)))
        window = share if window == "auto" else window
        guess = share if guess == "auto" else guess
        chosen = {"window": window, "guess": guess, "level": level}
        sizing = Sizing(chosen, {**budget.source, "chosen": chosen,
                                 "batch": "the batch-1 window at every batch size (each sequence's state)"})
    return LookaheadDecoder(target, window=int(window), level=level, guess=int(guess),
                            pool_from_prompt=settings.pool_from_prompt, seed=settings.seed, sizing=sizing)
