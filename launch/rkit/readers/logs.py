"""`rkit logs`: one rank's log of one attempt, printed or followed."""

from __future__ import annotations

import time

from rkit.contract.rundir import RunDir


def print_log(run: RunDir, *, rank: int, attempt: int | None, follow: bool, echo) -> None:
    from rkit.contract.errors import RkitError

    numbers = run.attempt_numbers()
    if not numbers:
        raise RkitError(f"{run.path}: no attempts yet.")
    n = numbers[-1] if attempt is None else attempt
    path = run.rank_log(n, rank)
    if not path.exists():
        raise RkitError(f"{path}: no such log (attempts: {', '.join(map(str, numbers))}; ranks start at 0).")
    import codecs

    from rkit.contract.safeio import open_regular

    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    with open_regular(path) as fh:  # a FIFO, a device or a directory: an error naming it, not a hang
        while True:
            if text := decoder.decode(fh.read()):
                echo(text.rstrip("\n"))
            if not follow:
                return
            time.sleep(0.5)
