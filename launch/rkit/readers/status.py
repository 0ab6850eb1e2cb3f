"""`rkit status`: what a run directory says about where the run is and why, read from its files alone (its live
view, `--watch`: readers/watch.py)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from rkit.contract.config import Config
from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, last_jsonl
from rkit.readers import goodput, goodput_events
from rkit.readers.digest import RunDigest
from rkit.readers.display import TOP, more, num, progress, render_goodput, resumed_from, steps_text, top
from rkit.run.policy import FINAL_EVENTS, RunState
from rkit.run.stragglers import straggler_events
from rkit.runtime.telemetry import metrics
from rkit.runtime.trainers import localtier, maxtext

SLURM_ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "REQUEUE_HOLD", "REQUEUE_FED",
                "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT")


@dataclass
class StatusFold(goodput_events.Fold):
    """What `rkit status` reads of the events, folded in one event at a time (`feed`): rkit.readers.digest keeps one per
    run, so a call reads only the events appended since the last; `StatusFold.of(events)` for events in hand."""

    goodput: goodput_events.EventFold = field(default_factory=goodput_events.EventFold)
    count: int = 0
    last: dict | None = None
    word: dict | None = None  # the newest final word, run.submitted or run.resumed (run_state)
    submitted_t: float | None = None
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # per attempt, by number
    stepped: set[int] = field(default_factory=set)  # attempts with an attempt.first_step
    job_submitted: bool = False
    job_id: Any = None  # of the last job.submitted, as written (checked where it is used)
    jobs_started: list[dict] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # the last nodes.excluded or nodes.rejoined
    injections: list[Any] = field(default_factory=list)
    stragglers: list[dict] = field(default_factory=list)
    disk_low: list[dict] = field(default_factory=list)
    period: int | None = None  # the newest attempt's checkpoint period (checkpoint.period auto chooses each)
    period_choice: dict | None = None  # the newest checkpoint.period event: period auto's choice and why
    tally: dict | None = None  # the newest attempt.ended's budgets used (policy.Tally.as_dict)

    def feed(self, e: dict) -> None:
        self.goodput.feed(e)
        self.count += 1
        self.last = e
        kind = e.get("event")
        if kind in FINAL_EVENTS or kind in (EV.RUN_SUBMITTED, EV.RUN_RESUMED):
            self.word = e
        if kind == EV.RUN_SUBMITTED and self.submitted_t is None:
            self.submitted_t = e["t"]
        n = e.get("attempt")
        if n is not None:
            row = self.rows.setdefault(n, {"attempt": n})
            if kind == EV.ATTEMPT_STARTED:
                self.period = e.get("checkpoint_period") or self.period
                row.update(started=e["t"], resume_from_step=e.get("resume_from_step"), nodes=e.get("nodes"),
                           processes=e.get("processes"), data_position=e.get("data_position"),
                           gradient_accumulation_steps=e.get("gradient_accumulation_steps"))
            elif kind == EV.ATTEMPT_FIRST_STEP:
                row["first_step_seconds"] = e.get("seconds_since_start")
            elif kind == EV.AGENT_MESH:
                row.update(devices=e.get("devices"), mesh=e.get("mesh"), global_batch=e.get("global_batch"))
            elif kind == EV.ATTEMPT_ENDED:
                row.update(ended=e["t"], cause=e.get("cause"), detail=e.get("detail"), decision=e.get("decision"),
                           committed_step=e.get("committed_step"), planned=bool(e.get("planned")))
                self.tally = e.get("tally") or self.tally
            elif kind == EV.CHECKPOINT_RESTORED:  # rank 0, with a local tier: the step and tier it came from
                row.update(restored_step=e.get("step"), restored_tier=e.get("tier"), lost_step=e.get("lost_step"))
            elif kind == EV.ATTEMPT_FAILED and "failed" not in row:
                row.update(failed=e["t"], detected_by=e.get("detected_by"), detect_seconds=e.get("detect_seconds"))
        if kind == EV.ATTEMPT_FIRST_STEP:
            self.stepped.add(n)
        elif kind == EV.JOB_SUBMITTED:
            self.job_submitted, self.job_id = True, e.get("job_id")
        elif kind == EV.JOB_STARTED:
            self.jobs_started.append(e)
        elif kind in (EV.NODES_EXCLUDED, EV.NODES_REJOINED):
            self.excluded = [str(n) for n in e.get("excluded") or []]
        elif kind == EV.INJECT_FIRED:  # the spec as given to --inject; else rebuilt from the event's fields
            self.injections.append(str(e.get("spec") or f"{e.get('kind', '?')}:" + ",".join(
                f"{k}={e[k]}" for k in ("rank", "step", "code") if e.get(k) is not None)))
        elif kind == EV.CHECKPOINT_PERIOD:
            self.period_choice = {k: e.get(k) for k in ("attempt", "period", "reason")}
        elif kind == EV.NODE_STRAGGLER:
            self.stragglers.extend(straggler_events([e]))
        elif kind == EV.DISK_LOW:
            self.disk_low.append({k: e.get(k) for k in ("attempt", "node", "fs", "path", "free_bytes", "fraction",
                                                        "threshold")})

    def attempts(self) -> list[dict[str, Any]]:
        """One row per attempt, by number (copies: a caller may add to them); a resumed attempt's row says how its
        recovery from the previous one's failure went (`recovery`)."""
        out = []
        for n in sorted(self.rows):
            row = dict(self.rows[n])
            if (parts := self.recovery(n)) is not None:
                row["recovery"] = parts
            out.append(row)
        return out

    def recovery(self, n: int) -> dict[str, float | None] | None:
        """Attempt n's recovery from attempt n-1's failure, in seconds: detect (the dead node's last heartbeat ->
        the failure), stop (-> the attempt ended), launch (-> the new ranks' agents started: the new step,
        containers or standbys), imports, distributed set-up, restore, compile (-> the first step); total."""
        prev, a = self.rows.get(n - 1), self.goodput.attempts.get(n)
        if not prev or prev.get("ended") is None or prev.get("cause") == "completed" or a is None \
                or a.first_step is None:
            return None
        agents = self.goodput.agents.get(n, {})
        began = prev.get("failed", prev["ended"]) - (prev.get("detect_seconds") or 0.0)
        started, ready = agents.get("started"), agents.get("ready")
        distributed = agents.get("distributed", 0.0) if ready is not None else None
        restore = a.restore[1] - a.restore[0] if a.restore else 0.0
        return {"detect": prev.get("detect_seconds"),
                "stop": prev["ended"] - prev["failed"] if "failed" in prev else None,
                "launch": None if started is None else started - prev["ended"],
                "imports": None if None in (started, ready) else ready - started - distributed,
                "distributed": distributed, "restore": restore if ready is not None else None,
                "compile": None if ready is None else a.first_step - ready - restore,
                "total": a.first_step - began}


