"""OpenMP's wait policy (methods/engine/threads.py): set when the suite is imported, before torch,
from the load at start; the environment's own setting is kept; bad values are named."""

import json
import os
import subprocess
import sys
import time

from harness import REPO

PROBE = ("import json, os, methods, torch; "
         "print(json.dumps({'env': os.environ.get('OMP_WAIT_POLICY'), **methods._threads.configure()}))")


def probe(code: str = PROBE, **env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "DECODEBENCH_OMP_POLICY")}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=REPO, capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip().splitlines()[-1]}


def test_passive_when_the_machine_is_busy_at_start():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(0.3)
        chosen = probe(DECODEBENCH_OMP_POLICY="auto")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert (
        chosen["env"] == "PASSIVE"
        and chosen["policy"] == "OMP_WAIT_POLICY=PASSIVE"
        and "cores at start" in chosen["why"]
    )


def test_the_environment_and_the_override_are_kept():
    chosen = probe(OMP_WAIT_POLICY="ACTIVE")
    assert chosen["env"] == "ACTIVE" and chosen["why"] == "set by the environment"
    assert probe(DECODEBENCH_OMP_POLICY="passive")["env"] == "PASSIVE"
    spin = probe(DECODEBENCH_OMP_POLICY="spin")
    assert spin["env"] is None and spin["policy"] == "libgomp default (spin)"
    late = probe("import json, torch, methods; print(json.dumps(methods._threads.configure()))")
    assert "torch was imported before" in late["why"]


def test_a_bad_policy_is_named():
    failed = probe("import methods", DECODEBENCH_OMP_POLICY="sleepy")
    assert failed["error"] == "ValueError: DECODEBENCH_OMP_POLICY='sleepy'; valid: auto, spin, passive, inherit"
