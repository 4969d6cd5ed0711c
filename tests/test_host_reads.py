"""The host-read counter behind `python -m harness.host_reads` (issue 35's measure of a GPU step)."""

import pytest
import torch

from harness.perf.host_reads import counting_host_reads, reads_per_step
from methods.ar import AutoregressiveDecoder
from methods.base import available_methods, get_method
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from tests.conftest import tiny_model
from tests.test_static_step import PROMPTS, method_context, method_params


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
    # inside inference mode (where the engine runs) the dispatcher sees other ops for the same reads
    with torch.inference_mode(), counting_host_reads() as reads:
        u = torch.arange(6, dtype=torch.float32)
        int(u[2]), float(u[3]), u[4].item(), bool(u[1] > 0), int(u.max())  # five scalar reads
        u[u > 2], u.masked_select(u > 2), (u > 2).nonzero()  # three data-dependent shapes
        u.to("meta"), u.to(torch.device("meta"), torch.float16), u.to(torch.zeros(1, device="meta"))  # three copies
        u.to(torch.float64), u[1:].sum(), u.index_select(0, torch.tensor([1]))  # no read
    assert reads.counts == {"scalar": 5, "nonzero": 3, "device copy": 3}, reads.counts


def test_an_autoregressive_step_reads_its_token():
    model = tiny_model("llama", seed=3)
    per_step, counts, steps = reads_per_step(AutoregressiveDecoder(ModelRunner(model)), [[1, 2, 3]], StopCondition(12))
    assert steps == 12 and per_step >= 1  # the next token must come back to the host at least once a step
    assert sum(counts.values()) == round(per_step * steps)


def test_device_greedy_acceptance_is_the_host_rule_with_its_margins():
    """`greedy_accept_logits` (the shared loop's greedy rule, one read) takes the same path, next
    token and margins as `greedy_accept` + `logit_margins`, including trees whose siblings repeat a
    token (the first matching child wins) and near-ties."""
    import random

    from methods.engine.acceptance import greedy_accept, greedy_accept_logits
    from methods.engine.tree import Tree
    from methods.loop import logit_margins

    rng, vocab = random.Random(0), 5
    for trial in range(300):
        n = rng.randint(1, 12)
        parents = [-1] + [rng.randrange(node) for node in range(1, n)]
        tree = Tree(torch.tensor([rng.randrange(vocab) for _ in range(n)]), parents)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(trial))
        if trial % 3 == 0:  # steer acceptance deep: each row's argmax is one of its children's tokens
            for node in range(n):
                if tree.children[node]:
                    logits[node, tree.tokens[rng.choice(tree.children[node])]] += 10
        expected = greedy_accept(tree, logits.argmax(-1).tolist())
        emitted = tree.tokens[expected.path[1:]].tolist() + [expected.next_token]
        with counting_host_reads() as reads:
            got = greedy_accept_logits(tree, logits)
        assert (got.path, got.next_token, got.emitted) == (expected.path, expected.next_token, emitted)
        assert got.margins == pytest.approx(logit_margins(logits[expected.path], emitted), abs=0)
        assert reads.total == 1


def test_a_batchs_greedy_acceptance_is_one_pass_and_each_trees_own_rule():
    """`greedy_batch_pending` (a batch's greedy acceptance, one vectorized pass and one read): each
    tree, padded among trees of other sizes (host trees and device trees), takes the path, next
    token, margins and per-node statistics its own rule takes alone."""
    import random

    from methods.engine.acceptance import greedy_accept_logits, greedy_batch_pending
    from methods.engine.tree import DeviceTree, Tree

    rng, vocab = random.Random(1), 5
    for trial in range(60):
        trees = []
        for b in range(rng.randint(1, 4)):
            n = rng.randint(1, 9)
            parents = [-1] + [rng.randrange(node) for node in range(1, n)]
            tokens = torch.tensor([rng.randrange(vocab) for _ in range(n)])
            tree = Tree(tokens, parents)
            if rng.random() < 0.5:  # the same tree kept on the device (EAGLE-2's)
                tree = DeviceTree(tokens, torch.tensor([0] + parents[1:]), torch.tensor(tree.depths),
                                  height=max(tree.depths))
            trees.append(tree)
        rows = max(len(t) for t in trees) + rng.randint(0, 2)  # the step's padded width
        logits = torch.randn(len(trees), rows, vocab, generator=torch.Generator().manual_seed(trial))
        for b, tree in enumerate(trees):  # steer acceptance deep: a row's argmax is one of its children's tokens
            for node in range(len(tree)):
                if tree.children[node] and rng.random() < 0.7:
                    logits[b, node, tree.tokens[rng.choice(tree.children[node])]] += 10
        pending = greedy_batch_pending(trees, logits)
        with counting_host_reads() as reads:
            got = pending.parse(pending.values.tolist())
        assert reads.total == 1
        for b, tree in enumerate(trees):
            alone = greedy_accept_logits(tree, logits[b, : len(tree)])
            assert vars(got[b]) == vars(alone), (trial, b)


