"""DFlash draft recipe: SpecForge's DFlash training (sgl-project/SpecForge, `OnlineDFlashModel` in
`algorithms/common/dflash_family_model.py`; z-lab/dflash ships no recipe), on the suite's corpus and loop.

- Target (frozen): the outputs of its layers `target_layer_ids` (upstream's `build_target_layer_ids` over the
  target's depth for a draft of `layers` layers) at every position of each conversation, computed once
  (`attach_dflash_features`: the inputs of layers k + 1, 16-bit and memory-mapped with `cache=`), with its
  argmax (`top`) for the held-out agreement.
- Anchors: up to `num_anchors` (512) positions a per conversation where the answer holds a and a + 1,
  drawn at random (the example's generator), sorted; a batch's conversations are padded with invalid blocks.
- Blocks: [x_a, mask x (bs - 1)] embedded by the target's embedding, at positions a .. a + bs - 1; the
  context is every position's features at 0 .. S - 1. The draft runs once over all of them: a block row
  sees the context strictly before its anchor (kv < a, as at inference: the anchor's own feature is not
  known yet) and every row of its own block (both ways); blocks never see each other (`visibility`, the
  dense mask of SpecForge's `create_dflash_sdpa_mask`; `block_attention` computes the same attention
  without materialising the block-to-block part). An invalid (padding) block sees only itself and
  weighs nothing.
- Loss: slot k of the block at a predicts x_{a+k} (same position, no shift) through the target's frozen
  lm_head; weight = (k > 0) x (a + k in the answer) x exp(-(k - 1) / gamma), gamma = 7 (SpecForge's
  `loss_decay_gamma` for Qwen3-8B); a conversation's loss is its weighted mean cross-entropy (SpecForge
  divides by the batch's total weight; the suite's loop averages conversations). With a reduced
  `vocabulary` (the model config's, as the draft drafts at inference) the cross-entropy runs over its
  rows, labels outside it left out of the loss but not of its denominator.
- Held-out `acc_k` (no_grad): slot k's argmax against the target's own greedy token at a + k.

Initialization (our choice, for short budgets; SpecForge starts from random weights): each draft layer
copies one of the target's last `layers` layers (q_norm/k_norm at 1), `norm` the target's final norm, `fc`
random. The draft is saved in upstream's released format (`models/heads/dflash.py`: config.json and
model.safetensors in bf16), which `method=dflash` loads. Defaults (`__main__.DEFAULTS`): SpecForge's lr
6e-4 and 6 epochs, 16 conversations a step, block size 16.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from methods.engine.runner import layer_inputs
from methods.models.heads.dflash import DFlashDraft, build_target_layer_ids, dflash_config, draft_config, save_dflash

from .examples import Example, attach_states, draft_labels, pad_batch

NUM_ANCHORS = 512  # SpecForge's num_anchors
GAMMA = 7.0  # SpecForge's loss_decay_gamma (examples/configs/qwen3-8b-dflash-online.yaml)
CE_ROWS = 2048  # rows per chunk of the vocabulary projection (recomputed in the backward: no logits kept)


def feature_layers(target, layers: int) -> tuple[int, ...]:
    """The target layers whose inputs are a `layers`-layer draft's features: k + 1 for upstream's ids k."""
    return tuple(k + 1 for k in build_target_layer_ids(target.config.num_hidden_layers, layers))


def _feature_rows(layers: tuple[int, ...]):
    def compute(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with layer_inputs(target.model, layers) as captured:
            last = target.model(input_ids=ids).last_hidden_state.float()
        return torch.cat([captured[i].float() for i in layers], -1), last
    return compute


@torch.no_grad()
def attach_dflash_features(target, examples: list[Example], layers: tuple[int, ...], cache: Path | None = None,
                           progress: bool = False, batch_tokens: int = 1024) -> None:
    """Per example: `features` [T, len(layers)·H], the inputs of `layers` (the outputs of the layers before
    them), and `top` [T], the target's argmax, from one target forward per right-padded batch; with `cache`,
    `examples.attach_states`' 16-bit memory-mapped cache (reused while the examples and layers match)."""
    hidden = target.get_input_embeddings().embedding_dim
    attach_states(target, examples, _feature_rows(tuple(layers)), {"features": len(layers) * hidden},
                  f"dflash layer inputs {list(layers)}", cache, progress, batch_tokens)


