"""`python -m harness.host_reads`: host reads per decoding step, see `harness/perf/host_reads.py`."""

from harness.perf.host_reads import main

if __name__ == "__main__":
    main()
