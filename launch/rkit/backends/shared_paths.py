"""Before the first attempt of a Slurm job: can every node of the allocation see the run directory, the image and
the Python? A run directory that a node cannot see fails obscurely (an srun output file that cannot be opened, an
agent that cannot import, an image "gone"); this says which path and which node, before anything trains.

One job step, one task per node: `srun --label ... stat --format=%n PATH...`. A path a node cannot see is one
`stat: cannot statx 'PATH': ...` line on that task's stderr; with `--label` and one task per node, task i runs on
the i-th node of the step's node list (block distribution in the allocation's node order).
"""

from __future__ import annotations

import re
import subprocess

LABEL = re.compile(r"^\s*(\d+):\s?(.*)$")


def check_argv(nodes: list[str], paths: list[str]) -> list[str]:
    return ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", "--label", "--kill-on-bad-exit=0", "--job-name=rkit-shared-paths",
            "stat", "--format=%n", "--", *paths]


def unseen(nodes: list[str], paths: list[str], stdout: str, stderr: str) -> dict[str, list[str]]:
    """Pure: {node: [paths it could not see]} from the check step's labelled output. A node whose task printed
    neither its paths nor an error about them (its task did not start) cannot see any of them."""
    seen: dict[int, set[str]] = {i: set() for i in range(len(nodes))}
    missing: dict[int, list[str]] = {i: [] for i in range(len(nodes))}
    for line in stdout.splitlines():
        if (m := LABEL.match(line)) and int(m.group(1)) in seen:
            seen[int(m.group(1))].add(m.group(2).strip())
    for line in stderr.splitlines():
        if (m := LABEL.match(line)) and int(m.group(1)) in missing:
            missing[int(m.group(1))] += [p for p in paths if f"'{p}'" in m.group(2) or f"‘{p}’" in m.group(2)]
    out: dict[str, list[str]] = {}
    for i, node in enumerate(nodes):
        lost = [p for p in paths if p in missing[i] or (p not in seen[i] and not missing[i])]
        if lost:
            out[node] = lost
    return out


def check(nodes: list[str], paths: list[str], timeout: float = 120) -> tuple[dict[str, list[str]], str | None]:
    """Run the check step: ({node: [unseen paths]}, None), or ({}, why) when the step itself could not run (the
    caller goes on: the check must not be what stops a run)."""
    try:
        done = subprocess.run(check_argv(nodes, paths), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return {}, f"the check step could not run: {exc}"
    if done.returncode != 0 and not any(LABEL.match(line) for line in (done.stdout + done.stderr).splitlines()):
        return {}, f"the check step failed (srun exit {done.returncode}): {done.stderr.strip()[-300:]}"
    return unseen(nodes, paths, done.stdout, done.stderr), None
