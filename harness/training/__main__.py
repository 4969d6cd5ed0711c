"""`python -m harness.training data|vocab|draft-lm|eagle|eagle3|medusa|hydra|dflash|pard --model <name>`: the CLI of the
recipes (see `harness/training/__init__.py`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from methods.base import BuildContext
from methods.engine.vocab import token_frequencies
from methods.models.heads.eagle3 import feature_layers
from methods.models.loading import load_draft_lm, resolve_device

from . import __doc__ as RECIPES_DOC
from .dflash import DFlashRecipe, attach_dflash_features
from .dflash import feature_layers as dflash_layers
from .distill import corpus
from .distributed import context, is_main, launched, place
from .draft_lm import DraftLMRecipe
from .eagle import EagleRecipe
from .eagle3 import Eagle3Recipe, attach_cached_features, attach_features
from .examples import attach_hidden, choose_mask_token, feature_spread, load_examples, split
from .hydra import HydraRecipe
from .loop import ROOT, default_corpus, evaluate, load_target, model_card, train
from .medusa import MedusaRecipe
from .pard import PARA_NUM, PardRecipe


def training_device(name: str) -> torch.device:
    """`--device`: auto = this rank's GPU (LOCAL_RANK under torchrun) where CUDA is present, else the CPU.
    The target (fp32) sits there too: its states, argmax and answers are computed where the draft trains."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if launched() else 0)
    return device


DEFAULTS = {  # kind: (epochs, lr, batch, noise): the committed zoo's settings (drafts/<model>/<kind>/training.json)
    "draft-lm": (6.0, 1e-3, 16, 0.0),
    "eagle": (10.0, 3e-4, 16, 0.1),
    "medusa": (6.0, 1e-3, 16, 0.0),
    "eagle3": (8.0, 2e-3, 16, 0.0),
    "hydra": (2.0, 1e-3, 16, 0.0),
    "dflash": (6.0, 6e-4, 16, 0.0),  # SpecForge's lr and epochs
    "pard": (4.0, 3e-4, 16, 0.0),  # 4 epochs as upstream's examples; lr: ours (upstream's 3e-5 fine-tunes a 0.5B draft)
}


def arguments() -> argparse.ArgumentParser:
    """The CLI's options: the command (`data`, `vocab`, `states` or a recipe) and its settings."""
    parser = argparse.ArgumentParser(prog="python -m harness.training", description=RECIPES_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["data", "vocab", "states", *DEFAULTS],
                        help="data: the target's answers; vocab: their token frequencies (reduced-vocabulary "
                             "drafting); "
                             "states: the target's states every head recipe reads (the EAGLE-3 feature cache, with the "
                             "last hidden state; resumable); then a draft recipe")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=9000)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--distill-batch", type=int, default=64,
                        help="prompts per batched generate (`data --measure` times the candidates)")
    parser.add_argument("--distill-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="dtype of the target that answers: auto = bfloat16 where the CPU has native bf16 "
                             "(2-3x the tokens/s), float32 elsewhere; the drafts' labels are always float32")
    parser.add_argument("--measure", action="store_true", help="data: time the batch sizes and dtypes, write nothing")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="data: answer these prompts (JSONL: id, kind, text, mode) instead of generating them; the "
                             "generated ones depend on the Python version (their passages and code come from its "
                             "standard library), so a corpus answered elsewhere takes the file `--prompts-only` wrote")
    parser.add_argument("--prompts-only", action="store_true",
                        help="data: write the prompts (checked disjoint) beside the answers' file, answer none")
    parser.add_argument("--device", default="auto", help="auto (CUDA where present, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--state-batch-tokens", type=int, default=None,
                        help="tokens per target forward computing the states (default: 16,384 on a GPU; on a CPU 1,024 "
                             "for the EAGLE-3 states, 4,096 for the last hidden states)")
    parser.add_argument("--data", type=Path, default=None, help="default: data/distill/<model>/answers.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="default: drafts/<model>/<kind>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=float, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--layers", type=int, default=2, help="draft LM, DFlash: decoder layers")
    parser.add_argument("--block-size", type=int, default=16, help="DFlash: tokens per block (upstream's drafts: 16)")
    parser.add_argument("--anchors", type=int, default=512,
                        help="DFlash: most anchored blocks per conversation (SpecForge's num_anchors; 512 takes every "
                             "answer position of the suite's corpus; fewer cost proportionally less)")
    parser.add_argument("--heads", type=int, default=4, help="Medusa: number of heads")
    parser.add_argument("--held-out", type=float, default=0.05)
    parser.add_argument("--train-examples", type=int, default=None,
                        help="train on the first N training conversations only (a shorter budget; the held-out set is "
                             "unchanged); default: all")
    parser.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3: training-time test steps (upstream: 7)")
    parser.add_argument("--para-num", type=int, default=PARA_NUM,
                        help="PARD: tokens trained per position, the real one and para_num - 1 masks "
                             f"(upstream: {PARA_NUM})")
    parser.add_argument("--mask-token", type=int, default=None,
                        help="DFlash, PARD: the mask id (DFlash's dflash_config.mask_token_id, PARD's pard_token); "
                             "default: the highest-id added token of the tokenizer that no training text holds")
    parser.add_argument("--resume", action="store_true",
                        help="continue from <out>/checkpoint.pt (weights, optimizer, step, RNG) of an interrupted run")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="conversations per forward on each process (default: its whole share of --batch on a "
                             "GPU, 4 on a CPU)")
    parser.add_argument("--questions", type=Path, default=ROOT / "data/spec_bench/question.jsonl",
                        help="evaluation questions the prompts must not overlap")
    return parser


