"""What the Slurm backend asks Slurm (sinfo, scontrol, squeue) and the job-level actions it takes (requeue,
exclude, cancel): every call through argv, every job id checked before any Slurm command sees it."""

from __future__ import annotations

import os
import re
import subprocess

from rkit.contract.errors import RkitError
from rkit.contract.events import EV


def slurm_version() -> tuple[int, int] | None:
    match = re.search(r"(\d+)\.(\d+)", slurm_output(["sinfo", "--version"]))
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_container_launch(mode: str) -> None:
    """`srun --container` (Slurm's OCI support) exists from Slurm 23.02; `srun apptainer exec` works anywhere."""
    if mode != "oci":
        return
    version = slurm_version()
    if version is not None and version < (23, 2):
        raise RkitError(f"slurm.container_launch: oci needs srun --container (Slurm >= 23.02 with an oci.conf); "
                        f"this cluster runs Slurm {version[0]}.{version[1]:02d}. Use container_launch: apptainer.")


def slurm_output(argv: list[str], timeout: float = 30) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def cpus_on_node() -> int | None:
    """The CPUs this job has on this node (SLURM_CPUS_ON_NODE in the batch step), else this machine's."""
    value = os.environ.get("SLURM_CPUS_ON_NODE", "")
    return int(value) if value.isdigit() else os.cpu_count()


def hostnames(nodelist: str) -> list[str]:
    out = slurm_output(["scontrol", "show", "hostnames", nodelist])
    return [line.strip() for line in out.splitlines() if line.strip()]


def node_address(node: str) -> str:
    out = slurm_output(["scontrol", "show", "node", node])
    match = re.search(r"NodeAddr=(\S+)", out)
    return match.group(1) if match else node


