"""Running generated code for HumanEval's pass@1, never in the harness process.

The program (the answer's code, completed with the problem's prompt when the answer holds only the
body) is written to a temporary folder and run by a fresh `python -I` with a timeout, a memory
limit and, where the kernel allows unprivileged namespaces (`unshare -rn`), no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache

TIMEOUT_SECONDS = 10
MEMORY_BYTES = 2 * 1024**3
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(answer: str, prompt: str, entry_point: str) -> str:
    """The program to test: the first code block (or the whole answer), with the problem's prompt
    in front when the code does not define the entry point itself."""
    blocks = _BLOCK.findall(answer)
    code = max(blocks, key=len) if blocks else answer
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return code
    return prompt + code


@lru_cache(maxsize=1)
def _network_isolation() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn"]
    return []  # no namespaces here: still a separate, isolated, time- and memory-limited process


def _limit_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def run_program(source: str, timeout: float = TIMEOUT_SECONDS) -> bool:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w") as f:
            f.write(source)
        try:
            done = subprocess.run([*_network_isolation(), sys.executable, "-I", path], cwd=folder, timeout=timeout,
                                  capture_output=True, preexec_fn=_limit_memory, env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def humaneval_passes(answer: str, problem: dict, timeout: float = TIMEOUT_SECONDS) -> bool:
    program = extract_code(answer, problem["prompt"], problem["entry_point"])
    return run_program(f"{program}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n", timeout)