def main(argv=None) -> None:
    args = arguments().parse_args(argv)
    try:
        device = training_device(args.device)
    except (ValueError, RuntimeError) as error:
        raise SystemExit(f"--device {args.device}: {error}")
    args.device = str(device)
    context(device)  # under torchrun: join the process group with the device's backend (nccl on GPUs) first
    # tokens per target forward of the states: given, 16,384 on a GPU, else each cache's own CPU default
    batch_tokens = args.state_batch_tokens or (16384 if device.type == "cuda" else None)
    state_batch = {"batch_tokens": batch_tokens} if batch_tokens else {}
    torch.manual_seed(args.seed)
    data_file = args.data or default_corpus(args.model)
    if args.kind == "data":
        corpus(args, data_file)
        return
    cfg, target, tokenizer = load_target(args.model, device=device)

    if not data_file.is_file():
        raise SystemExit(
            f"no training data at {data_file}: run `python -m harness.training data --model {args.model}` first"
        )
    if args.kind == "vocab":
        write_token_frequencies(data_file, args.out or ROOT / "drafts" / args.model / "token_frequencies.json",
                                target.get_output_embeddings().out_features)
        return
    if args.kind == "states":
        attach_features(target, load_examples(data_file), feature_layers(target.config.num_hidden_layers),
                        cache=data_file.with_name("eagle3_features.pt"), progress=True, **state_batch)
        print(f"wrote {data_file.with_name('eagle3_features.pt')} (+ .bin)")
        return
    epochs, lr, batch, noise = DEFAULTS[args.kind]
    args.epochs, args.lr, args.batch = args.epochs or epochs, args.lr or lr, args.batch or batch
    examples = load_examples(data_file)
    train_set, val_set = split(examples, args.held_out, args.seed)
    train_set = train_set[: args.train_examples]
    if args.kind in ("dflash", "pard") and args.mask_token is None:  # a row no training text holds
        args.mask_token = choose_mask_token(tokenizer, examples, target.get_input_embeddings().num_embeddings)
    if args.kind not in ("draft-lm", "pard"):
        target_states(args.kind, target, examples, data_file, state_batch, args.layers)
    recipe = build_recipe(args, cfg, target, train_set)
    place(recipe, device)
    out = args.out or ROOT / "drafts" / args.model / args.kind
    out.mkdir(parents=True, exist_ok=True)
    before = evaluate(recipe, val_set)
    result = train(recipe, train_set, val_set, args.epochs, args.lr, args.seed, out / "train_log.jsonl",
                   batch=args.batch, noise=noise, resume=args.resume, micro_batch=args.micro_batch, device=device)
    if is_main():  # under torchrun: rank 0 writes the files
        recipe.save(out)
        loss = {"pard": PARD_LOSS.format(mask=args.mask_token, para_num=args.para_num)}.get(args.kind)
        model_card(out, args.kind, args, data_file, len(train_set), len(val_set), result, before,
                   **({"loss": loss} if loss else {}))
        print(json.dumps({k: v for k, v in result.items()}, indent=2))


def target_states(kind: str, target, examples: list, data_file: Path, state_batch: dict,
                  draft_layers: int = 2) -> None:
    """The target's states a head recipe reads, attached to the examples: EAGLE-3's three layers' inputs and last
    hidden state (their cache beside the data), DFlash's layers' outputs (their own cache), else the last hidden
    state (from EAGLE-3's cache where it exists)."""
    if kind == "dflash":  # the outputs of upstream's feature layers for a draft of `draft_layers` layers
        attach_dflash_features(target, examples, dflash_layers(target, draft_layers),
                               cache=data_file.with_name("dflash_features.pt"), progress=True, **state_batch)
        return
    layers, features = feature_layers(target.config.num_hidden_layers), data_file.with_name("eagle3_features.pt")
    if kind == "eagle3":  # three layers' inputs + last hidden state: their own 16-bit cache beside the data
        attach_features(target, examples, layers, cache=features, progress=True, **state_batch)
    elif not attach_cached_features(target, examples, layers, features):  # it holds the last hidden state too
        attach_hidden(target, examples, cache=data_file.with_name("hidden_states.pt"), progress=True,
                      **state_batch)


