"""Hydra / Hydra++: the released checkpoint layout loads and computes what upstream's modules compute
(checked against the formulas written out here), grounded drafting walks the tree level by level,
the prefix layer's cache follows the accepted sequence, greedy output equals AR's, sampling keeps
the target distribution, and the recipe learns and writes files the loader reads."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext, get_method
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.static_trees import StaticTree
from methods.engine.stopping import StopCondition
from methods.hydra import HydraDecoder
from methods.models.heads.hydra import load_hydra_heads
from methods.models.specs import ModelSpec, ModelUnavailableError
from tests.conftest import decode_state, tiny_model, tiny_target_with_answers
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint

# ---------------------------------------------------------------------------------------------
# A checkpoint in the released layout, written by hand (upstream hydra/model/hydra_heads/*.py:
# `HydraMLP` / `HydraPrefixMLP` state_dict saved as hydra_lm_head.pt by hydra/train/train.py)


def hydra_state(target, arch="prefix-mlp", grounded=True, heads=4, layers=2, seed=0, scale=0.15):
    g = torch.Generator().manual_seed(seed)
    c = target.config
    H, V = c.hidden_size, c.vocab_size
    r = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    prefix = arch == "prefix-mlp"
    state = {"input_embed_fn.weight": target.get_input_embeddings().weight.detach().clone()}
    for i in range(heads):
        first = 1 if prefix else 0  # prefix-mlp: a Dropout before every block
        width = H * (i + 2) if grounded else H
        state[f"hydra_mlp.{i}.{first}.linear.weight"] = r(H, width)
        state[f"hydra_mlp.{i}.{first}.linear.bias"] = r(H)
        if grounded:
            state[f"hydra_mlp.{i}.{first}.res_connection.weight"] = r(H, width)
            state[f"hydra_mlp.{i}.{first}.res_connection.bias"] = r(H)
        shared_w, shared_b = r(H, H), r(H)  # upstream: `[ResBlock(H)] * (n - 1)`, one block repeated
        for j in range(1, layers):
            index = 2 * j + 1 if prefix else j
            state[f"hydra_mlp.{i}.{index}.linear.weight"] = shared_w
            state[f"hydra_mlp.{i}.{index}.linear.bias"] = shared_b
        lm = f"hydra_lm_head.{i}.1" if prefix else f"hydra_lm_head.{i}"
        state[f"{lm}.weight"], state[f"{lm}.bias"] = r(V, H), r(V)
    if prefix:
        head_dim = H // c.num_attention_heads
        q, kv, inter = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.intermediate_size
        p = "prefix_embeding_layer."
        state.update(
            {
                p + "embed_tokens.weight": r(V, H),  # unused by upstream (inputs_embeds), present in its files
                p + "layers.0.self_attn.q_proj.weight": r(q, H),
                p + "layers.0.self_attn.k_proj.weight": r(kv, H),
                p + "layers.0.self_attn.v_proj.weight": r(kv, H),
                p + "layers.0.self_attn.o_proj.weight": r(H, q),
                p + "layers.0.self_attn.rotary_emb.inv_freq": 1.0
                / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim),
                p + "layers.0.mlp.gate_proj.weight": r(inter, H),
                p + "layers.0.mlp.up_proj.weight": r(inter, H),
                p + "layers.0.mlp.down_proj.weight": r(H, inter),
                p + "layers.0.input_layernorm.weight": 1 + r(H),
                p + "layers.0.post_attention_layernorm.weight": 1 + r(H),
                p + "norm.weight": 1 + r(H),
            }
        )
    return state


def write_hydra(folder, target, arch="prefix-mlp", grounded=True, heads=4, layers=2, seed=0, **config):
    state = hydra_state(target, arch, grounded, heads, layers, seed)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "hydra_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({
        "hydra_num_heads": heads, "hydra_num_layers": layers, "hydra_head_arch": arch, "grounded_heads": grounded,
        "hidden_state_offset": 0, "base_model_name_or_path": "tiny", **config}))
    return state


# ---------------------------------------------------------------------------------------------
# The modules written out from upstream's definitions


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_head(state, arch, grounded, i, x, layers):
    """Head i on its input x: ResBlocks (res_connection(x) + SiLU(linear(x))), then its projection."""
    prefix = arch == "prefix-mlp"
    for j in range(layers):
        key = f"hydra_mlp.{i}.{2 * j + 1 if prefix else j}"
        residual = x @ state[f"{key}.res_connection.weight"].T + state[f"{key}.res_connection.bias"] \
            if j == 0 and grounded else x
        x = residual + F.silu(x @ state[f"{key}.linear.weight"].T + state[f"{key}.linear.bias"])
    lm = f"hydra_lm_head.{i}.1" if prefix else f"hydra_lm_head.{i}"
    return x @ state[f"{lm}.weight"].T + state[f"{lm}.bias"]


def reference_prefix(state, hidden, config):
    """upstream's prefix_embeding_layer (a one-layer LlamaModel on inputs_embeds): input RMSNorm,
    causal attention with RoPE and GQA, residual, post-attention RMSNorm, SiLU MLP, residual, norm."""
    p = lambda k: state["prefix_embeding_layer." + k]  # noqa: E731
    n, H = hidden.shape
    heads, kv_heads, eps = config.num_attention_heads, config.num_key_value_heads, config.rms_norm_eps
    d = H // heads
    x = rms(hidden, p("layers.0.input_layernorm.weight"), eps)
    q = (x @ p("layers.0.self_attn.q_proj.weight").T).view(n, heads, d)
    k = (x @ p("layers.0.self_attn.k_proj.weight").T).view(n, kv_heads, d)
    v = (x @ p("layers.0.self_attn.v_proj.weight").T).view(n, kv_heads, d)
    angles = torch.arange(n).float()[:, None] * p("layers.0.self_attn.rotary_emb.inv_freq")[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rotate = lambda t: torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1)  # noqa: E731
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    h = hidden + torch.einsum("hqk,khd->qhd", scores.softmax(-1),
                              v).reshape(n, H) @ p("layers.0.self_attn.o_proj.weight").T
    y = rms(h, p("layers.0.post_attention_layernorm.weight"), eps)
    h = h + (F.silu(y @ p("layers.0.mlp.gate_proj.weight").T) * (y @ p("layers.0.mlp.up_proj.weight").T)) \
        @ p("layers.0.mlp.down_proj.weight").T
    return rms(h, p("norm.weight"), eps)


def reference_tree(state, arch, grounded, layers, h, embed, root, tree: StaticTree, count):
    """The tree a path-by-path walk gives: node [.., r] = the r-th candidate of head (depth - 1) at its
    parent, which reads concat(h, e(root), e(tokens on the path to the parent)) (h alone ungrounded)."""
    tokens = [root]
    for node in range(1, count):
        path = [node]
        while tree.parents[path[-1]] > 0:
            path.append(tree.parents[path[-1]])
        ancestors = [tokens[a] for a in reversed(path[1:])]
        depth = tree.depths[node]
        x = torch.cat([h, embed[root], *[embed[t] for t in ancestors]]) if grounded else h
        logits = reference_head(state, arch, grounded, depth - 1, x, layers)
        tokens.append(int(torch.topk(logits, tree.top_k(depth)).indices[tree.ranks[node]]))
    return tokens


# ---------------------------------------------------------------------------------------------
# Loader and drafting against the references

SMALL = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("arch, grounded", [("mlp", True), ("prefix-mlp", True), ("mlp", False)])
def test_released_layout_loads_and_drafts_as_upstreams_modules(tmp_path, arch, grounded):
    target = tiny_model("llama", seed=60, vocab_size=64)
    state = write_hydra(tmp_path, target, arch, grounded, heads=4, layers=3, seed=1)
    heads, config = load_hydra_heads(ModelSpec(path=str(tmp_path)), target)
    assert (heads.num_heads, heads.num_layers, heads.arch, heads.grounded) == (4, 3, arch, grounded)
    embed = target.get_input_embeddings().weight
    # each head, numerically, on random inputs of its width
    g = torch.Generator().manual_seed(2)
    for i in range(4):
        x = torch.randn(5, 64 * (i + 2) if grounded else 64, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(heads.logits(i, heads.features(i, x)),
                                       reference_head(state, arch, grounded, i, x, 3),
                                       rtol=1e-4, atol=1e-4)
    # one drafting step on the published tree: the same tokens as the path-by-path walk
    decoder = HydraDecoder(ModelRunner(target), heads, StaticTree.build("hydra_mc_sim_7b_63"))
    prompt = [3, 9, 27, 17, 51, 25]
    prefill = decoder.target.prefill(prompt)
    seq = decode_state(decoder, prompt, [5])
    decoder.start(seq, prefill)
    h = prefill.hidden[-1] if arch == "mlp" else reference_prefix(state, prefill.hidden, target.config)[-1]
    torch.testing.assert_close(seq.values["h"], h, rtol=1e-4, atol=1e-4)
    tree = decoder.propose(seq, 5, budget=10)
    assert len(tree) == 64 and tree.parents == decoder.tree.parents
    assert tree.tokens.tolist() == reference_tree(state, arch, grounded, 3, h, embed, 5, decoder.tree, 64)
    # a budget of 2 draft tokens cuts the tree to depth 2
    assert max(decoder.propose(seq, 5, budget=2).depths) == 2


def test_prefix_layer_cache_follows_the_accepted_sequence(tmp_path):
    target = tiny_model("llama", seed=61, vocab_size=16)
    state = write_hydra(tmp_path, target, "prefix-mlp", seed=3)
    decoder = HydraDecoder(ModelRunner(target), load_hydra_heads(ModelSpec(path=str(tmp_path)), target)[0],
                           StaticTree.build(SMALL))
    prompt = [1, 5, 2, 7, 3]
    finished = []  # the sequence's state as it stopped (the decoder keeps none)
    decoder.finish = finished.append
    out = decoder.generate(prompt, StopCondition(30))
    assert out.stats.accepted_drafts > 0  # multi-token paths were followed
    sequence, values = prompt + out.tokens, finished[0].values
    assert len(prompt) < values["committed"] < len(sequence)
    hidden = ModelRunner(target).prefill(sequence[:values["committed"]]).hidden
    torch.testing.assert_close(values["h"], reference_prefix(state, hidden, target.config)[-1], rtol=1e-4,
                               atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Exactness and sampling


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_hydra_equals_ar(tmp_path, arch):
    target = tiny_model(arch, seed=62, vocab_size=16)
    ar = AutoregressiveDecoder(ModelRunner(target))
    gen = torch.Generator().manual_seed(4)
    for kind, grounded in [("prefix-mlp", True), ("mlp", True), ("mlp", False)]:
        write_hydra(tmp_path / f"{kind}{grounded}", target, kind, grounded, seed=5)
        heads = load_hydra_heads(ModelSpec(path=str(tmp_path / f"{kind}{grounded}")), target)[0]
        accepted = 0
        for tree in ("hydra_mc_sim_7b_63", SMALL):
            decoder = HydraDecoder(ModelRunner(target), heads, StaticTree.build(tree))
            for _ in range(2):
                prompt = torch.randint(0, 16, (int(torch.randint(2, 20, (), generator=gen)),), generator=gen).tolist()
                stop = StopCondition(40)
                out = decoder.generate(prompt, stop)
                assert out.tokens == ar.generate(prompt, stop).tokens, (kind, grounded, tree)
                assert sum(out.stats.accepted_lengths) == out.stats.new_tokens == 40
                # per-position acceptance is recorded
                assert out.stats.position_tested[0] >= out.stats.position_accepted[0]
                assert len(out.stats.position_proposed) == StaticTree.build(tree).max_depth
                accepted += out.stats.accepted_drafts
        assert accepted > 10, (kind, grounded)


def sampling_decoder(target, folder, arch="prefix-mlp"):
    write_hydra(folder, target, arch, heads=2, layers=2, seed=7)
    heads = load_hydra_heads(ModelSpec(path=str(folder)), target)[0]
    return HydraDecoder(ModelRunner(target), heads, StaticTree.build([[0], [1], [2], [0, 0], [0, 1], [1, 0]]))


def test_hydra_sampling_preserves_target_distribution(tiny_vocab_pair, tmp_path):
    target = tiny_vocab_pair[0]
    expected = exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))
    samples = draw(sampling_decoder(target, tmp_path), 1200, seed=7)
    assert chi_square_pvalue(samples, expected) > 1e-3
    broken = sampling_decoder(target, tmp_path / "mlp", "mlp")  # the acceptor is what is broken here
    broken.sample_accept = lambda tree, probs, gen, **kw: HydraDecoder.sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw
    )
    assert chi_square_pvalue(draw(broken, 1200, seed=7), expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# Registry, configuration errors


def test_registry_builds_hydra_and_rejects_unsupported_heads(tmp_path):
    target = tiny_model("llama", seed=63, vocab_size=16)
    write_hydra(tmp_path / "ok", target, "mlp", heads=4, layers=1)
    context = BuildContext(target, "tiny", {"drafts": {"hydra": {"path": str(tmp_path / "ok")}}})
    decoder = get_method("hydra")(ModelRunner(target), {"name": "hydra", "tree": "hydra_mc_sim_7b_63"}, context)
    record = decoder.describe()
    assert (record["heads"], record["head_arch"], record["tree_nodes"], record["tree_depth"]) == (4, "mlp", 64, 4)
    prompt, stop = [1, 2, 3, 4], StopCondition(20)
    assert decoder.generate(prompt,
                            stop).tokens == AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    typical = get_method("hydra")(ModelRunner(target), {"name": "hydra", "tree": SMALL, "acceptance": "typical"},
                                  context)
    assert typical.describe()["lossless"] is False and typical.describe()["acceptance"] == "typical"
    sampled = typical.generate(prompt, stop, SamplingConfig(temperature=0.7), torch.Generator().manual_seed(0))
    assert len(sampled.tokens) == 20 and sampled.stats.accepted_drafts > 0
    write_hydra(tmp_path / "three", target, "mlp", heads=3, layers=1)
    three = BuildContext(target, "tiny", {"drafts": {"hydra": {"path": str(tmp_path / "three")}}})
    with pytest.raises(ValueError, match="tree of depth 4 needs 4 Hydra heads; these weights have 3"):
        get_method("hydra")(ModelRunner(target), {"name": "hydra", "tree": "hydra_mc_sim_7b_63"}, three)
    write_hydra(tmp_path / "ca", target, "mlp", hydra_head_arch="cross-attn")
    bad = BuildContext(target, "tiny", {"drafts": {"hydra": {"path": str(tmp_path / "ca")}}})
    with pytest.raises(ValueError, match="'cross-attn' is not supported; supported: mlp, prefix-mlp"):
        get_method("hydra")(ModelRunner(target), {"name": "hydra", "tree": SMALL}, bad)
    missing = BuildContext(target, "smollm2-135m",
                           {"drafts": {"hydra": {"path": "drafts/smollm2-135m/hydra-not-trained"}}})
    with pytest.raises(ModelUnavailableError, match=r"python -m harness.training hydra --model smollm2-135m") as err:
        get_method("hydra")(ModelRunner(target), {"name": "hydra", "tree": SMALL}, missing)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# The recipe (harness/training/hydra.py)


@pytest.fixture(scope="module")
def tiny_target_data():
    return tiny_target_with_answers(10)


@pytest.mark.parametrize("arch, reduced", [("prefix-mlp", True), ("mlp", False)])
def test_recipe_learns_and_its_files_load_through_the_loader(tiny_target_data, tmp_path, arch, reduced):
    from harness.training.hydra import HydraRecipe
    from harness.training.loop import evaluate, train
    from methods.engine.vocab import DraftVocabulary

    target, examples = tiny_target_data
    answers = torch.cat([e.ids[e.answer_start:] for e in examples])
    vocabulary = DraftVocabulary(answers.unique()[:40], 96) if reduced else None  # some answer tokens left out
    recipe = HydraRecipe(target, heads=3, layers=2, arch=arch, vocabulary=vocabulary, dropout=0.1)
    before = evaluate(recipe, examples)
    result = train(recipe, examples, examples, epochs=20, lr=5e-3, seed=0, log_file=tmp_path / "log.jsonl",
                   batch=4, progress=False)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in log]  # cross-entropy against the teacher: its floor is the teacher's entropy
    assert len(log) == result["steps"] and sum(losses[-5:]) < sum(losses[:5]) and losses[-1] < losses[0]
    after = result["held_out_acceptance"]
    assert set(after) == {"acc_1", "acc_2", "acc_3"} and after["acc_1"] > before["acc_1"]
    recipe.save(tmp_path)
    # the released layout: upstream's keys, later blocks of a head repeated (tied), no copies of the target
    state = torch.load(tmp_path / "hydra_lm_head.pt", weights_only=True)
    first, second = (1, 3) if arch == "prefix-mlp" else (0, 1)
    assert f"hydra_mlp.2.{first}.res_connection.weight" in state and f"hydra_mlp.2.{second}.linear.weight" in state
    assert state[f"hydra_mlp.2.{first}.linear.weight"].shape == (32, 32 * 4)
    assert not any(k.startswith("input_embed_fn") or "embed_tokens" in k for k in state)
    assert ("draft_ids" in state) == reduced
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hydra_num_heads"], config["hydra_num_layers"], config["hydra_head_arch"],
            config["grounded_heads"]) \
        == (3, 2, arch, True)
    heads, _ = load_hydra_heads(ModelSpec(path=str(tmp_path)), target)
    reference = recipe.heads.eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.data = param.data.to(torch.bfloat16).float()  # stored in bf16
        example = examples[0]
        embeds = target.get_input_embeddings()(example.ids)
        for mine, theirs in zip(heads(example.hidden, embeds), reference(example.hidden, embeds)):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    # teacher forcing is what drafting computes: head 0 at position t, after the prefix ids[:t+1] and root ids[t+1]
    example, t = examples[1], examples[1].answer_start + 3
    step = HydraDecoder(ModelRunner(target), heads, StaticTree.build([[0]]))
    sequence = decode_state(step, example.ids[: t + 1].tolist())
    step.start(sequence, step.target.prefill(example.ids[: t + 1].tolist()))
    with torch.no_grad():
        x = torch.cat([sequence.values["h"], target.get_input_embeddings().weight[example.ids[t + 1]]])
        forced = heads(example.hidden, target.get_input_embeddings()(example.ids))[0][t]
        torch.testing.assert_close(heads.logits(0, heads.features(0, x)), forced, rtol=1e-4, atol=1e-4)
    # decoding with them: exact, and (reduced) every drafted token from the draft vocabulary
    decoder = HydraDecoder(ModelRunner(target), heads, StaticTree.build(SMALL[:6]))
    drafted = []
    propose = decoder.propose
    decoder.propose = lambda seq, root, budget: drafted.append(t := propose(seq, root, budget)) or t
    ar = AutoregressiveDecoder(ModelRunner(target))
    for example in examples[:3]:
        prompt = example.ids[: example.answer_start].tolist()
        assert decoder.generate(prompt, StopCondition(16)).tokens == ar.generate(prompt, StopCondition(16)).tokens
    if reduced:
        assert decoder.describe()["draft_vocab"] == 40
        assert set(torch.cat([t.tokens[1:] for t in drafted]).tolist()) <= set(vocabulary.ids.tolist())


def test_full_vocabulary_heads_draft_over_a_draft_vocabulary(tmp_path):
    from methods.engine.vocab import DraftVocabulary

    target = tiny_model("llama", seed=64, vocab_size=64)
    write_hydra(tmp_path, target, "mlp", seed=9)
    heads = load_hydra_heads(ModelSpec(path=str(tmp_path)), target)[0]
    vocabulary = DraftVocabulary(torch.arange(0, 64, 3), 64)
    decoder = HydraDecoder(ModelRunner(target), heads, StaticTree.build(SMALL), vocabulary=vocabulary)
    prompt = [3, 9, 27, 17]
    prefill = decoder.target.prefill(prompt)
    seq = decode_state(decoder, prompt, [5])
    decoder.start(seq, prefill)
    tree = decoder.propose(seq, 5, budget=8)
    assert all(t % 3 == 0 for t in tree.tokens[1:].tolist())
    # the depth-1 candidates are the head's best among the vocabulary's tokens (bias included)
    x = torch.cat([prefill.hidden[-1], target.get_input_embeddings().weight[5]])
    with torch.no_grad():
        logits = heads.logits(0, heads.features(0, x))[vocabulary.ids]
    assert tree.tokens[1:4].tolist() == vocabulary.ids[torch.topk(logits, 3).indices].tolist()


def test_bench_run_of_hydra_records_per_position_acceptance(tiny_chat_model_dir, tmp_path, monkeypatch):
    """`make bench METHOD=hydra` on a model whose drafts.hydra is a checkpoint in the released layout."""
    from harness.running.run import run
    from methods.models.loading import load_model
    from tests.test_harness import config, tiny_overrides

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path / "cache"))
    target = load_model(ModelSpec(path=str(tiny_chat_model_dir)), torch.float32, torch.device("cpu"))
    write_hydra(tmp_path / "heads", target, "prefix-mlp", heads=3, layers=1, seed=11)
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [text]}) + "\n"
                                 for i, text in enumerate(["Who wrote Hamlet?", "What is 2+2?"])))
    summary = run(config(*tiny_overrides(tiny_chat_model_dir, questions, tmp_path / "results", "method=hydra",
                                         "limit=2",
                                         "model.drafts.hydra=null",
                                         f"model.drafts.hydra={{path: {tmp_path / 'heads'}}}",
                                         "method.tree=[[0],[1],[0,0],[1,0],[0,0,0]]")))
    decoder = summary["decoder"]
    assert len(decoder["acceptance_per_position"]) == 3 and decoder["position_tested"][0] > 0
    assert summary["lossless"] and summary["fidelity"]["differing_questions"] == 0
    assert summary["method_config"]["head_arch"] == "prefix-mlp" and summary["method_config"]["tree_depth"] == 3


def test_hidden_state_offset_reads_an_earlier_layer(tmp_path):
    """`hidden_state_offset: k` is upstream's `outputs.hidden_states[-(k + 1)]`: the hidden state
    entering the target's layer L-k (k = 0: the last one, after the final norm)."""
    target = tiny_model("llama", seed=65, vocab_size=16)
    write_hydra(tmp_path, target, "prefix-mlp", seed=12, hidden_state_offset=1)
    context = BuildContext(target, "tiny", {"drafts": {"hydra": {"path": str(tmp_path)}}})
    decoder = get_method("hydra")(ModelRunner(target), {"name": "hydra", "tree": SMALL}, context)
    assert decoder.describe()["hidden_state_offset"] == 1
    prompt = [4, 1, 7, 9, 2]
    stop = StopCondition(30)
    out = decoder.generate(prompt, stop)
    assert out.tokens == AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    decoder.target.reset()
    prefill = decoder.target.prefill(prompt)
    with torch.no_grad():
        expected = target(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-2][0]
    torch.testing.assert_close(prefill.layers, expected, rtol=1e-5, atol=1e-5)
    sequence = decode_state(decoder, prompt)
    decoder.start(sequence, prefill)
    state = torch.load(tmp_path / "hydra_lm_head.pt", weights_only=True)
    torch.testing.assert_close(sequence.values["h"], reference_prefix(state, expected, target.config)[-1], rtol=1e-4,
                               atol=1e-4)


def test_auto_tree_is_hydras_cut_to_the_machines_budget(tmp_path, monkeypatch):
    from methods.engine.static_trees import HYDRA_MC_SIM_7B_63

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path / "cache"))
    target = tiny_model("llama", seed=66, vocab_size=32, layers=2)
    write_hydra(tmp_path / "heads", target, "mlp", heads=3, layers=1)
    context = BuildContext(target, "tiny", {"drafts": {"hydra": {"path": str(tmp_path / "heads")}}})
    decoder = get_method("hydra")(ModelRunner(target), {"name": "hydra"}, context)
    sizing = decoder.describe()["sizing"]
    budget = sizing["verify_tokens"]
    assert sizing["tree"] == "auto" and sizing["chosen"].startswith("hydra_mc_sim_7b_63, first")
    # upstream's list in its own order, paths deeper than the 3 heads left out, cut to the budget
    expected = [p for p in HYDRA_MC_SIM_7B_63 if len(p) <= 3][: budget - 1]
    assert sorted(map(list, decoder.tree.paths)) == sorted(expected) and decoder.tree.max_depth <= 3
