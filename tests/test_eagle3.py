"""EAGLE-3: the runner's layer features, the loader on the released format against a from-scratch
reference, greedy exactness, sampling (χ², with a broken-acceptor counter-test), the training recipe's
training-time test against inference, and the harness end to end."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext, check_method_params, get_method
from methods.eagle.eagle3 import Eagle3Decoder, Eagle3Drafter
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.engine.vocab import DraftVocabulary
from methods.models.heads.eagle3 import load_eagle3_head
from methods.models.heads.source import head_spec
from methods.models.specs import ModelSpec
from methods.settings.params import ConfigError
from tests.conftest import tiny_config, tiny_model, write_checkpoint
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint
from tests.test_tree_methods import assert_committed_cache_equals

LAYERS = 7  # the fewest target layers for which 2, L//2 and L-3 differ: (2, 3, 4)


def target_features(target, ids: list[int]) -> torch.Tensor:
    """[n, 3H] the inputs of layers 2, L//2, L-3, from transformers' own output_hidden_states
    (hidden_states[i] enters layer i), independent of the runner's hooks."""
    L = target.config.num_hidden_layers
    with torch.no_grad():
        states = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in (2, L // 2, L - 3)], -1)


# ---------------------------------------------------------------------------------------------
# Checkpoints written by hand in the released format (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's keys)


def write_eagle3(folder, target, draft_ids=None, hidden=None, embed=False, safetensors=False, seed=0, scale=0.1,
                 with_maps=True):
    """`draft_ids`: the target ids of the draft vocabulary (increasing, as upstream writes them) or
    None for the whole vocabulary; `hidden`: the head's width when it differs from the target's
    (then config.json says target_hidden_size and embed_tokens must be in the file)."""
    g = torch.Generator().manual_seed(seed)
    c = target.config
    vocab, target_hidden = c.vocab_size, c.hidden_size
    hidden = hidden or target_hidden
    heads, kv_heads, inter = c.num_attention_heads, c.num_key_value_heads, 2 * hidden
    head_dim = hidden // heads
    ids = torch.arange(vocab) if draft_ids is None else torch.as_tensor(draft_ids)
    r = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    state = {
        "fc.weight": r(hidden, 3 * target_hidden),
        "midlayer.self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": r(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": r(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": r(inter, hidden), "midlayer.mlp.up_proj.weight": r(inter, hidden),
        "midlayer.mlp.down_proj.weight": r(hidden, inter),
        "midlayer.hidden_norm.weight": 1 + r(hidden), "midlayer.input_layernorm.weight": 1 + r(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + r(hidden), "norm.weight": 1 + r(hidden),
        "lm_head.weight": r(len(ids), hidden) * 3,
    }
    if with_maps:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state["d2t"], state["t2d"] = ids - torch.arange(len(ids)), t2d
    if embed:
        state["embed_tokens.weight"] = r(vocab, hidden) * 10
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": vocab, "hidden_act": "silu",
        "max_position_embeddings": 2048, "torch_dtype": "float16", "draft_vocab_size": len(ids),
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": False,
    }
    if hidden != target_hidden:
        config["target_hidden_size"] = target_hidden
    write_checkpoint(folder, config, state, safetensors)
    return state


def reference_eagle3(state, tokens, features, embed, heads, kv_heads, eps=1e-5, theta=10000.0):
    """EAGLE-3's head written out: fc over the 3 layers' features -> [RMSNorm(embedding); RMSNorm(g)]
    -> attention (RoPE, GQA, causal) -> residual on g -> post-attention RMSNorm -> SiLU MLP ->
    residual -> final RMSNorm -> lm_head over the draft vocabulary. Returns (outputs, draft logits)."""
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    g = features @ state["fc.weight"].T
    n, hidden = g.shape
    head_dim = hidden // heads
    x = torch.cat([rms(embed[tokens], state["midlayer.input_layernorm.weight"]),
                   rms(g, state["midlayer.hidden_norm.weight"])], -1)
    proj = lambda name, h: (x @ state[f"midlayer.self_attn.{name}_proj.weight"].T).view(n, h, head_dim)  # noqa: E731
    q, k, v = proj("q", heads), proj("k", kv_heads), proj("v", kv_heads)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(n).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rotate = lambda t: torch.cat([-t[..., head_dim // 2:], t[..., : head_dim // 2]], -1)  # noqa: E731
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hidden)
    h = g + attended @ state["midlayer.self_attn.o_proj.weight"].T
    normed = rms(h, state["midlayer.post_attention_layernorm.weight"])
    out = h + (torch.nn.functional.silu(normed @ state["midlayer.mlp.gate_proj.weight"].T)
               * (normed @ state["midlayer.mlp.up_proj.weight"].T)) @ state["midlayer.mlp.down_proj.weight"].T
    return out, rms(out, state["norm.weight"]) @ state["lm_head.weight"].T


# ---------------------------------------------------------------------------------------------
# The runner's features


def test_runner_returns_the_inputs_of_the_requested_layers_and_only_when_asked():
    target = tiny_model("llama", seed=60, vocab_size=64, layers=LAYERS)
    ids = [3, 17, 5, 9, 2, 40]
    plain = ModelRunner(target).prefill(ids)
    assert plain.layers is None
    runner = ModelRunner(target)
    runner.capture_inputs((2, 3, 4))
    out = runner.prefill(ids)
    torch.testing.assert_close(out.layers, target_features(target, ids))
    torch.testing.assert_close(out.hidden, plain.hidden)  # capturing changes nothing else
    assert all(not layer._forward_pre_hooks for layer in target.model.layers)  # hooks live only during a forward
    with pytest.raises(ValueError, match="7 decoder layers"):
        runner.capture_inputs((2, 3, 7))


# ---------------------------------------------------------------------------------------------
# Loader


@pytest.mark.parametrize("case",
                         ["bin-reduced", "safetensors-full-no-maps", "narrower-head-with-embed", "unsorted-d2t"])
def test_eagle3_loader_matches_the_reference(tmp_path, case):
    target = tiny_model("llama", seed=61, vocab_size=64, layers=LAYERS)
    draft_ids = torch.tensor(sorted(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:24].tolist()))
    if case == "bin-reduced":
        state = write_eagle3(tmp_path, target, draft_ids)
    elif case == "safetensors-full-no-maps":  # draft_vocab_size == vocab_size, d2t/t2d left out
        state, draft_ids = write_eagle3(tmp_path, target, None, safetensors=True, with_maps=False), torch.arange(64)
    elif case == "narrower-head-with-embed":
        state = write_eagle3(tmp_path, target, draft_ids, hidden=32, embed=True, safetensors=True)
    else:  # a draft vocabulary listed out of id order: the loader reorders lm_head's rows with it
        state = write_eagle3(tmp_path, target, draft_ids)
        order = torch.randperm(24, generator=torch.Generator().manual_seed(1))
        state["lm_head.weight"], shuffled = state["lm_head.weight"][order], draft_ids[order]
        state["d2t"] = shuffled - torch.arange(24)
        torch.save(state, tmp_path / "pytorch_model.bin")
        draft_ids = shuffled
    head = load_eagle3_head(ModelSpec(path=str(tmp_path)), target)
    assert head.layers == (2, 3, 4)
    embed = state["embed_tokens.weight"] if "embed_tokens.weight" in state else target.get_input_embeddings().weight
    if "embed_tokens.weight" not in state:
        assert head.embed_tokens.weight is target.get_input_embeddings().weight  # shared, not copied
    tokens = [3, 17, 5, 9, 2]
    features = target_features(target, [1, *tokens[:-1]])
    drafter = Eagle3Drafter(head)
    drafter.follow(tokens, features)
    c = target.config
    expected, draft_logits = reference_eagle3(state, torch.tensor(tokens), features, embed, c.num_attention_heads,
                                              c.num_key_value_heads)
    torch.testing.assert_close(drafter.root_hidden, expected[-1], rtol=1e-4, atol=1e-4)
    full = torch.full((64,), float("-inf"))
    full[draft_ids] = draft_logits[-1]  # target id = draft id + d2t[draft id]
    torch.testing.assert_close(drafter.root_logits, full, rtol=1e-4, atol=1e-4)
    assert (head.vocabulary is None) == (case == "safetensors-full-no-maps")


@pytest.mark.parametrize("native_call", [False, True], ids=["torch ops", "one native call"])
def test_eagle3_head_drafts_the_same_on_the_fused_layer(tmp_path, native_call, monkeypatch):
    """The EAGLE-3 drafter runs its midlayer on the fused forward (q, k, v reading
    [input_layernorm(embed); hidden_norm(g)], the residual stream g): the committed pairs and two
    tree levels give the head's own (transformers) forward's outputs; with every linear on the
    native kernel, the layer is one native call."""
    from tests.test_native import all_native, layer_calls, native

    if native_call and native.unavailable_reason() is not None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    calls = layer_calls(monkeypatch)
    target = tiny_model("llama", seed=67, vocab_size=64, layers=LAYERS)
    write_eagle3(tmp_path, target, None, seed=3)
    fused, stock = (Eagle3Drafter(load_eagle3_head(ModelSpec(path=str(tmp_path)), target)) for _ in range(2))
    stock.fused = None
    assert fused.fused is not None and len(fused.linears) == 2
    path = all_native([fused.head, *fused.linears]) if native_call else None
    features = target_features(target, list(range(1, 13)))
    outputs = []
    for drafter in (fused, stock):
        with path.active() if path else contextlib.nullcontext():
            drafter.follow(list(range(10, 22)), features)
            first = drafter.feed_level([4, 5, 6], drafter.root_hidden.expand(3, -1), 1, [[], [], []])
            second = drafter.feed_level([7, 8], first[:2], 2, [[0], [1]])
        outputs.append((drafter.root_hidden, drafter.root_logits, first, second))
    assert calls == ([12, 3, 2] if native_call else [])
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_eagle3_loader_rejects_what_does_not_fit(tmp_path):
    from tests.test_tree_methods import write_eagle

    target = tiny_model("llama", seed=62, vocab_size=64, layers=LAYERS)
    write_eagle(tmp_path / "eagle1", target)
    with pytest.raises(ValueError, match="no draft_vocab_size: not an EAGLE-3 head"):
        load_eagle3_head(ModelSpec(path=str(tmp_path / "eagle1")), target)
    write_eagle3(tmp_path / "e3", target, [1, 4, 9])
    narrow = tiny_model("llama", seed=63, vocab_size=64, layers=LAYERS, hidden=32)
    with pytest.raises(ValueError, match="reads target features of size 64, the target's are 32"):
        load_eagle3_head(ModelSpec(path=str(tmp_path / "e3")), narrow)
    shallow = tiny_model("llama", seed=64, vocab_size=64, layers=6)
    with pytest.raises(ValueError, match=r"6 layers gives \(2, 3, 3\) \(needs L >= 7\)"):
        load_eagle3_head(ModelSpec(path=str(tmp_path / "e3")), shallow)
    state = write_eagle3(tmp_path / "bad-t2d", target, [1, 4, 9])
    state["t2d"][5] = True
    torch.save(state, tmp_path / "bad-t2d" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="t2d does not mark exactly"):
        load_eagle3_head(ModelSpec(path=str(tmp_path / "bad-t2d")), target)
    write_eagle3(tmp_path / "no-embed", target, [1, 4, 9], hidden=32)
    with pytest.raises(ValueError, match="no embed_tokens.weight"):
        load_eagle3_head(ModelSpec(path=str(tmp_path / "no-embed")), target)


def test_bad_settings_are_rejected_before_any_model_loads():
    check_method_params("eagle3", {"name": "eagle3", "total_tokens": "adaptive", "depth": 7, "top_k": 10, "head": None})
    for bad, message in [({"depth": -1}, "method.depth=-1: valid: an integer >= 0"),
                         ({"top_k": 0}, "method.top_k=0: valid: an integer >= 1"),
                         ({"total_tokens": "big"}, "valid: adaptive, auto or an integer >= 2"),
                         ({"draft_vocab": 100}, "method.draft_vocab=100: valid: one of the keys")]:
        with pytest.raises(ConfigError, match=message):
            check_method_params("eagle3", {"name": "eagle3", **bad})


def test_random_init_head_loads_through_the_released_format_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=65, vocab_size=64, layers=LAYERS)
    context = BuildContext(target, "tiny", {"drafts": {"eagle3": {"random_init": 0}}})
    decoder = get_method("eagle3")(ModelRunner(target), {"name": "eagle3", "total_tokens": 8, "depth": 3}, context)
    assert decoder.describe()["feature_layers"] == [2, 3, 4] and (tmp_path / "heads").is_dir()
    prompt, stop = [1, 2, 3], StopCondition(12)
    assert decoder.generate(prompt,
                            stop).tokens == AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    with pytest.raises(ValueError, match="needs L >= 7"):
        head_spec({}, BuildContext(tiny_model("llama", vocab_size=64, layers=3), "tiny", context.model_config),
                  "eagle3")


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_greedy_eagle3_equals_ar(arch, tmp_path):
    # a 16-token vocabulary: top-k trees often hold the target's choice, so multi-token paths are committed
    target = tiny_model(arch, seed=66, vocab_size=16, layers=LAYERS)
    write_eagle3(tmp_path / "reduced", target, [0, 1, 2, 3, 5, 6, 8, 9, 10, 12, 13, 15], seed=1)
    write_eagle3(tmp_path / "full", target, None, seed=2)
    reduced = load_eagle3_head(ModelSpec(path=str(tmp_path / "reduced")), target)
    full = load_eagle3_head(ModelSpec(path=str(tmp_path / "full")), target)
    decoders = {
        "default-tree": Eagle3Decoder(ModelRunner(target), reduced, total_tokens=60, depth=7, top_k=10),
        "small-tree": Eagle3Decoder(ModelRunner(target), reduced, total_tokens=8, depth=3, top_k=3),
        "full-vocab": Eagle3Decoder(ModelRunner(target), full, total_tokens=30, depth=5, top_k=6),
    }
    ar = AutoregressiveDecoder(ModelRunner(target))
    gen = torch.Generator().manual_seed(1)
    accepted = 0
    for name, decoder in decoders.items():
        for _ in range(2):
            prompt = torch.randint(0, 16, (int(torch.randint(2, 20, (), generator=gen)),), generator=gen).tolist()
            stop = StopCondition(32)
            out = decoder.generate(prompt, stop)
            assert out.tokens == ar.generate(prompt, stop).tokens, name
            assert sum(out.stats.accepted_lengths) == out.stats.new_tokens == 32
            accepted += out.stats.accepted_drafts
            assert out.stats.position_tested[0] >= out.stats.position_accepted[0]
    assert accepted > 20  # the commit of multi-token paths was exercised (random heads: few)


def test_head_cache_after_commit_equals_cache_built_along_the_accepted_path(tmp_path):
    target = tiny_model("llama", seed=67, vocab_size=16, layers=LAYERS)
    write_eagle3(tmp_path, target, None, seed=3)
    head = load_eagle3_head(ModelSpec(path=str(tmp_path)), target)
    decoder = Eagle3Decoder(ModelRunner(target), head, total_tokens=30, depth=5, top_k=8)
    prompt = [1, 5, 2, 7, 3]
    out = decoder.generate(prompt, StopCondition(25))
    assert out.stats.accepted_drafts > 0
    sequence = prompt + out.tokens
    fresh = Eagle3Drafter(head)
    fresh.follow(sequence[1:], target_features(target, sequence[:-1]))
    assert_committed_cache_equals(decoder.drafter, fresh, len(prompt), len(sequence))


# ---------------------------------------------------------------------------------------------
# Sampling preserves the target distribution, also with a draft vocabulary that lacks a token


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    target = tiny_model("llama", seed=20, vocab_size=4, hidden=32, layers=LAYERS, init_std=0.5)
    folder = tmp_path_factory.mktemp("eagle3-sampling")
    write_eagle3(folder, target, [0, 1, 3], seed=5, scale=0.5)  # token 2: q = 0, only the residual yields it
    head = load_eagle3_head(ModelSpec(path=str(folder)), target)
    return target, head, exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))


