"""Recipes that train the suite's own drafts for a target by self-distillation.

    python -m harness.training data    --model smollm2-135m      # prompts + the target's answers
    python -m harness.training draft-lm|eagle|medusa|eagle3|hydra|dflash --model smollm2-135m
    python -m harness.training pard --model smollm2-135m     # after draft-lm: it adapts that draft

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
- EAGLE-3 head: fc over the inputs of the target's layers 2, L//2, L-3 + one decoder layer over
  [embedding; feature] + its own lm_head over the model config's reduced draft vocabulary (d2t/t2d),
  trained with EAGLE-3's training-time test (the head unrolled `--ttt-steps` times on its own
  outputs; loss 0.8^j-weighted cross-entropy on the target's distribution over the draft vocabulary).
  `--train-examples N` and `--epochs` set the budget (`harness/training/eagle3.py`).
- Hydra heads (`harness/training/hydra.py`): Medusa-style heads grounded on the embeddings of the
  tokens drafted before them (Hydra++ `prefix-mlp` by default: one decoder layer over the target's
  hidden states first), trained with Hydra's teacher loss (the target's distribution as the label)
  over the reduced draft vocabulary.
- DFlash draft (`harness/training/dflash.py`): `--layers` Qwen3-style layers reading the outputs of
  upstream's feature layers, trained as SpecForge trains DFlash: blocks [x_a, mask, ...] at random answer
  anchors, each seeing the context before its anchor and its own block, cross-entropy of each slot's own
  position through the frozen lm_head, weighted exp(-(k-1)/7); saved in upstream's released format.
- PARD draft (`harness/training/pard.py`): the draft LM above adapted into a parallel draft (PARD's
  conditional drop-token training: each position also trained on 1..para_num-1 appended mask tokens
  predicting 2..para_num tokens ahead, the mask slots randomly thinned by COD); the mask id is saved as
  `pard_token` in its config.json.

The corpus (`data`): ~9,000 prompts (`methods/models/corpus.py`: its own subjects and templates,
`corpus_prompts.yaml`, the Python language reference and standard-library docstrings;
`harness/training/distill.py` checks them disjoint from every evaluation set on the machine, 13-word overlap
included), 80% answered greedily and 20% sampled at T = 1, batched and journalled (an interrupted run
resumes); `drafts/<model>/corpus.json` records its recipe and checksum."""