def _fold(events: list[dict] | StatusFold) -> StatusFold:
    return events if isinstance(events, StatusFold) else StatusFold.of(events)


def slurm_info(events: list[dict] | StatusFold) -> dict[str, Any] | None:
    """The run's Slurm job as its events and squeue see it (None for local runs)."""
    from rkit.backends.slurm import launcher as slurm

    fold = _fold(events)
    if not fold.job_submitted:
        return None
    job = slurm.checked_job_id(fold.job_id, "events.jsonl (job.submitted)")
    live = slurm.job_state(job)
    started = [e for e in fold.jobs_started if e.get("job_id") == job]
    return {"job_id": job, "state": live.get("state", "gone (not in the queue)"), "reason": live.get("reason"),
            "asked": live.get("state") != slurm.UNASKED,  # False: squeue could not say (missing, no controller)
            "nodes": live.get("nodes") or (started[-1].get("allocation") if started else None),
            "excluded_nodes": fold.excluded,
            # SLURM_RESTART_COUNT counts every requeue of the job, Slurm's own (node failure) and rkit's.
            "requeues": max((e.get("restart_count") or 0 for e in started), default=0),
            "restart_count": started[-1].get("restart_count") if started else None}


def run_state(run: RunDir, events: list[dict] | StatusFold, slurm: dict[str, Any] | None = None, *,
              final_committed: bool = False) -> tuple[RunState, str]:
    if run.is_locked():
        return RunState.RUNNING, "a supervisor is running this run"
    fold = _fold(events)
    kind = fold.word.get("event") if fold.word else None
    if kind in FINAL_EVENTS:
        return FINAL_EVENTS[kind], fold.word.get("reason", "")
    if not fold.count:
        return RunState.PENDING, "nothing has happened yet"
    if slurm and slurm["state"] in SLURM_ACTIVE:
        return RunState.PENDING if slurm["state"] != "RUNNING" else RunState.RUNNING, \
            f"Slurm job {slurm['job_id']} is {slurm['state']}" + (f" ({slurm['reason']})" if slurm["reason"]
                                                                   and slurm["reason"] != "None" else "")
    if final_committed:  # the final word was lost (a cut last line of events.jsonl), the checkpoint was not
        return RunState.FINISHED, ("the final step is committed (events.jsonl has no final word from the supervisor: "
                                   "its last line may have been cut)")
    if slurm and not slurm.get("asked", True):  # not "stopped, resume it": Slurm may hold or requeue it still
        return RunState.STOPPED, (f"the supervisor is not running here and Slurm could not be asked about job "
                                  f"{slurm['job_id']} ({slurm['reason']}); see `squeue -j {slurm['job_id']}` before "
                                  f"resuming: Slurm may still hold, run or requeue it")
    return RunState.STOPPED, ("the supervisor ended without a final word (killed or machine lost); "
                              f"resume with `{resume_command(run)}`")


