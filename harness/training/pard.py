"""PARD recipe: an AR draft LM adapted into a parallel draft with conditional drop-token (COD) training
(AMD-AGI/PARD @ 6f279bf, `pard/pard_train.py`; `methods/pard.py` drafts with the result).

Upstream's parts, and where they are here:

- The starting point (`pard_train.py:25`, `model_name`: the AR draft, e.g. Qwen2.5-0.5B-Instruct): the
  model config's `drafts.sps` (the embedded model's: `drafts/smollm2-135m/draft-lm`, the suite's draft LM).
- The mask id (`pard_train.py:28`, `unused_tokenids[0]`; upstream's examples take a reserved special
  token, e.g. Llama-3's 128020): `--mask-token`, else `examples.choose_mask_token`: the highest-id added token of
  the tokenizer that no training text holds and is not its bos/eos/pad/unk (SmolLM2: a code-pretraining
  marker such as `<empty_output>`). Saved as `pard_token`, with `spd_type: "pard"` (`pard_train.py:29`).
- The labels (`pard_train.py:27, 62`: `DataCollatorForLanguageModeling(mlm=False)` with pad = eos):
  every token of prompt and answer, pad and the eos id set to -100 (`base_labels`).
- The parallel layout (`pard_train.py:64-85`, `parallel_layout`): with L the padded length and P
  `para_num`, the input is [x_0..x_{L-1} | mask x L | ... ] (P blocks), every block at positions
  0..L-1; block b's labels are the labels with the first b set to -100; the 4-D additive mask
  (`chain_visibility`, upstream's formula) lets slot (b, j) see x_0..x_{j-b} and the masks (b', j-b+b')
  for b' = 1..b: a real prefix then b masks, what the draft sees at inference. With the causal LM's
  shift, slot (b, j) learns x_{j+1}, b + 1 tokens after its last real token.
- COD (`pard_train.py:86-107`, `cod_keep`, `cod_collate`): block 0 kept whole; block i keeps
  int(L * max(r^i, r_min)) slots drawn at random among the successors of block i-1's kept ones (so every
  kept slot's chain of masks is kept), r = 0.7 and r_min = 0.2 (`example_*.yaml:8-9`); one draw per
  batch, as upstream's collator; the labels pre-shifted, selected and shifted back so that the model's
  shift still pairs each kept slot with its own label.
- `para_num` 8 (`example_qwen.yaml:6`): `--para-num`.

Differences: upstream fine-tunes every weight (TRL SFTTrainer, lr 3e-5 constant, bf16); the suite's
own drafts share the target's embeddings and lm_head (frozen, left out of the file), so here the draft's
decoder layers and final norm are trained (a Hub draft that has its own embeddings trains them too), in
fp32, with the loop's AdamW and warm-up + cosine schedule (`loop.py`). The loss is the mean
cross-entropy of an example's kept labels (over the model config's reduced draft vocabulary where it
names one, labels outside it left out of the loss, as the draft LM's recipe), summed over a step's
examples, as every recipe's. Held-out `acc_k` (no COD: every slot): draft position k's top-1 against
the target's own argmax k - 1 tokens after the last real token, over answer positions.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from methods.models.loading import SHARED_KEY

from .examples import Example, draft_labels, mean_cross_entropy, pad_batch

PARA_NUM = 8  # upstream's para_num (config/train/example_*.yaml:6)
RETENTION, RETENTION_MIN = 0.7, 0.2  # down_sample_ration, down_sample_ration_min (example_*.yaml:8-9)
IGNORE = -100


def chain_visibility(length: int, para_num: int) -> torch.Tensor:
    """[P L, P L] bool, upstream's mask (`pard_train.py:71-77`) as written there: query row r sees
    column c when c == r, or c == r - i (L + 1) for some block offset i, or (c <= r - i L - i and
    r < (i + 1) L). Row (b, j) sees x_0..x_{j-b} and the masks (b', j-b+b'), b' = 1..b."""
    size = length * para_num
    rows, cols = torch.arange(size)[:, None], torch.arange(size)[None, :]
    visible = cols == rows
    for i in range(para_num):
        visible |= cols == rows - length * i - i
        visible |= (cols < rows - i * length - (i - 1)) & (rows < (i + 1) * length)
    return visible