def build_recipe(args: argparse.Namespace, cfg, target, train_set: list):
    """The recipe of `args.kind` on the target (moved to the CPU: recipes copy its weights into fresh modules there;
    then all moves to the training device)."""
    # classification losses over the model config's reduced draft vocabulary, where it names one
    vocab = draft_vocabulary(args.model, cfg, target) if (cfg.get("draft_vocabulary")
                                                          or {}).get("frequencies") else None
    target.to("cpu")  # recipes copy the target's weights into fresh modules on the CPU; then all moves to `device`
    return {"draft-lm": lambda: DraftLMRecipe(target, args.layers, vocabulary=vocab),
            "eagle": lambda: EagleRecipe(target, args.seed, cls_weight=1.0, feature_scale=feature_spread(train_set),
                                         vocabulary=vocab),
            "medusa": lambda: MedusaRecipe(target, args.heads, vocabulary=vocab),
            "eagle3": lambda: Eagle3Recipe(target, args.seed, draft_vocabulary(args.model, cfg, target),
                                           args.ttt_steps),
            "hydra": lambda: HydraRecipe(target, args.heads, vocabulary=draft_vocabulary(args.model, cfg, target)),
            "dflash": lambda: DFlashRecipe(target, args.layers, args.block_size, args.mask_token, vocabulary=vocab,
                                           seed=args.seed, num_anchors=args.anchors),
            "pard": lambda: PardRecipe(target, ar_draft(args.model, cfg, target), args.mask_token, args.para_num,
                                       vocabulary=vocab, ignore_ids=eos_ids(target)),
            }[args.kind]()


PARD_LOSS = ("Adapted from the model's AR draft (`drafts.sps`) with PARD's conditional drop-token training: "
             "mask id {mask} (`pard_token`), {para_num} tokens per position; loss on every prompt and answer "
             "token but the eos, as upstream's; labels are the corpus's tokens.")


def ar_draft(model_name: str, cfg, target):
    """The AR draft PARD adapts (upstream's `model_name`): the model config's `drafts.sps`."""
    spec = OmegaConf.to_container(cfg, resolve=True).get("drafts", {}).get("sps")
    if not spec:
        raise SystemExit(f"model {model_name!r} names no AR draft (drafts.sps) for PARD to adapt: train one "
                         f"(`python -m harness.training draft-lm --model {model_name}`) or add drafts.sps to "
                         f"conf/model/{model_name}.yaml")
    return load_draft_lm(spec, target)


def eos_ids(target) -> list[int]:
    """The target's eos ids: upstream's collator sets the eos labels to -100 (its pad token is the eos)."""
    eos = target.config.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def draft_vocabulary(model_name: str, cfg, target):
    """The model config's reduced draft vocabulary (`draft_vocabulary`: frequencies + size), as methods read it."""
    vocabulary = BuildContext(target, model_name, OmegaConf.to_container(cfg, resolve=True)).draft_vocabulary({})
    if vocabulary is None:
        raise SystemExit(f"model {model_name!r} names no draft_vocabulary (frequencies, size): EAGLE-3 needs one; "
                         f"run `python -m harness.training vocab --model {model_name}` and add it to "
                         f"conf/model/{model_name}.yaml")
    return vocabulary


def write_token_frequencies(data_file: Path, out: Path, vocab_size: int) -> None:
    """The answer tokens' frequencies of the drafts' training corpus: the ranking a reduced draft
    vocabulary (`methods/engine/vocab.py`, FR-Spec) keeps the top of."""
    examples = load_examples(data_file)
    answers = [e.ids[e.answer_start:] for e in examples]
    counts = token_frequencies(answers, vocab_size)
    total = sum(c for _, c in counts)
    source = (f"answer tokens of {len(examples)} self-distilled answers in "
              f"{data_file.relative_to(ROOT) if data_file.is_relative_to(ROOT) else data_file}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": source, "tokens": total, "counts": counts}, separators=(",", ":")) + "\n")
    print(f"wrote {out}: {len(counts)} distinct tokens of {total}")


if __name__ == "__main__":
    main()
