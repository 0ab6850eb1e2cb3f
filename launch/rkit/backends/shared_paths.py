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


def per_node_argv(nodes: list[str], job_name: str, command: list[str]) -> list[str]:
    """One job step running `command` once on each of `nodes`, its output labelled by task (this check's and
    gpu_health's)."""
    return ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", "--label", "--kill-on-bad-exit=0", f"--job-name={job_name}", *command]


def by_task(nodes: list[str], text: str) -> dict[str, list[str]]:
    """Pure: each node's lines of a per-node step's labelled output (task i ran on the i-th node)."""
    out: dict[str, list[str]] = {node: [] for node in nodes}
    for line in text.splitlines():
        if (m := LABEL.match(line)) and int(m.group(1)) < len(nodes):
            out[nodes[int(m.group(1))]].append(m.group(2))
    return out


def check_argv(nodes: list[str], paths: list[str]) -> list[str]:
    return per_node_argv(nodes, "rkit-shared-paths", ["stat", "--format=%n", "--", *paths])


def unseen(nodes: list[str], paths: list[str], stdout: str, stderr: str) -> dict[str, list[str]]:
    """Pure: {node: [paths it could not see]} from the check step's labelled output. A node whose task printed
    neither its paths nor an error about them (its task did not start) cannot see any of them."""
    printed, errors = by_task(nodes, stdout), by_task(nodes, stderr)
    out: dict[str, list[str]] = {}
    for node in nodes:
        seen = {line.strip() for line in printed[node]}
        missing = [p for line in errors[node] for p in paths if f"'{p}'" in line or f"‘{p}’" in line]
        lost = [p for p in paths if p in missing or (p not in seen and not missing)]
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
