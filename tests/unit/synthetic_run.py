"""A small synthetic run directory with a known timeline, for goodput, status and report tests.

Timeline (seconds after 1000; a Slurm run with checkpoint.period 5, two nodes, one rank each):
  0 run.submitted, job.submitted             -> queue 10
  10 job.started, 12 attempt 1 started       -> other 2
  32 first step (step 0)                     -> startup 20
  33..50 steps 1..14, step time 1 s except steps 6 and 11 (3 s: the saves of steps 5 and 10)
                                             -> productive 14, checkpoint 4
  80 attempt.hang, 30 s silent               -> hang 30 (50..80)
  85 attempt.ended (hang, requeue)           -> teardown 5
  86 job.requeued, 100 job.started           -> other 1, requeue 14
  101 attempt 2 started from step 10         -> other 1
  111 first step (step 11)                   -> startup 10
  112..119 steps 12..19, 1 s each; 12..14 were trained before -> recompute 3, productive 5
  122 attempt.ended (completed)              -> shutdown 3 (the final save: not a failure's teardown)
  123 run.finished                           -> other 1
Wall time 123 s.
"""

from __future__ import annotations

import json
from pathlib import Path

T0 = 1000.0
EXPECTED = {"queue": 10.0, "other": 5.0, "startup": 30.0, "productive": 19.0, "checkpoint": 4.0, "hang": 30.0,
            "teardown": 5.0, "shutdown": 3.0, "requeue": 14.0, "recompute": 3.0}
CONFIG_HASH = "sha256:" + "ab" * 32
IMAGE_SHA = "sha256:" + "cd" * 32


def events() -> list[dict]:
    def ev(t: float, name: str, **fields) -> dict:
        return {"t": T0 + t, "event": name, **fields}

    return [
        ev(0, "run.submitted", total_steps=20, config_hash=CONFIG_HASH),
        ev(0, "job.submitted", job_id="7"),
        ev(10, "job.started", job_id="7", restart_count=0, allocation="n1,n2"),
        ev(12, "attempt.started", attempt=1, resume_from_step=None, nodes=["n1", "n2"], processes=2),
        ev(13, "agent.started", attempt=1, rank=0),
        ev(32, "attempt.first_step", attempt=1, step=0, rank=0, seconds_since_start=20),
        ev(80, "attempt.hang", attempt=1, rank=1, node="n2", last_step=14, seconds_silent=30, timeout=25),
        ev(85, "attempt.ended", attempt=1, cause="hang", detail="hang: rank 1 made no step progress for 30 s",
           committed_step=10, decision="requeue", reason="infrastructure failure"),
        ev(86, "job.requeued", job_id="7", excluded=["n2"]),
        ev(100, "job.started", job_id="7", restart_count=1, allocation="n1,n3"),
        ev(101, "attempt.started", attempt=2, resume_from_step=10, nodes=["n1", "n3"], processes=2),
        ev(111, "attempt.first_step", attempt=2, step=11, rank=0, seconds_since_start=10),
        ev(115, "node.straggler", attempt=2, node="n3", ratio=1.9, median=1.9, others_median=1.0),
        ev(122, "attempt.ended", attempt=2, cause="completed", detail="", committed_step=19, decision="finish",
           reason="done"),
        ev(123, "run.finished", reason="the final step is committed", committed_step=19),
    ]


def metric_lines(rank: int, node_of_attempt: dict[int, str], slow: float = 1.0) -> list[dict]:
    """Rank's lines in the new format; `slow` multiplies this rank's step times (a straggler)."""
    out = []
    t = T0 + 32
    for step in range(15):
        st = 19.0 if step == 0 else (3.0 if step in (6, 11) else 1.0)
        t = T0 + 32 if step == 0 else t + st
        out.append(_line(t, 1, rank, node_of_attempt[1], step, st if step == 0 else st * slow))
    t = T0 + 111
    for step in range(11, 20):
        st = 9.5 if step == 11 else 1.0
        t = T0 + 111 if step == 11 else t + st
        out.append(_line(t, 2, rank, node_of_attempt[2], step, st if step == 11 else st * slow))
    return out


def _line(t: float, attempt: int, rank: int, node: str, step: int, step_time: float) -> dict:
    return {"t": t, "attempt": attempt, "rank": rank, "node": node, "step": step, "loss": 6.0 - step * 0.1,
            "step_time": step_time, "tokens_per_sec_per_device": 64.0 / step_time, "tflops_per_device": 0.01,
            "mfu": None, "device_memory_bytes": None, "device_memory_peak_bytes": None, "host_rss_bytes": 1 << 30}


def write_run(path: Path, *, with_metrics: bool = True, event_list: list[dict] | None = None) -> Path:
    path.mkdir(parents=True)
    resolved = {"name": path.name, "launcher": "slurm", "trainer": {"steps": 20},
                "resources": {"nodes": 2, "processes_per_node": 1}, "checkpoint": {"period": 5},
                "observability": {"straggler_factor": 1.5}}
    (path / "resolved.json").write_text(json.dumps(resolved))
    (path / "manifest.json").write_text(json.dumps({"config_hash": CONFIG_HASH, "rkit_version": "0.1.0",
                                                    "image": {"kind": "sif", "sha256": IMAGE_SHA,
                                                              "path": "/images/x y.sif"}}))
    (path / "attempts").mkdir()
    (path / "metrics").mkdir()
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (event_list or events())))
    if with_metrics:
        for rank, nodes, slow in ((0, {1: "n1", 2: "n1"}, 1.0), (1, {1: "n2", 2: "n3"}, 2.0)):
            text = "".join(json.dumps(x) + "\n" for x in metric_lines(rank, nodes, slow))
            (path / "metrics" / f"{rank}.jsonl").write_text(text + '{"t": 1, "step": 3')  # a line cut by a crash
    return path
