"""Recipes that train the suite's own drafts for a target by self-distillation.

    python -m harness.train_drafts data    --model smollm2-135m      # prompts + the target's answers
    python -m harness.train_drafts draft-lm|eagle|medusa --model smollm2-135m

Each recipe is seeded, logs its loss to `<out>/train_log.jsonl`, writes its weights in the format
its loader reads (tensors that copy the target's, embeddings and lm_head, left out: the loaders
fill them from the target) and a model card `<out>/README.md` with the data, steps, final loss and
the measured teacher-forced acceptance on held-out prompts.

- draft LM (SpS, MCSD): the target's first `layers` decoder layers + final norm, fine-tuned to
  predict the target's greedy tokens; embeddings and lm_head are the target's (frozen, tied).
- EAGLE head: fc over [embedding; feature] + one decoder layer (initialized from the target's last
  layer with its residual branches zeroed, so it starts by predicting f_{i+1} = f_i), trained as in
  EAGLE: smooth-L1 on the next feature (per dimension in units of its spread: SmolLM2 has a few
  massive-activation dimensions that would otherwise dominate) + cross-entropy of the target's
  next-token distribution through the frozen lm_head (weight 1.0 where EAGLE uses 0.1: slightly
  better in a 30-step trial), with uniform noise on the input features. (EAGLE's own form, the
  unscaled regression from the target's last layer as is, reached only 0.08 held-out agreement in 380 steps.)
- Medusa heads: `heads` ResBlocks on the last hidden state, head k trained on the target's token
  k+2 ahead (loss weight 0.8^k), vocab projection frozen to the target's lm_head and left out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# Data


@dataclass
class Example:
    ids: torch.Tensor  # [T] prompt + answer
    answer_start: int
    hidden: torch.Tensor | None = None  # [T, H] target's last hidden state (after the final norm)


def load_examples(file: Path) -> list[Example]:
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [Example(torch.tensor(r["ids"]), r["answer_start"]) for r in rows if len(r["ids"]) > r["answer_start"] + 2]


@torch.no_grad()
def attach_hidden(target, examples: list[Example], cache: Path | None = None, progress: bool = False) -> None:
    """The target's last hidden states of every example (EAGLE and Medusa train on them). With a
    `cache` file they are computed once and reused by the next recipe when the examples match."""
    from tqdm import tqdm

    if cache is not None and cache.is_file():
        stored = torch.load(cache)
        if len(stored["ids"]) == len(examples) and all(torch.equal(a, e.ids) for a, e in zip(stored["ids"], examples)):
            for example, hidden in zip(examples, stored["hidden"]):
                example.hidden = hidden
            return
    for example in tqdm(examples, desc="target hidden states", unit="example", disable=not progress):
        if example.hidden is None:
            example.hidden = target.model(input_ids=example.ids[None]).last_hidden_state[0].float()
    if cache is not None:
        torch.save({"ids": [e.ids for e in examples], "hidden": [e.hidden for e in examples]}, cache)


def split(examples: list[Example], held_out: float, seed: int) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(examples) * held_out)) if len(examples) > 1 else 0
    return [examples[i] for i in order[n_val:]], [examples[i] for i in order[:n_val]]


def feature_spread(examples: list[Example]) -> torch.Tensor:
    """[H] standard deviation of each dimension of the target's hidden states over the examples."""
    return torch.cat([e.hidden for e in examples]).std(0)


def answer_mask(example: Example, offset: int) -> torch.Tensor:
    """[T - offset] bool: position t predicts token t + offset, which belongs to the answer."""
    t = torch.arange(len(example.ids) - offset)
    return t + offset >= example.answer_start


# --------------------------------------------------------------------------------------------
# The three kinds


class DraftLMRecipe:
    kind = "draft-lm"

    def __init__(self, target, layers: int):
        import copy

        from methods.loading import truncated_copy

        # truncated_copy shares the target's tensors: copy them before training the layers
        self.model = copy.deepcopy(truncated_copy(target, layers)).float().train()
        self.model.requires_grad_(False)
        for module in (self.model.model.layers, self.model.model.norm):
            module.requires_grad_(True)
        self.layers = layers

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        hidden = self.model.model(input_ids=example.ids[None]).last_hidden_state[0, :-1]
        mask = answer_mask(example, 1)
        logits = self.model.lm_head(hidden[mask]).float()  # the vocab projection on answer positions only
        labels = example.ids[1:][mask]
        loss = F.cross_entropy(logits, labels)
        correct = (logits.argmax(-1) == labels).float()
        return loss, {"acc_1": correct}

    def save(self, out: Path) -> None:
        from safetensors.torch import save_file

        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.model.state_dict().items()
                 if k.startswith(("model.layers.", "model.norm."))}
        save_file(state, str(out / "model.safetensors"))
        config = self.model.config.to_dict()
        config["torch_dtype"] = "bfloat16"
        config["decodebench_shared_with_target"] = ["model.embed_tokens.weight", "lm_head.weight"]
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))


