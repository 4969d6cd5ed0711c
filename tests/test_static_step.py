"""The static step (`methods/engine/graphs.py`, `engine.cuda_graphs`): what a CUDA graph captures,
run eagerly on the CPU. Every lossless method gives the same greedy tokens through it as through
the ordinary forward; its buffers never move over an answer or the next; it has no graph break."""

import random

import pytest
import torch

from methods.base import BuildContext, available_methods, get_method
from methods.engine.graphs import StaticStep, graph_mode
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.engine.tree import Tree
from methods.rest import write_datastore
from methods.sam import build_static
from tests.conftest import tiny_model
from tests.test_hydra import write_hydra

PROMPTS = [[5, 9, 3, 7, 11, 5, 9, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]


def method_context(target, tmp_path) -> BuildContext:
    """Random heads of every kind, in their released formats, and a one-layer SpS draft."""
    write_hydra(tmp_path / "hydra", target, seed=2)
    drafts = {kind: {"random_init": 0} for kind in ("eagle", "eagle3", "medusa", "dflash")}
    rng = random.Random(0)  # REST's datastore: random text over the vocabulary
    text = [[rng.randrange(target.config.vocab_size) for _ in range(40)] for _ in range(100)]
    write_datastore(tmp_path / "rest.idx", text)
    # SAM's static automaton over the same text (`method_params` names its file)
    build_static(text, eos=0, vocab_size=target.config.vocab_size, log=lambda line: None).save(tmp_path / "sam.npz")
    return BuildContext(target, "tiny", {"drafts": {**drafts, "hydra": {"path": str(tmp_path / "hydra")},
                                                    "sps": {"target_layers": 1}, "pard": {"target_layers": 1}},
                                         "datastores": {"rest": str(tmp_path / "rest.idx")}})


def method_params(method: str, tmp_path) -> dict:
    """A method's `method.*` keys on `method_context`'s model: its defaults, SAM's static automaton the
    file written there (the tiny model has no corpus of its own), PARD's mask id the vocabulary's last
    (the one-layer draft is not a PARD checkpoint: its config names none)."""
    extra = {"sam": {"static": str(tmp_path / "sam.npz")}, "pard": {"mask_token": 255}}
    return {"name": method, **extra.get(method, {})}


def test_the_mode_is_checked_and_resolved_per_device():
    assert graph_mode("auto", torch.device("cpu")) == "off"
    assert graph_mode("on", torch.device("cpu")) == "eager"
    assert graph_mode("auto", torch.device("cuda")) == "graphs"
    assert graph_mode("off", torch.device("cuda")) == "off"
    with pytest.raises(ValueError, match="engine.cuda_graphs='yes'; valid: auto, on, off"):
        graph_mode("yes", torch.device("cpu"))


@pytest.mark.parametrize("method",
                         [m for m in available_methods() if m != "lazyllm" and not m.startswith(("toy", "echo"))])
def test_every_method_decodes_the_same_tokens_through_the_static_step(method, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))  # the random heads
    target = tiny_model("llama", seed=3, layers=8)
    context = method_context(target, tmp_path)
    outputs, used = {}, {"off": [], "on": []}
    original, mode = StaticStep.run, None
    monkeypatch.setattr(StaticStep, "run", lambda self, *a: used[mode].append(self.rows) or original(self, *a))
    for mode in ("off", "on"):
        decoder = get_method(method)(ModelRunner(target, cuda_graphs=mode), method_params(method, tmp_path), context)
        outputs[mode] = [decoder.generate(prompt, StopCondition(40)).tokens for prompt in PROMPTS]
    assert outputs["on"] == outputs["off"]
    assert not used["off"] and used["on"], "the static step ran only in the static mode"


def test_buffers_keep_their_addresses_and_padding_is_dropped():
    """Over two answers the cache's buffers and the static steps stay put (the second answer reuses
    them: no capture again); a padded verification commits only tree nodes."""
    target = tiny_model("llama", seed=5)
    runner = ModelRunner(target, cuda_graphs="on")
    plain = ModelRunner(target, cuda_graphs="off")
    addresses = set()
    for prompt in PROMPTS:
        for r in (runner, plain):
            r.reset()
            r.reserve(len(prompt) + 40)
            r.prefill(prompt)
        for step in range(12):
            tree = Tree(torch.tensor([3, 4, 5]), [-1, 0, 0])  # 3 rows, padded to 4
            start = runner.length
            out, expected = runner.verify(tree), plain.verify(tree)
            torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
            assert runner.length == start + 4 and plain.length == start + 3
            for r in (runner, plain):
                r.commit(start, [0, 2])
            for a, b in zip(runner.cache.layers, plain.cache.layers):
                torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            addresses.add(tuple(layer.key_buffer.data_ptr() for layer in runner.cache.layers))
    assert len(addresses) == 1 and runner.cache.regrowths == 0
    assert sorted(runner.static.steps) == [4]


def test_the_static_step_has_no_graph_break():
    """What a CUDA graph needs, checked on the CPU: Dynamo traces the whole step as one graph."""
    target = tiny_model("llama", seed=7, layers=2)
    runner = ModelRunner(target, cuda_graphs="on")
    runner.reserve(40)
    runner.prefill([1, 2, 3, 4])
    step = runner.static.step(4)
    step.ids.copy_(torch.tensor([[5, 6, 7, 8]]))
    step.start.fill_(runner.length)
    with torch.inference_mode():
        eager = step.compute()[0].clone()
        compiled = torch.compile(step.compute, fullgraph=True, backend="eager")  # raises on a graph break
        torch.testing.assert_close(compiled()[0], eager)


