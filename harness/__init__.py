"""The benchmark around the methods, in rooms named by what they hold: `stats/` (a run's numbers: the
bootstrap, speedups, fidelity, caveats, and the words that show them), `running/` (a benchmark run:
datasets, prompts, results folders), `reporting/` (tables, figures, the headline run),
`perf/` (`make perf`: what the engine itself costs), `cluster/` (SLURM and a sweep's jobs) and
`training/` (the draft recipes). See docs/architecture.md."""

import methods  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads; methods/machine/threads.py)
from methods.models.specs import PROJECT_ROOT as REPO  # noqa: E402,F401  (the checkout: conf/, data/, results/)
