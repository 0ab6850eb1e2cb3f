"""Host side: where an attempt's processes run. The Backend protocol (base), local processes (local/), Slurm
steps (slurm/), and the checks both do before an attempt (gpu_health, shared_paths)."""
