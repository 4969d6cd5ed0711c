"""decodebench's sweep launchers: hydra-submitit-launcher's, for sweeps that time decoding.

`hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml → `decodebench_slurm`) and
`hydra/launcher=local` (→ `decodebench_local`) subclass hydra-submitit-launcher 1.2.0's launchers
(same keys, same job folders, same requeue on preemption/timeout through `checkpoint`) and add:

- `exclusive` (default true): SLURM jobs ask for their node to themselves (`sbatch --exclusive`),
  local jobs run one at a time, so that no job's timing is measured beside another's.
  `hydra.launcher.exclusive=false` for plumbing runs (all jobs at once).
- Job states without accounting: submitit polls `sacct` with a back-off to 10 minutes and, where
  accounting is off, warns on every call and learns of a finished job only from its result file.
  Here each job gets a `QueueWatcher`: `sacct` while it works, else `scontrol show job`
  (harness/cluster/slurm.py), every `poll_s` seconds, with one log line when it switches.
- One status line per job, printed whenever it changes: pending, running (node, questions done,
  how many measured on a busy machine), done (speedup, its interval, τ and their caveats: n, busy
  questions, near-ties and mismatches, a speedup above τ), failed (the last line of its error and
  its log file).

The waiting loop here replaces upstream's `[j.results()[0] for j in jobs]`; the executor setup
mirrors upstream's `launch` (hydra_plugins/hydra_submitit_launcher/submitit_launcher.py).
"""
# No `from __future__ import annotations`: Hydra's plugin scan executes this module before it is in
# sys.modules, and dataclasses cannot resolve string annotations then.

import json
import logging
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import submitit
from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf
from submitit.slurm.slurm import SlurmInfoWatcher

from harness.cluster.slurm import job_states
from harness.running.busy import is_busy
from harness.running.results import read_jsonl
from harness.stats.text import speedup_status

log = logging.getLogger(__name__)
TERMINAL = ("done", "failed")


@dataclass
class SlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.decodebench_launcher.launcher.SlurmLauncher"
    exclusive: bool = True  # sbatch --exclusive: each job has its node to itself
    poll_s: float = 5.0  # seconds between job-state queries and status updates


@dataclass
class LocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.decodebench_launcher.launcher.LocalLauncher"
    exclusive: bool = True  # one job at a time
    poll_s: float = 2.0


ConfigStore.instance().store(group="hydra/launcher", name="decodebench_slurm", node=SlurmConf,
                             provider="decodebench_launcher")
ConfigStore.instance().store(group="hydra/launcher", name="decodebench_local", node=LocalConf,
                             provider="decodebench_launcher")


def queue_watcher(delay_s: float):
    """A submitit SlurmInfoWatcher that reads sacct while it works and scontrol when it does not."""
    class QueueWatcher(SlurmInfoWatcher):
        def __init__(self) -> None:
            super().__init__(delay_s=delay_s)
            self.sacct = shutil.which("sacct") is not None  # False once sacct has failed
            self.failing = False

        def update(self) -> None:
            """One query for every unfinished job (submitit's contract), sacct or scontrol."""
            pending = self._registered - self._finished
            if not pending:
                return
            self._num_calls += 1
            info = None
            if self.sacct:
                done = subprocess.run(self._make_command(), capture_output=True, text=True, timeout=60)
                if done.returncode == 0:
                    info = self.read_info(done.stdout)
                else:
                    self.sacct = False
                    reason = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
                    log.info("sacct unavailable (%s): job states from scontrol every %.0f s", reason, delay_s)
            if info is None:
                try:
                    info = job_states(sorted({job_id.split("_")[0] for job_id in pending}))
                except (OSError, subprocess.SubprocessError) as err:
                    if not self.failing:
                        log.warning("scontrol cannot tell job states (%s); retrying every %.0f s", err, delay_s)
                    self.failing = True
                    info = {}
                else:
                    if self.failing:
                        log.info("scontrol answers again")
                    self.failing = False
                # a whole array the controller forgot: every task of it is finished
                for job_id in pending:
                    gone = info.get(job_id.split("_")[0], {})
                    if job_id not in info and gone.get("State") == "FINISHED":
                        info[job_id] = {**gone, "JobID": job_id}
            self._info_dict.update(info)
            self._last_status_check = time.time()
            for job_id in pending:
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)

    return QueueWatcher()


class _SweepLauncher(BaseSubmititLauncher):
    """submitit's launcher, plus exclusive timing, job states without sacct and status lines."""

    def __init__(self, exclusive: bool = True, poll_s: float = 5.0, **params: Any) -> None:
        super().__init__(**params)
        self.exclusive = bool(exclusive)
        self.poll_s = float(poll_s)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Requeue on preemption or timeout, as upstream: the job resumes its results folder. The
        signal can arrive more than once (proctrack/linuxproc signals every process of the step)
        and submitit's handler is not re-entrant (a second call fails on the first's temporary
        pickle), so once checkpointing starts, further ones are ignored: the job is exiting."""
        signal.signal(getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG), signal.SIG_IGN)
        return super().checkpoint(*args, **kwargs)

    def executor(self):
        """submitit's executor with this launcher's parameters, set up as upstream's `launch` does."""
        init_keys = {"submitit_folder", "max_num_timeout"}
        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        generic = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in generic else f"{self._EXECUTOR}_{k}": v
                                      for k, v in self.params.items() if k not in init_keys})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        executor = self.executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        log.info("Submitit '%s' sweep output dir : %s", self._EXECUTOR, sweep_dir)
        params = [(list(overrides), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
                   Singleton.get_state()) for i, overrides in enumerate(job_overrides)]
        status = SweepStatus(sweep_dir, {p[2]: filter_overrides(p[0]) for p in params})
        jobs = self.submit(executor, params, status)
        status.wait(jobs, self.poll_s)
        killed = [f"#{num} {status.names[num]}: {status.lines[num]}" for num, job in zip(status.names, jobs)
                  if not job.paths.result_pickle.exists() and str(job.state).upper() not in ("COMPLETED", "FINISHED")]
        if killed:  # ended without a result (cancelled, out of memory, node lost): no job.json end either
            raise RuntimeError(f"{len(killed)} of {len(jobs)} jobs ended without a result (re-submit the sweep "
                               "to resume them):\n" + "\n".join(killed))
        return [job.results()[0] for job in jobs]

    def submit(self, executor, params: list, status: "SweepStatus") -> list:
        jobs = self.watch(executor.map_array(self, *zip(*params)))
        status.show(jobs)
        return jobs

    def watch(self, jobs: list) -> list:
        return jobs


