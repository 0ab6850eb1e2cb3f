"""The event vocabulary of a run's events.jsonl (EV: every name rkit writes or reads) and what a valid event is
(valid_event: the types of the fields readers rely on; a damaged line is skipped, never trusted)."""

from __future__ import annotations

from rkit.contract.safeio import finite


class EV:
    """The event vocabulary of events.jsonl: every name rkit writes or reads."""

    RUN_SUBMITTED = "run.submitted"  # a new run directory stamped: name, config hash, launcher, injections
    RUN_RESUMED = "run.resumed"  # `rkit run --resume` reopened the run: injections, host
    RUN_CHANGED = "run.changed"  # --resume with operational changes or a longer trainer.steps: {key: [old, new]}
    RUN_FINISHED = "run.finished"  # final word: the final step is committed in the run directory (reason)
    RUN_GAVE_UP = "run.gave_up"  # final word: a budget, a crash loop or a user mistake ended it (reason names which)
    RUN_INTERRUPTED = "run.interrupted"  # final word: stopped by Ctrl-C / SIGTERM (or scancel); resumable
    JOB_SUBMITTED = "job.submitted"  # Slurm: sbatch accepted the job: job_id, argv, script
    JOB_STARTED = "job.started"  # Slurm: the batch script's supervisor began: job_id, restart_count, excluded
    JOB_REQUEUE_REQUESTED = "job.requeue_requested"  # the supervisor asks Slurm for a requeue: reason, excluded
    JOB_REQUEUED = "job.requeued"  # scontrol requeue done: job_id, excluded (the next job's ExcNodeList)
    JOB_CANCEL_REQUESTED = "job.cancel_requested"  # `rkit cancel`: scancel sent for job_id
    ATTEMPT_STARTED = "attempt.started"  # an attempt launched: resume_from_step (None: from scratch), nodes, processes
    ATTEMPT_FIRST_STEP = "attempt.first_step"  # rank 0 trained the attempt's first step (start-up ends here)
    ATTEMPT_FAILED = "attempt.failed"  # how it failed: cls (the cause), rank, exit_code, lost_nodes, detected_by
    ATTEMPT_HANG = "attempt.hang"  # no step progress for the hang timeout: culprit rank, stopped_ranks, last_step
    ATTEMPT_STACKS_DUMPED = "attempt.stacks_dumped"  # the hung ranks' Python stacks written to attempts/<n>/stacks/
    ATTEMPT_NO_NODES = "attempt.no_nodes"  # too few healthy nodes to start: healthy, excluded (then a requeue)
    ATTEMPT_ENDED = "attempt.ended"  # cause, committed_step, decision (restart, requeue, finish, give up), tally
    RUN_RESIZED = "run.resized"  # the next attempt trains on another node count (resources.min_nodes): nodes, why
    AGENT_STARTED = "agent.started"  # a rank's agent began (warm: a standby took the rank)
    AGENT_READY = "agent.ready"  # MaxText imported, jax.distributed set up: then restore and compile
    AGENT_MESH = "agent.mesh"  # rank 0, after MaxText's set-up: devices, mesh axes, batch, accumulation, credentials
    IMAGE_REBUILT = "image.rebuilt"  # the SIF's bytes changed, its environment did not: the run goes on
    STANDBY = "standby"  # a warm standby rank: started, ready, died, replaced, discarded (rank, pid)
    STOP_REQUESTED = "stop.requested"  # Ctrl-C / SIGTERM to the supervisor: the ranks get grace_seconds to save
    PREEMPT_REQUESTED = "preempt.requested"  # a time limit or preemption signal: the ranks are asked to save
    PREEMPT_SAVED = "preempt.saved"  # the save asked for committed at or after requested_at_step: a planned end
    PREEMPT_UNSAVED = "preempt.unsaved"  # no new committed step after the request: steps since the last are lost
    PREEMPT_ESCALATED = "preempt.escalated"  # the grace ran out: SIGKILL to the ranks still running (still_running)
    NODES_EXCLUDED = "nodes.excluded"  # left out of later attempts (`withheld`: not, as it would be every node)
    NODES_REJOINED = "nodes.rejoined"  # excluded nodes that answered when asked again: spares again
    NODE_SUSPECTED = "node.suspected"  # heartbeat silent and no step progress on the node: the probe step starts
    NODE_ALIVE = "node.alive"  # a suspected node answered its probe (slow, not dead): the attempt goes on
    NODE_DEAD = "node.dead"  # a suspected node failed its probe: excluded, the attempt restarted without it
    LIVENESS_CHANNEL = "liveness.channel"  # a node's ranks step, its heartbeats never arrive: left to Slurm's view
    LIVENESS_SELF_CHECK = "liveness.self_check"  # many nodes silent at once: the supervisor's own side first
    NODE_UNCONFIRMED = "node.unconfirmed"  # a probe that gave no verdict on the node (the controller, a step limit)
    NODE_STRAGGLER = "node.straggler"  # a node whose median step time is `factor` x the other nodes': node, ratio
    INJECT_FIRED = "inject.fired"  # an --inject fault went off: index, kind, step, spec
    DISK_LOW = "disk.low"  # a file system the run writes to is nearly full: path, free_bytes, total_bytes
    AGENT_ENV_DROPPED = "agent.env_dropped"  # M_<KEY> variables removed before MaxText read them (names only)
    EXPORTER_INSECURE = "exporter.insecure"  # a node's exporter serves plain HTTP beyond loopback (insecure: true)
    CHECKPOINT_QUARANTINED = "checkpoint.quarantined"  # a step that failed its checks or restore, moved aside
    CHECKPOINT_PRUNED = "checkpoint.pruned"  # quarantined steps older than the newest committed one, removed
    CHECKPOINT_NOTE = "checkpoint.note"  # a step holds an item of a kind rkit does not check (not corruption)
    CHECKPOINT_RESTORED = "checkpoint.restored"  # rank 0 with a local tier: the step, its tier, any newer one lost
    CHECKPOINT_PERIOD = "checkpoint.period"  # period auto or a time: an attempt's period, interval, why
    AGENT_DEVICES = "agent.devices"  # a rank's share of its node's GPUs: local rank, visibility variables
    DETERMINISM_CHECKED = "determinism.checked"  # a rank checked deterministic mode's switches after MaxText's set-up
    DETERMINISM_CLOBBERED = "determinism.clobbered"  # one per switch that did not survive: expected, found


