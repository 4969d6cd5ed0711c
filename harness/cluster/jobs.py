"""A sweep's jobs (`make sweep`): the status each job left in its `job.json` (`harness/running/run.py`
writes it at start and end), one line per job.

    python -m harness.cluster.jobs results/.multirun/<sweep>
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.stats.text import speedup_status


def job_status(sweep_dir: Path) -> list[dict]:
    jobs = [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob("*/job.json"))]
    return sorted(jobs, key=lambda j: j.get("job", 0))


def print_jobs(sweep_dir: Path) -> int:
    """One line per job: ok (speedup, τ and their caveats, `harness.stats.text.speedup_status`; results
    folder), failed or interrupted (the error), or running: started but no end recorded (still running, or killed from
    outside: cancelled, out of memory, node lost; its log in the sweep's .submitit folder tells). With the SLURM job and
    node."""
    jobs = job_status(sweep_dir)
    counts = {status: sum(j["status"] == status for j in jobs) for status in ("ok", "running", "interrupted", "failed")}
    print(f"{len(jobs)} jobs in {sweep_dir}: " + ", ".join(f"{n} {status}" for status, n in counts.items() if n))
    for job in jobs:
        overrides = " ".join(job["overrides"])
        slurm = job.get("slurm") or {}
        array = f"{slurm.get('array_job_id')}_{slurm.get('task_id')}, " if slurm.get("array_job_id") else ""
        where = f"  [SLURM job {array}id {slurm['job_id']} on {slurm['node']}]" if slurm else ""
        if job["status"] == "ok":
            numbers = speedup_status(job.get("speedup"), job.get("speedup_ci95"), job.get("tau"), job.get("caveats"))
            print(f"  #{job['job']} ok          {overrides}  {numbers}  {job['results']}{where}")
            if job.get("fidelity_failure"):
                print(f"     {job['fidelity_failure']}")
        elif job["status"] == "running":
            print(f"  #{job['job']} RUNNING     {overrides}  no end recorded: still running, or killed{where}")
        else:
            print(f"  #{job['job']} {job['status'].upper():<11} {overrides}  {job['error']}{where}")
    failed_fidelity = sum(bool(j.get("fidelity_failure")) for j in jobs)
    return 0 if counts["ok"] == len(jobs) and not failed_fidelity else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a sweep folder (results/.multirun/<time stamp>)")
    return print_jobs(parser.parse_args(argv).sweep)


if __name__ == "__main__":
    raise SystemExit(main())