def base_labels(ids: torch.Tensor, lengths: torch.Tensor, ignore_ids=()) -> torch.Tensor:
    """[B, L] labels as upstream's collator makes them: the ids, with padding (past each length) and the
    ids `ignore_ids` (upstream's pad = eos) set to -100."""
    labels = ids.clone()
    labels[torch.arange(ids.shape[1], device=ids.device)[None] >= lengths[:, None]] = IGNORE
    for token in ignore_ids:
        labels[ids == token] = IGNORE
    return labels


def parallel_layout(ids: torch.Tensor, labels: torch.Tensor, para_num: int, mask_id: int) -> dict:
    """Every block, nothing dropped (`pard_train.py:80-85`): input_ids and labels [B, P L], position_ids
    [B, P L] (each block 0..L-1) and `visible` [P L, P L] (`chain_visibility`)."""
    batch, length = ids.shape
    blocks = [ids] + [torch.full_like(ids, mask_id) for _ in range(para_num - 1)]
    shifted = [torch.cat([torch.full_like(labels[:, :b], IGNORE), labels[:, b:]], 1) for b in range(para_num)]
    return {"input_ids": torch.cat(blocks, 1), "labels": torch.cat(shifted, 1),
            "position_ids": torch.arange(length, device=ids.device).repeat(para_num)[None].expand(batch, -1),
            "visible": chain_visibility(length, para_num).to(ids.device)}


