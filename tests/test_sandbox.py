"""pass@1's sandbox against hostile completions: each program below exits 0 only if its attack
worked, so none may score as a pass, and none may leave a trace outside the sandbox (a file, a
connection, a process that outlives it)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from harness.running import execution
from harness.running.execution import SandboxUnavailable, humaneval_passes, run_program, sandbox_problem
from tests.conftest import REPO

if sandbox_problem():
    pytest.skip(f"no sandbox on this machine: {sandbox_problem()}", allow_module_level=True)

GUARD_BYPASS = "import sys\nfor m in ('socket', '_socket', 'resource', 'multiprocessing'): sys.modules.pop(m, None)\n"


def hostile(tmp_path: Path, port: int) -> dict[str, str]:
    """name -> program; `marker` paths are on the host, outside the sandbox."""
    marker = tmp_path / "escaped"
    repo_marker = REPO / "escaped-from-sandbox"
    return {
        "write outside the workdir": f"open({str(marker)!r}, 'w').write('x')",
        "write into the repository": f"open({str(repo_marker)!r}, 'w').write('x')",
        "write into HOME": "import os\nopen(os.path.expanduser('~root/escaped-from-sandbox'), 'w').write('x')",
        "os.system": f"import os\nassert os.system('touch {marker}') == 0\nassert os.path.exists({str(marker)!r})",
        "subprocess": f"import subprocess\nsubprocess.run(['touch', {str(marker)!r}], check=True)\n"
        f"import os\nassert os.path.exists({str(marker)!r})",
        "subprocess past the guard": "import importlib, subprocess\nimportlib.reload(subprocess)\n"
        f"subprocess.run(['touch', {str(marker)!r}], check=True)\n"
        f"import os\nassert os.path.exists({str(marker)!r})",
        "fork bomb past the guard": "import posix, time\nstarted = 0\nwhile True:\n    try:\n"
        "        if posix.fork() == 0:\n"
        "            time.sleep(60)\n        started += 1\n    except OSError:\n        break\n"
        "assert started > 10000",
        "background child outliving the timeout": "import posix, time, sys\nif posix.fork() == 0:\n"
        "    posix.setsid()\n    time.sleep(12)\n"
        f"    open({str(marker)!r}, 'w').write('late')\n    posix._exit(0)\n"
        "sys.stdout.flush()\ntime.sleep(0.5)\nimport os\nassert "
        f"os.path.exists({str(tmp_path)!r})",
        "network connect": GUARD_BYPASS + "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'escaped')",
        "network to the internet": GUARD_BYPASS + "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
        "huge allocation": "x = bytearray(30 * 1024**3)\nx[-1] = 1",
        "huge output": "import sys\nchunk = 'x' * 1_000_000\nfor _ in range(20_000):\n    sys.stdout.write(chunk)",
        "infinite loop": "while True:\n    pass",
        "kill the harness": f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)",
    }


def processes_with(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_correct_program_passes_and_a_wrong_one_fails():
    problem = {"prompt": "def add(a, b):\n", "entry_point": "add",
               "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n"}
    assert humaneval_passes("```python\ndef add(a, b):\n    return a + b\n```", problem)
    assert not humaneval_passes("```python\ndef add(a, b):\n    return a - b\n```", problem)
    assert humaneval_passes("    return a + b\n", problem)  # the body alone, completed with the prompt


def test_hostile_programs_neither_pass_nor_escape(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    programs = hostile(tmp_path, listener.getsockname()[1])
    results, times = {}, {}
    for name, program in programs.items():
        begin = time.monotonic()
        results[name] = run_program(program, timeout=4)
        times[name] = time.monotonic() - begin
    time.sleep(9)  # past the background child's wake-up: it must have died with its sandbox
    assert {name for name, passed in results.items() if passed} == set()
    assert not (tmp_path / "escaped").exists()
    assert not (REPO / "escaped-from-sandbox").exists()
    assert not Path("/root/escaped-from-sandbox").exists()
    with pytest.raises(TimeoutError):
        listener.accept()  # no connection arrived
    assert processes_with("program.py") == []  # nothing outlived its sandbox
    assert max(times.values()) < 4 + 5, times  # every program was stopped at its timeout


def test_without_a_sandbox_pass_at_1_refuses_unless_opted_in(monkeypatch):
    monkeypatch.setattr(execution.shutil, "which", lambda name: None)
    execution.sandbox_problem.cache_clear()
    monkeypatch.delenv(execution.OPT_IN, raising=False)
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap.*DECODEBENCH_UNSANDBOXED=1"):
            run_program("pass")
        monkeypatch.setenv(execution.OPT_IN, "1")
        assert run_program("pass") and not run_program("raise SystemExit(1)")
    finally:
        execution.sandbox_problem.cache_clear()


def test_a_humaneval_run_without_a_sandbox_stops_before_the_model_loads(monkeypatch):
    from hydra import compose, initialize_config_dir

    from harness.running.validate import validate

    monkeypatch.setattr(execution.shutil, "which", lambda name: None)
    execution.sandbox_problem.cache_clear()
    monkeypatch.delenv(execution.OPT_IN, raising=False)
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["dataset=humaneval"])
        with pytest.raises(SandboxUnavailable, match="refuses"):
            validate(cfg)
    finally:
        execution.sandbox_problem.cache_clear()
