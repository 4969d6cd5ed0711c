"""SLURM from inside a job: which job and node this process runs as, and who else runs there.

`slurm_job()` is recorded with every answer (through `harness.running.busy.state`), so that an
answer timed beside other jobs on the same node says so.
"""

from __future__ import annotations

import os
import re
import subprocess

SQUEUE_TIMEOUT_S = 10


def slurm_job() -> dict | None:
    """This process's SLURM job, or None outside SLURM:
    {"job_id", "array_job_id" and "task_id" (array jobs only), "node", "other_jobs"}.

    `other_jobs` counts the jobs other than this one running on this node now
    (`squeue -w <node> -h -t R`); None when squeue could not tell (then "squeue_error" says why).
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    node = os.environ.get("SLURMD_NODENAME") or os.environ.get("SLURM_NODELIST")
    record: dict = {"job_id": job_id}
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        record["array_job_id"] = os.environ["SLURM_ARRAY_JOB_ID"]
        record["task_id"] = os.environ.get("SLURM_ARRAY_TASK_ID")
    record["node"] = node
    try:
        # %A is the job's own id (the SLURM_JOB_ID of each array task), unlike %i (array_task form)
        out = subprocess.run(["squeue", "-w", str(node), "-h", "-t", "R", "-o", "%A"],
                             capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as err:
        return {**record, "other_jobs": None, "squeue_error": f"{type(err).__name__}: {err}"}
    if out.returncode != 0:
        return {**record, "other_jobs": None, "squeue_error": out.stderr.strip() or f"exit {out.returncode}"}
    running = {line.strip() for line in out.stdout.splitlines() if line.strip()}
    record["other_jobs"] = len(running - {job_id})
    return record


def job_states(job_ids) -> dict[str, dict]:
    """The state of SLURM jobs from the controller (`scontrol show job`), for clusters without
    accounting (where `sacct` fails). `job_ids`: job or array ids ("123", or "123" for all tasks of
    array 123). Returns {"123" or "123_4": {"JobID", "State", "NodeList"}} as submitit reads sacct's
    output. A job the controller no longer knows (finished more than MinJobAge ago) gets State
    "FINISHED" (done, outcome unknown). Raises OSError/SubprocessError when scontrol cannot answer."""
    states: dict[str, dict] = {}
    for job_id in job_ids:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             timeout=SQUEUE_TIMEOUT_S)
        if out.returncode != 0:
            if "Invalid job id" not in out.stderr:
                raise subprocess.SubprocessError(f"scontrol show job {job_id}: {out.stderr.strip()}")
            states[str(job_id)] = {"JobID": str(job_id), "State": "FINISHED", "NodeList": ""}
            continue
        for line in out.stdout.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" not in fields:
                continue
            info = {"State": fields.get("JobState", "UNKNOWN"), "NodeList": fields.get("NodeList", "")}
            task = fields.get("ArrayTaskId")
            if not task:
                states[fields["JobId"]] = {**info, "JobID": fields["JobId"]}
                continue
            for index in _task_ids(task):
                key = f"{fields['ArrayJobId']}_{index}"
                states[key] = {**info, "JobID": key}
    return states


def _task_ids(spec: str) -> list[int]:
    """Array task ids of scontrol's ArrayTaskId: "4", "1-3", "1,3-5", "0-7%2"."""
    ids = []
    for part in spec.split("%")[0].split(","):
        low, _, high = part.partition("-")
        ids.extend(range(int(low), int(high or low) + 1))
    return ids
