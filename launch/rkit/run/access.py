"""A run directory's access on --resume (host side): what rkit owns inside it gets the recipe's `access` again
(rundir.set_access gives what is written from now on), and what another user owns is named."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from rkit.contract.rundir import RunDir


def restore_modes(root: Path, mask: int) -> tuple[int, list[Path]]:
    """Every file and folder below `root` this user owns loses the mode bits `mask` forbids, files their execute
    bits too (a run left 0777 inside, a copy made under another umask); links are not followed. Returns how many
    changed, and what another user owns (rkit cannot change those)."""
    changed, foreign, me = 0, [], os.geteuid()
    for top, dirs, files in os.walk(root, onerror=lambda exc: None):
        for name in [*dirs, *files]:
            path = os.path.join(top, name)
            try:
                info = os.lstat(path)
                if stat.S_ISLNK(info.st_mode):
                    continue
                if info.st_uid != me:
                    foreign.append(Path(path))
                    continue
                # rkit's own modes: folders 0777 & ~mask, files 0666 & ~mask (it writes no executables there)
                extra = mask | (0 if stat.S_ISDIR(info.st_mode) else 0o111)
                if info.st_mode & extra & 0o777:
                    os.chmod(path, stat.S_IMODE(info.st_mode) & ~extra)
                    changed += 1
            except OSError:
                continue
    return changed, foreign


def restore(run: RunDir, mask: int, access: str) -> None:
    changed, foreign = restore_modes(run.path, mask)
    if changed:
        print(f"rkit: note: {changed} file(s) or folder(s) in {run.path} allowed more than access: {access} "
              "does; their modes are restored.", file=sys.stderr)
    if foreign:
        print(f"rkit: warning: {len(foreign)} file(s) or folder(s) in {run.path} belong to another user (first: "
              f"{foreign[0]}); rkit cannot restore their modes. Ask them, or an administrator, to remove or chown "
              "them.", file=sys.stderr)