def resume_command(run: RunDir) -> str:
    """The `rkit run ... --resume` the run was stamped with (its recipe's absolute path and -o options)."""
    try:
        said = run.load_manifest().get("run", {}).get("resume_command")
    except (RkitError, OSError, ValueError, AttributeError):
        said = None
    return said if isinstance(said, str) and said.startswith("rkit run ") and "\n" not in said else \
        "rkit run RECIPE --resume"


def _steps_from_digest(digest: RunDigest, fold: StatusFold, period: int | None
                       ) -> tuple[list[dict[str, Any]], int, dict[int, goodput_events.AttemptSteps]] | None:
    """The merged view's newest 20 steps, the count of recomputed steps and goodput's AttemptSteps from rank 0's
    digest; None when it cannot stand in for the lines (legacy lines, or an attempt that stepped without rank 0:
    goodput then reads every rank)."""
    rank0 = digest.rank0()
    if rank0.legacy or fold.stepped - set(rank0.attempts()):
        return None
    return rank0.newest_steps(20), rank0.recomputed_steps(), rank0.attempt_steps(period)


def status(run: RunDir, *, events: list[dict] | None = None, config: Config | None = None, stamp: dict | None = None,
           rank_lines: dict[int, list[dict[str, Any]]] | None = None,
           placed: list[dict[str, Any]] | None = None, digest: RunDigest | None = None) -> dict[str, Any]:
    """The run's state as plain data. The keywords are what a caller has read already (`rkit report` reads each
    file once): events (run.events()), config (run.config()), stamp (run.load_manifest()), rank_lines
    (metrics.lines of every rank, by rank) and placed (goodput.run_lines). Without them the events and rank 0's
    metrics are read through `digest` (rkit.readers.digest: only what was appended since the last read; a live view
    passes the same one every frame), saved to the reader's cache afterwards."""
    run.require()
    config = run.config() if config is None else config
    stamp = run.load_manifest() if stamp is None else stamp
    own_digest = digest is None and events is None and rank_lines is None and placed is None
    if own_digest:
        digest = new_digest(run)
    fold = StatusFold.of(events) if events is not None else digest.fold() if digest is not None else \
        StatusFold.of(run.events())
    slurm = slurm_info(fold)
    committed = maxtext.latest_committed_step(run)
    state, reason = run_state(run, fold, slurm,
                              final_committed=maxtext.final_committed(run, config.trainer.final_step))
    total = config.trainer.final_step + 1
    processes = config.processes
    period = config.checkpoint.fixed_period or fold.period
    # A live run's open session ends now; a finished or stopped one ends at its last record.
    now = time.time() if state in (RunState.RUNNING, RunState.PENDING) else None
    fast = _steps_from_digest(digest, fold, period) if digest is not None and rank_lines is None \
        and placed is None else None
    if fast is not None:
        newest, recomputed_steps, steps_of = fast
        lost = goodput.compute(fold.goodput, checkpoint_period=period, now=now, steps=steps_of)
    else:
        # read once: the merged view and the goodput both need it
        rank0 = metrics.lines(run, 0) if rank_lines is None else rank_lines.get(0, [])
        merged = list(metrics.merge(rank0).values())
        newest, recomputed_steps = merged[-20:], sum(1 for s in merged if s["recomputed"])
        if placed is None:
            placed = goodput.run_lines(run, run.events() if events is None else events, rank0,
                                       every_rank=rank_lines)
        lost = goodput.compute(fold.goodput, placed, checkpoint_period=period, now=now)
    if own_digest:
        digest.save()
    recent = [s for s in newest if s["step_time"]]
    step_time = statistics.median(s["step_time"] for s in recent) if recent else None
    tps = [s["tokens_per_sec_per_device"] for s in newest if s["tokens_per_sec_per_device"]]
    started = fold.submitted_t
    ended = fold.last["t"] if fold.last and state is not RunState.RUNNING else time.time()
    current = newest[-1]["step"] if newest else None
    done_steps = (current + 1) if current is not None else 0
    eta = (total - done_steps) * step_time if state is RunState.RUNNING and step_time else None
    final_loss = newest[-1]["loss"] if newest else None
    table = fold.attempts()
    loss = run.load_outcome().get("loss") if run.outcome_file.is_file() else None
    if state is RunState.STOPPED:
        for row in table:  # its supervisor is gone: it is not running, whatever its processes do
            if "started" in row and "cause" not in row:
                row.update(cause="lost", detail="its supervisor ended without recording how; `rkit run --resume` "
                                                "checks its processes and records it")
    return {
        "name": run.name,
        "path": str(run.path),
        "state": state.value,
        "reason": reason,
        "config_hash": stamp.get("config_hash"),
        "step": current,  # MaxText's own number (from 0); steps_done = step + 1
        "steps_done": done_steps,
        "total_steps": total,
        "last_committed_step": committed,
        "final_step_committed": maxtext.final_committed(run, config.trainer.final_step),
        "loss": final_loss,
        # the newest attempt's processes: an elastic run's shrunk attempt has fewer than the recipe's
        "tokens_per_sec": statistics.median(tps) * ((table[-1].get("processes") if table else None) or processes)
        if tps else None,
        "checkpoint_auto": dict(fold.period_choice, setting=config.checkpoint.period)
        if config.checkpoint.auto and fold.period_choice else None,
        "checkpoint_tiers": localtier.tiers(run) if config.checkpoint.local_dir else None,
        "elastic": {"nodes": config.resources.nodes, "min_nodes": config.resources.fewest_nodes}
        if config.resources.can_shrink else None,
        "step_time_seconds": step_time,
        "elapsed_seconds": round(ended - started, 1) if started else None,
        "eta_seconds": round(eta, 1) if eta is not None else None,
        "recomputed_steps": recomputed_steps,
        "budgets": budgets_used(fold.tally, config, period),
        "attempts": table,
        "injections": list(fold.injections),
        "slurm": slurm,
        "goodput": lost.as_dict(top=3),
        "outcome": None if not isinstance(loss, dict) else
        {"loss_sha256": loss.get("sha256"), "first_step": loss.get("first_step"), "last_step": loss.get("last_step")},
        "stragglers": list(fold.stragglers),
        "disk_low": list(fold.disk_low),
        "last_event": fold.last,
        "nodes": node_states(run, table[-1] if table else None, time.time(),
                             latest=None if rank_lines is None else
                             {rank: lines[-1] if lines else None for rank, lines in rank_lines.items()}),
    }


