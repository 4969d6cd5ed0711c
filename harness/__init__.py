"""The benchmark around the methods, in rooms named by what they hold: `stats` (a run's numbers: the
bootstrap, speedups, fidelity, caveats), `running/` (a benchmark run: datasets, prompts, results
folders), `reporting/` (tables, figures, the headline run, the numbers in words),
`perf/` (`make perf`: what the engine itself costs), `cluster/` (SLURM and a sweep's jobs) and
`training/` (the draft recipes). See docs/architecture.md."""

from pathlib import Path

import methods  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads; methods/machine/threads.py)

REPO = Path(__file__).resolve().parents[1]  # the checkout: conf/, data/, drafts/, results/
