"""`python -m rkit.cli`: the batch script's `rkit supervise`, and the tests' CLI."""

from rkit.cli import main

main()