def budgets_used(tally: dict | None, config: Config, period: int | None) -> dict[str, Any] | None:
    """What the run has spent of its restart budgets (the newest attempt.ended's tally), against the recipe's;
    planned ends (time limits and preemptions answered by their save) are counted, never charged."""
    if not isinstance(tally, dict):
        return None
    r = config.resilience
    return {"training_failures": tally.get("training_failures"), "max_restarts": r.max_restarts,
            "infra_failures": tally.get("infra_failures"), "max_infra_restarts": r.max_infra_restarts,
            "planned_ends": tally.get("planned_ends", 0), "refills": tally.get("refills", 0),
            "window_steps": r.window_steps(period)}


def new_digest(run: RunDir) -> RunDigest:
    """The run's digest for status: its events folded into a StatusFold."""
    return RunDigest(run, StatusFold)


def render_status(s: dict[str, Any]) -> str:
    state = s["state"]
    lines = [f"run        {s['name']}  ({s['path']})",
             f"state      {state}" + (f": {s['reason']}" if s["reason"] and state != "running" else "")]
    lines.append(f"progress   {progress(s['step'], s['total_steps'])}, last committed step "
                 f"{num(s['last_committed_step'], '{}')}, loss {num(s['loss'], '{:.4f}')}")
    lines.append(f"speed      {num(s['tokens_per_sec'], '{:.0f}')} tokens/s, step time "
                 f"{num(s['step_time_seconds'], '{:.3f}')} s (median of recent steps)")
    lines.append(f"time       elapsed {num(s['elapsed_seconds'])} s" +
                 (f", ETA {num(s['eta_seconds'])} s" if s["eta_seconds"] is not None else ""))
    lines.append(f"config     {s['config_hash']}")
    lines.append(f"goodput    {render_goodput(s['goodput'])}")
    if (auto := s.get("checkpoint_auto")) and isinstance(auto, dict):
        lines.append(f"checkpoint every {auto.get('period')} steps from attempt {auto.get('attempt')} (period: "
                     f"{auto.get('setting', 'auto')}; {auto.get('reason')})")
    if (tiers := s.get("checkpoint_tiers")) and isinstance(tiers, dict):
        lines.append(f"tiers      persistent (run directory) {steps_text(tiers.get('persistent'))}; local (node "
                     f"storage) {steps_text(tiers.get('local'))}" + "".join(
                         f"; rank {r.get('rank')} on {r.get('node')}: {steps_text(r.get('steps'))}"
                         for r in (tiers.get("ranks") or [])[:TOP] if isinstance(r, dict)))
    if s.get("outcome") and s["outcome"]["loss_sha256"]:
        o = s["outcome"]
        lines.append(f"outcome    loss {o['loss_sha256']} over steps {o['first_step']}-{o['last_step']} "
                     "(outcome.json; rkit compare RUN OTHER)")
    shown, left = top(s["stragglers"], "ratio")
    for st in shown:
        lines.append(f"straggler  {st['node']} in attempt {st['attempt']}: median step time "
                     f"{num(st['ratio'], '{:.2f}')}x the other nodes'")
    lines += more(left, "stragglers")
    shown, left = top(s["disk_low"])
    for d in shown:
        lines.append(f"disk low   {d['fs']} ({d['path']}) on {d['node']} in attempt {d['attempt']}: "
                     f"{d['free_bytes']} bytes free, {num((d['fraction'] or 0) * 100, '{:.2f}')}% "
                     f"(threshold {num((d['threshold'] or 0) * 100, '{:.0f}')}%)")
    lines += more(left, "disk warnings")
    if s.get("slurm"):
        j = s["slurm"]
        lines.append(f"slurm      job {j['job_id']} {j['state']}, nodes {j['nodes'] or '-'}, excluded "
                     f"{', '.join(j['excluded_nodes']) or 'none'}, requeues {j['requeues']}")
    if s["injections"]:
        lines.append(f"injected   {', '.join(i if isinstance(i, str) else '?' for i in s['injections'][:TOP])}" +
                     (f" and {len(s['injections']) - TOP} more" if len(s["injections"]) > TOP else ""))
    if isinstance(b := s.get("budgets"), dict):
        window = (f"; refilled by {b['window_steps']} committed steps without a failure" +
                  (f" ({b['refills']} time(s) so far)" if b.get("refills") else "")) if b.get("window_steps") else ""
        lines.append(f"budgets    training failures {num(b.get('training_failures'), '{}')} of "
                     f"{b['max_restarts']}, infrastructure {num(b.get('infra_failures'), '{}')} of "
                     f"{b['max_infra_restarts']}{window}; planned ends {num(b.get('planned_ends'), '{}')} (time "
                     "limits and preemptions answered by their save: never charged)")
    lines.append(f"attempts   {len(s['attempts'])}" +
                 (f" ({s['recomputed_steps']} step(s) recomputed after restarts)" if s["recomputed_steps"] else ""))
    for a in s["attempts"]:
        start = resumed_from(a)
        start = start if start == "from scratch" else f"resumed from {start}"
        end = str(a.get("cause", "running")) + (", a planned end: saved, no budget spent" if a.get("planned") else "")
        found = "" if not a.get("detected_by") else f"; found by {a['detected_by']}" + (
            f" {a['detect_seconds']:.1f} s after the node's last heartbeat" if a.get("detect_seconds") else "")
        detail = f" ({a['detail']}{found})" if a.get("detail") else ""
        size = ""
        if s.get("elastic") and isinstance(a.get("nodes"), list):  # the size over time (resources.min_nodes)
            size = f" on {len(a['nodes'])} of {s['elastic']['nodes']} nodes" + "".join(
                f", {label} {a[key]}" for key, label in (("devices", "devices"), ("gradient_accumulation_steps",
                                                                                 "gradient accumulation"),
                                                         ("global_batch", "global batch")) if a.get(key))
        lines.append(f"  #{a['attempt']}  {start}{size}: {end}{detail}")
        if a.get("recovery"):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in a["recovery"].items() if k != "total" and v is not None)
            lines.append(f"       recovery {a['recovery']['total']:.1f} s: {parts}")
    return "\n".join(lines)