@pytest.mark.parametrize("method", ["eagle", "eagle2", "eagle3"])
def test_the_draft_step_runs_static_and_drafts_what_the_ordinary_loop_drafts(method, tmp_path, monkeypatch):
    """The EAGLE family's whole draft step over the head's reserved cache at device positions
    (`StaticDraft`: what a CUDA graph captures, run eagerly here), the follow of the accepted path
    included, drafts step by step what the ordinary loop drafts (EAGLE-1's template tokens; EAGLE-2/3's
    candidates: tokens, parents, path values); the head's eager follow runs only for the prompt (and
    where the step no longer fits near an answer's end); the head cache's buffers never move over two
    answers."""
    from methods.eagle.drafter import EagleDrafter
    from methods.eagle.static_draft import StaticDraft

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=3, layers=8)
    context = method_context(target, tmp_path)
    drafted, tokens, static_runs, addresses = {"off": [], "on": []}, {}, [], set()
    follows = {"off": 0, "on": 0}
    compute, follow = StaticDraft.compute, EagleDrafter.follow
    monkeypatch.setattr(StaticDraft, "compute",
                        lambda self, key, path: static_runs.append(path) or compute(self, key, path))
    loop = "_fill" if method == "eagle" else "expand"
    params = {"name": method} if method == "eagle" else {"name": method, "total_tokens": 16}
    for mode in ("off", "on"):
        monkeypatch.setattr(EagleDrafter, "follow", lambda self, *args, mode=mode: follows.__setitem__(
            mode, follows[mode] + 1) or follow(self, *args))
        decoder = get_method(method)(ModelRunner(target, cuda_graphs=mode), params, context)
        assert (decoder.static is None) == (mode == "off")
        original = getattr(decoder, loop)
        setattr(decoder, loop, lambda *args, mode=mode, original=original, **kw: drafted[mode].append(
            out := original(*args, **kw)) or out)
        tokens[mode] = []
        for prompt in PROMPTS:
            tokens[mode].append(decoder.generate(prompt, StopCondition(30)).tokens)
            layer = decoder.drafter.cache.layers[0]
            addresses.add((mode, layer.key_buffer.data_ptr(), layer.value_buffer.data_ptr()))
    assert tokens["on"] == tokens["off"]
    assert len(static_runs) == len(drafted["on"]) == len(drafted["off"]) > 20
    # every step but each answer's first feeds its accepted path inside the static step
    assert static_runs.count(False) == len(PROMPTS) and follows["on"] == len(PROMPTS)
    assert follows["off"] >= len(drafted["off"])  # the ordinary loop feeds every accepted path eagerly
    for on, off in zip(drafted["on"], drafted["off"]):
        for a, b in zip(on, off):
            if a is None or b is None:
                assert a is b
            elif a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(a, b)
    assert len([a for a in addresses if a[0] == "on"]) == 1  # one reserved head cache for both answers


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_the_draft_step_has_no_graph_break(method, tmp_path, monkeypatch):
    """What a CUDA graph of the whole draft step needs, checked on the CPU: Dynamo traces it, the
    follow of the accepted path and every level's head forward, top-k and tree update (EAGLE-1's
    template, EAGLE-2's frontier), as one graph."""
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=7, layers=2)
    params = {"name": method} if method == "eagle" else {"name": method, "total_tokens": 16}
    decoder = get_method(method)(ModelRunner(target, cuda_graphs="on"), params, method_context(target, tmp_path))
    decoder.generate(PROMPTS[0], StopCondition(12))
    static, depth = decoder.static, decoder.full_depth()
    decoder.drafter.committed = len(PROMPTS[0])  # an accepted path of 3 tokens after the prompt, deferred
    decoder.drafter.defer([5, 6, 7], torch.randn(3, target.config.hidden_size))
    assert static.ready(depth)
    with torch.inference_mode():
        assert static.stage()
        eager = [t.clone() for t in static.compute(depth, True) if t is not None]
        # raises on a graph break
        compiled = torch.compile(lambda: static.compute(depth, True), fullgraph=True, backend="eager")()
    for a, b in zip([t for t in compiled if t is not None], eager):
        torch.testing.assert_close(a, b)


def test_compiled_static_steps_decode_the_same_tokens(tmp_path, monkeypatch):
    """`engine.compile=on` on the CPU: Inductor compiles the target's static step per rows bucket and
    EAGLE-2's whole draft step (follow and levels), each as one graph without a break, and they
    decode the tokens of the uncompiled steps."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=3, layers=2)
    context = method_context(target, tmp_path)
    params = {"name": "eagle2", "total_tokens": 8, "depth": 2, "top_k": 2}
    tokens, graphs = {}, {}
    for mode in ("off", "on"):
        counters.clear()
        decoder = get_method("eagle2")(ModelRunner(target, cuda_graphs="on", compile=mode), params, context)
        tokens[mode] = decoder.generate(PROMPTS[0], StopCondition(24)).tokens
        graphs[mode] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        buckets = len(decoder.target.static.steps)
    assert tokens["on"] == tokens["off"]
    assert graphs["off"] == (0, 0)
    assert graphs["on"] == (buckets + 1, 0)  # every bucket the answer verified, and the draft step
    with pytest.raises(ValueError, match="engine.compile=on compiles the static steps: it needs engine.cuda_graphs=on"):
        ModelRunner(target, cuda_graphs="off", compile="on")
