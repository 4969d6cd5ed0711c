"""EAGLE-3 head recipe (SafeAILab/EAGLE `eagle/traineagle3`): fc over the inputs of the target's
layers 2, L//2 and L-3, one decoder layer over [embedding; feature], norm and an lm_head over the
reduced draft vocabulary (d2t/t2d from the model config's `draft_vocabulary` ranking), trained with
EAGLE-3's training-time test:

- step 0 reads the fused target features g_i with tokens x_{i+1} and predicts x_{i+2};
- step j (1 <= j < `steps`) reads, at every position, the head's OWN output of step j-1 with the true
  token x_{i+1+j} and predicts x_{i+2+j}; its query attends to the step-0 keys of positions <= i and
  to its own earlier steps' keys at position i (rotary position i + j): exactly what a tree level at
  depth j+1 sees at inference (`tests/test_eagle3.py` checks the two agree), so deep positions are
  trained on what inference feeds them;
- loss per step: cross-entropy against the target's next-token distribution over the draft
  vocabulary, on answer tokens whose target argmax the draft vocabulary holds, weighted 0.8^j (upstream).
  There is no feature regression (EAGLE-3 dropped it).

`batch_loss` runs a mini-batch of conversations through the unroll at once (right-padded; each
example's query rows start at its own `answer_start - 1 - steps`, earlier positions serving only as
step-0 keys; a real row reads only keys at positions <= its own and its own earlier steps, so never a
pad, and rows past an example's end are left out of the loss). It returns the sum of the examples'
losses, each what the one-example loss is (`tests/test_eagle3.py` checks loss, gradients and
accuracies against the loss written out position by position); `loss` is the batch of one.

Features (`attach_features`): the inputs of the three layers [T, 3H], the last hidden state [T, H]
(the target's distribution) and its argmax, from one target forward per right-padded batch. With
`cache=` (the CLI: `data/distill/<model>/eagle3_features.pt` + `.pt.bin`) they go through
`examples.attach_states`, `attach_hidden`'s cache: 16-bit rows [features | hidden] (bfloat16 if
float16 overflows), memory-mapped, rank-sharded under torchrun, reused by later runs while the
examples (sha256 of their ids) and layers match (batches of ~1,024 tokens: on one core of the EPYC,
11.2 s per 1,000 answer tokens against 17.1 at 4,096 and 11.9 one conversation at a time): 9,000 conversations of ~440
tokens are ~18 GB on disk, of which a process keeps in RAM only the rows it is using.

Initialization (our choice, for short budgets): the layer from the target's last one (q/k/v read its
hidden half, o_proj and down_proj zeroed so the head starts as the identity on g), fc selecting the
L-3 input, `norm` = the target's final norm, `lm_head` = the target's lm_head rows of the draft
vocabulary. Only what the head owns is saved: embeddings come from the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from methods.engine.runner import layer_inputs
from methods.models.heads.eagle3 import Eagle3Head, eagle3_head_config, feature_layers
from methods.models.heads.random_init import eagle3_config

from .examples import Example, attach_from, attach_states, offset_mask, pad_batch


def _feature_rows(layers: tuple[int, ...]):
    def compute(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with layer_inputs(target.model, layers) as captured:
            last = target.model(input_ids=ids).last_hidden_state.float()
        return torch.cat([*(captured[i].float() for i in layers), last], -1), last
    return compute


@torch.no_grad()
def attach_features(target, examples: list[Example], layers: tuple[int, ...], cache: Path | None = None,
                    progress: bool = False, batch_tokens: int = 1024) -> None:
    """Per example: `features` [T, 3H] (the inputs of `layers`), `hidden` [T, H] (last hidden state,
    after the final norm) and `top` [T] (the target's argmax at each position), from one target forward
    per right-padded batch. With a `cache` file: `examples.attach_states`'s cache (16-bit rows
    [features | hidden] memory-mapped, reused while the examples and layers match, rank-sharded)."""
    attach_states(target, examples, _feature_rows(tuple(layers)), *_feature_fields(target, layers), cache, progress,
                  batch_tokens)


def _feature_fields(target, layers) -> tuple[dict[str, int], str]:
    hidden = target.get_input_embeddings().embedding_dim
    return ({"features": len(layers) * hidden, "hidden": hidden},
            f"eagle3 layer inputs {list(layers)} + last hidden state")


def attach_cached_features(target, examples: list[Example], layers: tuple[int, ...], cache: Path) -> bool:
    """Attach an existing `attach_features` cache of exactly these examples and layers (its rows hold
    the last hidden state too, so EAGLE, Medusa and Hydra train from it without a second target
    pass); False, computing nothing, when there is none."""
    return attach_from(cache, examples, *reversed(_feature_fields(target, layers)))


class Eagle3Recipe:
    kind = "eagle3"

    def __init__(self, target, seed: int, vocabulary, steps: int = 7, decay: float = 0.8):
        if steps < 1:
            raise ValueError(f"training-time test steps must be >= 1, got {steps}")
        self.target, self.steps, self.decay = target, steps, decay
        ids = vocabulary.ids
        self.draft_ids = ids  # draft id d -> target id ids[d] (increasing, as upstream writes d2t)
        self.config_dict = eagle3_config(target, len(ids))
        hidden = self.config_dict["hidden_size"]
        self.layers = feature_layers(target.config.num_hidden_layers)
        self.head = Eagle3Head(eagle3_head_config(self.config_dict), hidden, len(ids), self.layers).float()
        last = target.model.layers[-1]
        layer = self.head.midlayer
        generator = torch.Generator().manual_seed(seed)
        small = lambda *shape: torch.randn(*shape, generator=generator) * 0.01  # noqa: E731
        with torch.no_grad():
            for name in ("q", "k", "v"):
                weight = getattr(last.self_attn, f"{name}_proj").weight
                getattr(layer.self_attn, f"{name}_proj").weight.copy_(torch.cat([small(*weight.shape), weight], 1))
            layer.self_attn.o_proj.weight.zero_()  # residual branches start at zero: out = g
            layer.mlp.load_state_dict(last.mlp.state_dict())
            layer.mlp.down_proj.weight.zero_()
            layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
            self.head.fc.weight.copy_(torch.cat([small(hidden, hidden), small(hidden, hidden), torch.eye(hidden)], 1))
            self.head.norm.weight.copy_(target.model.norm.weight)
            self.head.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])
            self.head.d2t.copy_(ids - torch.arange(len(ids)))
            self.head.t2d.zero_()
            self.head.t2d[ids] = True
        self.head.embed_tokens.weight = target.get_input_embeddings().weight  # frozen, shared
        self.head.requires_grad_(True)
        self.head.embed_tokens.requires_grad_(False)
        # the target's logits on the draft vocabulary
        self.target_rows = target.get_output_embeddings().weight[ids].detach()
        self.head.train()

    def parameters(self):
        return [p for p in self.head.parameters() if p.requires_grad]

    # -----------------------------------------------------------------------------------------
    def _project(self, embeds, hidden, positions):
        """q [B, heads, n, d], k and v [B, heads, n, d] (kv heads repeated) of the midlayer's attention;
        embeds and hidden [B, n, H], positions [n] or [B, n]."""
        # lazy: transformers' Llama code, slow to import: not for --help
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self.head.midlayer
        attn = layer.self_attn
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        B, n, d = x.shape[0], x.shape[1], attn.head_dim
        q = attn.q_proj(x).view(B, n, -1, d).transpose(1, 2)
        k = attn.k_proj(x).view(B, n, -1, d).transpose(1, 2)
        v = attn.v_proj(x).view(B, n, -1, d).transpose(1, 2)
        cos, sin = self.head.rotary_emb(x, positions if positions.dim() == 2 else positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = attn.num_key_value_groups
        return q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)

    def unroll(self, tokens: torch.Tensor, fused: torch.Tensor, rows_from=0, ends=None) -> list[torch.Tensor]:
        """The training-time test. tokens [B, n + steps - 1] (x_1, x_2, ...), fused [B, n, H]
        (g_0..g_{n-1}), right-padded: example b has `ends[b]` pairs (default n) and its rows start
        at position `rows_from[b]` (an int: the same for all; earlier positions serve only as keys).
        Returns, for each step j, the head's outputs [B, R - j, H], R = max(ends - rows_from): row r
        of example b is position rows_from[b] + r, and step j there has read tokens x_{i+1..i+1+j}.
        A row reads only step-0 keys at positions <= its own and its own earlier steps, so no real
        row reads a pad; rows past an example's end are garbage (the loss leaves them out).
        Unbatched tokens [n + steps - 1] and fused [n, H] give outputs [n - j - rows_from, H]."""
        if fused.dim() == 2:
            return [out[0] for out in self.unroll(tokens[None], fused[None], rows_from)]
        layer = self.head.midlayer
        attn = layer.self_attn
        B, n = fused.shape[:2]
        device = fused.device
        first = torch.as_tensor(rows_from, device=device).expand(B)
        ends = torch.full((B,), n, device=device) if ends is None else ends.to(device)
        count = int((ends - first).max())
        batch = torch.arange(B, device=device)[:, None]
        positions = first[:, None] + torch.arange(count, device=device)[None]  # [B, R]
        at = positions.clamp(max=n - 1)
        embed = self.head.embed_tokens
        q0, k0, v0 = self._project(embed(tokens[:, :n]), fused, torch.arange(n, device=device))
        k0 = k0.transpose(-1, -2)
        scale = attn.head_dim ** -0.5
        outputs, diag_k, diag_v = [], [], []
        hidden = fused[batch, at]
        q = q0.transpose(1, 2)[batch, at].transpose(1, 2)
        for step in range(min(self.steps, count)):
            rows = positions[:, :count - step]  # [B, R - step]
            if step:
                shifted = (rows + step).clamp(max=tokens.shape[1] - 1)
                q, k, v = self._project(embed(tokens[batch, shifted]), hidden[:, :count - step], rows + step)
                diag_k = [t[:, :, :count - step] for t in diag_k] + [k]
                diag_v = [t[:, :, :count - step] for t in diag_v] + [v]
            scores = q @ k0 * scale  # [B, heads, R - step, n]: step-0 keys, causal
            causal = torch.arange(n, device=device)[None, None, :] > rows[:, :, None]
            scores = scores.masked_fill(causal[:, None], float("-inf"))
            extra = [(q * k).sum(-1, keepdim=True) * scale for k in diag_k]  # its own earlier steps at position i
            weights = torch.cat([scores, *extra], -1).softmax(-1)
            attended = weights[..., :n] @ v0
            for s, v in enumerate(diag_v):
                attended = attended + weights[..., n + s, None] * v
            attended = attn.o_proj(attended.transpose(1, 2).reshape(B, count - step, -1))
            residual = hidden[:, :count - step] + attended
            out = residual + layer.mlp(layer.post_attention_layernorm(residual))
            outputs.append(out)
            hidden = out
        return outputs

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        return self.batch_loss([example], noise, [generator])

    def batch_loss(self, examples: list[Example], noise: float, generators) -> tuple[torch.Tensor, dict]:
        """The sum over `examples` of each one's loss (sum over steps j of 0.8^j x the mean over the
        example's answer positions of step j of the masked cross-entropy), in one right-padded unroll."""
        device = self.target_rows.device
        ids, lengths, starts, _ = pad_batch(examples, device=device)
        B, width = ids.shape
        n = width - 1  # pairs (x_{i+1}, g_i), i < n
        features = torch.zeros(B, n, examples[0].features.shape[-1], device=device)
        tops = torch.zeros(B, n, dtype=torch.long, device=device)
        need = offset_mask(lengths, starts, width, 1)  # [B, n]: position t predicts token t + 1 of the answer
        last = []
        for b, e in enumerate(examples):
            T = len(e.ids)
            features[b, :T - 1] = e.features[:T - 1].to(device, torch.float32)
            tops[b, :T - 1] = e.top[:T - 1].to(device)
            last.append(e.hidden[max(0, e.answer_start - 1):T - 1].to(device, torch.float32))
        first = (starts - 1 - self.steps).clamp_min(0)  # earlier positions only serve as keys
        fused = self.head.fuse(features)
        tokens = torch.cat([ids[:, 1:], ids.new_zeros(B, self.steps)], 1)
        with torch.no_grad():
            # the target's next-token distribution over the draft vocabulary at the answer positions only
            target_p = (torch.cat(last) @ self.target_rows.T).softmax(-1)  # [M, K], rows in `need` order
            slot = torch.full((B, n), -1, dtype=torch.long, device=device)
            slot[need] = torch.arange(int(need.sum()), device=device)
            in_vocab = self.head.t2d[tops]
            beyond = torch.cat([need, need.new_zeros(B, 1)], 1)  # the last step's last row predicts past the end
        total = fused.new_zeros(())
        stats = {}
        for step, out in enumerate(self.unroll(tokens, fused, first, lengths - 1)):
            # row r of example b: position first[b] + r, predicting the target's distribution at position + 1 + step
            predicted = first[:, None] + torch.arange(out.shape[1], device=device)[None] + 1 + step
            answer = beyond.gather(1, predicted.clamp(max=n))  # [B, R - step]: an answer token follows it
            if not bool(answer.any()):
                continue
            owner = torch.arange(B, device=device)[:, None].expand_as(answer)[answer]
            where = predicted[answer]
            logits = self.head.draft_logits(out[answer])
            keep = in_vocab[owner, where].float()
            ce = -(target_p[slot[owner, where]] * logits.log_softmax(-1)).sum(-1)
            per = ce.new_zeros(B).index_add(0, owner, ce * keep) / answer.sum(1).clamp_min(1)
            total = total + self.decay ** step * per.sum()
            draft = self.draft_ids.to(device)[logits.argmax(-1)]
            stats[f"acc_{step + 1}"] = (draft == tops[owner, where]).float().cpu()
        return total, stats

    def save(self, out: Path) -> None:
        state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).cpu().clone()
                 for k, v in self.head.state_dict().items() if not k.startswith(("embed_tokens.", "rotary_emb."))}
        torch.save(state, out / "pytorch_model.bin")
        (out / "config.json").write_text(json.dumps(self.config_dict, indent=2))