def test_a_greedy_step_of_the_shared_loop_reads_the_host_once():
    """Issue 35's budget for the shared loop: AR's accepted path, next token and margins come back
    in one read a step, the prefill's first token and its margin too."""
    model = tiny_model("llama", seed=3)
    per_step, counts, steps = reads_per_step(AutoregressiveDecoder(ModelRunner(model)), [[5, 9, 3, 7, 11]],
                                             StopCondition(40))
    assert steps == 40 and sum(counts.values()) == steps, counts


# Issue 35's budget: host reads per greedy decoding step (the step's one read; EAGLE-2/3's default
# adaptive size is the host's choice, read once more with the tree's structure: a fixed size reads
# once, `test_a_fixed_size_dynamic_tree_reads_the_host_once`). Per answer, a method may add PER_ANSWER
# reads (Lookahead's first window, Token Recycling's matrix statistics).
BUDGET = {"eagle2": 2, "eagle3": 2}
PER_ANSWER = 2


@pytest.mark.parametrize("method",
                         [m for m in available_methods() if m != "lazyllm" and not m.startswith(("toy", "echo"))])
def test_every_method_keeps_its_host_read_budget(method, tmp_path, monkeypatch):

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=3, layers=8)
    decoder = get_method(method)(ModelRunner(target), method_params(method, tmp_path),
                                 method_context(target, tmp_path))
    decoder.generate(PROMPTS[0], StopCondition(8))  # first-use work (a latency curve, a random head) is not a step's
    with counting_host_reads() as reads:
        out = decoder.generate(PROMPTS[1], StopCondition(40))
    steps = out.stats.steps
    assert steps > 5 and reads.total <= BUDGET.get(method, 1) * steps + PER_ANSWER, (reads.counts, steps)


@pytest.mark.parametrize("method", [m for m in available_methods() if m not in ("lazyllm", "jacobi")
                                    and not m.startswith(("toy", "echo"))])
def test_a_sampled_step_reads_at_most_twice(method, tmp_path, monkeypatch):
    """Issue 35's budget while sampling: 2 reads a step. The acceptance (`acceptance.sample_accept`:
    a chain's or a tree's tests, residuals, next token and margins on the device) reads once; the
    drafters draw on the device (`sampling.draw_children`); EAGLE-2/3 read their tree's structure
    once more. (Jacobi is greedy only.)"""
    from methods.engine.sampling import SamplingConfig

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=3, layers=8)
    decoder = get_method(method)(ModelRunner(target), method_params(method, tmp_path),
                                 method_context(target, tmp_path))
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature=0.8)
    decoder.generate(PROMPTS[0], StopCondition(8), sampling, generator)  # first-use work is not a step's
    with counting_host_reads() as reads:
        out = decoder.generate(PROMPTS[1], StopCondition(40), sampling, generator)
    assert out.stats.steps > 5 and reads.total <= 2 * out.stats.steps + PER_ANSWER, (reads.counts, out.stats.steps)


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
def test_a_fixed_size_dynamic_tree_reads_the_host_once(method, tmp_path, monkeypatch):
    """EAGLE-2/3 at a fixed `total_tokens`: the frontier, top-k, rerank and the tree's structure stay
    on the device (`DeviceTree`), its depth and path nodes' child flags come back in the acceptance's
    read: one read per greedy step, with the tokens and per-position statistics of the same trees
    built on the host."""
    from methods.engine.tree import Tree

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=3, layers=8)
    context = method_context(target, tmp_path)
    device, host = (get_method(method)(ModelRunner(target), {"name": method, "total_tokens": 16}, context)
                    for _ in range(2))
    on_device = host.device_tree
    host.device_tree = lambda *args: Tree((tree := on_device(*args)).tokens, tree.parents)
    outputs = []
    for decoder in (device, host):
        decoder.generate(PROMPTS[0], StopCondition(8))
        with counting_host_reads() as reads:
            outputs.append(decoder.generate(PROMPTS[1], StopCondition(40)))
        if decoder is device:
            steps = outputs[0].stats.steps
            assert steps > 5 and reads.total <= steps + PER_ANSWER, (reads.counts, steps)
    assert outputs[0].tokens == outputs[1].tokens
    for key in ("accepted_lengths", "position_proposed", "position_tested", "position_accepted", "drafted_tokens"):
        assert getattr(outputs[0].stats, key) == getattr(outputs[1].stats, key), key
    assert len(outputs[0].stats.position_proposed) > 1 and outputs[0].stats.position_tested[0] > 5
