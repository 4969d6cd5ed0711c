"""What the data scripts raise, in a module of its own: prepare.py and speed_bench.py both raise it, and
prepare.py imports speed_bench.py (so speed_bench.py cannot import prepare.py back without a circle)."""


class HubUnavailable(SystemExit):
    """A dataset the Hugging Face Hub holds cannot be read (no network, a gated dataset, a missing revision): the
    message says how to prepare the split elsewhere or from local files."""
