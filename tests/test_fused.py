"""The engine's own forward for Llama-family decoders (`methods/engine/fused.py`): the same
logits, KV cache and greedy tokens as the `transformers` stack, weights shared rather than
copied, a batch dimension, and a stated fallback for what it does not run."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.engine.fused import FusedDecoder, fused_decoder
from methods.engine.kv_cache import TreeKVCache
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.engine.tree import attention_mask
from methods.machine.profile import MachineProfile
from tests.conftest import hf_greedy, tiny_model

CASES = {
    "llama": dict(arch="llama"),
    "qwen2 (q/k/v biases)": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "llama3 rope scaling": dict(arch="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "multi-head, tied embeddings": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=True),
}


def pair(**case):
    """The same tiny model twice: one runs fused, one (an unfused copy) through transformers."""
    model = tiny_model(seed=3, **case)
    reference = copy.deepcopy(model)
    profile = MachineProfile("cpu")  # the measured linear plan: the native layer where it is chosen
    return (ModelRunner(model, decoder="auto", profile=profile),
            ModelRunner(reference, decoder="transformers", profile=profile))


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_fused_forward_matches_transformers_logits_and_cache(case):
    fused, stock = pair(**CASES[case])
    assert fused.fused is not None and stock.fused is None
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (40,), generator=gen).tolist()
    for runner in (fused, stock):
        runner.capture_inputs([0, 2])
    outputs = [runner.prefill(prompt, all_logits=True) for runner in (fused, stock)]
    # a tree of 5 nodes (0 -> 1, 2; 1 -> 3; 3 -> 4) verified in one forward, then a path committed
    parents = [-1, 0, 0, 1, 3]
    visible = torch.eye(5, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            visible[node] |= visible[parent]
    depths = torch.tensor([0, 1, 1, 2, 3])
    tokens = torch.randint(0, 256, (5,), generator=gen).tolist()
    for runner in (fused, stock):
        start = runner.length
        outputs.append(runner.forward(tokens, positions=start + depths,
                                      mask=attention_mask(visible, start, runner.dtype, runner.device)))
        runner.commit(start, [0, 1, 3])
        outputs.append(runner.forward(tokens[:1]))  # one-token step after the commit
        outputs.append(runner.forward(tokens[:3]))  # causal continuation over a non-empty cache
    half = len(outputs) // 2 + 1
    ours, theirs = outputs[:1] + outputs[2:half], outputs[1:2] + outputs[half:]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.layers, b.layers, rtol=1e-4, atol=1e-4)
    assert fused.length == stock.length == len(prompt) + 3 + 1 + 3
    for a, b in zip(fused.cache.layers, stock.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["llama", "qwen2 (q/k/v biases)", "llama3 rope scaling"])
def test_fused_greedy_tokens_equal_transformers_generate(case):
    fused, _ = pair(**CASES[case])
    reference = tiny_model(seed=3, **CASES[case])  # never fused
    prompt = list(range(5, 25))
    ours = AutoregressiveDecoder(fused).generate(prompt, StopCondition(max_new_tokens=48)).tokens
    assert ours == hf_greedy(reference, prompt, 48)
    # the fused model itself still generates through transformers, unchanged
    assert hf_greedy(fused.model, prompt, 48) == ours


def test_projection_weights_become_views_of_the_fused_ones():
    model = tiny_model("qwen2", seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    decoder = fused_decoder(model)
    assert fused_decoder(model) is decoder and ModelRunner(model).fused is decoder  # made once per model
    layer, attn, mlp = decoder.layers[0], model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.data_ptr() == layer.qkv.weight.data_ptr()
    assert attn.v_proj.bias.data_ptr() == layer.qkv.bias.data_ptr() + 4 * (attn.q_proj.out_features
                                                                           + attn.k_proj.out_features)
    assert mlp.up_proj.weight.data_ptr() == layer.gate_up.weight.data_ptr() + 4 * mlp.gate_proj.weight.numel()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_batch_of_two_sequences_equals_each_alone():
    model = tiny_model("llama", seed=5)
    decoder = FusedDecoder(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 12), generator=gen)
    positions = torch.arange(12).expand(2, 12)
    batch_cache = TreeKVCache()
    together, _ = decoder.forward(ids, positions, None, batch_cache)
    for b in range(2):
        cache = TreeKVCache()
        alone, _ = decoder.forward(ids[b:b + 1], positions[b:b + 1], None, cache)
        torch.testing.assert_close(together[b], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch_cache.layers[0].keys[b], cache.layers[0].keys[0], rtol=1e-5, atol=1e-5)


def test_what_the_fused_forward_does_not_run_falls_back_with_a_reason():
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    runner = ModelRunner(model, profile=MachineProfile("cpu"))
    assert runner.fused is None and "rope_type 'dynamic'" in runner.unfused_reason
    with pytest.raises(ValueError, match="the fused forward does not run this model: rope_type 'dynamic'"):
        FusedDecoder(model)
    with pytest.raises(ValueError, match="engine.decoder='fast'; valid: auto, transformers"):
        ModelRunner(model, decoder="fast")


def test_past_a_sliding_window_the_stock_forward_runs():
    """Mistral's window changes nothing below it; a forward whose keys reach past it runs on the
    transformers stack (which applies the window), and greedy tokens still equal generate's."""
    model = tiny_model("mistral", seed=2)
    model.config.sliding_window = 24
    reference = copy.deepcopy(model)
    runner = ModelRunner(model, profile=MachineProfile("cpu"))
    assert runner.fused is not None and runner.fused.window == 24
    prompt = list(range(3, 19))
    ours = AutoregressiveDecoder(runner).generate(prompt, StopCondition(max_new_tokens=24)).tokens
    assert ours == hf_greedy(reference, prompt, 24)


