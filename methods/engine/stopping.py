"""The stopping rule, identical for every decoder: max new tokens, EOS ids, template stop strings.

Speculative decoders emit several tokens per step; `StopCondition.cut` finds the first token at
which AR decoding would have stopped, so every method stops at exactly the same token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

# Tokens decoded around a new token when looking for stop strings: enough for any template's
# stop string (they are a few tokens long).
STOP_STRING_WINDOW = 24


@dataclass(frozen=True)
class StopCondition:
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = field(default=None, compare=False)
    # Called with the number of tokens emitted so far at every check (once per decoding step):
    # the harness's live token count. It must be cheap; the harness's throttles itself.
    progress: Callable[[int], None] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.stop_strings and self.decode is None:
            raise ValueError("stop strings need a decode function (the tokenizer's)")

    def cut(self, tokens: Sequence[int], checked: int) -> tuple[int, str] | None:
        """`tokens[:checked]` passed the rule already. Returns (length to keep, reason) at the
        first stop in `tokens[checked:]`, or None."""
        if self.progress is not None:
            self.progress(len(tokens))
        for i in range(checked, len(tokens)):
            if tokens[i] in self.eos_token_ids:
                return i + 1, "eos"
            if self.stop_strings and self._ends_stop_string(tokens, i):
                return i + 1, "stop_string"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "length"
        return None

    def _ends_stop_string(self, tokens: Sequence[int], i: int) -> bool:
        """Whether token i completes a stop string (one absent before it)."""
        start = max(0, i + 1 - STOP_STRING_WINDOW)
        with_token = self.decode(tokens[start : i + 1])
        if not any(s in with_token for s in self.stop_strings):
            return False
        without = self.decode(tokens[start:i])
        return any(s in with_token and s not in without for s in self.stop_strings)

    def trim_text(self, text: str) -> str:
        """The answer text: cut before the first stop string."""
        for s in self.stop_strings:
            index = text.find(s)
            if index >= 0:
                text = text[:index]
        return text