def cod_keep(length: int, para_num: int, retention: float = RETENTION, minimum: float = RETENTION_MIN,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """[P, L] bool: the slots COD keeps (`pard_train.py:88-97`). Block 0 whole; block i keeps
    int(L * max(r^i, r_min)) slots drawn among the successors (j + 1 mod L) of block i-1's kept ones;
    none once a count is 0 (and every later block then none)."""
    keep = torch.zeros(para_num, length, dtype=torch.bool)
    keep[0] = True
    previous = torch.arange(length)
    for i in range(1, para_num):
        count = int(length * max(retention ** i, minimum))
        if count == 0:
            break
        chosen = previous[torch.randperm(len(previous), generator=generator)[:count]]
        keep[i, chosen] = True
        previous = (chosen + 1) % length
    return keep


def cod_collate(ids: torch.Tensor, labels: torch.Tensor, para_num: int, mask_id: int,
                retention: float = RETENTION, minimum: float = RETENTION_MIN,
                generator: torch.Generator | None = None) -> dict:
    """One batch as upstream's collator returns it: the parallel layout, COD-sampled unless r = 1 or
    P = 1 (`pard_train.py:87`); `attention_mask` [B, 1, N, N] additive float (0 seen, float32's min
    hidden), labels rolled so that the causal LM's shift pairs each kept slot with its own label
    (`pard_train.py:105`)."""
    layout = parallel_layout(ids, labels, para_num, mask_id)
    visible = layout.pop("visible")
    if retention != 1 and para_num > 1:
        index = cod_keep(ids.shape[1], para_num, retention, minimum, generator).reshape(-1).nonzero()[:, 0]
        index = index.to(ids.device)
        layout["labels"] = torch.roll(torch.roll(layout["labels"], -1, 1)[:, index], 1, 1)
        layout["input_ids"], layout["position_ids"] = layout["input_ids"][:, index], layout["position_ids"][:, index]
        visible = visible[index][:, index]
    mask = torch.full(visible.shape, torch.finfo(torch.float32).min, device=ids.device)
    mask.masked_fill_(visible, 0.0)
    layout["attention_mask"] = mask[None, None].expand(ids.shape[0], 1, -1, -1)
    return {key: value.contiguous() for key, value in layout.items()}


class PardRecipe:
    kind = "pard"
    on_gpu = True  # batch_loss places each batch where the recipe is (`distributed.place`)

    def __init__(self, target, draft, mask_id: int, para_num: int = PARA_NUM, vocabulary=None, ignore_ids=(),
                 retention: float = RETENTION, minimum: float = RETENTION_MIN):
        """`draft`: the AR draft LM to adapt (`load_draft_lm`: the suite's own share the target's embeddings and
        lm_head, which stay frozen and are left out of the file; a Hub draft's are trained and saved)."""
        self.shared = list(getattr(draft.config, SHARED_KEY, None) or [])
        self.model = copy.deepcopy(draft).float().train()
        self.model.requires_grad_(not self.shared)
        if self.shared:
            for module in (self.model.model.layers, self.model.model.norm):
                module.requires_grad_(True)
        self.target, self.mask_id, self.para_num = target, int(mask_id), para_num
        self.ignore_ids, self.retention, self.minimum = tuple(ignore_ids), retention, minimum
        self.ids = None if vocabulary is None else vocabulary.ids
        self.full_size = self.model.lm_head.weight.shape[0]

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def rows(self) -> torch.Tensor:
        """The lm_head rows the loss projects onto: all, or the reduced draft vocabulary's."""
        weight = self.model.lm_head.weight
        return weight if self.ids is None else weight[self.ids.to(weight.device)]

    def _top(self, example: Example) -> torch.Tensor:
        if example.top is None:
            with torch.no_grad():
                device = self.target.get_input_embeddings().weight.device
                example.top = self.target(input_ids=example.ids[None].to(device)).logits[0].argmax(-1).cpu()
        return example.top

    def hidden(self, batch: dict) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        return self.model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                attention_mask=batch["attention_mask"].to(dtype)).last_hidden_state

    def batch_loss(self, examples: list[Example], noise: float, generators) -> tuple[torch.Tensor, dict]:
        """The sum over `examples` of each one's mean cross-entropy over its kept labels (one COD draw for
        the batch, from the first example's generator); without gradients, the held-out agreement."""
        if not torch.is_grad_enabled():
            return self.held_out(examples)
        device = self.model.lm_head.weight.device
        ids, lengths, _, _ = pad_batch(examples, device=device)
        generator = next((g for g in generators if g is not None), None)
        batch = cod_collate(ids, base_labels(ids, lengths, self.ignore_ids), self.para_num, self.mask_id,
                            self.retention, self.minimum, generator)
        hidden = self.hidden(batch)[:, :-1]
        labels = batch["labels"][:, 1:]  # the causal LM's shift
        valid = labels != IGNORE
        owner = torch.arange(len(examples), device=device)[:, None].expand_as(valid)[valid]
        logits = hidden[valid].float() @ self.rows().T.float()
        targets = draft_labels(labels[valid], self.ids, self.full_size)
        return mean_cross_entropy(logits, targets, owner, len(examples)).sum(), {}

    def held_out(self, examples: list[Example]) -> tuple[torch.Tensor, dict]:
        """`acc_k` per example and slot, every slot (no COD): slot (k-1, j) proposes token j + 1 from the
        real prefix x_0..x_{j-k+1}; counted where that prefix reaches the prompt's end and token j + 1 is an
        answer token; compared with the target's argmax after x_0..x_j."""
        device = self.model.lm_head.weight.device
        hits: dict[str, list[torch.Tensor]] = {f"acc_{k}": [] for k in range(1, self.para_num + 1)}
        for example in examples:  # one at a time: the full layout is P times the example's length
            ids = example.ids[None].to(device)
            length = ids.shape[1]
            batch = cod_collate(ids, base_labels(ids, torch.tensor([length], device=device)), self.para_num,
                                self.mask_id, retention=1.0)
            logits = self.hidden(batch)[0].float() @ self.rows().T.float()  # [P L, V or K]
            draft = logits.argmax(-1)
            draft = draft if self.ids is None else self.ids.to(device)[draft]
            top = self._top(example).to(device)
            for b in range(self.para_num):
                j = torch.arange(max(b, example.answer_start - 1 + b), length - 1, device=device)
                hits[f"acc_{b + 1}"].append((draft[b * length + j] == top[j]).float().cpu())
        return torch.zeros(()), {key: torch.cat(values) for key, values in hits.items()}

    def save(self, out: Path) -> None:
        """The suite's format (the trained tensors, config.json naming the shared ones) or, for a draft with its
        own embeddings, the released one (`save_pretrained`); `pard_token` and `spd_type` in config.json."""
        self.model.config.pard_token = self.mask_id
        self.model.config.spd_type = "pard"
        if not self.shared:
            self.model.save_pretrained(out)
            return
        state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in self.model.state_dict().items()
                 if k not in self.shared and k != "lm_head.weight"}
        save_file(state, str(out / "model.safetensors"))
        config = self.model.config.to_dict()
        config["torch_dtype"] = "bfloat16"
        config[SHARED_KEY] = self.shared
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
