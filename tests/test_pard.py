"""PARD (`methods/pard.py`, `harness/training/pard.py`): greedy tokens are AR's, alone and in a batch; the
draft proposes the argmax of its own forward over the new tokens and K - 1 masks, in one forward per step,
and keeps only committed tokens in its cache; sampling keeps the target's distribution (and a broken
acceptor is caught); the COD collator is upstream's; the loader reads the released format."""

from __future__ import annotations

import json
import types

import pytest
import torch

from harness.training.examples import choose_mask_token
from harness.training.pard import (
    PardRecipe,
    base_labels,
    chain_visibility,
    cod_collate,
    cod_keep,
    parallel_layout,
)
from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext, get_method
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.models.specs import ModelUnavailableError
from methods.pard import PardDecoder, PardSettings, load_pard_draft
from tests.conftest import assert_embedded_greedy, decode_state, tiny_model
from tests.stats_util import PROMPT, TEMPERATURE_1, chi_square_pvalue, draw, exact_joint

VOCAB = 16
MASK = VOCAB  # the draft's one extra row, as a released draft's unused token
PROMPTS = [[1, 2, 3], [5, 9, 3, 12, 7, 7, 1, 0, 4, 11, 2, 8, 6, 15, 3], [4, 4, 10, 2, 9, 13, 1]]
STOPS = [StopCondition(24), StopCondition(12), StopCondition(20)]


def pard_draft(target, seed: int = 1, **config):
    """A PARD draft for `target` as released ones are laid out: a causal LM over the target's vocabulary
    and one more row (the mask), `pard_token` and `spd_type` in its config. Its layers are the target's
    (so its first slot, the next-token prediction, is the target's own and drafts are accepted); the
    mask row is random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {**target.config.to_dict(), "vocab_size": target.config.vocab_size + 1,
                "pard_token": target.config.vocab_size, "spd_type": "pard", **config}
    draft = LlamaForCausalLM(LlamaConfig(**settings)).eval().requires_grad_(False)
    state = dict(target.state_dict())
    generator = torch.Generator().manual_seed(seed)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        state[key] = torch.cat([state[key], torch.randn(1, state[key].shape[1], generator=generator) * 0.02])
    draft.load_state_dict(state)
    return draft


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=45, vocab_size=VOCAB)
    return target, pard_draft(target)


def write_pard(folder, draft, **config):
    """The draft saved as released (config.json beside model.safetensors); `config` edits config.json."""
    draft.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    written.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in written.items() if v is not None}))
    return folder


def decoder(models, k: int = 4) -> PardDecoder:
    target, draft = models
    return PardDecoder(ModelRunner(target), draft, MASK, k=k)


def ar_tokens(target):
    ar = AutoregressiveDecoder(ModelRunner(target))
    return [ar.generate(p, s).tokens for p, s in zip(PROMPTS, STOPS)]


# ---------------------------------------------------------------------------------------------
# Decoding


def test_greedy_tokens_are_ars_alone_and_at_b2_and_b3(models):
    expected = ar_tokens(models[0])
    alone = [decoder(models).generate(p, s) for p, s in zip(PROMPTS, STOPS)]
    assert [out.tokens for out in alone] == expected
    assert all(out.stats.accepted_drafts > 0 for out in alone)  # multi-token steps were verified
    for batch in (2, 3):
        outs = decoder(models).generate_batch(PROMPTS[:batch], STOPS[:batch])
        assert [out.tokens for out in outs] == expected[:batch], f"B = {batch}"
        # each sequence drafts what it drafts alone: the same accepted lengths step by step
        assert [out.stats.accepted_lengths for out in outs] == [out.stats.accepted_lengths for out in alone[:batch]]


def test_the_draft_is_the_argmax_of_one_causal_forward_over_the_new_tokens_and_k_minus_1_masks(models):
    """Upstream's step (pard_infer.py:171-183): the committed tokens then K - 1 pard tokens at the positions
    that continue the sequence, causal; drafts = the argmax of the last K logits. Checked against the
    draft model's own forward over the whole text."""
    target, draft = models
    pard = decoder(models, k=5)
    state = decode_state(pard, PROMPTS[1], emitted=[6])
    pard.start(state, None)
    tree = pard.propose(state, state.sequence[-1], budget=20)
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([state.sequence + [MASK] * 4])).logits[0, -5:, :VOCAB]
    assert tree.tokens.tolist() == [6] + logits.argmax(-1).tolist()
    assert tree.is_chain and tree.draft_probs is None


