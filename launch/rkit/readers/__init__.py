"""Host side: the commands that read a run directory, during or after the run: status, watch and log (status,
digest, display), report, list (listing), outcome.json and compare (outcome, compare), bench, diff, goodput."""
