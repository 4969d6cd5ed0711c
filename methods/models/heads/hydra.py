"""Hydra heads (zankner/Hydra, arXiv 2402.05109): Medusa-style heads on the target's last hidden
state made sequentially dependent ("grounded"), and Hydra++'s prefix layer.

    head i (0-based) predicts the token i+2 positions after the last verified one, x_{t+2+i}:
      grounded:    input = concat(h_t, e(x_{t+1}), ..., e(x_{t+1+i}))          [H * (i+2)]
                   ResBlock(H*(i+2) -> H) = res_connection(x) + SiLU(linear(x))   (res_connection: Linear)
      ungrounded:  input = h_t, ResBlock(H) = x + SiLU(linear(x))
      then hydra_num_layers - 1 ResBlock(H), then hydra_lm_head[i]: Linear(H -> V, bias=True)
    e = the target's input embeddings; x_{t+1} is the root (the target's own next token).

`prefix-mlp` (Hydra++): h_t is first replaced by norm(LlamaDecoderLayer(h)_t), one Llama decoder
layer (the target's shapes, causal, its own KV cache over the accepted sequence) and a final RMSNorm
over the target's hidden states: upstream's `prefix_embeding_layer`, a one-layer `LlamaModel`. Its
rotary base is the target's rope_theta (upstream's modified Llama fixes 10000, its Vicuna targets' value).

Released format (`HydraModel.hydra_head.state_dict()` saved as `hydra_lm_head.pt`, upstream
`hydra/train/train.py`), keys by architecture (upstream `hydra/model/hydra_heads/`):
  mlp:        hydra_mlp.{i}.{j}.linear.{weight,bias}, hydra_mlp.{i}.0.res_connection.{weight,bias}
              (grounded), hydra_lm_head.{i}.{weight,bias}
  prefix-mlp: Dropouts sit at the even indices: hydra_mlp.{i}.{2j+1}.linear.*, hydra_mlp.{i}.1.res_connection.*,
              hydra_lm_head.{i}.1.{weight,bias}, prefix_embeding_layer.layers.0.* and prefix_embeding_layer.norm.weight
Upstream builds the later ResBlocks of a head as ONE module repeated (`[ResBlock(H)] * (n - 1)`), so
they share weights and the file repeats the same tensors under each index; the loader reads each
index into its own block, which computes the same. Released files also hold `input_embed_fn.weight`
(the target's embeddings) and `prefix_embeding_layer.embed_tokens.weight` (unused): ignored, the
target's embeddings are used. `config.json`: hydra_num_heads, hydra_num_layers, hydra_head_arch,
grounded_heads, hidden_state_offset (0: the last hidden state after the final norm; k > 0: the
hidden state entering the target's layer L-k, upstream's `hidden_states[-(k+1)]`),
base_model_name_or_path. Supported architectures: mlp, prefix-mlp (cross-attn and eagle-attn are not).

This suite's own trained heads may leave the vocab projections out (then each head projects
through the target's lm_head, bias zero) or keep only the rows of a reduced draft vocabulary: the
weight is then [K, H], its bias [K], and the file holds `draft_ids` [K] (the target ids of the rows).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from ..specs import ModelSpec
from .checkpoints import checkpoint_folder, read_config, read_state_dict
from .medusa import count_heads_and_layers

WEIGHT_FILES = ("hydra_lm_head.pt", "hydra_lm_head.safetensors")
ARCHS = ("mlp", "prefix-mlp")


class ResBlock(nn.Module):
    """upstream `ResBlock(hidden_size, num_condition)`: res_connection(x) + SiLU(linear(x)); the
    residual is a Linear when the input is wider than H (num_condition > 0), else the identity."""

    def __init__(self, hidden_size: int, num_condition: int = 0):
        super().__init__()
        width = hidden_size * (num_condition + 1)
        self.linear = nn.Linear(width, hidden_size)
        self.res_connection = nn.Linear(width, hidden_size) if num_condition > 0 else nn.Identity()
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_connection(x) + self.act(self.linear(x))


def _llama_config(target_config):
    fields = {k: v for k, v in target_config.to_dict().items()
              if k not in ("architectures", "model_type", "transformers_version", "layer_types", "auto_map")}
    fields["num_hidden_layers"] = 1
    fields["attention_bias"] = False
    cfg = LlamaConfig(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


class PrefixLayer(nn.Module):
    """Hydra++'s `prefix_embeding_layer`: one Llama decoder layer (input norm, attention, post norm,
    MLP) and a final RMSNorm, over the target's hidden states. Keys: layers.0.*, norm.weight."""

    def __init__(self, target_config):
        super().__init__()
        # lazy: transformers' model code, slow to import: not to check a config
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        config = _llama_config(target_config)
        self.config = config
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """hidden [n, H] (or [b, n, H]) at `positions` [n] -> [same]; causal over `cache` + these rows."""
        x = hidden if hidden.dim() == 3 else hidden[None]
        position_ids = positions.view(1, -1)
        if mask is None and cache is None and x.shape[1] > 1:
            n = x.shape[1]
            mask = torch.zeros(1, 1, n, n, dtype=x.dtype, device=x.device).masked_fill_(
                ~torch.ones(n, n, dtype=torch.bool, device=x.device).tril_(), torch.finfo(x.dtype).min)
        x = self.layers[0](x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                           use_cache=cache is not None, position_embeddings=self.rotary_emb(x, position_ids))
        x = self.norm(x)
        return x if hidden.dim() == 3 else x[0]


