"""Jobs on batch-scheduler allocations (Slurm) and worker pools."""
