"""Reporting runs: `make report` (`report`, the entry, writing `tables` with their `latex`, each table's
`breakdown` and the `curves` across tables), figures, a run's numbers in words (`text`), the published
numbers beside ours (`published`) and the reference run of every method (`headline`)."""
