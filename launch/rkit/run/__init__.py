"""Host side: running a recipe. `rkit run`, `--resume`, `supervise` and `reproduce` (runner), the run's writer
lock (lock), the attempt loop (supervisor) applying the pure policy (policy: states, causes, budgets, what follows
an attempt; ending: how an attempt ended) and ending each attempt that way (attemptend), what a running attempt
says (attemptwatch, watchdog, ranklogs, oomkills, stragglers), node liveness (liveness), excluded nodes and their
expiry (exclusions), the checks before each attempt (preflight), a lost attempt's record (attemptrecord),
TensorBoard restart marks (tbmarks), modes restored on `--resume` (access)."""
