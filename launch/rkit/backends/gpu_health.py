"""Before each attempt on GPU nodes: is every node's set of GPUs fit to train? Two causes fail a node:
uncorrectable ECC errors since the driver loaded (a GPU that corrupts memory; NVIDIA's volatile count, AMD's
uncorrectable count), and compute processes still holding a GPU (a rank of an earlier attempt that did not die,
another job on a node that should be ours). A failing node is excluded like a dead one.

Read with the vendor's command-line tool on the node itself, outside any container (the driver's view):
- NVIDIA: `nvidia-smi --query-gpu=index,ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits`
  and `nvidia-smi --query-compute-apps=pid,process_name,gpu_bus_id --format=csv,noheader` (one line per process;
  none when the GPUs are free). ECC reads "[N/A]" on a GPU without ECC: not an error.
- AMD: `amd-smi metric --ecc --json` and `amd-smi process --json`. Their JSON has changed between ROCm releases,
  so the parsers look for what does not change: numbers under keys that name uncorrectable errors, and process
  records with a `pid`.
The tools are found on PATH (srun looks them up in the supervisor's), or where RKIT_NVIDIA_SMI / RKIT_AMD_SMI say.
On Slurm each query is one job step with one task per node (`srun --label`, like the shared-path check); the
local launcher runs it here. A query that cannot run (no tool on a node, the step refused) is a warning: the
check must not be what stops a run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from typing import Any

from rkit.backends.shared_paths import by_task, per_node_argv

QUERIES = {
    "nvidia": {
        "ecc": ["nvidia-smi", "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
                "--format=csv,noheader,nounits"],
        "processes": ["nvidia-smi", "--query-compute-apps=pid,process_name,gpu_bus_id", "--format=csv,noheader"],
    },
    "amd": {
        "ecc": ["amd-smi", "metric", "--ecc", "--json"],
        "processes": ["amd-smi", "process", "--json"],
    },
}


def nvidia_ecc(text: str) -> dict[str, int]:
    """{gpu index: uncorrectable errors} from the csv query (GPUs without ECC left out)."""
    out = {}
    for line in text.splitlines():
        index, _, count = (part.strip() for part in line.partition(","))
        if index.isdigit() and count.isdigit():
            out[index] = int(count)
    return out


def nvidia_processes(text: str) -> list[str]:
    """One description per compute process ("pid 123 python on 00000000:07:00.0")."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0].isdigit():
            out.append(f"pid {parts[0]} {' on '.join(p for p in parts[1:3] if p)}".strip())
    return out


def _walk(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, str(k))
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v, key)
    yield key, value


def _json(text: str) -> Any:
    start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        return None


def amd_ecc(text: str) -> dict[str, int]:
    """{gpu: uncorrectable errors}: every number under a key naming uncorrectable (not deferred) errors."""
    data = _json(text)
    gpus = data if isinstance(data, list) else [data] if isinstance(data, dict) else []
    out = {}
    for i, gpu in enumerate(gpus):
        counts = [v for k, v in _walk(gpu) if re.search(r"(?i)uncorrect", k) and not re.search(r"(?i)defer", k)
                  and isinstance(v, int) and not isinstance(v, bool)]
        if counts:
            out[str(gpu.get("gpu", i)) if isinstance(gpu, dict) else str(i)] = sum(counts)
    return out


def amd_processes(text: str) -> list[str]:
    data = _json(text)
    out = []
    for _, value in _walk(data):
        if isinstance(value, dict) and isinstance(value.get("pid"), int):
            out.append(f"pid {value['pid']} {value.get('name', '')}".strip())
    return out


# Where a site's tool is not on the default PATH (e.g. /opt/rocm/bin/amd-smi): its path in this variable.
TOOL_ENV = {"nvidia": "RKIT_NVIDIA_SMI", "amd": "RKIT_AMD_SMI"}

PARSERS = {("nvidia", "ecc"): nvidia_ecc, ("nvidia", "processes"): nvidia_processes,
           ("amd", "ecc"): amd_ecc, ("amd", "processes"): amd_processes}


def verdict(vendor: str, ecc_text: str, processes_text: str) -> str | None:
    """Pure: why one node's GPUs are unfit, or None."""
    why = []
    bad = {gpu: n for gpu, n in PARSERS[vendor, "ecc"](ecc_text).items() if n > 0}
    if bad:
        why.append("uncorrectable ECC errors on GPU " + ", ".join(f"{g} ({n})" for g, n in sorted(bad.items())))
    if held := PARSERS[vendor, "processes"](processes_text):
        why.append(f"{len(held)} process(es) still holding GPUs: {'; '.join(held[:4])}")
    return "; ".join(why) or None


def step_argv(nodes: list[str], query: list[str]) -> list[str]:
    return per_node_argv(nodes, "rkit-gpu-health", query)


def by_node(nodes: list[str], stdout: str) -> dict[str, str]:
    """Each node's output of a query step, as the text its tool printed."""
    return {node: "\n".join(lines) for node, lines in by_task(nodes, stdout).items()}


def _run(argv: list[str], timeout: float, env: dict[str, str] | None) -> tuple[str | None, str | None]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{argv[0]} could not run: {exc}"
    if done.returncode != 0 and not done.stdout.strip():
        return None, f"{' '.join(argv[:3])}... failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"
    return done.stdout, None


def check(nodes: list[str] | None, vendor: str, *, timeout: float = 120,
          env: dict[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """({node: why its GPUs are unfit}, why the check was not made or None). `nodes` None: this host only
    (the local launcher), under the name "localhost"."""
    texts: dict[str, dict[str, str]] = {}
    tool = (env if env is not None else os.environ).get(TOOL_ENV[vendor])
    for kind, query in QUERIES[vendor].items():
        query = [tool, *query[1:]] if tool else query
        argv = query if nodes is None else step_argv(nodes, query)
        stdout, why = _run(argv, timeout, env)
        if why:
            return {}, why
        texts[kind] = {"localhost": stdout} if nodes is None else by_node(nodes, stdout)
    return {node: why for node in texts["ecc"]
            if (why := verdict(vendor, texts["ecc"][node], texts["processes"].get(node, "")))}, None