class SlurmLauncher(_SweepLauncher):
    _EXECUTOR = "slurm"

    def executor(self):
        executor = super().executor()
        if self.exclusive:
            executor.update_parameters(slurm_exclusive=True)
        return executor

    def watch(self, jobs: list) -> list:
        watcher = queue_watcher(self.poll_s)
        for job in jobs:
            # submitit's SlurmJob shares one class-wide watcher (sacct, up to 10 min between polls);
            # ours is set on these jobs only, as an instance attribute
            job.watcher = watcher
            watcher.register_job(job.job_id)
        return jobs


class LocalLauncher(_SweepLauncher):
    _EXECUTOR = "local"

    def submit(self, executor, params: list, status: "SweepStatus") -> list:
        if not self.exclusive:
            return super().submit(executor, params, status)
        jobs = []
        for one in params:  # one job at a time: none is timed beside another job of the sweep
            status.wait(jobs, self.poll_s)
            jobs.extend(executor.map_array(self, *zip(one)))
            status.show(jobs)
        return jobs


class SweepStatus:
    """One line per job of a sweep, printed when it changes."""

    def __init__(self, sweep_dir: Path, overrides: dict[int, list[str]]):
        """`overrides`: each job's; a job is named by those not shared by every job of the sweep."""
        self.sweep_dir = sweep_dir
        shared = set.intersection(*map(set, overrides.values())) if len(overrides) > 1 else set()
        self.names = {num: " ".join(o for o in job if o not in shared) for num, job in overrides.items()}
        self.lines: dict[int, str] = {}
        for num in self.names:
            self._print(num, "pending (not submitted yet)")

    def _print(self, num: int, line: str) -> None:
        if self.lines.get(num) != line:
            self.lines[num] = line
            print(f"[sweep] #{num} {self.names[num]}: {line}", flush=True)

    def records(self) -> dict[int, dict]:
        """The job.json of each job (harness/running/run.py writes it at start and end)."""
        found = {}
        for path in self.sweep_dir.glob("*/job.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            found[record.get("job")] = record
        return found

    def show(self, jobs: list) -> list[str]:
        records = self.records()
        states = []
        for num, job in zip(self.names, jobs):
            state, line = describe(job, records.get(num))
            states.append(state)
            self._print(num, line)
        return states

    def wait(self, jobs: list, poll_s: float) -> None:
        while not all(state in TERMINAL for state in self.show(jobs)):
            time.sleep(poll_s)


def describe(job, record: dict | None) -> tuple[str, str]:
    """(pending | running | done | failed, the status line) of one submitit job, from its state and
    its job.json (one left by an earlier submission of the sweep, another job id, is ignored)."""
    state = str(job.state)
    record = record if record and record.get("job_id") == job.job_id else {}
    status, slurm = record.get("status"), record.get("slurm") or {}
    job_name = f"{slurm['array_job_id']}_{slurm['task_id']}" if slurm.get("array_job_id") else slurm.get("job_id")
    where = f" on {slurm['node']}, job {job_name}" if slurm.get("node") else ""
    if status == "ok":
        numbers = speedup_status(record.get("speedup"), record.get("speedup_ci95"), record.get("tau"),
                                 record.get("caveats"))
        return "done", f"done{where}: {numbers} ({record.get('results')})"
    if status == "failed":
        error = (record.get("error") or "").strip().splitlines()[-1:] or ["no error recorded"]
        return "failed", f"failed{where}: {error[0]} (log: {job.paths.stderr})"
    if job.done():  # ended without recording its end: killed (cancelled, out of memory, node lost)
        return "failed", f"failed{where}: {state}: {last_line(job.paths.stderr)} (log: {job.paths.stderr})"
    if status == "running" and state.upper() not in ("PENDING", "REQUEUED"):
        return "running", f"running{where}: {questions_done(record)} (log: {job.paths.stderr})"
    again = ", requeued after preemption or time limit" if status == "interrupted" else ""
    return "pending", f"{state.lower()} (job {job.job_id}{again})"


def questions_done(record: dict) -> str:
    """`3/5 questions` and, when some were measured beside other work (either side), `, BUSY 2/3`."""
    total = record.get("questions")
    if not record.get("results") or total is None:
        return "loading"

    rows = {name: read_jsonl(Path(record["results"]) / "answers" / f"{name}.jsonl")
            for name in {record.get("method"), "ar"}}
    done = {row.get("question_id") for row in rows[record.get("method")]}
    busy = {row.get("question_id") for side in rows.values() for row in side if is_busy(row.get("machine"))} & done
    return f"{len(done)}/{total} questions" + (f", BUSY {len(busy)}/{len(done)}" if busy else "")


def last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1].strip()[-300:] if lines else "empty log"