def follow(run: RunDir, echo, poll_seconds: float = 2.0) -> RunState:
    """`rkit run --wait`: print progress lines until the run reaches a final state and its job left the queue."""
    last = None
    digest = new_digest(run)
    while True:
        s = status(run, digest=digest)
        digest.save()
        line = f"{s['state']}: {progress(s['step'], s['total_steps'])}, committed " \
               f"{num(s['last_committed_step'], '{}')}, attempts {len(s['attempts'])}"
        if line != last:
            echo(line)
            last = line
        slurm_done = not s["slurm"] or s["slurm"]["state"] not in SLURM_ACTIVE
        if RunState(s["state"]).is_final() and slurm_done:
            return RunState(s["state"])
        time.sleep(poll_seconds)


def node_states(run: RunDir, attempt: dict[str, Any] | None, now: float,
                latest: dict[int, dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
    """Per node of the current attempt: the ranks that reported a step in it, their newest step, and the age of
    the node's newest health sample (telemetry/<node>.jsonl). Reads only the ends of the files; `latest`: each
    rank's newest metrics line (normalized) when the caller has read the metrics files already."""
    if attempt is None:
        return []
    nodes = [str(n) for n in attempt.get("nodes") or []]
    rows = {n: {"node": n, "ranks": [], "last_step": None, "telemetry_age_seconds": None} for n in nodes}
    for rank in metrics.ranks(run) if latest is None else sorted(latest):
        if latest is None:
            raw = last_jsonl(run.metrics_file(rank))
            line = metrics.normalize(raw) if raw else None
        else:
            line = latest[rank]
        if line is None or (line.get("attempt") is not None and line["attempt"] != attempt["attempt"]):
            continue  # nothing from this rank in this attempt yet
        # MaxText's raw lines name no node: on a one-node attempt it can only be that node.
        node = str(line.get("node") or (nodes[0] if len(nodes) == 1 else "?"))
        row = rows.setdefault(node, {"node": node, "ranks": [], "last_step": None, "telemetry_age_seconds": None})
        row["ranks"].append(rank)
        row["last_step"] = line["step"] if row["last_step"] is None else max(row["last_step"], line["step"])
    for row in rows.values():
        sample = last_jsonl(run.telemetry_file(row["node"]))
        if sample and isinstance(sample.get("t"), (int, float)):
            row["telemetry_age_seconds"] = round(now - sample["t"], 1)
    return list(rows.values())