def assert_cache_holds(lane, draft, sequence):
    """The lane's draft cache holds exactly `sequence`'s KV: its length, and a fresh prefill's keys and values."""
    assert lane.fed == list(sequence) and lane.runner.length == len(sequence)
    fresh = ModelRunner(draft)
    fresh.prefill(sequence)
    for mine, theirs in zip(lane.runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_after_a_step_the_draft_cache_holds_the_committed_tokens_only(models):
    """The masks' K/V is dropped after the forward (pard_infer.py:243-246): after every step the draft cache
    holds the committed tokens it was fed, the same K/V as a prefill of them, and the next step feeds
    only the step's accepted drafts and next token."""
    target, draft = models
    pard = decoder(models, k=4)
    state = decode_state(pard, PROMPTS[2], emitted=[3])
    pard.start(state, None)
    pard.propose(state, 3, budget=20)
    assert_cache_holds(state.draft, draft, state.sequence)
    state.sequence.extend([7, 7, 1])  # two drafts accepted and a next token, say
    before = state.draft.runner.forward_passes
    pard.propose(state, 1, budget=20)
    assert state.draft.runner.forward_passes == before + 1
    assert_cache_holds(state.draft, draft, state.sequence)

    steps = []
    advance = pard.advance
    pard.advance = lambda st, tree, acc, out: steps.append((list(st.draft.fed), list(st.sequence),
                                                            len(acc.emitted or []))) or advance(st, tree, acc, out)
    out = pard.generate(PROMPTS[1], STOPS[1])
    assert len(steps) > 1
    for fed, sequence, emitted in steps:  # fed: the sequence before this step's tokens
        assert fed == sequence[: len(sequence) - emitted]
    assert_cache_holds(pard.draft, draft, pard.draft.fed)
    assert out.tokens == ar_tokens(target)[1]


def test_one_draft_forward_per_step_alone_and_for_a_batch(models):
    """Alone: one draft forward per step that drafts. At B = 3: one forward of the batch's draft per step
    (each sequence's prefix fed alone once, when the batch is made)."""
    pard = decoder(models, k=4)
    drafted = []
    propose = pard.propose
    pard.propose = lambda state, root, budget: drafted.append(t := propose(state, root, budget)) or t
    out = pard.generate(PROMPTS[1], STOPS[1])
    assert pard.draft.runner.forward_passes == sum(len(tree) > 1 for tree in drafted) > 1
    assert len(drafted) == out.stats.steps - 1  # (the last step may have no room for a draft)
    batched = decoder(models, k=4)
    calls = []
    propose_batch = batched.propose_batch
    batched.propose_batch = lambda states, budgets: calls.append(len(states)) or propose_batch(states, budgets)
    outs = batched.generate_batch(PROMPTS, STOPS)
    assert batched.batch_draft.runner.forward_passes == len(calls) == max(o.stats.steps for o in outs) - 1
    assert calls[0] == 3 and calls[-1] < 3  # sequences left the batch
    assert all(lane.runner.forward_passes == 1 for lane in batched.lane_drafts)  # each prefix, alone


def test_the_batch_draft_cache_rows_hold_the_committed_tokens(models):
    """At B = 3 after each step every running sequence's row of the batch's draft cache is as long as the
    tokens it was fed (the masks and padding dropped by the commit)."""
    pard = decoder(models, k=3)
    checked = []
    advance = pard.advance

    def check(state, tree, acceptance, verified):
        batch = pard.batch_draft
        row = next(i for i, s in enumerate(batch.states) if s is state)
        checked.append(batch.runner.cache.lengths[row] == len(state.draft.fed))
        advance(state, tree, acceptance, verified)

    pard.advance = check
    outs = pard.generate_batch(PROMPTS, STOPS)
    assert checked and all(checked)
    assert [out.tokens for out in outs] == ar_tokens(models[0])


def test_the_loops_cut_bounds_a_greedy_step(models):
    pard = decoder(models, k=6)
    state = decode_state(pard, PROMPTS[0], emitted=[2])
    pard.start(state, None)
    state.cut = 2
    assert len(pard.propose(state, 2, budget=20)) == 3
    state.cut = None
    state.sequence.append(5)
    assert len(pard.propose(state, 5, budget=3)) == 4  # the stopping rule's budget


# ---------------------------------------------------------------------------------------------
# Sampling: exact at temperature > 0


@pytest.fixture(scope="module")
def sampling_pair(tiny_vocab_pair):
    """The 4-token target and a peaked PARD draft that disagrees with it (5 rows: token 4 is its mask)."""
    target, _ = tiny_vocab_pair
    return target, tiny_model("llama", seed=21, vocab_size=5, hidden=32, layers=1, init_std=0.5)


def test_sampled_drafts_come_with_their_slots_distributions(sampling_pair):
    target, draft = sampling_pair
    pard = PardDecoder(ModelRunner(target), draft, 4, k=3)
    state = decode_state(pard, PROMPT, emitted=[1], sampling=TEMPERATURE_1)
    state.generator = torch.Generator().manual_seed(0)
    pard.start(state, None)
    tree = pard.propose(state, 1, budget=10)
    with torch.no_grad():
        q = draft(input_ids=torch.tensor([PROMPT + [1, 4, 4]])).logits[0, -3:, :4].softmax(-1)
    torch.testing.assert_close(tree.draft_probs[:3], q, atol=1e-5, rtol=1e-5)
    assert all(q[i, token] > 0 for i, token in enumerate(tree.tokens[1:].tolist()))


def test_sampling_keeps_the_target_distribution(sampling_pair):
    target, draft = sampling_pair
    expected = exact_joint(target, PROMPT, 3, TEMPERATURE_1)
    pard = PardDecoder(ModelRunner(target), draft, 4, k=2)
    samples = draw(pard, 1500, seed=3)
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_sampling_with_a_broken_residual_is_caught(sampling_pair):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection biases the output; the same test
    must reject it, or it would not be evidence of anything."""
    target, draft = sampling_pair
    expected = exact_joint(target, PROMPT, 3, TEMPERATURE_1)
    pard = PardDecoder(ModelRunner(target), draft, 4, k=2)
    pard.sample_accept = lambda tree, probs, gen, **kw: PardDecoder.sample_accept(tree, probs, gen,
                                                                                  residual=lambda p, q: p, **kw)
    samples = draw(pard, 1500, seed=3)
    assert chi_square_pvalue(samples, expected) < 1e-6


def test_batched_sampling_keeps_the_target_distribution(sampling_pair):
    """At B = 4 (a fourth sequence with a longer prompt: padding in the batch's draft forward)."""
    target, draft = sampling_pair
    expected = exact_joint(target, PROMPT, 3, TEMPERATURE_1)
    pard = PardDecoder(ModelRunner(target), draft, 4, k=2)
    generators = [torch.Generator().manual_seed(10 + b) for b in range(4)]
    prompts = [PROMPT, [3, 2, 1, 0, 1, 2, 3, 0, 1], PROMPT, PROMPT]
    stops = [StopCondition(3), StopCondition(6), StopCondition(3), StopCondition(3)]
    samples = []
    while len(samples) < 1500:
        outs = pard.generate_batch(prompts, stops, TEMPERATURE_1, generators)
        samples += [tuple(outs[b].tokens) for b in (0, 2, 3)]
    assert chi_square_pvalue(samples[:1500], expected) > 1e-3


def test_a_seeded_sampled_answer_is_the_same_at_any_batch_size(models):
    sampling = SamplingConfig(temperature=0.8, top_k=8)
    alone = [decoder(models).generate(p, s, sampling, torch.Generator().manual_seed(b)).tokens
             for b, (p, s) in enumerate(zip(PROMPTS, STOPS))]
    generators = [torch.Generator().manual_seed(b) for b in range(3)]
    outs = decoder(models).generate_batch(PROMPTS, STOPS, sampling, generators)
    assert [out.tokens for out in outs] == alone


# ---------------------------------------------------------------------------------------------
# Loading


def test_the_loader_reads_a_released_checkpoint_and_builds_the_method(models, tmp_path):
    target, draft = models
    folder = write_pard(tmp_path / "pard", draft)
    assert json.loads((folder / "config.json").read_text())["pard_token"] == MASK
    assert (folder / "model.safetensors").is_file()
    context = BuildContext(target, "tiny", {"drafts": {"pard": {"path": str(folder)}}})
    pard = get_method("pard")(ModelRunner(target), {"name": "pard", "k": 3}, context)
    assert pard.mask == MASK and pard.k == 3 and pard.describe()["draft_tokens"] == 3
    assert [pard.generate(p, s).tokens for p, s in zip(PROMPTS, STOPS)] == ar_tokens(target)
    auto = get_method("pard")(ModelRunner(target), {"name": "pard"}, context)  # no machine profile: upstream's 12
    assert auto.k == 12 and auto.describe()["k"] == "auto"


def test_the_loader_refuses_a_draft_without_pard_token_unless_given_one(models, tmp_path):
    target, draft = models
    folder = write_pard(tmp_path / "plain", draft, pard_token=None, spd_type=None)
    with pytest.raises(ValueError, match="no pard_token in its config.json.*method.mask_token=<id>"):
        load_pard_draft({"path": str(folder)}, target)
    assert load_pard_draft({"path": str(folder)}, target, mask_token=MASK)[1] == MASK
    unset = write_pard(tmp_path / "unset", draft, pard_token=-1)  # upstream's value when no unused id was given
    with pytest.raises(ValueError, match="no pard_token"):
        load_pard_draft({"path": str(unset)}, target)
    pard2 = write_pard(tmp_path / "pard2", draft, spd_type="pard2")
    with pytest.raises(ValueError, match="PARD-2"):
        load_pard_draft({"path": str(pard2)}, target)
    with pytest.raises(ValueError, match="outside its 17-row embedding"):
        load_pard_draft({"path": str(folder)}, target, mask_token=17)


def test_embedded_greedy_pard_equals_generate_alone_and_in_a_batch(embedded, embedded_decoder, embedded_prompts,
                                                                   embedded_reference):
    """The suite's adapted draft in drafts/smollm2-135m/pard (conf/model/smollm2-135m.yaml)."""
    assert_embedded_greedy(embedded_decoder("pard"), embedded[1], embedded_prompts, embedded_reference, batch=3)


def test_a_missing_embedded_draft_is_refused_before_anything_loads_with_the_command_that_builds_it():
    from methods.models.specs import model_config

    assert model_config("smollm2-135m").drafts.pard.path == "drafts/smollm2-135m/pard"
    model = {"name": "tiny", "drafts": {"pard": {"path": "drafts/tiny/pard"}}}
    message = r"no PARD draft at drafts/tiny/pard yet: build it with `python -m harness.training pard --model tiny`"
    with pytest.raises(ModelUnavailableError, match=message):
        PardSettings().check_model(model)
    PardSettings(draft={"path": "elsewhere"}).check_model(model)  # a draft given: not the model's
    with pytest.raises(ModelUnavailableError, match=message):
        get_method("pard")(None, {"name": "pard"}, BuildContext(None, "tiny", model))


# ---------------------------------------------------------------------------------------------
# COD training (harness/training/pard.py)

# upstream's mask at L = 5, P = 3 (pard_train.py:71-77, evaluated there): row (b, j) sees x_0..x_{j-b} and
# the masks (b', j-b+b'); row (2, 0) also sees (0, 4), an artifact of the formula (its label is -100)
EXPECTED_MASK = """
100000000000000 110000000000000 111000000000000 111100000000000 111110000000000
000001000000000 100000100000000 110000010000000 111000001000000 111100000100000
000010000010000 000001000001000 100000100000100 110000010000010 111000001000001"""


def upstream_mask(length: int, para_num: int) -> torch.Tensor:
    """pard_train.py:71-77, verbatim but for names."""
    tgt_len = length * para_num
    mask = torch.full((tgt_len, tgt_len), torch.finfo(torch.float32).min)
    mask_cond = torch.arange(mask.size(-1))
    tmp_mask = (mask_cond == (mask_cond).view(mask.size(-1), 1))
    for i in range(para_num):
        tmp_mask += (mask_cond == (mask_cond - length * i - i).view(mask.size(-1), 1))
        tmp_mask += (mask_cond < (mask_cond - i * length - (i - 1)).view(mask.size(-1), 1)) * \
            (mask_cond < (i + 1) * length).view(-1, 1)
    mask.masked_fill_(tmp_mask, 0)
    return mask == 0


def test_the_chain_mask_is_upstreams():
    expected = torch.tensor([[c == "1" for c in row] for row in EXPECTED_MASK.split()])
    assert torch.equal(chain_visibility(5, 3), expected)
    for length, para_num in [(1, 1), (4, 1), (7, 4), (9, 8)]:
        assert torch.equal(chain_visibility(length, para_num), upstream_mask(length, para_num))


def test_the_parallel_layout_blocks_positions_and_labels():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    layout = parallel_layout(ids, ids.clone(), 3, 99)
    assert layout["input_ids"].tolist() == [[5, 6, 7, 8, 9] + [99] * 10]
    assert layout["position_ids"].tolist() == [list(range(5)) * 3]
    assert layout["labels"].tolist() == [[5, 6, 7, 8, 9, -100, 6, 7, 8, 9, -100, -100, 7, 8, 9]]
    labels = base_labels(torch.tensor([[1, 2, 3, 0], [4, 2, 5, 6]]), torch.tensor([3, 4]), ignore_ids=[2])
    assert labels.tolist() == [[1, -100, 3, -100], [4, -100, 5, 6]]  # padding and the eos (upstream's pad)


def test_cod_keeps_upstreams_counts_along_unbroken_chains():
    keep = cod_keep(100, 8, generator=torch.Generator().manual_seed(0))
    assert keep.sum(1).tolist() == [100, 70, 48, 34, 24, 20, 20, 20]  # int(L * max(0.7^i, 0.2)): 0.7^2 < 0.49
    for i in range(1, 8):  # a kept slot's predecessor in the chain is kept
        j = keep[i].nonzero()[:, 0]
        assert keep[i - 1, (j - 1) % 100].all()
    assert cod_keep(3, 8, 0.7, 0.2).sum(1).tolist() == [3, 2, 1, 1, 0, 0, 0, 0]  # a count of 0 ends it
    assert not cod_keep(5, 4, 0.5, 0.0)[3:].any() and cod_keep(5, 4, 0.5, 0.0).sum(1).tolist() == [5, 2, 1, 0]


def test_cod_collate_selects_slots_and_rolls_the_labels():
    ids = torch.arange(1, 11)[None].repeat(2, 1)
    labels = base_labels(ids, torch.tensor([10, 8]))
    batch = cod_collate(ids, labels, 4, 0, generator=torch.Generator().manual_seed(1))
    full = parallel_layout(ids, labels, 4, 0)
    index = cod_keep(10, 4, generator=torch.Generator().manual_seed(1)).reshape(-1).nonzero()[:, 0]
    assert torch.equal(batch["input_ids"], full["input_ids"][:, index])
    assert torch.equal(batch["position_ids"], full["position_ids"][:, index])
    # each kept slot's label (after the model's shift) is its own label in the full layout
    assert torch.equal(batch["labels"][:, 1:], full["labels"][:, index[:-1] + 1])
    seen = batch["attention_mask"][0, 0] == 0
    assert torch.equal(seen, full["visible"][index][:, index]) and batch["attention_mask"].shape == (2, 1, 24, 24)
    assert batch["attention_mask"].min() == torch.finfo(torch.float32).min


def test_a_training_slot_sees_what_the_drafts_slot_sees_at_inference(models):
    """The collated forward's slot (b, j), COD or not, gives the draft's logits after the real prefix
    x_0..x_{j-b} and b masks at positions j-b+1..j: training and inference agree."""
    _, draft = models
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    for retention in (1.0, 0.7):
        batch = cod_collate(ids, ids.clone(), 4, MASK, retention, 0.2, torch.Generator().manual_seed(2))
        with torch.no_grad():
            logits = draft(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           attention_mask=batch["attention_mask"]).logits[0]
            index = cod_keep(8, 4, retention, 0.2, torch.Generator().manual_seed(2)).reshape(-1).nonzero()[:, 0]
            for slot, flat in enumerate(index.tolist()):
                b, j = divmod(flat, 8)
                if j < b:  # upstream's rows without a real prefix (label -100)
                    continue
                text = ids[0, : j - b + 1].tolist() + [MASK] * b
                alone = draft(input_ids=torch.tensor([text])).logits[0, -1]
                torch.testing.assert_close(logits[slot], alone, atol=1e-4, rtol=1e-4)


def test_the_mask_token_is_an_unused_added_token():
    from harness.training.examples import Example

    tokenizer = types.SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=2, unk_token_id=None,
                                      added_tokens_decoder={i: None for i in range(8)})
    examples = [Example(torch.tensor([1, 7, 9, 10, 2]), 2)]
    assert choose_mask_token(tokenizer, examples, 12) == 6  # 7 occurs in the data
    tokenizer.added_tokens_decoder = {}
    assert choose_mask_token(tokenizer, examples, 12) == 11  # no added token: the last unused row


@pytest.fixture(scope="module")
def tiny_draft_lm(tmp_path_factory):
    """A tiny target, its answers and the suite's draft LM for it (the draft-lm recipe's format: layers and
    norm, embeddings and lm_head shared with the target), as the PARD recipe starts from."""
    from harness.training.draft_lm import DraftLMRecipe
    from harness.training.loop import train
    from tests.conftest import tiny_target_with_answers

    target, examples = tiny_target_with_answers(12)
    folder = tmp_path_factory.mktemp("draft-lm")
    recipe = DraftLMRecipe(target, layers=1)
    train(recipe, examples, examples, epochs=4, lr=3e-3, seed=0, log_file=folder / "log.jsonl", batch=4,
          progress=False)
    recipe.save(folder)
    return target, examples, folder


def test_the_recipe_learns_and_its_draft_decodes_as_ar(tiny_draft_lm, tmp_path):
    from harness.training.loop import evaluate, train
    from methods.models.loading import load_draft_lm

    target, examples, folder = tiny_draft_lm
    recipe = PardRecipe(target, load_draft_lm({"path": str(folder)}, target), mask_id=95, para_num=4,
                        ignore_ids=[2])
    before = evaluate(recipe, examples)
    assert set(before) == {"acc_1", "acc_2", "acc_3", "acc_4"}
    result = train(recipe, examples, examples, epochs=12, lr=3e-3, seed=0, log_file=tmp_path / "log.jsonl",
                   batch=4, progress=False)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    after = result["held_out_acceptance"]
    assert after["acc_2"] > before["acc_2"]  # the first mask slot learned to look two tokens ahead
    recipe.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["pard_token"] == 95 and config["spd_type"] == "pard"
    draft, mask = load_pard_draft({"path": str(tmp_path)}, target)
    assert mask == 95 and draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    pard = PardDecoder(ModelRunner(target), draft, mask, k=3)
    ar = AutoregressiveDecoder(ModelRunner(target))
    prompts = [example.ids[: example.answer_start].tolist() for example in examples[:3]]
    assert [pard.generate(p, StopCondition(16)).tokens for p in prompts] == \
        [ar.generate(p, StopCondition(16)).tokens for p in prompts]


def test_the_training_cli_adapts_the_models_draft_lm(tiny_draft_lm, tmp_path, monkeypatch):
    """`python -m harness.training pard`: the model config's drafts.sps adapted, the mask id chosen from the
    tokenizer and the corpus, written with its model card and the command that trains it again."""
    from omegaconf import OmegaConf

    import harness.training.__main__ as cli

    target, examples, folder = tiny_draft_lm
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"ids": e.ids.tolist(), "answer_start": e.answer_start}) + "\n"
                            for e in examples))
    tokenizer = types.SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=None, unk_token_id=None,
                                      added_tokens_decoder={})
    config = OmegaConf.create({"name": "tiny", "drafts": {"sps": {"path": str(folder)}}})
    monkeypatch.setattr(cli, "load_target", lambda model, device: (config, target, tokenizer))
    out = tmp_path / "pard"
    cli.main(["pard", "--model", "tiny", "--data", str(data), "--out", str(out), "--epochs", "1", "--batch", "4",
              "--para-num", "3", "--device", "cpu"])
    used = {int(t) for e in examples for t in e.ids}
    mask = max(set(range(96)) - used)
    assert json.loads((out / "config.json").read_text())["pard_token"] == mask
    card = (out / "README.md").read_text()
    assert f"--para-num 3 --mask-token {mask}" in card and f"mask id {mask}" in card
    assert set(json.loads((out / "training.json").read_text())["held_out_acceptance"]) == {"acc_1", "acc_2", "acc_3"}
    assert load_pard_draft({"path": str(out)}, target)[1] == mask


