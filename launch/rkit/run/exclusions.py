"""Which nodes later attempts leave out, and for how long (issue 40).

A node is excluded on evidence (a confirmed death, a step srun could not start on it, unfit GPUs), never the whole
allocation: when every healthy node would go, the fault is more likely the supervisor's own side (its network, its
host) than every node at once, so nothing is excluded and the next attempt runs where this one did
(`withheld` on the `nodes.excluded` event). An exclusion is not for life: before an attempt, nodes excluded at
least RECHECK_AFTER seconds ago, and before a requeue every excluded node of the allocation, are asked again (the
backend's `recheck`: Slurm's own state, then a probe step); one that answers rejoins as a spare (`nodes.rejoined`),
so the requeued job's ExcNodeList holds only nodes Slurm holds down or that failed a check in this job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rkit.contract.config import Config
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir
from rkit.run import elastic

RECHECK_AFTER = 60.0  # seconds an excluded node stays out before an attempt asks it again (a requeue always asks)


@dataclass
class Exclusions:
    run: RunDir
    config: Config
    backend: Any  # backends.base.Backend: its `exclude` list is what attempts leave out
    clock: Callable[[], float] = time.monotonic
    checked: dict[str, float] = field(default_factory=dict)  # node -> when it was last found unfit

    def add(self, nodes: list[str], reason: str = "implicated in a node failure") -> bool:
        """Keep failed nodes out of the next step; True when too few healthy nodes are left (requeue)."""
        exclude = self.backend.exclude
        new = [n for n in nodes if n not in exclude]
        healthy = self.backend.healthy_nodes()
        withheld = bool(new) and not [n for n in healthy if n not in new]
        if not withheld:
            exclude.extend(new)
            healthy = [n for n in healthy if n not in new]
            self.checked.update(dict.fromkeys(new, self.clock()))
        self.run.emit(EV.NODES_EXCLUDED, nodes=nodes, excluded=list(exclude), healthy=healthy,
                      reason=reason if not withheld else
                      f"{reason}; not excluded: every healthy node of the allocation would be (the supervisor's "
                      f"side is more likely at fault than all of them at once)",
                      **({"withheld": True} if withheld else {}))
        return elastic.size_for(self.config, len(healthy)) is None

    def rescue(self, keep_out: list[str]) -> bool:
        """Too few healthy nodes are left after excluding `keep_out`: before the allocation is given up for a
        requeue, the nodes excluded earlier are asked again (a repaired node answers; the fault campaign's second
        node crash requeued the job 0.1 s before the first node, back for a minute, rejoined). True when enough
        answered for the job to go on."""
        earlier = [n for n in self.backend.exclude if n not in keep_out]
        if earlier:
            self.readmit(requeue=True, nodes=earlier)
        return elastic.size_for(self.config, len(self.backend.healthy_nodes())) is not None

    def readmit(self, *, requeue: bool, nodes: list[str] | None = None) -> list[str]:
        """Ask excluded nodes again (before a requeue all, else those excluded RECHECK_AFTER seconds ago or more;
        `nodes`: those); the ones that answer rejoin. Returns them."""
        now = self.clock()
        due = [n for n in self.backend.exclude if n in nodes] if nodes is not None else [
            n for n in self.backend.exclude if requeue or now - self.checked.get(n, float("-inf")) >= RECHECK_AFTER]
        if not due:
            return []
        said = self.backend.recheck(due)
        back = [n for n in due if said.get(n) is None]
        self.checked.update({n: now for n in due if n not in back})
        if back:
            self.backend.exclude[:] = [n for n in self.backend.exclude if n not in back]
            self.run.emit(EV.NODES_REJOINED, nodes=back, excluded=list(self.backend.exclude),
                          healthy=self.backend.healthy_nodes(),
                          reason="answered when asked again after its exclusion: a spare again",
                          still_out={n: why for n, why in said.items() if why is not None})
        return back
