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

Initialization (our choice, for short budgets): the layer from the target's last one (q/k/v read its
hidden half, o_proj and down_proj zeroed so the head starts as the identity on g), fc selecting the
L-3 input, `norm` = the target's final norm, `lm_head` = the target's lm_head rows of the draft
vocabulary. Only what the head owns is saved: embeddings come from the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .examples import Example


@torch.no_grad()
def attach_features(target, examples: list[Example], layers: tuple[int, ...], progress: bool = False) -> None:
    """Per example: `features` [T, 3H] (the inputs of `layers`), `hidden` [T, H] (last hidden state,
    after the final norm) and `top` [T] (the target's argmax at each position), in one target forward."""
    from tqdm import tqdm

    from methods.engine.runner import layer_inputs

    lm_head = target.get_output_embeddings()
    for example in tqdm(examples, desc="target features", unit="example", disable=not progress):
        with layer_inputs(target.model, layers) as captured:
            hidden = target.model(input_ids=example.ids[None]).last_hidden_state[0].float()
        example.features = torch.cat([captured[i][0] for i in layers], -1).float()
        example.hidden = hidden
        example.top = lm_head(hidden).argmax(-1)


class Eagle3Recipe:
    kind = "eagle3"

    def __init__(self, target, seed: int, vocabulary, steps: int = 7, decay: float = 0.8):
        from methods.models.heads.eagle3 import Eagle3Head, eagle3_head_config, feature_layers
        from methods.models.heads.random_init import eagle3_config

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
        self.target_rows = target.get_output_embeddings().weight[ids].detach()  # the target's logits on the draft vocabulary
        self.head.train()

    def parameters(self):
        return [p for p in self.head.parameters() if p.requires_grad]

    # -----------------------------------------------------------------------------------------
    def _project(self, embeds, hidden, positions):
        """q [heads, n, d], k and v [heads, n, d] (kv heads repeated) of the midlayer's attention."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self.head.midlayer
        attn = layer.self_attn
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        n, d = x.shape[0], attn.head_dim
        q = attn.q_proj(x).view(n, -1, d).transpose(0, 1)[None]
        k = attn.k_proj(x).view(n, -1, d).transpose(0, 1)[None]
        v = attn.v_proj(x).view(n, -1, d).transpose(0, 1)
        cos, sin = self.head.rotary_emb(x[None], positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = attn.num_key_value_groups
        return q[0], k[0].repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)

    def unroll(self, tokens: torch.Tensor, fused: torch.Tensor, rows_from: int = 0) -> list[torch.Tensor]:
        """The training-time test. tokens [n + steps - 1] (x_1, x_2, ...), fused [n, H] (g_0..g_{n-1}).
        Returns, for each step j, the head's outputs [n - j - rows_from, H] at positions
        rows_from .. n-1-j: step j at position i has read tokens x_{i+1..i+1+j}."""
        layer = self.head.midlayer
        attn = layer.self_attn
        n = fused.shape[0]
        embed = self.head.embed_tokens
        q0, k0, v0 = self._project(embed(tokens[:n]), fused, torch.arange(n))
        scale = attn.head_dim ** -0.5
        outputs, diag_k, diag_v = [], [], []
        hidden = fused[rows_from:]
        q = q0[:, rows_from:]
        for step in range(self.steps):
            rows = torch.arange(rows_from, n - step)
            count = rows.numel()
            if count <= 0:
                break
            if step:
                q, k, v = self._project(embed(tokens[rows + step]), hidden[:count], rows + step)
                diag_k = [t[:, :count] for t in diag_k] + [k]
                diag_v = [t[:, :count] for t in diag_v] + [v]
                q = q[:, :count]
            scores = q @ k0.transpose(1, 2) * scale  # [heads, count, n]: step-0 keys, causal
            scores = scores.masked_fill(torch.arange(n)[None, None, :] > rows[None, :, None], float("-inf"))
            extra = [(q * k).sum(-1, keepdim=True) * scale for k in diag_k]  # its own earlier steps at position i
            weights = torch.cat([scores, *extra], -1).softmax(-1)
            attended = weights[..., :n] @ v0
            for s, v in enumerate(diag_v):
                attended = attended + weights[..., n + s, None] * v
            attended = attn.o_proj(attended.transpose(0, 1).reshape(count, -1))
            residual = hidden[:count] + attended
            out = residual + layer.mlp(layer.post_attention_layernorm(residual))
            outputs.append(out)
            hidden = out
        return outputs

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        ids, T, start = example.ids, len(example.ids), example.answer_start
        n = T - 1  # pairs (x_{i+1}, g_i), i < n
        rows_from = max(0, start - 1 - self.steps)  # earlier positions only serve as keys
        fused = self.head.fuse(example.features[:n])
        tokens = torch.cat([ids[1:], ids.new_zeros(self.steps)])
        with torch.no_grad():
            target_p = (example.hidden @ self.target_rows.T).softmax(-1)  # [T, K]
            in_vocab = self.head.t2d[example.top]
        total = fused.new_zeros(())
        stats = {}
        for step, out in enumerate(self.unroll(tokens, fused, rows_from)):
            rows = torch.arange(rows_from, rows_from + out.shape[0])
            predicted = rows + 1 + step  # the target position whose next-token distribution step `step` predicts
            answer = (predicted + 1 >= start) & (predicted + 1 <= T - 1)
            if not bool(answer.any()):
                continue
            logits = self.head.draft_logits(out[answer])
            where = predicted[answer]
            keep = in_vocab[where].float()
            ce = -(target_p[where] * logits.log_softmax(-1)).sum(-1)
            total = total + self.decay ** step * (ce * keep).sum() / answer.sum()
            draft = self.draft_ids[logits.argmax(-1)]
            stats[f"acc_{step + 1}"] = (draft == example.top[where]).float()
        return total, stats

    def save(self, out: Path) -> None:
        state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).clone()
                 for k, v in self.head.state_dict().items() if not k.startswith(("embed_tokens.", "rotary_emb."))}
        torch.save(state, out / "pytorch_model.bin")
        (out / "config.json").write_text(json.dumps(self.config_dict, indent=2))
