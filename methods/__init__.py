"""Decoding methods. `base.py` holds the `Decoder` interface and the registry, `loop.py` the loop
every method shares over a batch of sequences, `state.py` one sequence's state; every other module
here is one method (its drafter only) and registers itself by name, and `eagle/` is the EAGLE
family's package (it registers `eagle`, `eagle2` and `eagle3`); `engine/` is the machinery they
share (target forward + KV cache, trees, acceptance, sampling, stopping); `machine/` is the machine
profile (everything that measures the machine, handed in); `models/` loads targets, draft LMs and
draft heads; `settings/` is what a method is configured with (its typed settings and `auto` sizing)."""

from .machine import threads as _threads

_threads.configure()  # before anything imports torch: OpenMP reads its wait policy once
