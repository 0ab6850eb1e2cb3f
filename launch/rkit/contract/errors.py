"""One error root: every user mistake becomes an RkitError, which the CLI prints and maps to exit code 2."""

from __future__ import annotations

from rkit.contract.stamp import REDACTED, redact_message


class RkitError(Exception):
    """A problem the user can fix. The message says what was given, what is valid and what to do."""

    exit_code = 2


class RunDirUnwritable(RkitError):
    """The run directory's file system refused a write (full, over quota, read-only): the run stops, exit 1."""

    exit_code = 1


class RecipeError(RkitError):
    """A recipe that cannot be used; carries every problem found, each with file, key path and line."""

    def __init__(self, source: str, problems: list[Problem], partial: object = None):
        self.source = source
        self.problems = problems
        # the recipe as far as it could be read (recipe.load.Recipe) when only the schema's checks failed: the
        # checks of its data settings and MaxText keys can still run, so that every problem is named at once
        self.partial = partial
        super().__init__(self.render())

    SHOWN = 100  # problems printed; the rest counted (`rkit validate --json` lists every one)

    def render(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s) in the recipe"]
        lines.extend(f"  {p.render(self.source)}" for p in self.problems[:self.SHOWN])
        if len(self.problems) > self.SHOWN:
            lines.append(f"  ... and {len(self.problems) - self.SHOWN} more (`rkit validate --json` lists them all)")
        return "\n".join(lines)


class Problem:
    """One thing wrong with a recipe: where (key path, line) and what to do."""

    def __init__(self, path: str, message: str, line: int | None = None):
        self.path = path
        self.message = message
        self.line = line

    def render(self, source: str) -> str:
        where = f"{source}:{self.line}" if self.line else source
        key = self.path or "(top level)"
        return f"{where}: {key}: {redact_message(self.message, REDACTED)}"  # a message may quote the value

    def as_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "message": self.message}
