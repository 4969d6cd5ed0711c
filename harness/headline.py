"""`python -m harness.headline` (what `make headline` calls): see `harness/reporting/headline.py`."""

from harness.reporting.headline import main

if __name__ == "__main__":
    raise SystemExit(main())
