"""`python -m harness.run method=... model=... dataset=...` (what `make bench` calls): see `harness/running/run.py`."""

import sys

from harness.running.run import entry

if __name__ == "__main__":
    entry(sys.argv[1:])
