"""rkit: resilient, reproducible MaxText training on Slurm clusters and on a laptop."""

__version__ = "0.1.0"
