"""The Slurm launcher: the batch script and `srun --container` steps (launcher), Slurm's commands and their
answers (queries), a step's life (steps), and the standby steps on every healthy node (standby)."""