# ---------------------------------------------------------------------------------------------
# Model configs


def test_the_released_drafts_are_configured_for_upstreams_targets():
    from methods.models.specs import model_config

    expected = {"llama3.1-8b-instruct": "amd/PARD-Llama-3.2-1B", "llama3.3-70b-instruct": "amd/PARD-Llama-3.2-1B",
                "qwen2.5-7b-instruct": "amd/PARD-Qwen2.5-0.5B", "qwen3-8b": "amd/PARD-Qwen3-0.6B",
                "deepseek-r1-distill-qwen-7b": "amd/PARD-DeepSeek-R1-Distill-Qwen-1.5B"}
    assert {name: model_config(name).drafts.pard.path for name in expected} == expected


def test_qwen3_is_prompted_in_its_non_thinking_mode():
    """Upstream evaluates Qwen3 with enable_thinking=False: the model config's chat_template_kwargs reach the
    tokenizer's chat template."""
    from harness.running.prompts import ChatTemplate, Message
    from methods.models.specs import model_config

    calls = []

    class Tokenizer:
        eos_token_id, chat_template = 151645, "{{ messages }}"

        def apply_chat_template(self, chat, **options):
            calls.append(options)
            return {"input_ids": [7, 8]}

    template = ChatTemplate.for_model(model_config("qwen3-8b"), Tokenizer())
    assert template.prompt_ids([Message("user", "hi")]) == [7, 8]
    assert calls[0]["enable_thinking"] is False and calls[0]["add_generation_prompt"] is True
    assert template.eos_token_ids == {151645, 151643}
    ChatTemplate.for_model(model_config("qwen2.5-7b-instruct"), Tokenizer()).prompt_ids([Message("user", "hi")])
    assert "enable_thinking" not in calls[1]
