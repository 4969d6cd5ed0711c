"""One training loop for every recipe (AdamW, warm-up + cosine, gradient clipping, a JSONL loss log),
held-out teacher-forced agreement, and the model card written beside the weights.

A recipe provides `kind`, `parameters()`, `save(out)` and either `batch_loss(examples, noise,
generators) -> (summed loss, stats)` (a mini-batch in one forward) or `loss(example, noise, generator)
-> (mean loss, stats)` (one conversation; the loop sums them). A step's loss is the mean over its
`batch` conversations of each conversation's loss. Under `torchrun` the loop is data-parallel
(`distributed.py`): the global batch is split across ranks, each rank reading its own shard."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from methods.engine.hardware import cpu_isa, cpu_model
from methods.models.loading import load_model, load_tokenizer
from methods.models.specs import ModelSpec, model_config

from . import distributed
from .examples import Example

ROOT = Path(__file__).resolve().parents[2]
# conversations per forward on a CPU (a GPU takes its whole share of the step); why 4: docs/drafts.md
CPU_MICRO_BATCH = 4


def load_target(model_name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """The target a recipe distils from: (its model config, the model, its tokenizer)."""
    cfg = model_config(model_name)
    spec = ModelSpec.from_mapping(cfg)
    return cfg, load_model(spec, dtype, torch.device(device)), load_tokenizer(spec)


def evaluate(recipe, examples: list[Example], micro_batch: int = 8) -> dict[str, float]:
    """Held-out teacher-forced top-1 agreement of each draft position with the target's own argmax
    (`acc_k`: the fraction of answer positions where draft position k proposes the target's choice
    given the true prefix). Under torchrun each rank evaluates its share; the counts are summed."""
    ctx = distributed.context()
    mine = examples[ctx.rank::ctx.world]
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        if hasattr(recipe, "batch_loss"):
            mine = sorted(mine, key=lambda e: len(e.ids))
            chunks = [mine[i:i + micro_batch] for i in range(0, len(mine), micro_batch)]
            results = [recipe.batch_loss(chunk, 0.0, [None] * len(chunk))[1] for chunk in chunks]
        else:
            results = [recipe.loss(example, 0.0, None)[1] for example in mine]
        for stats in results:
            for key, value in stats.items():
                if key.startswith("acc_"):
                    sums.setdefault(key, [0.0, 0.0])
                    sums[key][0] += float(value.sum())
                    sums[key][1] += value.numel()
    keys = sorted(set().union(*distributed.gather_objects(sorted(sums))))
    totals = distributed.all_reduce_sum([x for k in keys for x in sums.get(k, [0.0, 0.0])])
    return {k: totals[2 * i] / max(totals[2 * i + 1], 1) for i, k in enumerate(keys)}


def train(recipe, train_set: list[Example], val_set: list[Example], epochs: float, lr: float, seed: int,
          log_file: Path, batch: int = 8, noise: float = 0.0, progress: bool = True, micro_batch: int | None = None,
          checkpoint: Path | None = None, resume: bool = False, checkpoint_every: int | None = None,
          stop_after: int | None = None, device: torch.device | str | None = None) -> dict:
    """Train `recipe` for ceil(epochs * len(train_set) / batch) steps of `batch` conversations.

    micro_batch: conversations per forward on each rank (default: `CPU_MICRO_BATCH` on a CPU, the
    rank's whole share of the step on a GPU).
    checkpoint: where rank 0 writes weights + optimizer + scheduler + step + RNG states (default
    `<log_file's folder>/checkpoint.pt`), every `checkpoint_every` steps (default: ~20 per run) and at
    the end; `resume=True` continues from it (the log keeps its first `step` lines). `stop_after`:
    stop after that many steps of the run (an interrupted run, for tests). device: where the recipe
    trains (default: under torchrun with CUDA this rank's GPU, else where its parameters are)."""
    device = torch.device(device) if device is not None else distributed.default_device(recipe)
    if device != recipe.parameters()[0].device:
        distributed.place(recipe, device)
    params = recipe.parameters()
    ctx = distributed.context(device)
    if batch % ctx.world:
        raise ValueError(f"the global batch ({batch} conversations) must be a multiple of the {ctx.world} processes")
    torch.manual_seed(seed + ctx.rank)
    module = distributed.RecipeModule(recipe, params)
    model = distributed.wrap(module, ctx)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps = max(1, math.ceil(epochs * len(train_set) / batch))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    sampler = distributed.LaneSampler(len(train_set), batch, seed)
    per_step = sum(1 for lane in sampler.lanes if lane)  # conversations per step: batch, or all of a smaller set
    checkpoint = checkpoint or log_file.with_name("checkpoint.pt")
    checkpoint_every = checkpoint_every or max(1, steps // 20)
    start, losses, elapsed = 0, [], 0.0
    if resume and checkpoint.is_file():
        start, losses, elapsed = _resume(checkpoint, ctx, params, optimizer, schedule, steps, batch, seed)
    started = time.perf_counter() - elapsed
    total_tokens = 0
    log = _open_log(log_file, start) if ctx.is_main else None
    try:
        last = steps if stop_after is None else min(steps, start + stop_after)
        for step in tqdm(range(start, last), desc=f"train {recipe.kind}", unit="step",
                         disable=not (progress and ctx.is_main)):
            optimizer.zero_grad(set_to_none=True)
            local = sorted(sampler.local_batch(step, ctx.rank, ctx.world), key=lambda i: len(train_set[i].ids))
            size = micro_batch or (max(1, len(local)) if device.type == "cuda" else CPU_MICRO_BATCH)
            step_loss, tokens = _backward(model, ctx, train_set, local, size, seed, step, noise, per_step)
            total_tokens += tokens
            global_loss = distributed.all_reduce_sum([step_loss])[0] / per_step
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(global_loss)
            if log is not None:
                log.write(json.dumps({"step": step + 1, "loss": round(global_loss, 5), "lr": schedule.get_last_lr()[0],
                                      "seconds": round(time.perf_counter() - started, 1)}) + "\n")
                log.flush()
            if (step + 1) % checkpoint_every == 0 or step + 1 == last:
                _save_checkpoint(checkpoint, ctx, params, optimizer, schedule, step + 1, steps, batch, seed, losses,
                                 time.perf_counter() - started)
    finally:
        if log is not None:
            log.close()
    tail = losses[-max(1, len(losses) // 10):]
    seconds = time.perf_counter() - started
    tokens = distributed.all_reduce_sum([total_tokens])[0]  # answer tokens trained on by this run (not before a resume)
    return {"steps": steps, "batch": batch, "processes": ctx.world, "final_loss": sum(tail) / max(len(tail), 1),
            "seconds": seconds, "answer_tokens": int(tokens), "held_out_acceptance": evaluate(recipe, val_set)}


def _resume(checkpoint: Path, ctx, params, optimizer, schedule, steps: int, batch: int,
            seed: int) -> tuple[int, list[float], float]:
    """The state of an interrupted run loaded from its checkpoint (weights, optimizer, scheduler, this rank's RNG);
    its step, losses and seconds so far. A checkpoint of another run (steps, batch or seed) refuses."""
    state = torch.load(checkpoint, weights_only=False)
    if state["steps"] != steps or state["batch"] != batch or state["seed"] != seed:
        raise ValueError(f"{checkpoint}: written by another run ({state['steps']} steps of {state['batch']}, "
                         f"seed {state['seed']}; this one: {steps} of {batch}, seed {seed})")
    with torch.no_grad():
        for p, saved in zip(params, state["params"], strict=True):
            p.copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["scheduler"])
    rng = state["rng"]
    torch.set_rng_state(rng[ctx.rank] if len(rng) == ctx.world else rng[0])
    return state["step"], state["losses"], state["seconds"]


def _open_log(log_file: Path, start: int):
    """The training log (rank 0), opened to append: its lines up to step `start` kept (a resumed run), none else."""
    kept = []
    if start and log_file.is_file():
        kept = [line for line in log_file.read_text().splitlines() if line and json.loads(line)["step"] <= start]
    log_file.write_text("".join(line + "\n" for line in kept))
    return log_file.open("a")


def _backward(model, ctx, train_set: list[Example], local: list[int], size: int, seed: int, step: int,
              noise: float, per_step: int) -> tuple[float, int]:
    """One step's forward and backward passes on this rank's conversations (`local`: their indices), `size` per
    forward; the sum of their losses and the answer tokens they hold."""
    chunks = [local[i:i + size] for i in range(0, len(local), size)] or [[]]
    # the same number of backward passes on every rank (the last one all-reduces)
    count = max(distributed.gather_objects(len(chunks)))
    chunks += [[]] * (count - len(chunks))
    step_loss, tokens = 0.0, 0
    for c, chunk in enumerate(chunks):
        examples = [train_set[i] for i in chunk]
        generators = [distributed.example_generator(seed, step, i) for i in chunk]
        sync = c == len(chunks) - 1 or not ctx.distributed
        with (model.no_sync() if not sync else contextlib.nullcontext()):
            loss = model(examples, noise, generators)
            # DDP averages gradients over ranks: scaled by world / per_step, they are the global mean's
            (loss * (ctx.world / per_step)).backward()
        step_loss += float(loss.detach())
        tokens += sum(len(e.ids) - e.answer_start for e in examples)
    return step_loss, tokens


def _save_checkpoint(file: Path, ctx, params, optimizer, schedule, step, steps, batch, seed, losses, seconds) -> None:
    rng = distributed.gather_objects(torch.get_rng_state())
    if ctx.is_main:
        state = {"step": step, "steps": steps, "batch": batch, "seed": seed, "world": ctx.world,
                 "params": [p.detach().clone() for p in params], "optimizer": optimizer.state_dict(),
                 "scheduler": schedule.state_dict(), "rng": rng, "losses": list(losses), "seconds": seconds}
        tmp = file.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(file)
    distributed.barrier()


ANSWER_LOSS = "Loss on answer tokens only; labels are the fp32 target's."  # the model card's words for the loss


def model_card(out: Path, kind: str, args, data_file: Path, n_train: int, n_val: int, result: dict, before: dict,
               machine: str | None = None, loss: str = ANSWER_LOSS) -> None:
    """`loss`: what the loss covers, in one sentence (a recipe whose loss is not on answer tokens says so)."""
    machine = machine or machine_label(getattr(args, "device", "cpu"))
    acc = ", ".join(f"{k.replace('acc_', 'position ')}: {v:.3f}" for k, v in result["held_out_acceptance"].items())
    acc_before = ", ".join(f"{k.replace('acc_', 'position ')}: {v:.3f}" for k, v in before.items())
    command = recipe_command(args)
    source = data_file.relative_to(ROOT) if data_file.is_relative_to(ROOT) else data_file
    text = f"""# {kind} for {args.model}

Trained by `{command}` (`make train-drafts` runs the same recipe with its defaults).

- **Data**: self-distillation. {n_train} training and {n_val} held-out conversations from
  `{source}` ({_corpus_summary(data_file, args.model)}):
  prompts generated by `harness/training/distill.py` from its own templates and from text shipped with Python
  (the language reference in `pydoc_data`, standard-library docstrings), checked disjoint from the evaluation
  questions; answers are the target's own (up to {args.max_new_tokens} new tokens). {loss}
- **Training**: {result["steps"]} steps of {result["batch"]} conversations, AdamW lr {args.lr}, cosine schedule,
  seed {args.seed}, {result["seconds"] / 60:.1f} min on {machine}. Log: `train_log.jsonl`.
- **Final loss** (mean of the last 10% of steps): {result["final_loss"]:.4f}
- **Teacher-forced top-1 agreement with the target** on the held-out answers (the greedy acceptance
  rate of each draft position given a correct prefix): {acc}. Before training: {acc_before}.
- Weights that copy the target's (token embeddings, lm_head) are not in the file; the loader takes
  them from the target.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps({"kind": kind, "args": vars(args) | {"out": str(args.out)},
                                                    "train": n_train, "held_out": n_val, "machine": machine, **result,
                                                    "held_out_acceptance_before": before}, indent=2, default=str))


def recipe_command(args) -> str:
    """The command that trains this draft again: the recipe, the model, and every setting that shaped it."""
    options = {"--seed": args.seed, "--epochs": args.epochs, "--lr": args.lr, "--batch": args.batch}
    data = Path(args.data).resolve() if getattr(args, "data", None) is not None else None
    if data is not None and data != default_corpus(args.model).resolve():
        options["--data"] = data.relative_to(ROOT) if data.is_relative_to(ROOT) else data
    if getattr(args, "train_examples", None) is not None:
        options["--train-examples"] = args.train_examples
    if args.kind == "eagle3":
        options["--ttt-steps"] = args.ttt_steps
    if args.kind in ("medusa", "hydra"):
        options["--heads"] = args.heads
    if args.kind in ("draft-lm", "dflash"):
        options["--layers"] = args.layers
    if args.kind == "dflash":
        options |= {"--block-size": args.block_size, "--mask-token": args.mask_token, "--anchors": args.anchors}
    if args.kind == "pard":
        options["--para-num"], options["--mask-token"] = args.para_num, args.mask_token
    if str(getattr(args, "device", "cpu")).startswith("cuda"):
        options["--device"] = "cuda"
    return f"python -m harness.training {args.kind} --model {args.model} " + " ".join(
        f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in options.items()
    )


def default_corpus(model: str) -> Path:
    """Where `python -m harness.training data` writes a model's corpus unless told otherwise."""
    return ROOT / "data" / "distill" / model / "answers.jsonl"


def corpus_manifest(model: str, data_file: Path) -> Path:
    """The committed manifest of a corpus: `drafts/<model>/corpus.json` for the default one, and
    `drafts/<model>/corpus-<name>.json` for one written to `data/distill/<model>/<name>/answers.jsonl`."""
    if data_file.resolve() == default_corpus(model).resolve():
        return ROOT / "drafts" / model / "corpus.json"
    return ROOT / "drafts" / model / f"corpus-{data_file.parent.name}.json"


def _corpus_summary(data_file: Path, model: str) -> str:
    """The corpus manifest's counts, where the manifest (`corpus_manifest`) describes this file."""
    manifest = corpus_manifest(model, data_file)
    m = json.loads(manifest.read_text()) if manifest.is_file() else {}
    if not m or (ROOT / m["file"]).resolve() != data_file.resolve():
        return "no manifest describes it"
    modes = m.get("modes", {})
    return (f"{m['prompts']:,} prompts, {m['answer_tokens']:,} answer tokens, {modes.get('greedy', 0):,} answered "
            "greedily and "
            f"{modes.get('sample', 0):,} sampled at T = 1, in {m.get('dtype')}; manifest "
            f"`{manifest.relative_to(ROOT)}`")


def machine_label(device: torch.device | str = "cpu") -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"{cpu_model()} {cpu_isa()} ({torch.get_num_threads()} threads), torch {torch.__version__}"