def test_eagle3_sampling_preserves_target_distribution(sampling_setup):
    target, head, expected = sampling_setup
    samples = draw(Eagle3Decoder(ModelRunner(target), head, total_tokens=6, depth=3, top_k=2), 600, seed=7)
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_eagle3_sampling_with_broken_acceptor_is_caught(sampling_setup):
    """Forgetting to remove a rejected child from p (residual = p) favours rejected tokens."""
    target, head, expected = sampling_setup
    decoder = Eagle3Decoder(ModelRunner(target), head, total_tokens=6, depth=3, top_k=2)
    decoder.sample_accept = lambda tree, probs, gen, **kw: Eagle3Decoder.sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw
    )
    samples = draw(decoder, 600, seed=7)
    assert chi_square_pvalue(samples, expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# Training recipe: the training-time test is what inference computes; saved in the released format


def test_training_time_test_equals_inference_and_saves_the_released_format(tmp_path):
    from harness.training.eagle3 import Eagle3Recipe, attach_features
    from harness.training.examples import Example

    target = tiny_model("llama", seed=68, vocab_size=32, layers=LAYERS)
    vocabulary = DraftVocabulary(torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 13, 15, 16, 20, 21, 22, 25, 30]), 32)
    recipe = Eagle3Recipe(target, 0, vocabulary, steps=4)
    with torch.no_grad():  # leave the identity-like initialization: every branch contributes
        for p in recipe.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 32, (14,), generator=torch.Generator().manual_seed(0))
    example = Example(ids, answer_start=6)
    attach_features(target, [example], recipe.layers)
    torch.testing.assert_close(example.features, target_features(target, ids.tolist()))
    n = len(ids) - 1
    with torch.no_grad():
        steps = recipe.unroll(torch.cat([ids[1:], ids.new_zeros(4)]), recipe.head.fuse(example.features[:n]))
    assert [len(s) for s in steps] == [n, n - 1, n - 2, n - 3]
    head = recipe.head.eval()
    head.vocabulary = vocabulary
    for i in (0, 4, 9):  # inference at position i: the pairs up to i, then a chain of tree levels
        drafter = Eagle3Drafter(head)
        drafter.follow(ids[1: i + 2].tolist(), example.features[: i + 1])
        torch.testing.assert_close(drafter.root_hidden, steps[0][i], rtol=1e-4, atol=1e-5)
        hidden = drafter.root_hidden[None]
        for depth in range(1, 4):
            hidden = drafter.feed_level([int(ids[i + 1 + depth])], hidden, depth, [list(range(depth - 1))])
            torch.testing.assert_close(hidden[0], steps[depth][i], rtol=1e-4, atol=1e-5)
    head.train()
    loss, stats = recipe.loss(example, 0.0, None)
    loss.backward()
    assert sorted(stats) == ["acc_1", "acc_2", "acc_3", "acc_4"] and torch.isfinite(loss)
    assert recipe.head.fc.weight.grad.abs().sum() > 0 and recipe.head.embed_tokens.weight.grad is None
    recipe.save(tmp_path)
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert "embed_tokens.weight" not in saved and saved["d2t"].dtype == torch.long and saved["t2d"].dtype == torch.bool
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == len(vocabulary)
    loaded = load_eagle3_head(ModelSpec(path=str(tmp_path)), target)
    assert torch.equal(loaded.vocabulary.ids, vocabulary.ids)
    torch.testing.assert_close(loaded.lm_head.weight, recipe.head.lm_head.weight.detach().to(torch.bfloat16).float())


