"""Running a benchmark: the Hydra entry (`run`), datasets, chat prompts, the results folders, the
task-quality scores and their sandbox (`quality`, `execution`), the config's checks (`validate`),
what a measurement ran on (`environment`) and how busy the machine was (`busy`); a run's numbers are
harness/stats.py's."""
