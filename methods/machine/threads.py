"""OpenMP's wait policy, chosen when the suite is imported, before torch loads the OpenMP runtime
(libgomp reads it once, when it loads).

Between parallel regions OpenMP's threads wait for the next one. libgomp's default spins (300,000
iterations, milliseconds) before it sleeps: on a quiet CPU that saves a wake-up at each of the
~100 regions and barriers of a step; on an oversubscribed one a spinning thread burns the time
slice its partner needs, and every barrier waits for a thread that is not running.
`python -m harness.perf.contention` measures it; on the AMD EPYC AVX512-BF16 class (2 cores,
AR on the embedded model, fp32, tokens/s, x its fair share = quiet / k):

    policy                    quiet          2x oversubscribed   5x oversubscribed
    libgomp default (spin)    45.7 (1.00)    4.5-10  (0.2-0.46)  1.0-1.1 (0.12)
    OMP_WAIT_POLICY=PASSIVE   28-31 (0.65)   20.5 (0.94)         6.4 (0.73)
    GOMP_SPINCOUNT=1000       37.4 (0.79)    19.3 (0.88)         6.0 (0.69)
    one thread                34.6 (0.74)    15.4 (0.66)         5.8 (0.61)

No one setting is good both ways, so `auto` (the default) looks before it chooses: it samples the
machine for SAMPLE_SECONDS and keeps libgomp's spinning when nothing else runs, PASSIVE when
other processes use at least PASSIVE_CORES cores (or the hypervisor steals `load.BUSY_STEAL`). Work that starts later,
mid-run, is not seen (the policy cannot change once torch has loaded); the busy flag marks those questions.
DECODEBENCH_OMP_POLICY=auto|spin|passive|inherit overrides (`inherit`: what the environment says); an OMP_WAIT_POLICY or
GOMP_SPINCOUNT already set is always kept.
"""

from __future__ import annotations

import os
import sys
import time

from . import load

CHOICES = ("auto", "spin", "passive", "inherit")
KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SAMPLE_SECONDS = 0.2
# other processes' CPU use, in cores, that makes `auto` choose PASSIVE: a process that runs all the
# time (a core or most of one), not one that starts beside us (a Python start-up is ~0.3 cores of
# a 0.2 s sample, and made `auto` choose PASSIVE at a 0.25 threshold, costing a third of AR's speed)
PASSIVE_CORES = 0.75
_CHOSEN: dict = {}


def configure() -> dict:
    """Sets the wait policy once per process, before torch is imported; returns what was chosen
    and why ({"policy", "why"}), as results record it."""
    if _CHOSEN:
        return dict(_CHOSEN)
    choice = os.environ.get("DECODEBENCH_OMP_POLICY", "auto")
    if choice not in CHOICES:
        raise ValueError(f"DECODEBENCH_OMP_POLICY={choice!r}; valid: {', '.join(CHOICES)}")
    given = {knob: os.environ[knob] for knob in KNOBS if knob in os.environ}
    described = " ".join(f"{k}={v}" for k, v in given.items()) or "libgomp default (spin)"
    if "torch" in sys.modules:
        _CHOSEN.update(policy=described,
                       why="torch was imported before the suite: its OpenMP runtime had read the policy")
    elif given or choice == "inherit":
        _CHOSEN.update(policy=described, why="set by the environment")
    elif choice == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _CHOSEN.update(policy="OMP_WAIT_POLICY=PASSIVE", why="DECODEBENCH_OMP_POLICY=passive")
    elif choice == "spin":
        _CHOSEN.update(policy=described, why="DECODEBENCH_OMP_POLICY=spin")
    else:
        before = load.snapshot()
        time.sleep(SAMPLE_SECONDS)
        record = load.state(before, load.snapshot())
        others = record.get("other_cores") or 0.0
        if others >= PASSIVE_CORES or (record.get("steal") or 0.0) >= load.BUSY_STEAL:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            _CHOSEN.update(policy="OMP_WAIT_POLICY=PASSIVE",
                           why=f"other processes used {others:.2f} cores at start (steal "
                               f"{100 * (record.get('steal') or 0):.0f}%): "
                               "spinning threads would stall every barrier")
        else:
            _CHOSEN.update(
                policy=described,
                why=f"quiet at start (other processes {others:.2f} cores): spinning saves a wake-up per region",
            )
    return dict(_CHOSEN)
