"""The live progress bar of `rkit run` (rich); quiet when output is not a terminal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .policy import Progress as RunProgress


@contextmanager
def live_progress(*, enabled: bool, total: int) -> Iterator[Callable[[RunProgress], None]]:
    console = Console(stderr=True)
    if not enabled:
        yield lambda p: None
        return
    if not console.is_terminal:
        last = {"attempt": 0}

        def log(p: RunProgress) -> None:
            if p.attempt != last["attempt"]:
                last["attempt"] = p.attempt
                start = "from scratch" if p.committed is None else f"from step {p.committed}"
                console.print(f"rkit: attempt {p.attempt} starting {start}")

        yield log
        return
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[tps]}"), TextColumn("ckpt {task.fields[ckpt]}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
    task = bar.add_task("attempt 1", total=total, tps="", ckpt="-")
    with bar:
        def update(p: RunProgress) -> None:
            bar.update(task, description=f"attempt {p.attempt}",
                       completed=0 if p.step is None else p.step + 1,
                       tps=f"{p.tokens_per_sec:,.0f} tok/s" if p.tokens_per_sec else "",
                       ckpt="-" if p.committed is None else str(p.committed))

        yield update