def visibility(anchors: torch.Tensor, keep: torch.Tensor, context: int, block: int) -> torch.Tensor:
    """[B, N·bs, S + N·bs] bool, what each block row sees (SpecForge's `create_dflash_sdpa_mask`, full
    attention): the context strictly before its anchor and every row of its own block; an invalid block
    (`keep` False) only its own rows (SpecForge's sees nothing; no row may see nothing here)."""
    B, N = anchors.shape
    q = torch.arange(N * block, device=anchors.device)
    kv = torch.arange(context + N * block, device=anchors.device)
    anchor = anchors.repeat_interleave(block, 1)[:, :, None]  # [B, Q, 1]
    valid = keep.repeat_interleave(block, 1)[:, :, None]
    sees_context = (kv[None, None] < context) & (kv[None, None] < anchor) & valid
    own_block = (kv[None, None] >= context) & ((kv[None, None] - context) // block == (q // block)[None, :, None])
    return sees_context | own_block


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                    context: int, block: int) -> torch.Tensor:
    """Attention under `visibility` without its block-to-block part: q [B, heads, N·bs, d]; k, v [B, kv_heads,
    S + N·bs, d] (the context's rows first). Scores against the context (masked to kv < anchor) and against
    the row's own block, one softmax over both. Returns [B, N·bs, heads·d]."""
    B, heads, Q, d = q.shape
    kv_heads, N = k.shape[1], anchors.shape[1]
    groups, scale = heads // kv_heads, d ** -0.5
    q = q.view(B, kv_heads, groups, N, block, d)
    to_context = torch.einsum("bkgnid,bksd->bkgnis", q, k[:, :, :context]) * scale
    sees = (torch.arange(context, device=q.device)[None, None, :] < anchors[:, :, None]) & keep[:, :, None]
    to_context = to_context.masked_fill(~sees[:, None, None, :, None, :], float("-inf"))
    own_k = k[:, :, context:].view(B, kv_heads, N, block, d)
    to_block = torch.einsum("bkgnid,bknjd->bkgnij", q, own_k) * scale
    weights = torch.cat([to_context, to_block], -1).softmax(-1)
    out = torch.einsum("bkgnis,bksd->bkgnid", weights[..., :context], v[:, :, :context])
    out = out + torch.einsum("bkgnij,bknjd->bkgnid", weights[..., context:],
                             v[:, :, context:].view(B, kv_heads, N, block, d))
    return out.reshape(B, heads, Q, d).transpose(1, 2).reshape(B, Q, heads * d)


def loss_weights(block: int, gamma: float = GAMMA) -> torch.Tensor:
    """[bs]: slot 0 (the anchor, known) 0; slot k >= 1 exp(-(k - 1) / gamma) (SpecForge's decay)."""
    k = torch.arange(block, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1).clamp_min(0) / gamma), torch.zeros(()))


