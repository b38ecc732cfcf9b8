"""From a login node to a running job: Slurm scripts (pure functions of the config) and pre-launch checks."""
