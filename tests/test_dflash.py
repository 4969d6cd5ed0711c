"""DFlash: the loader on tiny checkpoints in the released format (exact key names) against a from-scratch
reference, the draft cache grown step by step against a full recompute, greedy exactness alone and in a batch
(Llama and Qwen3 targets), one draft forward per step, sampling (chi-square, with a broken-acceptor
counter-test), the settings, and the training recipe's mask, loss weights and agreement with inference."""

from __future__ import annotations

import json
import math

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext, check_method_params, get_method
from methods.dflash import DFlashDecoder, DFlashSettings
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.models.heads.dflash import ContextCache, build_target_layer_ids, load_dflash_draft
from methods.models.specs import ModelSpec, ModelUnavailableError
from methods.settings.params import ConfigError
from tests.conftest import assert_embedded_greedy, tiny_model
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint

LAYERS = 4  # the tiny targets' layers; the draft reads the outputs of layers 0 and 2 (HF hidden_states[1], [3])
IDS = [0, 2]


def qwen3_target(seed: int, vocab_size: int = 16, layers: int = LAYERS):
    """A tiny Qwen3 target (q_norm/k_norm), DFlash's own family; it runs on the stock decoder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).float().eval().requires_grad_(False)


def write_dflash(folder, target, ids=IDS, layers=2, block=4, mask=None, seed=0, scale=0.1, bias=False,
                 drop=(), add=None, **config_overrides):
    """A DFlash checkpoint as released (config.json + model.safetensors, upstream's key names, no prefix) with
    the target's shapes. `drop`: keys left out; `add`: extra tensors; `config_overrides`: config.json fields."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    c = target.config
    H, heads, kv_heads = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    d, inter = H // heads, 2 * H
    r = lambda *shape: torch.randn(*shape, generator=g) * scale  # noqa: E731
    state = {"fc.weight": r(H, len(ids) * H), "hidden_norm.weight": 1 + r(H), "norm.weight": 1 + r(H)}
    for i in range(layers):
        p = f"layers.{i}."
        state |= {p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
                  p + "self_attn.q_proj.weight": r(heads * d, H), p + "self_attn.k_proj.weight": r(kv_heads * d, H),
                  p + "self_attn.v_proj.weight": r(kv_heads * d, H), p + "self_attn.o_proj.weight": r(H, heads * d),
                  p + "self_attn.q_norm.weight": 1 + r(d), p + "self_attn.k_norm.weight": 1 + r(d),
                  p + "mlp.gate_proj.weight": r(inter, H), p + "mlp.up_proj.weight": r(inter, H),
                  p + "mlp.down_proj.weight": r(H, inter)}
        if bias:
            state |= {p + f"self_attn.{n}_proj.bias": r(heads * d if n in "qo" else kv_heads * d) for n in "qkv"}
            state[p + "self_attn.o_proj.bias"] = r(H)
    for key in drop:
        del state[key]
    state |= add or {}
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": d, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 512, "vocab_size": c.vocab_size, "attention_bias": bias,
              "block_size": block, "num_target_layers": c.num_hidden_layers,
              "layer_types": ["full_attention"] * layers,
              "dflash_config": {"mask_token_id": c.vocab_size - 1 if mask is None else mask,
                                "target_layer_ids": list(ids)}, **config_overrides}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return state, config


def target_features(target, ids: list[int], layer_ids=IDS) -> torch.Tensor:
    """[n, len(layer_ids)·H]: the outputs of the target's layers k (HF hidden_states[k + 1], upstream's
    `extract_context_feature`), from transformers' own forward, independent of the runner's hooks."""
    with torch.no_grad():
        states = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[k + 1][0] for k in layer_ids], -1)


