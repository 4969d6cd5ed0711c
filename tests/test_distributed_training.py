"""The draft recipes are data-parallel: 2 gloo processes train the same curve as 1 process at the same
global batch and seed (each rank reading only its shard), a run stopped and resumed from its
checkpoint equals an uninterrupted one, and a mini-batch in one forward equals the per-example losses."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from harness.training.examples import Example, attach_hidden
from harness.training.loop import train
from tests.conftest import hf_greedy, tiny_model

BATCH, EPOCHS, STOP = 4, 3.0, 4  # 12 examples: 9 steps of 4 conversations; the interrupted run stops after 4
FEATURE_LAYERS = (0, 1, 2)  # EAGLE-3 features of the 3-layer target: the inputs of its layers


def _data():
    target = tiny_model("llama", seed=5, vocab_size=96, hidden=32, layers=3, tie_word_embeddings=True, init_std=0.3)
    generator = torch.Generator().manual_seed(0)
    examples = []
    for n in range(12):
        prompt = torch.randint(0, 96, (4 + n % 5,), generator=generator).tolist()  # unequal lengths: padding
        answer = hf_greedy(target, prompt, 10 + 3 * (n % 4))
        examples.append(Example(torch.tensor(prompt + answer), len(prompt)))
    attach_hidden(target, examples)
    return target, examples


def _vocabulary():
    from methods.engine.vocab import DraftVocabulary

    return DraftVocabulary(torch.arange(0, 96, 2), 96)  # half the tokens: the reduced-vocabulary loss


def _recipe(kind, target, examples):
    from harness.training.eagle import EagleRecipe
    from harness.training.medusa import MedusaRecipe

    if kind == "eagle":
        return EagleRecipe(target, seed=0, cls_weight=1.0, vocabulary=_vocabulary())
    return MedusaRecipe(target, heads=2)


class _Recording:
    """The recipe, recording which examples this process computed a loss on."""

    def __init__(self, recipe, examples):
        self.recipe, self.index, self.seen = recipe, {id(e): i for i, e in enumerate(examples)}, set()
        self.kind = recipe.kind

    def parameters(self):
        return self.recipe.parameters()

    def batch_loss(self, examples, noise, generators):
        if torch.is_grad_enabled():
            self.seen.update(self.index[id(e)] for e in examples)
        return self.recipe.batch_loss(examples, noise, generators)


def _run(kind, folder: Path, **kwargs):
    target, examples = _data()
    recipe = _Recording(_recipe(kind, target, examples), examples)
    folder.mkdir(parents=True, exist_ok=True)
    result = train(recipe, examples, examples[:4], epochs=EPOCHS, lr=3e-3, seed=0, log_file=folder / "log.jsonl",
                   batch=BATCH, noise=0.1 if kind == "eagle" else 0.0, progress=False, checkpoint_every=2, **kwargs)
    return recipe, result


def _losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "log.jsonl").read_text().splitlines()]


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # the hidden-state cache computed by both ranks at once (every other batch each), into one file
    target, examples = _data()
    cached = [Example(e.ids, e.answer_start) for e in examples]
    attach_hidden(target, cached, out / "hidden_states.pt", batch_tokens=64)
    report = {"cache": [(e.hidden.float().clone(), e.top.clone()) for e in cached]}
    # EAGLE-3's feature cache, the same machinery: both ranks at once into one file
    from harness.training.eagle3 import attach_features

    featured = [Example(e.ids, e.answer_start) for e in examples]
    attach_features(target, featured, FEATURE_LAYERS, out / "eagle3_features.pt", batch_tokens=64)
    report["features"] = [(e.features.float().clone(), e.hidden.float().clone(), e.top.clone()) for e in featured]
    for kind in ("eagle", "medusa"):
        recipe, result = _run(kind, out / kind / "full")
        _run(kind, out / kind / "resumed", stop_after=STOP)
        resumed, _ = _run(kind, out / kind / "resumed", resume=True)
        report[kind] = {"params": [p.detach().clone() for p in recipe.parameters()],
                        "resumed": [p.detach().clone() for p in resumed.parameters()],
                        "seen": sorted(recipe.seen), "acc": result["held_out_acceptance"]}
    torch.save(report, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_two_gloo_processes_train_the_one_process_curve(two_processes, kind, tmp_path):
    out, ranks = two_processes
    one, result = _run(kind, tmp_path)
    single, double = _losses(tmp_path), _losses(out / kind / "full")
    assert len(single) == len(double) == result["steps"] == 9
    assert len(set(single)) == len(single)  # a curve, not a constant
    if kind == "eagle":
        assert sum(single[-3:]) < sum(single[:3])  # it learns
    torch.testing.assert_close(torch.tensor(double), torch.tensor(single), rtol=1e-4, atol=1e-5)
    # each rank read only its shard (examples i with i % 2 == rank), together all of them
    assert ranks[0][kind]["seen"] == list(range(0, 12, 2)) and ranks[1][kind]["seen"] == list(range(1, 12, 2))
    for rank in ranks:  # gradients were all-reduced: both ranks hold the one-process weights
        for p, q in zip(rank[kind]["params"], one.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), rtol=1e-4, atol=1e-5)
        assert rank[kind]["acc"] == pytest.approx(result["held_out_acceptance"], abs=1e-6)


def test_two_processes_compute_one_hidden_state_cache(two_processes):
    out, ranks = two_processes
    _, examples = _data()
    assert (out / "hidden_states.pt.bin").stat().st_size == sum(len(e.ids) for e in examples) * 32 * 2
    for rank in ranks:
        for (hidden, top), e in zip(rank["cache"], examples, strict=True):
            torch.testing.assert_close(hidden, e.hidden, rtol=2e-3, atol=2e-3)
            assert torch.equal(top, e.top)


def test_two_processes_compute_one_eagle3_feature_cache(two_processes):
    from harness.training.eagle3 import attach_features

    out, ranks = two_processes
    target, examples = _data()
    expected = [Example(e.ids, e.answer_start) for e in examples]
    attach_features(target, expected, FEATURE_LAYERS)  # one process, in RAM, float32
    assert (out / "eagle3_features.pt.bin").stat().st_size == sum(len(e.ids) for e in examples) * 4 * 32 * 2
    for rank in ranks:
        for (features, hidden, top), e in zip(rank["features"], expected, strict=True):
            torch.testing.assert_close(features, e.features, rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(hidden, e.hidden, rtol=2e-3, atol=2e-3)
            assert torch.equal(top, e.top)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_resumed_two_process_run_equals_the_uninterrupted_one(two_processes, kind):
    out, ranks = two_processes
    assert _losses(out / kind / "resumed") == pytest.approx(_losses(out / kind / "full"), rel=1e-5, abs=1e-6)
    for p, q in zip(ranks[0][kind]["resumed"], ranks[0][kind]["params"], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_resume_restores_weights_optimizer_and_step_in_one_process(tmp_path):
    full, _ = _run("medusa", tmp_path / "full")
    _run("medusa", tmp_path / "cut", stop_after=STOP)
    state = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)
    assert state["step"] == STOP and state["optimizer"]["state"] and len(state["rng"]) == 1
    assert len(_losses(tmp_path / "cut")) == STOP
    resumed, _ = _run("medusa", tmp_path / "cut", resume=True)
    assert _losses(tmp_path / "cut") == pytest.approx(_losses(tmp_path / "full"), rel=1e-6)
    for p, q in zip(resumed.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # without the checkpoint's optimizer state the continuation differs: the test can fail
    state["optimizer"]["state"] = {}
    torch.save(state, tmp_path / "cut" / "checkpoint.pt")
    (tmp_path / "cut" / "log.jsonl").write_text("".join(
        line + "\n" for line in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()[:STOP]))
    _run("medusa", tmp_path / "cut", resume=True)
    assert _losses(tmp_path / "cut") != pytest.approx(_losses(tmp_path / "full"), rel=1e-6)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    _run("medusa", tmp_path, stop_after=2)
    target, examples = _data()
    from harness.training.medusa import MedusaRecipe

    with pytest.raises(ValueError, match="written by another run"):
        train(MedusaRecipe(target, heads=2), examples, examples[:2], epochs=EPOCHS, lr=3e-3, seed=1,
              log_file=tmp_path / "log.jsonl", batch=BATCH, progress=False, resume=True)


# ---------------------------------------------------------------------------------------------
# Batched losses equal the per-example ones


@pytest.mark.parametrize("kind", ["draft-lm", "eagle", "eagle-full-vocab", "medusa", "medusa-reduced-vocab"])
def test_a_batched_loss_equals_the_per_example_losses(kind):
    from harness.training.draft_lm import DraftLMRecipe
    from harness.training.eagle import EagleRecipe
    from harness.training.medusa import MedusaRecipe

    target, examples = _data()
    recipe = {"draft-lm": lambda: DraftLMRecipe(target, layers=1, vocabulary=_vocabulary()),
              "eagle": lambda: EagleRecipe(target, seed=0, vocabulary=_vocabulary()),
              "eagle-full-vocab": lambda: EagleRecipe(target, seed=0),
              "medusa": lambda: MedusaRecipe(target, heads=3),
              "medusa-reduced-vocab": lambda: MedusaRecipe(target, heads=3, vocabulary=_vocabulary())}[kind]()
    with torch.no_grad():  # move off the identity initialization: every branch contributes
        for p in recipe.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    batch = examples[:6]
    assert len({len(e.ids) for e in batch}) > 2  # padding matters
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(6)]  # noqa: E731
    batched, _ = recipe.batch_loss(batch, 0.1, gens())
    grads = torch.autograd.grad(batched, recipe.parameters())
    singles = [recipe.batch_loss([e], 0.1, [g])[0] for e, g in zip(batch, gens())]
    single_grads = torch.autograd.grad(sum(singles), recipe.parameters())
    torch.testing.assert_close(batched, sum(singles), rtol=1e-5, atol=1e-6)
    for g, h in zip(grads, single_grads):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        _, stats = recipe.batch_loss(batch, 0.0, [None] * 6)
        per = [recipe.batch_loss([e], 0.0, [None])[1] for e in batch]
    for key in stats:
        if key.startswith("acc_"):
            assert torch.equal(stats[key], torch.cat([s[key] for s in per if key in s]))


def test_held_out_accuracy_is_against_the_targets_argmax_not_the_corpus_token():
    """A sampled answer's tokens are not the target's choices: accuracy counts agreement with the target."""
    from harness.training.loop import evaluate
    from harness.training.medusa import MedusaRecipe

    target, examples = _data()
    recipe = MedusaRecipe(target, heads=1)  # identity init: head 1 is the target's lm_head one position late
    greedy = evaluate(recipe, examples)["acc_1"]
    sampled = []
    generator = torch.Generator().manual_seed(3)
    for e in examples:  # the same conversations with the answers' tokens replaced by random ones (target's argmax kept)
        ids = e.ids.clone()
        ids[e.answer_start:] = torch.randint(0, 96, (len(ids) - e.answer_start,), generator=generator)
        sampled.append(Example(ids, e.answer_start, hidden=e.hidden, top=e.top))
    assert evaluate(recipe, sampled)["acc_1"] == pytest.approx(greedy)
    # and where the target's argmax is what head 1 proposes, the agreement is 1 whatever the corpus says
    with torch.no_grad():
        agreeing = []
        for e in sampled:
            top = e.top.clone()
            top[1:-1] = recipe.heads[0](e.hidden[:-2]).argmax(-1)  # head 1 at t predicts the token after t + 1
            agreeing.append(Example(e.ids, e.answer_start, hidden=e.hidden, top=top))
    assert greedy < 0.5 and evaluate(recipe, agreeing)["acc_1"] == 1.0


def test_a_corrupt_hidden_state_cache_is_recomputed_and_other_errors_propagate(tmp_path, monkeypatch, capsys):
    from harness.training import examples as examples_module

    cache = tmp_path / "hidden.pt"
    ex = [examples_module.Example(torch.arange(6), 2)]
    fields = {"hidden": 4}
    assert not examples_module.attach_from(cache, ex, "hidden", fields)  # missing: quietly recomputed
    assert capsys.readouterr().out == ""
    cache.write_bytes(b"not a torch archive")
    assert not examples_module.attach_from(cache, ex, "hidden", fields)  # corrupt: recomputed, and said
    assert "unreadable cache" in capsys.readouterr().out

    def broken(*args, **kwargs):
        raise TypeError("a bug, not a corrupt cache")

    monkeypatch.setattr(examples_module.torch, "load", broken)
    with pytest.raises(TypeError, match="a bug"):
        examples_module.attach_from(cache, ex, "hidden", fields)