def node_states(nodes: list[str]) -> dict[str, str]:
    """Slurm's compact state of each node (sinfo %t: idle, alloc, mix, down, drain, fail, ...; a trailing * when
    it is not responding); {} when sinfo did not answer."""
    out = slurm_output(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"]) if nodes else ""
    states: dict[str, str] = {}
    for line in out.splitlines():
        name, _, state = line.strip().partition(" ")
        states.setdefault(name, state.strip())
    return states


def held_down(state: str) -> bool:
    """A state in which Slurm itself keeps the node from jobs: down, failing, drained or draining, in
    maintenance, or not responding."""
    return state.endswith("*") or state.startswith(("down", "fail", "drain", "drng", "maint"))


def slurmd_addresses(nodes: list[str], timeout: float = 10) -> dict[str, tuple[str, int]]:
    """Where each node's slurmd listens, from one `scontrol show node` of them all (NodeAddr and Port, else the
    cluster's SlurmdPort, else Slurm's default 6818); nodes the controller did not describe are left out."""
    out = slurm_output(["scontrol", "show", "node", ",".join(nodes)], timeout=timeout) if nodes else ""
    found: dict[str, tuple[str, int | None]] = {}
    for block in re.split(r"\n(?=NodeName=)", out):
        name, addr = re.search(r"NodeName=(\S+)", block), re.search(r"NodeAddr=(\S+)", block)
        if name and addr:
            port = re.search(r"\bPort=(\d+)", block)
            found[name.group(1)] = (addr.group(1), int(port.group(1)) if port else None)
    if any(port is None for _, port in found.values()):
        config = re.search(r"SlurmdPort\s*=\s*(\d+)", slurm_output(["scontrol", "show", "config"], timeout=timeout))
        default = int(config.group(1)) if config else 6818
        found = {n: (a, default if p is None else p) for n, (a, p) in found.items()}
    return {n: (a, int(p or 6818)) for n, (a, p) in found.items()}


# A Slurm job id: digits, with _N for an array task or +N for a heterogeneous job's component.
JOB_ID = re.compile(r"^[0-9]{1,12}([_+][0-9]{1,9})?$")


def checked_job_id(job_id: object, where: str = "") -> str:
    """`job_id` if it is a Slurm job id; before any Slurm command sees it (an id read back from a run's files
    could be anything, `-1` or `--signal=KILL` included)."""
    if isinstance(job_id, str) and JOB_ID.fullmatch(job_id):
        return job_id
    raise RkitError(f"{where or 'Slurm job id'}: {job_id!r} is not a Slurm job id (digits, with _N for an array "
                    "task); was the file edited? No Slurm command was run.")


def submitted_job_id(events: list[dict], where: str) -> str | None:
    """The job id of the last `job.submitted` event (checked), or None for a run never submitted."""
    ids = [e.get("job_id") for e in events if e.get("event") == EV.JOB_SUBMITTED]
    return checked_job_id(ids[-1], f"{where} (job.submitted)") if ids else None


UNASKED = "UNKNOWN"  # job_state's state when squeue could not be asked (missing, no controller, no answer)


def job_state(job_id: str) -> dict[str, str]:
    """State, reason, nodes and restart count of a job as squeue sees it; {} when it left the queue; state
    UNASKED, with why as the reason, when squeue could not say (not on PATH, the controller not answering): a job
    that may well be queued is not taken for one that has gone."""
    try:
        done = subprocess.run(["squeue", "-h", "-j", checked_job_id(job_id), "-o", "%T|%r|%N|%D"],
                              capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        return {"state": UNASKED, "reason": f"squeue could not be run: {exc.strerror or exc}"}
    except subprocess.TimeoutExpired:
        return {"state": UNASKED, "reason": "squeue did not answer within 30 s"}
    out = done.stdout if done.returncode == 0 else ""
    if done.returncode != 0 and "Invalid job id" not in done.stderr:  # gone from the controller's memory: gone
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"state": UNASKED, "reason": f"squeue failed: {said[:200]}"}
    if not out.strip():
        return {}
    state, reason, nodes, count = (out.strip().splitlines()[0].split("|") + ["", "", "", ""])[:4]
    return {"state": state, "reason": reason, "nodes": nodes, "node_count": count}


def requeue(job_id: str) -> bool:
    done = subprocess.run(["scontrol", "requeue", checked_job_id(job_id)], capture_output=True, text=True,
                          check=False)
    return done.returncode == 0


def exclusion_that_fits(job_id: str, nodes: list[str]) -> list[str]:
    """Of NODES, those the requeued job can be kept off and still be schedulable: Slurm refuses a job whose
    ExcNodeList leaves its partition fewer nodes than it asks for (BadConstraints: pending for ever, even once the
    nodes are back; the fault campaign's 3-node test bed after two crashes). Nodes Slurm holds down are dropped from
    the list first (it keeps jobs off them itself); if that is not enough, the list is cut to what fits."""
    job = slurm_output(["scontrol", "show", "job", checked_job_id(job_id)])
    wanted, partition = re.search(r"\bNumNodes=(\d+)", job), re.search(r"\bPartition=(\S+)", job)
    if not wanted or not partition:
        return nodes  # cannot tell: as asked
    states: dict[str, str] = {}
    for line in slurm_output(["sinfo", "-h", "-N", "-p", partition.group(1), "-o", "%N %t"]).splitlines():
        name, _, state = line.strip().partition(" ")
        states.setdefault(name, state)
    room = len(states) - int(wanted.group(1))  # how many of the partition's nodes may be excluded
    if not states or len(nodes) <= room:
        return nodes
    down = [n for n in nodes if held_down(states.get(n, ""))]
    return [*[n for n in nodes if n not in down], *down][:max(0, room)]


def exclude_nodes(job_id: str, nodes: list[str]) -> bool:
    """Keep NODES out of a pending job's next allocation (Slurm refuses this for a running job)."""
    done = subprocess.run(["scontrol", "update", f"jobid={checked_job_id(job_id)}", f"ExcNodeList={','.join(nodes)}"],
                          capture_output=True, text=True, check=False)
    return done.returncode == 0


def cancel(job_id: str) -> bool:
    done = subprocess.run(["scancel", checked_job_id(job_id)], capture_output=True, text=True, check=False)
    return done.returncode == 0



def step_ids(names: list[str]) -> dict[str, str]:
    """The ids of this job's steps named `names` (one squeue for all of them); those squeue does not list are
    left out."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or not names:
        return {}
    wanted, found = set(names), {}
    for line in slurm_output(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j"]).splitlines():
        step, _, named = line.partition("|")
        if named.strip() in wanted:
            found.setdefault(named.strip(), step.split(".")[-1])
    return found


def step_id(name: str) -> str | None:
    """The id of this job's step named `name` (squeue), None when there is none."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    for line in slurm_output(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j"]).splitlines():
        step, _, named = line.partition("|")
        if named.strip() == name:
            return step.split(".")[-1]
    return None