def reference_draft(state, config, features, block, start, embed, theta=10000.0):
    """DFlash's draft written out from upstream's model.py: context = hidden_norm(fc(features)) at positions
    0 .. len - 1; the block's embeddings at start ..; per layer q from the block, k/v from [context; block]
    through the same projections, q_norm/k_norm per head, RoPE, attention over everything (not causal),
    residual, SwiGLU MLP; the final norm. Returns [len(block), H]."""
    eps, heads, kv_heads, d = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    ctx = rms(features @ state["fc.weight"].T, state["hidden_norm.weight"])
    h = embed[torch.tensor(block)]
    c, n = len(features), len(block)
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    positions = torch.cat([torch.arange(c), start + torch.arange(n)]).float()
    angles = torch.cat([positions[:, None] * inv_freq] * 2, -1)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    rope = lambda t, cs, sn: t * cs + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sn  # noqa: E731
    linear = lambda x, name: x @ state[name + ".weight"].T + state.get(name + ".bias", 0)  # noqa: E731
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, state[p + "input_layernorm.weight"])
        both = torch.cat([ctx, x])
        q = rms(linear(x, p + "self_attn.q_proj").view(n, heads, d), state[p + "self_attn.q_norm.weight"])
        k = rms(linear(both, p + "self_attn.k_proj").view(c + n, kv_heads, d), state[p + "self_attn.k_norm.weight"])
        v = linear(both, p + "self_attn.v_proj").view(c + n, kv_heads, d)
        q, k = rope(q, cos[c:], sin[c:]), rope(k, cos, sin)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)).softmax(-1)
        h = h + linear(torch.einsum("hqk,khd->qhd", weights, v).reshape(n, heads * d), p + "self_attn.o_proj")
        x = rms(h, state[p + "post_attention_layernorm.weight"])
        gate, up = x @ state[p + "mlp.gate_proj.weight"].T, x @ state[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    return rms(h, state["norm.weight"])


def fresh_draft(draft, embed, sequence_features, block, start):
    """The draft's block output with a fresh cache holding nothing: every context position at once."""
    cache = ContextCache()
    cache.reset(start + len(block), draft)
    with torch.no_grad():
        return draft.draft(embed(torch.tensor([block])), sequence_features[None], [start], [start], [cache])[0]


# ---------------------------------------------------------------------------------------------
# Loader


@pytest.mark.parametrize("bias", [False, True], ids=["released", "attention_bias"])
def test_loader_reads_the_released_keys_and_drafts_as_the_reference(tmp_path, bias):
    target = tiny_model("llama", seed=61, vocab_size=64, layers=LAYERS)
    state, config = write_dflash(tmp_path, target, bias=bias)
    draft = load_dflash_draft(ModelSpec(path=str(tmp_path)), target)
    assert set(draft.state_dict()) == set(state)  # the module's own names are the released ones, no more
    assert draft.target_layer_ids == IDS and draft.feature_layers == (1, 3) and draft.block_size == 4
    assert draft.mask_token_id == 63
    sequence = [3, 17, 5, 9, 2, 40, 11]
    start = 5  # the context: positions 0..4; the block [sequence[5], mask, mask, mask] at 5..8
    features = target_features(target, sequence)[:start]
    block = [sequence[start]] + [63] * 3
    embed = target.get_input_embeddings()
    expected = reference_draft(state, config, features, block, start, embed.weight)
    torch.testing.assert_close(fresh_draft(draft, embed, features, block, start), expected, rtol=1e-4, atol=1e-4)
    # the same without a cache: every block row sees every context position and the whole block
    with torch.no_grad():
        masked = draft.forward_masked(embed(torch.tensor([block])), start + torch.arange(4)[None], features[None],
                                      torch.arange(start)[None], torch.ones(1, 4, start + 4, dtype=torch.bool))
    torch.testing.assert_close(masked[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case, message", [
    ("no dflash_config", "config.json has no dflash_config: not a DFlash draft"),
    ("missing key", r"missing \['layers.1.self_attn.k_norm.weight'\]"),
    ("own lm_head", r"unexpected \['lm_head.weight'\]"),
    ("prefixed keys", r"missing \['fc.weight'"),
    ("three feature layers", "size mismatch for fc.weight"),
    ("another hidden size", "a draft of hidden size 64 for a target of 32"),
    ("another depth", "trained for a target of 36 layers, this one has 4"),
    ("the last layer", r"target_layer_ids \[0, 3\]: each must be 0 .. 2"),
    ("sliding layers", r"layer_types \['full_attention', 'sliding_attention'\]: only full_attention"),
    ("no mask token", "dflash_config has no mask_token_id"),
])
def test_loader_refuses_what_does_not_fit_in_one_line(tmp_path, case, message):
    target = tiny_model("llama", seed=62, vocab_size=64, layers=LAYERS)
    if case == "no dflash_config":
        _, config = write_dflash(tmp_path, target)
        del config["dflash_config"]
        (tmp_path / "config.json").write_text(json.dumps(config))
    elif case == "missing key":
        write_dflash(tmp_path, target, drop=["layers.1.self_attn.k_norm.weight"])
    elif case == "own lm_head":
        write_dflash(tmp_path, target, add={"lm_head.weight": torch.zeros(64, 64)})
    elif case == "prefixed keys":
        state, _ = write_dflash(tmp_path, target)
        from safetensors.torch import save_file

        save_file({f"model.{k}": v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    elif case == "three feature layers":
        _, config = write_dflash(tmp_path, target)
        config["dflash_config"]["target_layer_ids"] = [0, 1, 2]
        (tmp_path / "config.json").write_text(json.dumps(config))
    elif case == "another hidden size":
        write_dflash(tmp_path, target)
        target = tiny_model("llama", seed=62, vocab_size=64, layers=LAYERS, hidden=32)
    elif case == "another depth":
        write_dflash(tmp_path, target, num_target_layers=36)
    elif case == "the last layer":
        write_dflash(tmp_path, target, ids=[0, 3])
    elif case == "sliding layers":
        write_dflash(tmp_path, target, layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    else:
        _, config = write_dflash(tmp_path, target)
        del config["dflash_config"]["mask_token_id"]
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as error:
        load_dflash_draft(ModelSpec(path=str(tmp_path)), target)
    assert "\n" not in str(error.value)


def test_upstreams_default_feature_layers():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the released Qwen3-8B draft's
    assert build_target_layer_ids(30, 1) == [15] and build_target_layer_ids(30, 2) == [1, 27]


# ---------------------------------------------------------------------------------------------
# Decoding


def corrupted_oracle(decoder, reference: dict, seed: int = 0, wrong: float = 0.3):
    """Drafts that are the target's own greedy continuation (`reference[prompt]`, AR's tokens), each wrong with
    probability `wrong`: multi-token paths get committed, and partial ones. The draft forward still runs on
    every step (its caches and features follow the real sequence); only its tokens are replaced."""
    generator = torch.Generator().manual_seed(seed)
    draft_blocks = decoder.draft_blocks

    def oracle(states, count):
        roots, drafts = draft_blocks(states, count)
        drafts = drafts.clone()
        for row, state in enumerate(states):
            ahead = reference[tuple(state.prompt)][len(state.tokens):len(state.tokens) + count]
            for j, token in enumerate(ahead):
                if torch.rand((), generator=generator) >= wrong:
                    drafts[row, j] = token
        return roots, drafts

    decoder.draft_blocks = oracle
    return decoder


def prompts_and_stops(vocab: int = 16):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (3, 30, 11)]
    return prompts, [StopCondition(24), StopCondition(16), StopCondition(24)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_dflash_equals_ar_alone_and_in_a_batch(tmp_path, arch):
    target = qwen3_target(66) if arch == "qwen3" else tiny_model("llama", seed=66, vocab_size=16, layers=LAYERS)
    write_dflash(tmp_path / "b4", target, seed=1)
    write_dflash(tmp_path / "b16", target, ids=[1], layers=1, block=16, seed=2)
    ar = AutoregressiveDecoder(ModelRunner(target))
    prompts, stops = prompts_and_stops()
    reference = {tuple(p): ar.generate(p, StopCondition(40)).tokens for p in prompts}
    accepted = 0
    for name in ("b4", "b16"):
        draft = load_dflash_draft(ModelSpec(path=str(tmp_path / name)), target)
        for oracle in (False, True):
            make = lambda: DFlashDecoder(ModelRunner(target), draft)  # noqa: E731
            make_one = (lambda: corrupted_oracle(make(), reference)) if oracle else make
            alone = [make_one().generate(p, s) for p, s in zip(prompts, stops)]
            assert [out.tokens for out in alone] == [reference[tuple(p)][: s.max_new_tokens]
                                                     for p, s in zip(prompts, stops)], (name, oracle)
            for out in alone:
                assert sum(out.stats.accepted_lengths) == out.stats.new_tokens
                assert max(out.stats.accepted_lengths) <= draft.block_size
            accepted += sum(out.stats.accepted_drafts for out in alone)
            for batch in (2, 3):
                outs = make_one().generate_batch(prompts[:batch], stops[:batch])
                assert [out.tokens for out in outs] == [out.tokens for out in alone[:batch]], (name, oracle, batch)
    assert accepted > 40  # multi-token paths were committed


def test_the_draft_cache_grown_step_by_step_equals_a_full_recompute(tmp_path):
    """At every step of a decode (with partial and whole acceptances), the draft's block output from its
    cache, grown by each step's new features, equals the draft run afresh over every context position of the
    sequence so far (features from transformers' own forward), with and without a cache."""
    target = tiny_model("llama", seed=67, vocab_size=16, layers=LAYERS)
    write_dflash(tmp_path, target, seed=3)
    draft = load_dflash_draft(ModelSpec(path=str(tmp_path)), target)
    prompt = [1, 5, 2, 7, 3, 9, 4]
    reference = {tuple(prompt): AutoregressiveDecoder(ModelRunner(target)).generate(prompt, StopCondition(40)).tokens}
    decoder = corrupted_oracle(DFlashDecoder(ModelRunner(target), draft), reference)
    recorded, run = [], draft.draft

    def record(embeds, features, counts, starts, caches):
        out = run(embeds, features, counts, starts, caches)
        recorded.append((starts[0], out[0].clone()))
        return out

    draft.draft = record
    out = decoder.generate(prompt, StopCondition(30))
    del draft.draft
    assert out.stats.accepted_drafts > 10 and len(recorded) > 5
    sequence = prompt + out.tokens
    features = target_features(target, sequence)
    embed = target.get_input_embeddings()
    for start, hidden in recorded:
        block = [sequence[start]] + [draft.mask_token_id] * 3
        torch.testing.assert_close(hidden, fresh_draft(draft, embed, features[:start], block, start),
                                   rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            masked = draft.forward_masked(embed(torch.tensor([block])), start + torch.arange(4)[None],
                                          features[None, :start], torch.arange(start)[None],
                                          torch.ones(1, 4, start + 4, dtype=torch.bool))
        torch.testing.assert_close(hidden, masked[0], rtol=1e-4, atol=1e-5)


def test_one_draft_forward_drafts_a_step_for_the_whole_batch(tmp_path):
    """Each step that drafts runs the draft once, for every running sequence's block together (B rows), and
    each chain holds at most the block's drafts, fewer when the answer's end is near."""
    target = tiny_model("llama", seed=68, vocab_size=16, layers=LAYERS)
    write_dflash(tmp_path, target, seed=4)
    draft = load_dflash_draft(ModelSpec(path=str(tmp_path)), target)
    decoder = DFlashDecoder(ModelRunner(target), draft)
    calls, steps, run, propose_batch = [], [], draft.draft, decoder.propose_batch
    draft.draft = lambda embeds, *args: calls.append(embeds.shape[:2]) or run(embeds, *args)

    def proposing(states, budgets):
        trees = propose_batch(states, budgets)
        steps.append(sum(len(tree) > 1 for tree in trees))
        assert all(len(tree) - 1 == min(3, budget) for tree, budget in zip(trees, budgets))
        return trees

    decoder.propose_batch = proposing
    prompts, stops = prompts_and_stops()
    outs = decoder.generate_batch(prompts, stops)
    assert [tuple(shape) for shape in calls] == [(drafting, 4) for drafting in steps if drafting]
    assert max(steps) == 3 and len(set(steps)) > 1  # the batch drained
    assert sum(out.stats.extra["draft_forwards"] for out in outs) == sum(steps)
    calls.clear(), steps.clear()
    out = decoder.generate(prompts[0], stops[0])
    assert len(calls) == out.stats.extra["draft_forwards"] == sum(steps) >= out.stats.steps - 2


# ---------------------------------------------------------------------------------------------
# Sampling preserves the target's distribution


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    target = tiny_model("llama", seed=20, vocab_size=4, hidden=32, layers=LAYERS, init_std=0.5)
    folder = tmp_path_factory.mktemp("dflash-sampling")
    write_dflash(folder, target, seed=5, scale=0.5)
    draft = load_dflash_draft(ModelSpec(path=str(folder)), target)
    return target, draft, exact_joint(target, PROMPT, 3, SamplingConfig(temperature=1.0))


def test_dflash_sampling_preserves_the_target_distribution(sampling_setup):
    target, draft, expected = sampling_setup
    decoder = DFlashDecoder(ModelRunner(target), draft)
    samples = draw(decoder, 800, seed=7)
    assert chi_square_pvalue(samples, expected) > 1e-3
    assert decoder.describe()["draft_tokens"] == 3


def test_dflash_sampling_with_a_broken_acceptor_is_caught(sampling_setup):
    """Sampling the next token from p itself after a rejected draft (the draft not removed) favours drafts."""
    target, draft, expected = sampling_setup
    decoder = DFlashDecoder(ModelRunner(target), draft)
    decoder.sample_accept = lambda tree, probs, gen, **kw: DFlashDecoder.sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw)
    decoder.sample_pending = lambda tree, probs, gen, **kw: DFlashDecoder.sample_pending(
        tree, probs, gen, residual=lambda p, q: p, **kw)
    samples = draw(decoder, 800, seed=7)
    assert chi_square_pvalue(samples, expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# Settings, sizes, the embedded model's draft


class Curve:
    """A machine profile that only has a latency curve."""

    def latency_curve(self, target, name):
        return {1: 1.0, 4: 1.0, 8: 1.1, 16: 2.0, 64: 8.0}


def test_block_size_auto_is_the_drafts_block_cut_to_the_verify_budget_and_b_is_upstreams(tmp_path):
    target = tiny_model("llama", seed=69, vocab_size=16, layers=LAYERS)
    write_dflash(tmp_path, target, ids=[1], layers=1, block=16, seed=6)
    spec = {"drafts": {"dflash": {"path": str(tmp_path)}}}
    build = get_method("dflash")
    plain = build(ModelRunner(target), {"name": "dflash"}, BuildContext(target, "tiny", spec))
    assert (plain.block, plain.sizing.value) == (16, 15)  # no profile: upstream's whole block
    profiled = build(ModelRunner(target), {"name": "dflash"}, BuildContext(target, "tiny", spec, Curve()))
    assert (profiled.block, profiled.sizing.value) == (16, 8)  # v(9) <= 1.3: 9 tokens verified
    assert profiled.describe()["verify_block"] == 9 and profiled.sizing.cut(4) < 8
    explicit = build(ModelRunner(target), {"name": "dflash", "block_size": 5},
                     BuildContext(target, "tiny", spec, Curve()))
    assert (explicit.block, explicit.sizing.value, explicit.sizing.cut(4)) == (5, 4, None)
    prompt, stop = [1, 2, 3], StopCondition(20)
    expected = AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    for decoder in (plain, profiled, explicit):
        out = decoder.generate(prompt, stop)
        assert out.tokens == expected and max(out.stats.accepted_lengths) <= decoder.sizing.value + 1


def test_settings_are_checked_and_a_missing_embedded_draft_says_how_to_train_it():
    check_method_params("dflash", {"name": "dflash", "block_size": "auto", "draft_vocab": "auto", "head": None})
    for bad, message in [({"block_size": 1}, "method.block_size=1: valid: auto or an integer >= 2"),
                         ({"block_size": "big"}, "valid: auto or an integer >= 2"),
                         ({"depth": 3}, "method.depth=3: valid: one of the keys")]:
        with pytest.raises(ConfigError, match=message):
            check_method_params("dflash", {"name": "dflash", **bad})
    model = {"name": "smollm2-135m", "drafts": {"dflash": {"path": "drafts/smollm2-135m/not-trained"}}}
    with pytest.raises(ConfigError, match=r"train it with `python -m harness.training dflash --model smollm2-135m`") \
            as error:
        DFlashSettings().check_model(model)
    assert "\n" not in str(error.value)
    DFlashSettings(head={"path": "elsewhere"}).check_model(model)  # a draft given: nothing to build
    DFlashSettings().check_model({"name": "x", "drafts": {"dflash": {"path": "z-lab/Qwen3-8B-DFlash-b16"}}})
    target = tiny_model("llama", seed=69, vocab_size=16, layers=LAYERS)
    with pytest.raises(ModelUnavailableError, match="no DFlash draft at drafts/smollm2-135m/not-trained yet"):
        get_method("dflash")(ModelRunner(target), {"name": "dflash"}, BuildContext(target, "smollm2-135m", model))


def test_the_embedded_models_draft_is_the_suites_own():
    from omegaconf import OmegaConf

    from methods.models.specs import model_config

    drafts = OmegaConf.to_container(model_config("smollm2-135m"), resolve=True)["drafts"]
    assert drafts["dflash"] == {"path": "drafts/smollm2-135m/dflash"}
    for name, hub in (("qwen3-4b", "z-lab/Qwen3-4B-DFlash-b16"), ("qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16"),
                      ("llama3.1-8b-instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat")):
        assert OmegaConf.to_container(model_config(name), resolve=True)["drafts"]["dflash"] == {"path": hub}


def test_embedded_greedy_dflash_equals_generate_alone_and_in_a_batch(embedded, embedded_decoder, embedded_prompts,
                                                                     embedded_reference):
    """The suite's trained draft in drafts/smollm2-135m/dflash (conf/model/smollm2-135m.yaml)."""
    assert_embedded_greedy(embedded_decoder("dflash"), embedded[1], embedded_prompts, embedded_reference, batch=3)


def test_chat_template_kwargs_reach_the_tokenizers_template():
    """A model config's `chat_template_kwargs` (Qwen3's enable_thinking: false) go to apply_chat_template."""
    from omegaconf import OmegaConf

    from harness.running.prompts import ChatTemplate, Message
    from methods.models.specs import model_config

    class Tokenizer:
        chat_template, eos_token_id = "{{ messages }}", 2

        def apply_chat_template(self, chat, **kwargs):
            self.kwargs = kwargs
            return {"input_ids": [1, 2, 3]}

    tokenizer = Tokenizer()
    config = model_config("qwen3-8b")
    assert OmegaConf.to_container(config)["chat_template_kwargs"] == {"enable_thinking": False}
    assert ChatTemplate.for_model(config, tokenizer).prompt_ids([Message("user", "hi")]) == [1, 2, 3]
    assert tokenizer.kwargs == {"add_generation_prompt": True, "return_dict": True, "enable_thinking": False}
    ChatTemplate.for_model(model_config("smollm2-135m"), tokenizer).prompt_ids([Message("user", "hi")])
    assert "enable_thinking" not in tokenizer.kwargs


# ---------------------------------------------------------------------------------------------
# The training recipe (SpecForge's): mask, loss weights, agreement with inference, the CLI end to end


def specforge_mask(anchors, keep, S, block):
    """SpecForge's `create_dflash_sdpa_mask` (full attention), line for line."""
    B, N = anchors.shape
    q_indices = torch.arange(N * block).view(1, 1, -1, 1)
    kv_indices = torch.arange(S + N * block).view(1, 1, 1, -1)
    q_block_ids = q_indices // block
    anchor_expanded = anchors.view(B, 1, N, 1).repeat_interleave(block, dim=2)
    mask_context = (kv_indices < S) & (kv_indices < anchor_expanded)
    is_draft = kv_indices >= S
    kv_block_ids = (kv_indices - S) // block
    mask_draft = is_draft & (q_block_ids == kv_block_ids)
    valid_block = keep.view(B, 1, N, 1).repeat_interleave(block, dim=2)
    return ((mask_context | mask_draft) & valid_block)[:, 0]


def test_the_recipes_mask_is_specforges_and_its_loss_weights_decay():
    from harness.training.dflash import loss_weights, visibility

    anchors, keep = torch.tensor([[1, 4], [2, 0]]), torch.tensor([[True, True], [True, False]])
    mask = visibility(anchors, keep, 6, 3)
    assert mask.shape == (2, 6, 12)
    # block 0 of sequence 0 (anchor 1): the context before it, position 0, and its own three rows, both ways
    assert mask[0, 0].nonzero().flatten().tolist() == [0, 6, 7, 8] == mask[0, 2].nonzero().flatten().tolist()
    assert mask[0, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 9, 10, 11]  # anchor 4: positions 0..3
    assert mask[1, 4].nonzero().flatten().tolist() == [9, 10, 11]  # an invalid block: only itself
    reference = specforge_mask(anchors, keep, 6, 3)
    assert torch.equal(mask[0], reference[0]) and torch.equal(mask[1, :3], reference[1, :3])
    assert not reference[1, 3:].any()  # SpecForge's invalid block sees nothing (weighted 0 either way)
    torch.testing.assert_close(loss_weights(4), torch.tensor([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))


@pytest.fixture(scope="module")
def recipe_setup():
    from harness.training.dflash import DFlashRecipe, attach_dflash_features, feature_layers
    from tests.conftest import tiny_target_with_answers

    target, examples = tiny_target_with_answers(12)  # 3 layers, vocabulary 96, tied embeddings
    recipe = DFlashRecipe(target, layers=2, block_size=4, mask_token_id=95, seed=0)
    assert recipe.draft.target_layer_ids == [1, 0] and feature_layers(target, 2) == (2, 1)
    attach_dflash_features(target, examples, recipe.draft.feature_layers)
    return target, examples, recipe


def test_the_recipes_blocks_are_what_inference_drafts_and_its_loss_is_the_weighted_mean(recipe_setup):
    """Each block of the all-at-once training forward equals the inference draft from the context before its
    anchor (its cache path) and the dense-mask attention; a conversation's loss is the decayed weighted mean of
    its slots' cross-entropy on the answer's tokens (same position)."""
    target, examples, recipe = recipe_setup
    batch = examples[:3]
    from harness.training.dflash import visibility
    from harness.training.examples import pad_batch

    ids, lengths, starts, _ = pad_batch(batch)
    features = torch.zeros(3, ids.shape[1], batch[0].features.shape[-1])
    for b, e in enumerate(batch):
        features[b, : len(e.ids)] = e.features
        torch.testing.assert_close(e.features, target_features(target, e.ids.tolist(), [1, 0]))
    anchors, keep = recipe.anchors(lengths, starts, [None] * 3)
    assert all(int(keep[b].sum()) == len(e.ids) - 1 - e.answer_start for b, e in enumerate(batch))
    with torch.no_grad():
        hidden = recipe.forward_blocks(ids, features, anchors, keep)
        B, N, bs = hidden.shape[:3]
        embeds = recipe.embed(torch.where(torch.arange(bs)[None, None] == 0, ids.gather(1, anchors)[..., None], 95)
                              .view(B, N * bs))
        positions = (anchors[..., None] + torch.arange(bs)).view(B, N * bs)
        dense = recipe.draft.forward_masked(embeds, positions, features, torch.arange(ids.shape[1]).expand(B, -1),
                                            visibility(anchors, keep, ids.shape[1], bs))
        torch.testing.assert_close(hidden[keep], dense.view(B, N, bs, -1)[keep], rtol=1e-4, atol=1e-5)
        embed = target.get_input_embeddings()
        for b, n in [(0, 0), (0, int(keep[0].sum()) - 1), (2, 1)]:
            a = int(anchors[b, n])
            block = [int(ids[b, a])] + [95] * 3
            torch.testing.assert_close(hidden[b, n], fresh_draft(recipe.draft, embed, features[b, :a], block, a),
                                       rtol=1e-4, atol=1e-5)
        loss, stats = recipe.batch_loss(batch, 0.0, [None] * 3)
    expected = 0.0
    for b, e in enumerate(batch):
        total = weight_sum = 0.0
        for n in range(int(keep[b].sum())):
            for k in range(1, bs):
                at = int(anchors[b, n]) + k
                if at < len(e.ids):
                    w = math.exp(-(k - 1) / 7)
                    logits = hidden[b, n, k] @ recipe.rows.T
                    total += w * float(torch.nn.functional.cross_entropy(logits[None], e.ids[at:at + 1]))
                    weight_sum += w
        expected += total / weight_sum
    assert abs(float(loss) - expected) < 1e-4
    assert sorted(stats) == ["acc_1", "acc_2", "acc_3"]


def test_the_recipe_learns_and_the_cli_writes_a_draft_the_method_loads(recipe_setup, tmp_path, monkeypatch):
    """`python -m harness.training dflash` on a tiny target and a synthetic corpus of its own answers: the loss
    falls, the model card and training.json are written, and the draft (upstream's format) decodes AR's tokens."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from harness.training import __main__ as cli

    target, examples, _ = recipe_setup
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"ids": e.ids.tolist(), "answer_start": e.answer_start}) + "\n"
                            for e in examples))

    class Tokenizer:
        all_special_ids = [0]
        added_tokens_decoder = {0: "<eos>", 93: "<a>", 94: "<b>", 95: "<c>"}

    used = {t for e in examples for t in e.ids.tolist()}
    monkeypatch.setattr(cli, "load_target", lambda name, device="cpu": (OmegaConf.create({"name": name}), target,
                                                                       Tokenizer()))
    out = tmp_path / "dflash"
    cli.main(["dflash", "--model", "tiny", "--data", str(data), "--out", str(out), "--epochs", "12", "--lr", "3e-3",
              "--batch", "4", "--block-size", "4", "--layers", "1", "--device", "cpu"])
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    card = json.loads((out / "training.json").read_text())
    assert len(log) == card["steps"] and log[-1]["loss"] < log[0]["loss"]
    assert card["kind"] == "dflash" and set(card["held_out_acceptance"]) == {"acc_1", "acc_2", "acc_3"}
    assert "python -m harness.training dflash --model tiny" in (out / "README.md").read_text()
    config = json.loads((out / "config.json").read_text())
    mask = max(t for t in (93, 94, 95) if t not in used)
    assert config["dflash_config"] == {"mask_token_id": mask, "target_layer_ids": [1]}
    assert config["block_size"] == 4 and config["architectures"] == ["DFlashDraftModel"]
    assert set(load_file(str(out / "model.safetensors"))) == {
        "fc.weight", "hidden_norm.weight", "norm.weight",
        *(f"layers.0.{name}.weight" for name in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj"))}
    decoder = get_method("dflash")(ModelRunner(target), {"name": "dflash", "head": {"path": str(out)}},
                                   BuildContext(target, "tiny", {}))
    prompt, stop = examples[0].ids[: examples[0].answer_start].tolist(), StopCondition(20)
    assert decoder.generate(prompt, stop).tokens == AutoregressiveDecoder(ModelRunner(target)).generate(prompt,
                                                                                                         stop).tokens