def _trained_recipe(steps=4, seed=68):
    from harness.training.eagle3 import Eagle3Recipe

    target = tiny_model("llama", seed=seed, vocab_size=32, layers=LAYERS)
    vocabulary = DraftVocabulary(torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 13, 15, 16, 20, 21, 22, 25, 30]), 32)
    recipe = Eagle3Recipe(target, 0, vocabulary, steps=steps)
    with torch.no_grad():  # off the identity-like initialization: every branch contributes
        for p in recipe.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return target, recipe


def _conversations(shapes, seed=1):
    """Examples of unequal lengths and answer starts (padding, and rows starting at different positions)."""
    from harness.training.examples import Example

    generator = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(0, 32, (length,), generator=generator), start) for length, start in shapes]


def _loss_by_the_definition(recipe, example):
    """The per-example loss written out position by position from the (inference-checked) unbatched
    unroll: step j at position i predicts the target's distribution at i + 1 + j; answer positions
    only, the cross-entropy zeroed where the target's argmax is outside the draft vocabulary, each
    step's mean over its answer positions weighted 0.8^j."""
    ids, T, start = example.ids, len(example.ids), example.answer_start
    n = T - 1
    steps = recipe.unroll(torch.cat([ids[1:], ids.new_zeros(recipe.steps)]),
                          recipe.head.fuse(example.features[:n].float()))
    total = torch.zeros(())
    for j, out in enumerate(steps):
        terms = []
        for i in range(len(out)):
            t = i + 1 + j  # the target position whose next token it predicts
            if start <= t + 1 <= T - 1:
                p = (example.hidden[t].float() @ recipe.target_rows.T).softmax(-1)
                ce = -(p * recipe.head.draft_logits(out[i]).log_softmax(-1)).sum()
                terms.append(ce * float(bool(recipe.head.t2d[example.top[t]])))
        if terms:
            total = total + 0.8 ** j * torch.stack(terms).mean()
    return total


