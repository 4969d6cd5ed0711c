"""The cluster: SLURM from inside a job (`slurm`) and the status of a sweep's jobs (`jobs`)."""
