"""Running a benchmark: the Hydra entry (`run`), datasets, chat prompts, the results folders, the
task-quality scores and their sandbox (`quality`, `execution`), the config's checks (`validate`),
what a measurement ran on (`environment`), how busy the machine was (`busy`) and a run's numbers
(`metrics`)."""