def test_batched_training_time_test_equals_the_per_example_losses_and_gradients():
    from harness.training.eagle3 import attach_features

    target, recipe = _trained_recipe()
    # lengths 9..20, answers starting early (rows from 0) and late (rows from start - 1 - steps)
    batch = _conversations([(14, 6), (20, 3), (9, 7), (17, 12), (11, 1), (20, 16)])
    attach_features(target, batch, recipe.layers)
    batched, stats = recipe.batch_loss(batch, 0.0, [None] * len(batch))
    grads = torch.autograd.grad(batched, recipe.parameters())
    defined = [_loss_by_the_definition(recipe, e) for e in batch]
    expected_grads = torch.autograd.grad(sum(defined), recipe.parameters())
    torch.testing.assert_close(batched, sum(defined), rtol=1e-5, atol=1e-5)
    for g, h in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    singles = [recipe.batch_loss([e], 0.0, [None]) for e in batch]
    for one, by_definition in zip(singles, defined):
        torch.testing.assert_close(one[0], by_definition, rtol=1e-5, atol=1e-5)
    assert sorted(stats) == ["acc_1", "acc_2", "acc_3", "acc_4"]
    for key in stats:  # the batch's accuracies are the examples' own, in order
        assert torch.equal(stats[key], torch.cat([s[1][key] for s in singles if key in s[1]]))
    # step j predicts the target's next token at positions t in [max(start - 1, 1 + j), T - 2]
    assert len(stats["acc_2"]) == sum(len(e.ids) - max(e.answer_start, 3) for e in batch) == 44
    # the batch was padded (and its rows start at different positions): the singles were not
    assert len({len(e.ids) for e in batch}) > 3 and len({max(0, e.answer_start - 5) for e in batch}) > 3


