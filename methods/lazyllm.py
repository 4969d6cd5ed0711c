"""LazyLLM (arXiv 2407.14057): progressive prompt-token pruning in prefill, for time to first token.

LOSSY by design. The target runs layer by layer (its own decoder layers, no copy of the modeling
code). At each pruning layer of the schedule, the prompt tokens present there are scored by the
attention the current token (the last prompt token in prefill, the new token while decoding) pays
them, softmax(q·Kᵀ/√d) averaged over heads, computed directly from that layer's query and cached
keys (no eager attention maps), and only the top `keep` fraction of the prompt (the last prompt
token always) goes on to later layers. A pruned token's hidden state stays in the Aux Cache, so a
later decoding step that selects it again computes only the layers it is missing: every
(token, layer) pair is computed at most once, and the whole run never does more layer-token work on
the prompt than a full prefill.

Attention at a layer covers every entry that layer holds with a position up to the query's.
Decoding is AR; the runner verifies single-token steps only.

Default schedule (documented choice; LazyLLM gives none): prune after 1/4, 1/2 and 3/4 of the
layers, keeping 70%, 50% and 35% of the prompt tokens.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from .ar import AutoregressiveDecoder
from .base import BuildContext, register
from .engine.runner import ForwardOutput, ModelRunner
from .settings.params import Check, Settings, setting


@dataclass(frozen=True)
class LazyLLMSettings(Settings):
    """LazyLLM: progressive prompt-token pruning in prefill (LOSSY), composed with AR decoding."""

    paper = "Fu et al. 2024 (no official code)"
    lossless = "no: prunes the prefill"

    def batch_problem(self) -> str | None:
        return ("its runner keeps each layer's own subset of the prompt (the Aux Cache), which one cache "
                "length per sequence cannot hold")

    schedule: list = setting(((0.25, 0.70), (0.50, 0.50), (0.75, 0.35)), Check(
        lambda v: len(v) > 0 and all(len(p) == 2 and 0 <= p[0] and 0 < p[1] <= 1 for p in v),
        "a list of [layer, keep] pairs: layer an index or a fraction of the depth, keep in (0, 1]"),
        "[layer, keep]: after `layer` (an index, or a fraction of the depth when < 1), keep the `keep` fraction of "
        "the prompt tokens that the current token attends to most; the paper's documented default")


def resolve_schedule(schedule, num_layers: int) -> dict[int, float]:
    """[(layer, keep), ...] -> {layer index: keep fraction}. A layer given as a float in (0, 1) is
    a fraction of the depth; keep fractions are of the whole prompt and must not increase."""
    resolved: dict[int, float] = {}
    for layer, keep in schedule:
        index = int(round(layer * num_layers)) if isinstance(layer, float) and layer < 1 else int(layer)
        if not 0 <= index < num_layers - 1:
            raise ValueError(f"lazyllm pruning layer {layer!r} -> {index} is outside 0..{num_layers - 2}")
        if not 0 < float(keep) <= 1:
            raise ValueError(f"lazyllm keep fraction must be in (0, 1], got {keep!r}")
        resolved[index] = float(keep)
    keeps = [resolved[i] for i in sorted(resolved)]
    if keeps != sorted(keeps, reverse=True):
        raise ValueError(f"lazyllm keep fractions must not increase with depth, got {keeps}")
    return resolved


class LazyRunner(ModelRunner):
    """The target with LazyLLM's pruned prefill, Aux Cache and revival."""

    def __init__(self, model, schedule=LazyLLMSettings.schedule, **engine):
        """`engine`: the run's runner's `engine_settings()` (its linear path, forward, static steps and
        machine profile)."""
        super().__init__(model, **engine)
        self.layers = self.decoder.layers
        self.schedule = resolve_schedule(schedule, len(self.layers))
        attention = self.layers[0].self_attn
        self._rope = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        self.reset()

    def reset(self) -> None:
        super().reset()
        n_layers = len(self.layers)
        self.prompt_length = 0
        self.aux_hidden: torch.Tensor | None = None  # [n, H]: each prompt token's latest layer output
        self.last_layer: torch.Tensor | None = None  # [n]: the last layer computed for each prompt token
        self.entry_positions = [torch.empty(0, dtype=torch.long) for _ in range(n_layers)]
        self.prompt_computed = [0] * n_layers  # prompt tokens computed per layer, prefill + revivals
        self.prefill_computed = [0] * n_layers
        self.revived = [0] * n_layers

    # ------------------------------------------------------------------------------------------
    def run_layer(self, index: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run layer `index` for queries `hidden` [q, H] at `positions` [q] (appended to its cache);
        each query sees the entries of that layer at positions up to its own."""
        keys = torch.cat([self.entry_positions[index], positions])
        if self.entry_positions[index].numel() == 0:
            mask = None  # the layer's first queries, in position order: plain causal attention (fast path)
        else:
            allowed = keys[None, :] <= positions[:, None]
            mask = torch.zeros(1, 1, *allowed.shape, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~allowed.to(self.device), torch.finfo(self.dtype).min)
        position_ids = positions.to(self.device).view(1, -1)
        x = hidden[None]
        out = self.layers[index](x, attention_mask=mask, position_ids=position_ids, past_key_values=self.cache,
                                 use_cache=True, position_embeddings=self.decoder.rotary_emb(x, position_ids))
        self.entry_positions[index] = keys
        return out[0]

    def _importance(self, index: int, query_input: torch.Tensor, position: int) -> torch.Tensor:
        """Attention of one query (its input to layer `index`) over that layer's cached entries,
        averaged over heads: [entries]."""
        attention = self.layers[index].self_attn
        head_dim = attention.head_dim
        q = attention.q_proj(self.layers[index].input_layernorm(query_input)).view(1, -1, 1, head_dim)
        position_ids = torch.tensor([[position]], device=self.device)
        cos, sin = self.decoder.rotary_emb(query_input[None, None], position_ids)
        q, _ = self._rope(q, q, cos, sin)
        keys = self.cache.layers[index].keys  # [1, kv_heads, T, d], rotated
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        scores = (q @ keys.transpose(-1, -2))[0, :, 0] * attention.scaling  # [heads, T]
        return scores.float().softmax(-1).mean(0)

    def _select(self, index: int, query_input: torch.Tensor, position: int, must_keep: int | None) -> torch.Tensor:
        """Prompt tokens to carry past pruning layer `index`: the top `keep` fraction of the prompt
        among those present at that layer, by the query's attention."""
        scores = self._importance(index, query_input, position)
        entries = self.entry_positions[index]
        is_prompt = entries < self.prompt_length
        candidates, candidate_scores = entries[is_prompt], scores[is_prompt.to(scores.device)]
        count = max(1, math.ceil(self.schedule[index] * self.prompt_length))
        if must_keep is not None:
            candidate_scores = candidate_scores.clone()
            candidate_scores[candidates == must_keep] = float("inf")
        top = torch.topk(candidate_scores, min(count, candidates.numel())).indices
        return candidates[top.cpu()].sort().values

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int], *, all_logits: bool = False) -> ForwardOutput:
        if self.length:
            raise RuntimeError("prefill on a non-empty cache; call reset() first")
        n = len(prompt)
        self.check_room(n)
        ids = torch.tensor(prompt, device=self.device)
        self.prompt_length = n
        self.aux_hidden = self.decoder.embed_tokens(ids)
        self.last_layer = torch.full((n,), -1, dtype=torch.long)
        active = torch.arange(n)
        for index in range(len(self.layers)):
            query_input = self.aux_hidden[n - 1].clone()  # the last token's input to this layer
            self.aux_hidden[active.to(self.device)] = self.run_layer(index, self.aux_hidden[active.to(self.device)],
                                                                  active)
            self.last_layer[active] = index
            self.prompt_computed[index] += active.numel()
            if index in self.schedule:
                active = self._select(index, query_input, n - 1, must_keep=n - 1)
        self.forward_passes += 1
        self.prefill_computed = list(self.prompt_computed)
        hidden = self.decoder.norm(self.aux_hidden[n - 1 :])
        return ForwardOutput(logits=self.lm_head(hidden).float(), hidden=hidden)

    @torch.inference_mode()
    def forward(self, tokens, *, positions=None, mask=None, logits_for=slice(None), bound=None,
                rows=None) -> ForwardOutput:
        """One decoding step (a single new token), reviving the prompt tokens it selects."""
        if len(tokens) != 1:
            raise NotImplementedError("LazyLLM's runner decodes one token per step (it composes with AR)")
        position = self.length
        self.check_room(position + 1)
        hidden = self.decoder.embed_tokens(torch.as_tensor(tokens, device=self.device))
        revive = torch.empty(0, dtype=torch.long)  # prompt tokens computed at this layer in this step
        for index in range(len(self.layers)):
            query_input = hidden[0]
            queries = torch.cat([self.aux_hidden[revive.to(self.device)], hidden])
            out = self.run_layer(index, queries, torch.cat([revive, torch.tensor([position])]))
            if revive.numel():
                self.aux_hidden[revive.to(self.device)] = out[:-1]
                self.last_layer[revive] = index
                self.prompt_computed[index] += revive.numel()
                self.revived[index] += revive.numel()
            hidden = out[-1:]
            if index in self.schedule:
                selected = self._select(index, query_input, position, must_keep=None)
                revive = selected[self.last_layer[selected] == index]
        self.forward_passes += 1
        hidden = self.decoder.norm(hidden)
        return ForwardOutput(logits=self.lm_head(hidden).float(), hidden=hidden)

    def commit(self, start: int, path: Sequence[int]) -> None:
        if list(path) != [0]:
            raise NotImplementedError("LazyLLM's runner only commits single-token steps")

    def rollback(self, length: int) -> None:
        raise NotImplementedError("LazyLLM's runner cannot roll back")

    def layer_token_fractions(self, prefill_only: bool = False) -> list[float]:
        """Prompt tokens computed per layer (in the prefill, or so far including revivals), as a
        fraction of the prompt (1.0 = full prefill)."""
        counts = self.prefill_computed if prefill_only else self.prompt_computed
        return [count / self.prompt_length for count in counts]


class LazyLLMDecoder(AutoregressiveDecoder):
    name = "lazyllm"
    lossless = False

    def __init__(self, target: ModelRunner, schedule=LazyLLMSettings.schedule):
        """`target`: the run's runner, whose model, engine settings and machine profile the lazy runner takes."""
        super().__init__(LazyRunner(target.model, schedule, **target.engine_settings()))

    def describe(self):
        return {**super().describe(), "schedule": {int(k): v for k, v in self.target.schedule.items()}}

    def finish(self, state) -> None:
        extra = state.stats.extra
        extra["prompt_tokens"] = self.target.prompt_length
        extra["prefill_layer_token_fraction"] = self.target.layer_token_fractions(prefill_only=True)
        extra["layer_token_fraction"] = self.target.layer_token_fractions()
        extra["revived_per_layer"] = list(self.target.revived)


@register("lazyllm", settings=LazyLLMSettings)
def build(target, settings: LazyLLMSettings, context: BuildContext) -> LazyLLMDecoder:
    return LazyLLMDecoder(target, [tuple(entry) for entry in settings.schedule])
