"""`python -m harness.perf` (`make perf`): see `harness/perf/engine.py`."""

from harness.perf.engine import main

main()
