"""How busy the machine was over an interval: the readings behind every busy flag, for answers
(`harness.running.busy`) and for the hardware profile's measurements (`hardware`).

Over the interval: the load averages at both ends, the CPU time other processes used (in cores:
the machine's busy time from `/proc/stat` minus this process's own and its children's, and a
measured server's) and the
fraction of time the hypervisor stole (`steal`, where the OS reports it). Busy: other processes
used at least `BUSY_CORES` cores on average, steal reached `BUSY_STEAL`, or (under SLURM, recorded
by the harness) other jobs ran on the node.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

BUSY_CORES = 0.25  # other processes' average CPU use over the interval, in cores
BUSY_STEAL = 0.05  # fraction of CPU time stolen by the hypervisor
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat() -> tuple[float, float, float] | None:
    """(busy, steal, total) CPU seconds of the whole machine, or None where /proc/stat is absent."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq = (fields + [0.0] * 7)[:7]
    steal = fields[7] if len(fields) > 7 else 0.0
    busy = user + nice + system + irq + softirq
    return busy / _TICKS, steal / _TICKS, (busy + idle + iowait + steal) / _TICKS


def process_cpu(pid: int) -> float:
    """A running process's CPU time in seconds, its waited-for children's included (`/proc/<pid>/stat`'s
    utime, stime, cutime, cstime); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(float(x) for x in fields[11:15]) / _TICKS


def snapshot(measured: Sequence[int] = ()) -> dict:
    """The counters at one instant; `state(before, after)` turns two of them into a record. This
    process's own CPU time includes its finished children's (a compiler it ran is not other work) and that
    of the running processes `measured` names (a server it measures is not other work either)."""
    times = os.times()
    return {"wall": time.monotonic(), "self_cpu": times.user + times.system + times.children_user
            + times.children_system + sum(process_cpu(pid) for pid in measured),
            "stat": _proc_stat(), "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def state(before: dict, after: dict) -> dict:
    """The machine's load over the interval between two snapshots, with its `busy` flag."""
    record = {"load_before": before["loadavg"], "load_after": after["loadavg"], "other_cores": None, "steal": None}
    elapsed = after["wall"] - before["wall"]
    if before["stat"] and after["stat"] and elapsed > 0:
        busy = after["stat"][0] - before["stat"][0]
        steal = after["stat"][1] - before["stat"][1]
        total = after["stat"][2] - before["stat"][2]
        own = after["self_cpu"] - before["self_cpu"]
        record["other_cores"] = round(max(0.0, busy - own) / elapsed, 3)
        record["steal"] = round(steal / total, 4) if total > 0 else 0.0
    record["busy"] = is_busy(record)
    return record


def is_busy(record: dict | None) -> bool:
    """Measured beside other work: other processes' CPU use, steal, or other SLURM jobs on the node."""
    if not record:
        return False
    return bool((record.get("other_cores") or 0) >= BUSY_CORES or (record.get("steal") or 0) >= BUSY_STEAL
                or ((record.get("slurm") or {}).get("other_jobs") or 0) > 0)