class EagleRecipe:
    kind = "eagle"

    def __init__(self, target, seed: int, cls_weight: float = 0.1, feature_scale: torch.Tensor | None = None):
        from methods.heads.eagle import EagleHead, head_config
        from methods.heads.random_init import eagle_config

        self.target = target
        self.cls_weight = cls_weight
        # the regression is measured per feature dimension in units of its spread: a few
        # "massive activation" dimensions (tens of times the others in SmolLM2) would dominate it
        self.feature_scale = feature_scale
        self.config_dict = eagle_config(target)
        self.head = EagleHead(head_config(self.config_dict, qkv_bias=False), fc_bias=True).float()
        last = target.model.layers[-1]
        layer = self.head.layers[0]
        layer.self_attn.load_state_dict(last.self_attn.state_dict())
        layer.mlp.load_state_dict(last.mlp.state_dict())
        layer.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
        hidden = self.config_dict["hidden_size"]
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.head.fc.weight.copy_(torch.cat([torch.randn(hidden, hidden, generator=generator) * 0.01,
                                                 torch.eye(hidden)], dim=1))
            self.head.fc.bias.zero_()
            # the layer's residual branches start at zero: the head starts by predicting f_{i+1} = f_i
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        self.head.embed_tokens.weight = target.get_input_embeddings().weight  # frozen, shared
        self.head.requires_grad_(True)
        self.head.embed_tokens.requires_grad_(False)
        self.lm_head = target.get_output_embeddings()
        self.head.train()

    def parameters(self):
        return [p for p in self.head.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        # pair i = (token i+1, feature i) at position i predicts feature i+1 and token i+2
        features = example.hidden[:-1]
        if noise:
            scale = features.std()
            features = features + (torch.rand(features.shape, generator=generator) - 0.5) * 2 * noise * scale
        n = len(features)
        tokens = example.ids[1:]
        positions = torch.arange(n)
        mask = torch.full((n, n), float("-inf")).triu_(1)[None, None]
        predicted = self.head(tokens, features, positions, mask, None)[:-1]  # pairs 0..n-2
        wanted = example.hidden[1:n]
        keep = answer_mask(example, 2)
        scale = 1.0 if self.feature_scale is None else self.feature_scale
        reg = F.smooth_l1_loss(predicted[keep] / scale, wanted[keep] / scale)
        logits = self.lm_head(predicted[keep]).float()
        with torch.no_grad():
            target_probs = self.lm_head(wanted[keep]).float().softmax(-1)
        cls = -(target_probs * logits.log_softmax(-1)).sum(-1).mean()
        correct = (logits.argmax(-1) == example.ids[2:][keep]).float()
        return reg + self.cls_weight * cls, {"acc_1": correct, "reg": reg.detach(), "cls": cls.detach()}

    def save(self, out: Path) -> None:
        state = {k: v.detach().to(torch.bfloat16).clone() for k, v in self.head.state_dict().items()
                 if not k.startswith(("embed_tokens.", "rotary_emb."))}
        torch.save(state, out / "pytorch_model.bin")
        (out / "config.json").write_text(json.dumps(self.config_dict, indent=2))


class MedusaRecipe:
    kind = "medusa"

    def __init__(self, target, heads: int):
        from methods.heads.medusa import MedusaHeads

        lm_head = target.get_output_embeddings()
        self.heads = MedusaHeads(heads, 1, lm_head.in_features, lm_head.out_features).float()
        with torch.no_grad():
            for head in self.heads:  # Medusa's init: the ResBlock starts as the identity
                head[0].linear.weight.zero_()
                head[0].linear.bias.zero_()
                head[-1].weight = lm_head.weight
        self.heads.requires_grad_(True)
        for head in self.heads:
            head[-1].requires_grad_(False)
        self.heads.train()

    def parameters(self):
        return [p for p in self.heads.parameters() if p.requires_grad]

    def loss(self, example: Example, noise: float, generator) -> tuple[torch.Tensor, dict]:
        total, stats = 0.0, {}
        for k, head in enumerate(self.heads):
            offset = k + 2
            if len(example.ids) <= offset:
                break
            keep = answer_mask(example, offset)
            if not keep.any():
                continue
            logits = head(example.hidden[:-offset][keep]).float()
            labels = example.ids[offset:][keep]
            total = total + 0.8 ** k * F.cross_entropy(logits, labels)
            stats[f"acc_{k + 1}"] = (logits.argmax(-1) == labels).float()
        return total, stats

    def save(self, out: Path) -> None:
        state = {k: v.detach().float().clone() for k, v in self.heads.state_dict().items()
                 if not k.endswith(f".{self.heads.num_layers}.weight")}
        torch.save(state, out / "medusa_lm_head.pt")
        config = {"medusa_num_heads": len(self.heads), "medusa_num_layers": self.heads.num_layers,
                  "base_model_name_or_path": "smollm2-135m (the suite's embedded default)"}
        (out / "config.json").write_text(json.dumps(config, indent=2))


# --------------------------------------------------------------------------------------------
# One training loop for all kinds


def evaluate(recipe, examples: list[Example]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for example in examples:
            _, stats = recipe.loss(example, 0.0, None)
            for key, value in stats.items():
                if key.startswith("acc_"):
                    sums.setdefault(key, [0.0, 0.0])
                    sums[key][0] += float(value.sum())
                    sums[key][1] += value.numel()
    return {k: s / max(n, 1) for k, (s, n) in sorted(sums.items())}


def train(recipe, train_set: list[Example], val_set: list[Example], epochs: float, lr: float, seed: int,
          log_file: Path, batch: int = 8, noise: float = 0.0, progress: bool = True) -> dict:
    from tqdm import tqdm

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    params = recipe.parameters()
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps = max(1, math.ceil(epochs * len(train_set) / batch))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    order_rng = random.Random(seed)
    order: list[int] = []
    losses = []
    started = time.perf_counter()
    with log_file.open("w") as log:
        for step in tqdm(range(steps), desc=f"train {recipe.kind}", unit="step", disable=not progress):
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for _ in range(batch):
                if not order:
                    order = list(range(len(train_set)))
                    order_rng.shuffle(order)
                loss, _ = recipe.loss(train_set[order.pop()], noise, generator)
                (loss / batch).backward()
                step_loss += float(loss.detach()) / batch
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(step_loss)
            log.write(json.dumps({"step": step + 1, "loss": round(step_loss, 5), "lr": schedule.get_last_lr()[0],
                                  "seconds": round(time.perf_counter() - started, 1)}) + "\n")
            log.flush()
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": steps, "batch": batch, "final_loss": sum(tail) / len(tail),
            "seconds": time.perf_counter() - started, "held_out_acceptance": evaluate(recipe, val_set)}


def model_card(out: Path, kind: str, args, data_file: Path, n_train: int, n_val: int, result: dict, before: dict) -> None:
    acc = ", ".join(f"{k.replace('acc_', 'position ')}: {v:.3f}" for k, v in result["held_out_acceptance"].items())
    acc_before = ", ".join(f"{k.replace('acc_', 'position ')}: {v:.3f}" for k, v in before.items())
    text = f"""# {kind} for {args.model}

Trained by `python -m harness.train_drafts {kind} --model {args.model} --seed {args.seed}` (`make train-drafts`).

- **Data**: self-distillation. {n_train} training and {n_val} held-out conversations from
  `{data_file.relative_to(ROOT) if data_file.is_relative_to(ROOT) else data_file}`: prompts generated
  by `harness/distill.py` from its own templates and from text shipped with Python (the language reference in
  `pydoc_data`, standard-library docstrings), checked disjoint from the Spec-Bench questions; answers
  are the target's own greedy outputs (up to {args.max_new_tokens} new tokens). Loss on answer tokens only.
- **Training**: {result['steps']} steps of {result['batch']} conversations, AdamW lr {args.lr}, cosine schedule,
  seed {args.seed}, {result['seconds'] / 60:.1f} min on {_machine()}. Log: `train_log.jsonl`.
- **Final loss** (mean of the last 10% of steps): {result['final_loss']:.4f}
- **Teacher-forced top-1 agreement with the target** on the held-out answers (the greedy acceptance
  rate of each draft position given a correct prefix): {acc}. Before training: {acc_before}.
- Weights that copy the target's (token embeddings, lm_head) are not in the file; the loader takes
  them from the target.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps({"kind": kind, "args": vars(args) | {"out": str(args.out)},
                                                    "train": n_train, "held_out": n_val, **result,
                                                    "held_out_acceptance_before": before}, indent=2, default=str))


def _machine() -> str:
    from .environment import cpu_name

    return f"{cpu_name()} ({torch.get_num_threads()} threads), torch {torch.__version__}"


# --------------------------------------------------------------------------------------------
# CLI


def load_target(model_name: str, dtype: torch.dtype = torch.float32):
    from methods.loading import ModelSpec, load_model, load_tokenizer, model_config

    cfg = model_config(model_name)
    spec = ModelSpec.from_mapping(cfg)
    return cfg, load_model(spec, dtype, torch.device("cpu")), load_tokenizer(spec)


DEFAULTS = {  # kind: (epochs, lr, batch, noise)
    "draft-lm": (4.0, 1e-3, 8, 0.0),
    "eagle": (4.0, 3e-4, 8, 0.1),
    "medusa": (1.0, 1e-3, 8, 0.0),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["data", *DEFAULTS])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=800)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--distill-batch", type=int, default=32, help="prompts per batched generate")
    parser.add_argument("--data", type=Path, default=None, help="default: data/distill/<model>/answers.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="default: drafts/<model>/<kind>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=float, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--layers", type=int, default=2, help="draft LM: decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="Medusa: number of heads")
    parser.add_argument("--held-out", type=float, default=0.05)
    parser.add_argument("--questions", type=Path, default=ROOT.parent / "shared/data/spec_bench/question.jsonl",
                        help="evaluation questions the prompts must not overlap")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    data_file = args.data or ROOT / "data" / "distill" / args.model / "answers.jsonl"
    cfg, target, tokenizer = load_target(args.model)

    if args.kind == "data":
        from .distill import check_disjoint, self_distill, training_prompts
        from .prompts import ChatTemplate

        prompts = training_prompts(args.prompts, args.seed)
        for question_file in (args.questions, ROOT / "tests" / "fixtures" / "spec_bench_sample.jsonl"):
            if question_file.is_file():
                check_disjoint(prompts, question_file)
                print(f"{len(prompts)} prompts, none overlapping {question_file}")
        template = ChatTemplate.for_model(cfg, tokenizer)
        data_file.parent.mkdir(parents=True, exist_ok=True)
        journal = data_file.with_suffix(".partial.jsonl")  # survives an interrupted run; a rerun resumes
        records = self_distill(target, template, prompts, args.max_new_tokens, args.distill_batch, journal=journal)
        data_file.write_text("".join(json.dumps(r) + "\n" for r in records))
        journal.unlink()
        tokens = sum(len(r["ids"]) - r["answer_start"] for r in records)
        print(f"wrote {data_file}: {len(records)} answers, {tokens} answer tokens")
        return

    if not data_file.is_file():
        raise SystemExit(f"no training data at {data_file}: run `python -m harness.train_drafts data --model {args.model}` first")
    epochs, lr, batch, noise = DEFAULTS[args.kind]
    args.epochs, args.lr, args.batch = args.epochs or epochs, args.lr or lr, args.batch or batch
    examples = load_examples(data_file)
    train_set, val_set = split(examples, args.held_out, args.seed)
    if args.kind != "draft-lm":
        attach_hidden(target, examples, cache=data_file.with_name("hidden_states.pt"), progress=True)
    recipe = {"draft-lm": lambda: DraftLMRecipe(target, args.layers),
              "eagle": lambda: EagleRecipe(target, args.seed, cls_weight=1.0, feature_scale=feature_spread(train_set)),
              "medusa": lambda: MedusaRecipe(target, args.heads)}[args.kind]()
    out = args.out or ROOT / "drafts" / args.model / args.kind
    out.mkdir(parents=True, exist_ok=True)
    before = evaluate(recipe, val_set)
    result = train(recipe, train_set, val_set, args.epochs, args.lr, args.seed, out / "train_log.jsonl",
                   batch=args.batch, noise=noise)
    recipe.save(out)
    model_card(out, args.kind, args, data_file, len(train_set), len(val_set), result, before)
    print(json.dumps({k: v for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