# The types of the event fields readers rely on (a field may be absent or null); an event whose `t` is not a time
# or whose `event` is not a name, or any of these of another type, is damaged and skipped.
EVENT_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(("attempt", "rank", "resume_from_step", "committed_step", "last_step", "exit_code",
                     "restart_count", "processes", "index", "requested_at_step", "full_nodes", "node_count",
                     "devices", "global_batch", "gradient_accumulation_steps", "checkpoint_period", "period",
                     "saves", "failures", "lost_step"), int),
    "step": (int, str),  # a training step, or a standby step's name (`standby` notes: "standby-2")
    **dict.fromkeys(("cause", "cls", "reason", "detail", "decision", "node", "error", "signal", "spec", "kind",
                     "name", "what", "received", "config_hash", "tier"), str),
    **dict.fromkeys(("nodes", "lost_nodes", "injections", "healthy", "excluded", "stopped_ranks", "names"), list),
    **dict.fromkeys(("changes", "tally", "mesh"), dict),
    **dict.fromkeys(("seconds", "seconds_since_start", "restore_started", "restore_seconds", "import_seconds",
                     "distributed_seconds", "detect_seconds", "timeout", "seconds_silent", "standby_import_seconds",
                     "ratio", "median", "others_median", "factor", "free_bytes", "total_bytes", "fraction",
                     "threshold", "grace_seconds", "interval_seconds", "mtbf_seconds", "save_seconds",
                     "step_seconds", "hours"), float),
    **dict.fromkeys(("fs", "path"), str),
    "ended_by_launcher": bool,  # attempt.failed: srun ended the failing rank after another's exit (its code lost)
    "planned": bool,  # attempt.ended: a time limit or preemption answered by its save (no budget spent)
}
LATEST_T = 1e11  # seconds since 1970: the year 5138


def valid_event(event: dict) -> bool:
    t = event.get("t")
    if not (finite(t) and 0 <= t < LATEST_T and isinstance(event.get("event"), str)):
        return False
    for key, value in event.items():  # an event's few fields, not every typed name (a month's events: 7x fewer)
        want = EVENT_FIELD_TYPES.get(key)
        if want is None or value is None:
            continue
        if want is float:
            if not finite(value):
                return False
        elif want is int:
            if not isinstance(value, int) or isinstance(value, bool) or abs(value) >= 1 << 62:
                return False
        elif not isinstance(value, want):
            return False
    return True
