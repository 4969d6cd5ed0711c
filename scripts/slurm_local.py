"""A throwaway single-node SLURM on this machine, for trying sweeps and for tests/test_slurm.py.

    python scripts/slurm_local.py install          # apt-get install slurm-wlm munge (quiet, idempotent)
    python scripts/slurm_local.py start /tmp/slurm # prints `export SLURM_CONF=/tmp/slurm/slurm.conf`
    export SLURM_CONF=/tmp/slurm/slurm.conf        # then sbatch / squeue / make sweep LAUNCHER=slurm
    python scripts/slurm_local.py stop /tmp/slurm  # cancels its jobs, stops its daemons by their pids

Everything lives in the given folder: munge key, socket and log, slurm.conf, the controller's
state, slurmd's spool, both daemons' logs and pid files. The node is this machine as `slurmd -C`
sees it (all its CPUs and memory), in one partition `debug`. No accounting (no slurmdbd): sacct
does not work, as on many small clusters; the sweep launcher (hydra_plugins/decodebench_launcher/launcher.py,
harness/cluster/slurm.py) reads job states from squeue and scontrol instead. Needs root (slurmd runs jobs as their
submitting user) and Debian's `slurm-wlm` and `munge` packages (tested with 22.05). Process tracking by /proc
(`proctrack/linuxproc`, `task/none`), so no cgroup setup is needed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
PARTITION = "debug"
DAEMONS = ("slurmd", "slurmctld", "munged")  # stopped in this order


class Unavailable(RuntimeError):
    """SLURM cannot be installed or started here (the reason is the message)."""


def missing_binaries() -> list[str]:
    return [name for name in BINARIES
            if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def install() -> None:
    """Install the Debian packages when a binary is missing; quiet, and a no-op when present."""
    if not missing_binaries():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"SLURM is not installed ({', '.join(missing_binaries())} missing) and apt-get "
                          "cannot be used here (needs root and Debian/Ubuntu)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                    ["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode == 0 and command[1] == "install":
            break
    if missing_binaries():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {tail[0]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


def _run(command: list[str], folder: Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, **kwargs)
    if done.returncode != 0:
        raise Unavailable(f"{' '.join(command)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()} "
                          f"(logs in {folder})")
    return done


def slurm_conf(folder: Path) -> str:
    """The slurm.conf of a one-node cluster whose every file lives in `folder`."""
    host = socket.gethostname().split(".")[0]
    node = subprocess.run([_sbin("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    node = " ".join(part for part in node.split() if not part.startswith("NodeName="))
    return f"""# written by scripts/slurm_local.py: a throwaway single-node cluster
ClusterName=decodebench-local
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={folder}/munge/munge.socket,cred_expire=10
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=2
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
NodeName={host} NodeAddr=127.0.0.1 {node} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def start(folder: Path, timeout_s: float = 60) -> dict:
    """Start munged, slurmctld and slurmd with everything in `folder`; returns the environment
    (SLURM_CONF) that SLURM commands need. Raises Unavailable with the reason."""
    install()
    folder = Path(folder).resolve()
    if os.geteuid() != 0:
        raise Unavailable("a local SLURM needs root (slurmd runs jobs as their user)")
    for sub in ("munge", "state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)  # job processes read slurm.conf; munge checks the socket's directory
    os.chmod(folder / "munge", 0o700)
    key = folder / "munge" / "munge.key"
    if not key.exists():
        _run([_sbin("mungekey"), "--create", f"--keyfile={key}"], folder)
    conf = folder / "slurm.conf"
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:  # a daemon that started is stopped again if a later step fails
        _run([_sbin("munged"), "--force", f"--key-file={key}", f"--socket={folder}/munge/munge.socket",
              f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
              f"--seed-file={folder}/munge/munged.seed"], folder)
        conf.write_text(slurm_conf(folder))
        _run([_sbin("slurmctld"), "-f", str(conf)], folder, env=env)
        _run([_sbin("slurmd"), "-f", str(conf)], folder, env=env)
        deadline = time.time() + timeout_s
        state = ""
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return {"SLURM_CONF": str(conf)}
            time.sleep(0.5)
        logs = "; ".join(f"{name}: {_last_line(folder / f'{name}.log')}" for name in ("slurmctld", "slurmd"))
        raise Unavailable(f"the node did not come up within {timeout_s:.0f} s (sinfo: {state or 'no answer'}; {logs})")
    except (Unavailable, OSError, subprocess.SubprocessError):
        stop(folder)
        raise


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return lines[-1] if lines else "no log"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(folder: Path) -> None:
    """Cancel this cluster's jobs, then stop its daemons by the pids in their pid files."""
    folder = Path(folder).resolve()
    conf = folder / "slurm.conf"
    if conf.is_file() and (folder / "slurmctld.pid").is_file():
        env = {**os.environ, "SLURM_CONF": str(conf)}
        subprocess.run(["scancel", "--user", str(os.getuid())], env=env, capture_output=True, timeout=30)
        deadline = time.time() + 15
        while time.time() < deadline:
            queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            time.sleep(0.5)
    for daemon in DAEMONS:
        pid_file = folder / f"{daemon}.pid"
        if not pid_file.is_file():
            continue
        text = pid_file.read_text().strip()
        pid = int(text) if text.isdigit() else None
        if pid and _alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.time() + 10
            while _alive(pid) and time.time() < deadline:
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        pid_file.unlink(missing_ok=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["install", "start", "stop"])
    parser.add_argument("folder", type=Path, nargs="?", help="where config, state and logs live (start, stop)")
    args = parser.parse_args(argv)
    try:
        if args.action == "install":
            install()
            print("SLURM and munge are installed")
        elif args.folder is None:
            parser.error(f"{args.action} needs a folder")
        elif args.action == "start":
            env = start(args.folder)
            print(f"export SLURM_CONF={env['SLURM_CONF']}")
        else:
            stop(args.folder)
            print(f"stopped the SLURM of {args.folder}")
    except Unavailable as err:
        print(f"SLURM unavailable: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
