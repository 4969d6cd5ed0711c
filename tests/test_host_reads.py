"""The host-read counter behind `python -m harness.host_reads` (issue 35's measure of a GPU step)."""

import torch

from harness.perf.host_reads import counting_host_reads, reads_per_step
from methods.ar import AutoregressiveDecoder
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from tests.conftest import tiny_model


def test_every_kind_of_host_read_is_counted_once():
    t = torch.arange(6, dtype=torch.float32)
    original_tolist = torch.Tensor.tolist
    with counting_host_reads() as reads:
        int(t[2]), float(t[3]), t[4].item(), bool(t[1] > 0)  # four scalar reads
        t.tolist(), t.numpy()
        (t > 2).nonzero()
        t.to("meta")  # a copy to another device
        (t * 2 + 1).sum(-1, keepdim=True)  # device-side work reads nothing
    assert reads.counts == {"scalar": 4, "tolist": 1, "numpy": 1, "nonzero": 1, "device copy": 1}
    assert reads.total == 8 and torch.Tensor.tolist is original_tolist  # patched only inside


def test_an_autoregressive_step_reads_its_token():
    model = tiny_model("llama", seed=3)
    per_step, counts, steps = reads_per_step(AutoregressiveDecoder(ModelRunner(model)), [[1, 2, 3]], StopCondition(12))
    assert steps == 12 and per_step >= 1  # the next token must come back to the host at least once a step
    assert sum(counts.values()) == round(per_step * steps)