class DFlashRecipe:
    kind = "dflash"
    on_gpu = True  # batch_loss places each batch where the recipe is (`distributed.place`)

    def __init__(self, target, layers: int, block_size: int, mask_token_id: int, vocabulary=None, seed: int = 0,
                 num_anchors: int = NUM_ANCHORS, gamma: float = GAMMA):
        if block_size < 2 or layers < 1:
            raise ValueError(f"a DFlash draft needs a block of 2 or more and a layer (block {block_size}, "
                             f"layers {layers})")
        self.config = dflash_config(target, layers, block_size, mask_token_id)
        ids = self.config["dflash_config"]["target_layer_ids"]
        torch.manual_seed(seed)
        self.draft = DFlashDraft(draft_config(self.config), ids, block_size, mask_token_id).float()
        self._initialize(target)
        self.block, self.mask, self.num_anchors = block_size, mask_token_id, num_anchors
        self.weights = loss_weights(block_size, gamma)
        self.embed = target.get_input_embeddings().requires_grad_(False)  # frozen, shared with the target
        weight = target.get_output_embeddings().weight.detach()
        self.ids = None if vocabulary is None else vocabulary.ids
        self.rows = weight if self.ids is None else weight[self.ids].contiguous()  # the frozen projection
        self.full_size = weight.shape[0]
        self.draft.requires_grad_(True).train()

    def _initialize(self, target) -> None:
        """Each draft layer from one of the target's last layers (their shapes are the target's); q_norm and
        k_norm stay 1; the final norm the target's."""
        source = target.model.layers[-len(self.draft.layers):]
        with torch.no_grad():
            for layer, copied in zip(self.draft.layers, source):
                names = dict(copied.named_parameters())
                for name, parameter in layer.named_parameters():
                    if name in names and names[name].shape == parameter.shape:
                        parameter.copy_(names[name])
            self.draft.norm.weight.copy_(target.model.norm.weight)

    def parameters(self):
        return [p for p in self.draft.parameters() if p.requires_grad]

    def anchors(self, lengths: torch.Tensor, starts: torch.Tensor, generators) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, N] anchor positions (sorted; padding 0) and [B, N] keep: the answer holds a and a + 1; at most
        `num_anchors` per conversation, drawn with its generator (a fixed one when None)."""
        chosen = []
        for length, start, generator in zip(lengths.tolist(), starts.tolist(), generators):
            valid = torch.arange(start, length - 1)
            if len(valid) > self.num_anchors:
                generator = generator or torch.Generator().manual_seed(0)
                valid = valid[torch.randperm(len(valid), generator=generator)[: self.num_anchors]].sort().values
            chosen.append(valid)
        N = max(1, max(len(c) for c in chosen))
        anchors = torch.zeros(len(chosen), N, dtype=torch.long)
        keep = torch.zeros(len(chosen), N, dtype=torch.bool)
        for b, c in enumerate(chosen):
            anchors[b, : len(c)], keep[b, : len(c)] = c, True
        return anchors, keep

    def forward_blocks(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                       keep: torch.Tensor) -> torch.Tensor:
        """The draft over every block of the batch at once: ids [B, S], features [B, S, n·H], anchors and keep
        [B, N]. Returns the blocks' outputs [B, N, bs, H] (after `norm`)."""
        draft, bs = self.draft, self.block
        B, S = ids.shape
        N = anchors.shape[1]
        block = torch.full((B, N, bs), self.mask, dtype=torch.long, device=ids.device)
        block[:, :, 0] = torch.where(keep, ids.gather(1, anchors), self.mask)
        h = self.embed(block.view(B, N * bs)).float()
        positions = (anchors[:, :, None] + torch.arange(bs, device=ids.device)).view(B, N * bs)
        context_positions = torch.arange(S, device=ids.device).expand(B, S)
        cos, sin = draft.rotary_emb(h, torch.cat([context_positions, positions], 1))
        context = draft.fuse(features)
        for layer in draft.layers:
            attention = layer.self_attn
            q, k, v = attention.project(layer.input_layernorm(h), context, cos, sin)
            h = h + attention.o_proj(block_attention(q, k, v, anchors, keep, S, bs))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return draft.norm(h).view(B, N, bs, -1)

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        return self.batch_loss([example], noise, [generator])

    def batch_loss(self, examples: list[Example], noise: float, generators) -> tuple[torch.Tensor, dict]:
        """The sum over `examples` of each one's weighted mean cross-entropy over its blocks' slots."""
        device = self.rows.device
        ids, lengths, starts, _ = pad_batch(examples, device=device)
        B, S = ids.shape
        features = torch.zeros(B, S, examples[0].features.shape[-1], device=device)
        for b, e in enumerate(examples):
            features[b, : len(e.ids)] = e.features.to(device, torch.float32)
        anchors, keep = (t.to(device) for t in self.anchors(lengths.cpu(), starts.cpu(), generators))
        hidden = self.forward_blocks(ids, features, anchors, keep)  # [B, N, bs, H]
        where = anchors[:, :, None] + torch.arange(self.block, device=device)  # the position each slot predicts
        inside = where < lengths[:, None, None]
        labels = ids.gather(1, where.clamp(max=S - 1).view(B, -1)).view(where.shape)
        weight = (keep[:, :, None] & inside & (where >= starts[:, None, None])) * self.weights.to(device)
        rows = weight > 0
        ce = self.cross_entropy(hidden[rows], labels[rows])
        owner = torch.arange(B, device=device)[:, None, None].expand_as(rows)[rows]
        w = weight[rows]
        per = ce.new_zeros(B).index_add(0, owner, ce * w) / w.new_zeros(B).index_add(0, owner, w).clamp_min(1e-9)
        stats = {}
        if not torch.is_grad_enabled():
            stats = self.agreement(hidden, where, rows, examples)
        return per.sum(), stats

    def cross_entropy(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[R, H] rows and their target ids [R] -> [R] cross-entropy through the frozen lm_head (over the draft
        vocabulary's rows where one is set: a label outside it gives 0), chunked and recomputed in the
        backward so no [R, V] logits are kept."""
        mapped = draft_labels(labels, self.ids, self.full_size)

        def chunk(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            ce = F.cross_entropy(h @ self.rows.T.to(h.dtype), y.clamp_min(0), reduction="none")
            return ce * (y >= 0)

        parts = [checkpoint(chunk, h, y, use_reentrant=False) if torch.is_grad_enabled() else chunk(h, y)
                 for h, y in zip(hidden.split(CE_ROWS), mapped.split(CE_ROWS))]
        return torch.cat(parts) if parts else hidden.new_zeros(0)

    def agreement(self, hidden, where, rows, examples) -> dict:
        """acc_k: slot k's argmax (over the drafting vocabulary) against the target's greedy token at its
        position (`top` of the position before it), over the slots the loss weighs."""
        device = hidden.device
        tops = torch.zeros(where.shape[0], int(where.max()) + 1, dtype=torch.long, device=device)
        for b, e in enumerate(examples):
            n = min(len(e.ids), tops.shape[1])
            tops[b, :n] = e.top[:n].to(device)
        stats = {}
        for k in range(1, self.block):
            slot = rows[:, :, k]
            if not bool(slot.any()):
                continue
            draft = (hidden[:, :, k][slot] @ self.rows.T.to(hidden.dtype)).argmax(-1)
            if self.ids is not None:
                draft = self.ids.to(device)[draft]
            stats[f"acc_{k}"] = (draft == tops.gather(1, where[:, :, k] - 1)[slot]).float().cpu()
        return stats

    def save(self, out: Path) -> None:
        save_dflash(self.draft, self.config, out)