@pytest.mark.parametrize("native_call", [False, True], ids=["torch ops", "one native call"])
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama head", "qwen2 head (q/k/v biases)"])
def test_eagle_head_drafts_the_same_on_the_fused_layer(qkv_bias, native_call, monkeypatch):
    """The EAGLE drafter runs its head's decoder layer on the fused forward: the committed pairs
    and two tree levels (with their level masks) give the head's own forward's outputs; also with
    every linear on the native kernel, where the layer (no input norm) is one native call."""
    from methods.eagle.drafter import EagleDrafter
    from methods.models.heads.eagle import EagleHead, head_config
    from tests.test_native import all_native, layer_calls, native

    if native_call and native.unavailable_reason() is not None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    calls = layer_calls(monkeypatch)
    target = tiny_model("llama", seed=8)
    torch.manual_seed(9)
    head = EagleHead(head_config(target.config.to_dict(), qkv_bias), qkv_bias=qkv_bias).eval().requires_grad_(False)
    stock_head = copy.deepcopy(head)
    fused, stock = EagleDrafter(head, target.lm_head), EagleDrafter(stock_head, target.lm_head)
    stock.fused = None
    assert fused.fused is not None and len(fused.linears) == 2
    path = all_native([head, *fused.linears]) if native_call else None
    features = torch.randn(12, target.config.hidden_size)
    outputs = []
    for drafter in (fused, stock):
        with path.active() if path else contextlib.nullcontext():
            drafter.follow(list(range(10, 22)), features)
            first = drafter.feed_level([4, 5, 6], features[:3], 1, [[], [], []])
            second = drafter.feed_level([7, 8], first[:2], 2, [[0], [1]])
        outputs.append((drafter.root_hidden, first, second))
    assert calls == ([12, 3, 2] if native_call else [])
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_one_token_steps_take_attention_outputs_in_any_memory_layout(monkeypatch):
    """CUDA's SDPA kernels may return a non-contiguous output (seen on an H200: the one-query grouped
    path failed with `view size is not compatible`); the CPU's returns a contiguous one. Here SDPA
    returns its output in a transposed layout, as on CUDA, and the greedy tokens stay generate's."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, heads not outermost

    model = tiny_model(seed=3, arch="llama")
    assert model.config.num_key_value_heads != model.config.num_attention_heads  # the grouped one-query path
    prompt = list(range(3, 20))
    expected = hf_greedy(copy.deepcopy(model), prompt, 8)
    monkeypatch.setattr(F, "scaled_dot_product_attention", strided_sdpa)
    runner = ModelRunner(model, decoder="auto", profile=MachineProfile("cpu"))
    assert runner.fused is not None
    out = AutoregressiveDecoder(runner).generate(prompt, StopCondition(max_new_tokens=8))
    assert out.tokens == expected
