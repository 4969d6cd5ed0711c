"""Reporting runs: tables (`report`), figures, the published numbers beside ours (`published`) and the
reference run of every method (`headline`)."""
