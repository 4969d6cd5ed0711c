"""How busy the machine was while a question was measured.

Every answer record carries `machine`: the load readings of `methods.engine.load` over the
question (load averages before and after, other processes' CPU use in cores, steal) and, under
SLURM, the job id, node and how many other jobs ran there. A question is *busy* when other
processes used at least `BUSY_CORES` cores on average, steal reached `BUSY_STEAL` or other SLURM
jobs shared the node: its timing was measured beside other work and its speedup is not to be
trusted alone (the summary lists such questions; see docs/benchmarks.md, "Reading the busy flag").
"""

from __future__ import annotations

from harness.cluster.slurm import slurm_job
from methods.machine import load
from methods.machine.load import BUSY_CORES, BUSY_STEAL, is_busy, snapshot

__all__ = ["BUSY_CORES", "BUSY_STEAL", "is_busy", "snapshot", "state"]


def state(before: dict, after: dict) -> dict:
    """The machine state over the interval between two snapshots, as stored in answer records."""
    record = load.state(before, after)

    job = slurm_job()
    if job:
        record["slurm"] = job
        record["busy"] = is_busy(record)
    return record