def test_eagle3_features_are_cached_in_16_bits_memory_mapped_and_reused_only_when_they_match(tmp_path):
    import copy

    import numpy as np

    from harness.training.eagle3 import attach_features
    from harness.training.examples import attach_hidden

    target, recipe = _trained_recipe()
    H = target.config.hidden_size
    shapes = [(14, 6), (20, 3), (9, 7), (17, 12), (11, 1), (20, 16)]
    expected = _conversations(shapes)
    attach_features(target, expected, recipe.layers)  # in RAM, float32
    for e in expected:
        torch.testing.assert_close(e.features, target_features(target, e.ids.tolist()))
        assert e.features.dtype == torch.float32 and e.hidden.shape == (len(e.ids), H)
    cache = tmp_path / "eagle3_features.pt"
    cached = _conversations(shapes)
    attach_features(target, cached, recipe.layers, cache=cache, batch_tokens=40)  # several right-padded batches
    assert (tmp_path / "eagle3_features.pt.bin").stat().st_size == sum(len(e.ids) for e in expected) * 4 * H * 2
    for a, e in zip(cached, expected):
        assert a.features.dtype == a.hidden.dtype == torch.float16
        torch.testing.assert_close(a.features.float(), e.features, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(a.hidden.float(), e.hidden, rtol=2e-3, atol=2e-3)
        assert torch.equal(a.top, e.top)
    # the batched loss reads the 16-bit views: the float32 loss to float16's precision
    with torch.no_grad():
        torch.testing.assert_close(recipe.batch_loss(cached, 0.0, [None] * 6)[0],
                                   recipe.batch_loss(expected, 0.0, [None] * 6)[0], rtol=1e-2, atol=1e-2)
    # a later run maps the file (marked: example 0's first feature row + 1), it does not recompute
    data = np.fromfile(tmp_path / "eagle3_features.pt.bin", dtype=np.float16)
    data[:3 * H] += 1
    data.tofile(tmp_path / "eagle3_features.pt.bin")
    again = _conversations(shapes)
    attach_features(target, again, recipe.layers, cache=cache)
    torch.testing.assert_close(again[0].features[0].float(), expected[0].features[0] + 1, rtol=2e-3, atol=1e-2)
    torch.testing.assert_close(again[0].hidden[0].float(), expected[0].hidden[0], rtol=2e-3, atol=2e-3)
    # the head recipes (EAGLE, Medusa, Hydra) read the last hidden state from it without a target pass
    from harness.training.eagle3 import attach_cached_features

    heads = _conversations(shapes)
    assert attach_cached_features(target, heads, recipe.layers, cache)
    torch.testing.assert_close(heads[3].hidden.float(), expected[3].hidden, rtol=2e-3, atol=2e-3)
    assert torch.equal(heads[3].top, expected[3].top)
    assert not attach_cached_features(target, _conversations(shapes[:-1]), recipe.layers, cache)  # other examples
    assert not attach_cached_features(target, _conversations(shapes), (1, 3, 5), cache)  # other layers
    assert not attach_cached_features(target, _conversations(shapes), recipe.layers, tmp_path / "absent.pt")
    # other examples, other layers, or attach_hidden's kind on the same file: computed afresh
    other = _conversations(shapes[:-1])
    attach_features(target, other, recipe.layers, cache=cache)
    torch.testing.assert_close(other[0].features[0].float(), expected[0].features[0], rtol=2e-3, atol=2e-3)
    layers = (1, 3, 5)
    moved = _conversations(shapes[:-1])
    attach_features(target, moved, layers, cache=cache)
    with torch.no_grad():
        states = target(input_ids=moved[1].ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(moved[1].features.float(), torch.cat([states[i][0] for i in layers], -1), rtol=2e-3,
                               atol=2e-3)
    hidden_only = _conversations(shapes[:-1])
    attach_hidden(target, hidden_only, cache)
    assert hidden_only[0].features is None and hidden_only[0].hidden.shape == (14, H)
    assert (tmp_path / "eagle3_features.pt.bin").stat().st_size == sum(len(e.ids) for e in hidden_only) * H * 2
    # layer inputs beyond float16's range: the whole file in bfloat16
    loud = copy.deepcopy(target)
    with torch.no_grad():
        loud.model.embed_tokens.weight.mul_(1e6)  # the residual stream (the layers' inputs) beyond 65504
    big = _conversations(shapes[:3])
    attach_features(loud, big, recipe.layers)
    assert max(float(e.features.abs().max()) for e in big) > 65504  # float16 overflows
    stored = _conversations(shapes[:3])
    attach_features(loud, stored, recipe.layers, cache=tmp_path / "loud.pt")
    for a, e in zip(stored, big):
        assert a.features.dtype == torch.bfloat16 and torch.isfinite(a.features.float()).all()
        torch.testing.assert_close(a.features.float(), e.features, rtol=1e-2, atol=1e-2 * float(e.features.abs().max()))
        assert torch.equal(a.top, e.top)


# ---------------------------------------------------------------------------------------------
# The harness: `make bench METHOD=eagle3` on a tiny model with a head in the released format


@pytest.fixture(scope="module")
def tiny_deep_chat_model_dir(tmp_path_factory, embedded):
    from transformers import LlamaForCausalLM

    _, tokenizer = embedded
    folder = tmp_path_factory.mktemp("tiny-deep-chat-model")
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden=32, layers=LAYERS,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_bench_runs_eagle3_with_a_released_format_head(tiny_deep_chat_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from harness.running.run import run
    from tests.test_harness import config, tiny_overrides

    target = AutoModelForCausalLM.from_pretrained(tiny_deep_chat_model_dir)
    write_eagle3(tmp_path / "head", target, list(range(0, target.config.vocab_size, 7)), seed=4)
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                                 for i, t in enumerate(["Who wrote Hamlet?", "What is 2+2?"])))
    summary = run(config(*tiny_overrides(tiny_deep_chat_model_dir, questions, tmp_path / "results", "method=eagle3",
                                               "limit=2", f"model.drafts.eagle3={{path: {tmp_path / 'head'}}}",
                                               "method.total_tokens=20")))
    assert summary["lossless"] and summary["fidelity"]["differing_questions"] == 0
    assert summary["decoder"]["position_tested"][0] > 0


def test_embedded_greedy_eagle3_equals_ar_with_the_suites_head(embedded, embedded_decoder, embedded_prompts):
    """The trained head in drafts/smollm2-135m/eagle3 (conf/model/smollm2-135m.yaml), two prompts."""
    model, tokenizer = embedded
    stop = StopCondition(32, frozenset({tokenizer.eos_token_id}))
    decoder = embedded_decoder("eagle3", total_tokens=10, depth=4, top_k=6)
    ar = AutoregressiveDecoder(ModelRunner(model))
    accepted = 0
    for prompt in embedded_prompts[:2]:
        out = decoder.generate(prompt, stop)
        assert out.tokens == ar.generate(prompt, stop).tokens
        accepted += out.stats.accepted_drafts
    assert accepted > 0
