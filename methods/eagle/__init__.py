"""The EAGLE family: EAGLE (static tree) and EAGLE-2 (dynamic tree) decoding with the EAGLE draft head,
and EAGLE-3 (`eagle3.py`: its own head, EAGLE-2's tree).

The head drafts from (token, target feature) pairs. With the target's cache holding T positions
and the root x_T pending, the head's cache holds the T pairs (x_{i+1}, f_i), i < T, and its last
output predicts the root's children. A tree node at depth d is fed at head position T + d - 1
with its token and the head's own output at its parent (tree mask over the head's cache). After
verification the head's tree entries are dropped and the accepted path is fed with the target's
true features, so the head's cache always equals the one built along the accepted sequence.

* `eagle`: EAGLE-1's static tree (default `eagle_mc_sim_7b_63`: 25 nodes, 4/8/8/3/2 per depth);
  node [.., r] carries the r-th ranked candidate of its parent; one head forward per level.
* `eagle2`: EAGLE-2's dynamic tree: expand the top-k frontier by cumulative log-probability for
  `depth` steps (k² candidates per step), then keep the best `total_tokens - 1` candidates,
  ancestors before descendants. `total_tokens: auto` times target forwards at 40..60 tokens and
  picks the size as EAGLE-2's `-1` does. `total_tokens: adaptive` times target forwards of 1..64
  tokens once and sizes every tree for the most expected tokens per second: with the candidates'
  values (the head's path probabilities, EAGLE-2's estimate of acceptance) sorted, keep the n that
  maximizes (1 + p_1 + ... + p_n) / (draft time + verify time of n + 1 tokens). On hardware where a
  forward's cost grows with its tokens (CPUs) it keeps small trees; where it is flat, large ones.
  On the device: the expansion, the rerank and, at a fixed size, the tree's structure
  (`tree.DeviceTree`) never come back to the host, so a greedy step reads once (the acceptance);
  the adaptive size is the host's choice, from one more read.
Under `engine.cuda_graphs` the whole draft step, the follow of the last accepted path (deferred to
it) and either depth loop (EAGLE-1's template, EAGLE-2's expansion), runs over the head's reserved
cache at device positions (`StaticDraft`), captured as one CUDA graph on a GPU.
Sampling (temperature > 0), `method.sampling_rule`:
* `eagle1` (`eagle`'s default), EAGLE-1's own (SafeAILab/EAGLE v1: `cnets.py` `Model.sample` /
  `topK_genrate`, `utils.py` `evaluate_posterior`): each expanded node's children are *sampled*
  from the head's processed distribution q (temperature, top-k, top-p, as the target's), without
  replacement, the j-th draw going to the node's j-th child; the tree carries q. Verification is
  SpecInfer's multi-candidate rule (`acceptance.sample_accept` with the draft's q, children drawn
  without replacement): try the children in drawn order, accept x with probability min(1, p(x)/q(x));
  on rejection p <- norm(max(p - q, 0)) and x leaves q (q(x) <- 0, renormalized); the bonus comes
  from the final p. A node whose q has fewer tokens than it has children keeps only as many
  children as q can give (the others and their subtrees leave the tree).
* `eagle2`, and always for `eagle2` / `eagle3`: drafts stay deterministic (top-k) and are verified
  with EAGLE-2's rule (accept x with probability p(x), else zero it and renormalize).
Both preserve the target distribution. Greedy decoding (temperature 0) is the same for both.

The package: `settings.py` (the three methods' settings classes), `drafter.py` (`EagleDrafter`: the
head, its cache and its tree levels), `static_draft.py` (`StaticDraft`: the draft step as one static
computation), `batch_draft.py` (`BatchDraft`: a batch's dynamic trees drafted at once), `decoder.py`
(`EagleBase`: what the three decoders share), `template.py` (`eagle`),
`dynamic.py` (`eagle2`: expansion, rerank, sizing) and `eagle3.py` (`eagle3`). Importing the package
registers the three (`base.available_methods` imports every module and package beside `base.py`).
"""

from . import dynamic, eagle3, template  # noqa: F401  (importing them registers eagle2, eagle3, eagle)
