"""Models and their files: `specs` (what names a model, the cache, Hub errors), `loading` (targets, GGUF
wheels, tokenizers, draft LMs), `corpus` (the suite's draft-training corpus: its prompts, manifest and
the files REST and SAM build from it), `draft_lm` (drafting a tree with a small LM), `heads/` (EAGLE and
Medusa heads, their released formats, random initialisation)."""
