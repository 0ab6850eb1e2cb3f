"""Host side: the commands that read a run directory, during or after the run: status and watch (status, watch,
digest, metric_columns, display), logs, report, list (listing), outcome.json and compare (outcome, compare), bench,
diff, goodput; and prune, which removes what ended runs no longer need."""