class HydraHeads(nn.Module):
    """The heads of one Hydra checkpoint, with upstream's module names (so `state_dict` keys are the
    released ones). `tie_blocks=True` repeats one ResBlock for a head's later layers as upstream does
    (training); the loader builds them untied (the released tensors are equal anyway)."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, arch: str = "mlp",
                 grounded: bool = True, target_config=None, dropout: float = 0.0, tie_blocks: bool = False):
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"Hydra head architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")
        if num_layers < 1 or num_heads < 1:
            raise ValueError(f"Hydra needs at least one head and one layer per head; got {num_heads}, {num_layers}")
        self.arch, self.grounded = arch, grounded
        self.num_heads, self.num_layers, self.hidden_size = num_heads, num_layers, hidden_size
        prefix = arch == "prefix-mlp"

        def blocks(i: int) -> list[nn.Module]:
            first = ResBlock(hidden_size, i + 1 if grounded else 0)
            later = [ResBlock(hidden_size) for _ in range(num_layers - 1)]
            if tie_blocks and later:
                later = [later[0]] * len(later)
            if not prefix:
                return [first, *later]
            # upstream HydraPrefixMLP: Dropout before every block
            drop = nn.Dropout(dropout)
            return [drop, first, *[m for block in later for m in (drop, block)]]

        self.hydra_mlp = nn.ModuleList(nn.Sequential(*blocks(i)) for i in range(num_heads))
        if prefix:
            self.hydra_lm_head = nn.ModuleList(
                nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden_size, vocab_size)) for _ in range(num_heads))
            self.prefix_embeding_layer = PrefixLayer(target_config)
        else:
            self.hydra_lm_head = nn.ModuleList(nn.Linear(hidden_size, vocab_size) for _ in range(num_heads))
        self.register_buffer("draft_ids", None)  # target ids of the projection's rows when reduced

    # ---------------------------------------------------------------------------------------
    def projection(self, i: int) -> nn.Linear:
        head = self.hydra_lm_head[i]
        return head[-1] if isinstance(head, nn.Sequential) else head

    def features(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Head i's hidden state from its input (concat(h, e(...)) when grounded, else h)."""
        return self.hydra_mlp[i](x)

    def logits(self, i: int, features: torch.Tensor) -> torch.Tensor:
        """Head i's logits over its projection's rows (all V, or the K rows of `draft_ids`)."""
        return self.hydra_lm_head[i](features)

    def base(self, hidden: torch.Tensor, positions: torch.Tensor | None = None, mask=None, cache=None) -> torch.Tensor:
        """What the heads read as h: the target's hidden states, through the prefix layer for prefix-mlp."""
        if self.arch != "prefix-mlp":
            return hidden
        if positions is None:
            positions = torch.arange(hidden.shape[-2], device=hidden.device)
        return self.prefix_embeding_layer(hidden, positions, mask, cache)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Teacher-forced, as upstream's training forward. hidden [T, H] (the target's, whole
        sequence), embeds [T, H] (the target's embeddings of the same tokens). Returns per head i
        logits [T, V']: row t reads h_t and e(x_{t+1..t+1+i}) (rows past the end read embeddings
        wrapped around, as upstream's torch.roll; callers drop them) and predicts x_{t+2+i}."""
        h = self.base(hidden)
        out = []
        for i in range(self.num_heads):
            if self.grounded:
                x = torch.cat([h, *[torch.roll(embeds, -(j + 1), 0) for j in range(i + 1)]], -1)
            else:
                x = h
            out.append(self.logits(i, self.features(i, x)))
        return out


def load_hydra_heads(spec: ModelSpec, target_model) -> tuple[HydraHeads, dict]:
    """The heads of a Hydra checkpoint folder (or Hub id) and its config.json."""
    folder = checkpoint_folder(spec, WEIGHT_FILES)
    config = read_config(folder)
    if not config:
        raise ValueError(
            f"{folder}: config.json missing (a Hydra checkpoint has hydra_num_heads, hydra_head_arch, ...)"
        )
    arch = config.get("hydra_head_arch", "mlp")
    if arch not in ARCHS:
        raise ValueError(f"{spec.describe()}: Hydra head architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHS)}")
    state, file = read_state_dict(folder, WEIGHT_FILES)
    state = {k: v for k, v in state.items()
             if not k.startswith(("input_embed_fn.", "prefix_embeding_layer.embed_tokens."))
             and not k.endswith("inv_freq")}
    grounded = bool(config.get("grounded_heads", False))
    num_heads, num_layers = count_heads_and_layers(state, prefix="hydra_mlp.", kind="Hydra")
    declared = config.get("hydra_num_heads")
    if declared is not None and declared != num_heads:
        raise ValueError(f"{spec.describe()}: config.json says hydra_num_heads={declared}, the weights hold "
                         f"{num_heads} heads")
    if config.get("hydra_num_layers", num_layers) != num_layers:
        raise ValueError(f"{spec.describe()}: config.json says hydra_num_layers={config['hydra_num_layers']}, "
                         f"the weights hold {num_layers} blocks per head")
    embed = target_model.get_input_embeddings()
    lm_head = target_model.get_output_embeddings()
    hidden, vocab = lm_head.in_features, lm_head.out_features
    width = state["hydra_mlp.0.0.linear.weight" if arch == "mlp" else "hydra_mlp.0.1.linear.weight"].shape
    if width[0] != hidden:
        raise ValueError(f"Hydra heads {spec.describe()} have hidden size {width[0]}, the target {hidden}: "
                         f"they were trained for another model")
    if grounded != (width[1] == 2 * hidden):
        raise ValueError(f"{spec.describe()}: config.json says grounded_heads={grounded} but head 0 reads {width[1]} "
                         f"inputs (H={hidden})")
    draft_ids = state.pop("draft_ids", None)
    rows = vocab if draft_ids is None else draft_ids.numel()
    heads = HydraHeads(num_heads, num_layers, hidden, rows, arch, grounded, target_model.config)
    proj = "hydra_lm_head.{}.weight" if arch == "mlp" else "hydra_lm_head.{}.1.weight"
    shared = [i for i in range(num_heads) if proj.format(i) not in state]
    if shared and draft_ids is not None:
        raise ValueError(f"{spec.describe()}: draft_ids given but head {shared[0]}'s vocab projection is missing")
    for i in shared:  # projection left out of the file: the target's lm_head (tied below), no bias
        state[proj.format(i)] = lm_head.weight.detach()
        state[proj.format(i).replace(".weight", ".bias")] = torch.zeros(vocab)
    missing, unexpected = heads.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"{folder / file}: not a Hydra {arch} checkpoint (missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]})")
    param = next(target_model.parameters())
    heads = heads.to(param.device).eval().requires_grad_(False)
    for weight in heads.parameters():
        weight.data = weight.data.to(param.dtype)
    for i in shared:
        heads.projection(i).weight = lm_head.weight
    if draft_ids is not None:
        heads.draft_ids = draft_ids.long().to(param.device)
    object.__setattr__(heads, "embed", embed)  # the target's embeddings, read for grounding (not a submodule)
    return heads, {**config, "hydra_num_heads": num_heads, "hydra_num_layers": num_layers}
