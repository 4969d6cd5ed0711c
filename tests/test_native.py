"""The engine's native kernels (`methods/engine/native.c`): RMSNorm, RoPE and the KV write bit for
bit as torch computes them (alone and inside whole forwards), the linear kernel inside a whole
model token for token as `generate` and independent of the row count, the whole decoder layer in
one call (the torch layer's outputs and cache; a token verified in a tree or a batch gets the bits
it gets alone; EAGLE's head layer in `test_fused.py`), a plan measured again when the kernels
change, and a machine without a compiler simply going without."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from methods.ar import AutoregressiveDecoder
from methods.engine import native
from methods.engine.linear import BUCKETS, KERNELS, LinearPath, LinearPlan, linear_shapes
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.engine.tree import attention_mask
from methods.machine.plan import measure_plan
from methods.machine.profile import MachineProfile, candidates
from tests.conftest import hf_greedy, tiny_model

needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")


def prefill_verify_steps(runner: ModelRunner, prompt_length: int) -> tuple[list, list]:
    """A prefill, a 4-node tree verify committed to a path that skips a sibling, and two one-token
    steps: the forwards' outputs and then every layer's cached keys and values."""
    outputs = [runner.prefill(list(range(3, 3 + prompt_length)), all_logits=True)]
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    start = runner.length
    outputs.append(runner.forward([5, 6, 7, 8], positions=start + torch.tensor([0, 1, 1, 2]),
                                  mask=attention_mask(visible, start, runner.dtype, runner.device)))
    runner.commit(start, [0, 1, 3])
    outputs += [runner.forward([9]), runner.forward([10])]
    return outputs, [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]


@needs_native
@pytest.mark.parametrize("dim", [576, 64, 33])
def test_rms_norm_is_llama_rms_norm_bit_for_bit(dim):
    gen = torch.Generator().manual_seed(dim)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    for rows in (1, 3, 8):
        x = torch.randn(1, rows, dim, generator=gen) * 4
        with torch.inference_mode():
            assert torch.equal(native.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


@needs_native
def test_rope_store_is_the_torch_expression_and_a_cache_write_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for batch, n, heads, kv, d, start in ((1, 1, 9, 3, 64, 5), (2, 5, 4, 2, 32, 0)):
        qkv = torch.randn(batch, n, heads + 2 * kv, d, generator=gen)
        cos, sin = torch.randn(batch, n, 1, d, generator=gen), torch.randn(batch, n, 1, d, generator=gen)
        keys, values = torch.zeros(batch, kv, 16, d), torch.zeros(batch, kv, 16, d)
        q = native.rope_store(qkv, cos, sin, keys, values, start, heads, kv)
        qk = qkv[:, :, : heads + kv]
        rotated = (qk * cos + qk.roll(d // 2, -1) * sin).transpose(1, 2)
        assert q.is_contiguous() and torch.equal(q, rotated[:, :heads])
        assert torch.equal(keys[:, :, start:start + n], rotated[:, heads:])
        assert torch.equal(values[:, :, start:start + n], qkv[:, :, heads + kv:].transpose(1, 2))
        assert not keys[:, :, :start].any() and not keys[:, :, start + n:].any()


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", ["measured", "w_xt"])
def test_the_native_small_ops_change_no_bit_of_a_forward(arch, kernel, monkeypatch):
    """The same runner and linear plan with RMSNorm, RoPE and the KV write native or torch's: every
    logit, hidden state and cached key/value equal bit for bit, through a prefill, a tree verify
    with a commit, and one-token steps; also with every linear on `w_xt`, whose outputs come back
    transposed (not contiguous)."""
    import methods.engine.fused as fused

    monkeypatch.setattr(fused.FusedLayer, "native_layer", lambda *args: None)  # the ops one by one, here
    results = []
    for glue in (True, False):
        if not glue:
            monkeypatch.setattr(fused, "native_active", lambda x: False)
        runner = ModelRunner(tiny_model(arch, seed=7), skinny_gemm="auto", profile=MachineProfile("cpu"))
        if kernel != "measured":
            shapes = linear_shapes(runner.model, *runner.fused.linears)
            runner.linear = LinearPath(LinearPlan({key: {b: kernel for b in BUCKETS} for key in shapes}))
        results.append(prefill_verify_steps(runner, prompt_length=37))
    (native_out, native_cache), (torch_out, torch_cache) = results
    for a, b in zip(native_out, torch_out):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    for (ka, va), (kb, vb) in zip(native_cache, torch_cache):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_linear_on_the_native_kernel_decodes_as_generate(arch, monkeypatch):
    """Every decoder layer in one native call, the LM head on the native linear kernel."""
    model = tiny_model(arch, seed=5)
    reference = tiny_model(arch, seed=5)
    runner = ModelRunner(model, skinny_gemm="auto", profile=MachineProfile("cpu"))
    runner.linear = all_native(runner)
    layers = layer_calls(monkeypatch)
    calls = []
    original = native.linear

    def spy(x, packed, out_features, bias):
        calls.append(x.numel() // x.shape[-1])
        return original(x, packed, out_features, bias)

    native.linear = spy
    try:
        prompt = list(range(3, 23))
        tokens = AutoregressiveDecoder(runner).generate(prompt, StopCondition(max_new_tokens=40)).tokens
        stock = ModelRunner(reference, skinny_gemm="off", decoder="transformers")
        stock.prefill(prompt)
        runner.reset()
        runner.prefill(prompt)
        tree_rows = runner.forward(prompt[:6]).logits  # a 6-row forward on the native kernel too
        torch.testing.assert_close(tree_rows, stock.forward(prompt[:6]).logits, rtol=1e-4, atol=1e-4)
    finally:
        native.linear = original
    assert tokens == hf_greedy(reference, prompt, 40)
    assert 1 in calls and 6 in calls and 1 in layers and 6 in layers


def all_native(runner_or_modules) -> LinearPath:
    """A linear path that computes every linear of these modules on the native kernel."""
    modules = runner_or_modules
    if isinstance(runner_or_modules, ModelRunner):
        modules = [runner_or_modules.model, *runner_or_modules.fused.linears]
    path = LinearPath(LinearPlan({key: {b: "native" for b in BUCKETS} for key in linear_shapes(*modules)}))
    path.adopt(*modules)
    return path


def layer_calls(monkeypatch) -> list[int]:
    """Records the row count of every whole-layer native call."""
    calls, original = [], native.NativeLayer.__call__

    def spy(self, x, *args):
        calls.append(x.shape[0] * x.shape[1])
        return original(self, x, *args)

    monkeypatch.setattr(native.NativeLayer, "__call__", spy)
    return calls


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_native_layer_computes_the_torch_layer_and_its_cache(arch, monkeypatch):
    """A prefill, a tree verify with a commit, and one-token steps with every layer in one native
    call give the logits, hidden states and KV cache of the same layers as torch operations
    (qwen2: q/k/v biases) on the same native projections, within fp32 rounding."""
    import methods.engine.fused as fused

    calls = layer_calls(monkeypatch)
    results = []
    for whole in (True, False):
        if not whole:
            monkeypatch.setattr(fused.FusedLayer, "native_layer", lambda *args: None)
        runner = ModelRunner(tiny_model(arch, seed=7), skinny_gemm="auto", profile=MachineProfile("cpu"))
        runner.linear = all_native(runner)
        results.append(prefill_verify_steps(runner, prompt_length=27))  # 27 rows: a native prefill too
    layers = len(runner.cache.layers)
    assert calls == [27] * layers + [4] * layers + [1] * 2 * layers
    (native_out, native_cache), (torch_out, torch_cache) = results
    for a, b in zip(native_out, torch_out):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)
    for (ka, va), (kb, vb) in zip(native_cache, torch_cache):
        torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)


@needs_native
def test_the_native_layer_adds_a_masks_values_on_the_keys_it_sees(monkeypatch):
    """An additive mask whose visible entries are not all 0 (a bias on the scores; the engine's own
    masks hold only 0 and the minimum) shifts the native layer's scores as it shifts torch's."""
    import methods.engine.fused as fused

    calls = layer_calls(monkeypatch)
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    logits = []
    for whole in (True, False):
        if not whole:
            monkeypatch.setattr(fused.FusedLayer, "native_layer", lambda *args: None)
        runner = ModelRunner(tiny_model("llama", seed=5), skinny_gemm="auto", profile=MachineProfile("cpu"))
        runner.linear = all_native(runner)
        runner.prefill(list(range(3, 30)))
        start = runner.length
        mask = attention_mask(visible, start, runner.dtype, runner.device)
        bias = -2.0 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))
        mask = torch.where(mask == 0, bias, mask)  # the masked entries stay the minimum
        logits.append(runner.forward([5, 6, 7, 8], positions=start + torch.tensor([0, 1, 1, 2]), mask=mask).logits)
        if whole:  # the same forward without the bias: the bias must matter
            runner.rollback(start)
            unbiased = runner.forward([5, 6, 7, 8], positions=start + torch.tensor([0, 1, 1, 2]),
                                      mask=attention_mask(visible, start, runner.dtype, runner.device)).logits
    assert 4 in calls
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits[0], unbiased, atol=1e-3)


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_token_verified_in_a_tree_gets_the_bits_it_gets_decoded_alone(arch, monkeypatch):
    """The accepted path of a tree whose nodes sit away from their depth (node 3 at depth 2 after a
    sibling) gets, bit for bit, the logits and the committed KV that decoding its tokens one by one
    gets: attention walks each row's visible keys in position order, whatever the tree."""
    calls = layer_calls(monkeypatch)
    runner = ModelRunner(tiny_model(arch, seed=11), skinny_gemm="auto", profile=MachineProfile("cpu"))
    runner.linear = all_native(runner)
    prompt = list(range(3, 40))
    runner.prefill(prompt)
    start = runner.length
    # 0 -> {1, 2}; 2 -> 3; 1 -> 4: the path 0, 2, 3 sits at cache slots start + 0, 2, 3
    visible = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
                           dtype=torch.bool)
    tokens = [20, 21, 22, 23, 24]
    tree = runner.forward(tokens, positions=start + torch.tensor([0, 1, 1, 2, 2]),
                          mask=attention_mask(visible, start, runner.dtype, runner.device))
    runner.commit(start, [0, 2, 3])
    committed = [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]
    runner.rollback(start)
    alone = [runner.forward([tokens[i]]) for i in (0, 2, 3)]
    assert 5 in calls and 1 in calls
    for node, step in zip((0, 2, 3), alone):
        assert torch.equal(tree.logits[node], step.logits[0]) and torch.equal(tree.hidden[node], step.hidden[0])
    for (keys, values), layer in zip(committed, runner.cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


@needs_native
def test_a_sequence_in_a_batch_gets_the_bits_it_gets_alone():
    from methods.engine.fused import FusedDecoder
    from methods.engine.kv_cache import TreeKVCache

    model = tiny_model("llama", seed=5)
    decoder = FusedDecoder(model)
    path = all_native([model, *decoder.linears])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 12), generator=gen)
    positions = torch.arange(12).expand(2, 12)
    with path.active():
        batch_cache = TreeKVCache()
        together, _ = decoder.forward(ids, positions, None, batch_cache)
        step, _ = decoder.forward(ids[:, :1], positions[:, -1:] + 1, None, batch_cache)
        for b in range(2):
            cache = TreeKVCache()
            alone, _ = decoder.forward(ids[b:b + 1], positions[b:b + 1], None, cache)
            alone_step, _ = decoder.forward(ids[b:b + 1, :1], positions[b:b + 1, -1:] + 1, None, cache)
            assert torch.equal(together[b], alone[0]) and torch.equal(step[b], alone_step[0])
            for mine, theirs in zip(batch_cache.layers, cache.layers):
                assert torch.equal(mine.keys[b], theirs.keys[0]) and torch.equal(mine.values[b], theirs.values[0])


@needs_native
def test_the_profilers_forward_without_gemms_skips_the_native_layers_projections_too(monkeypatch):
    """`make perf` times a forward without its GEMMs (`gemms_skipped`): a native layer then computes
    zeros for its projections, so a layer without biases passes its input through unchanged."""
    from methods.engine.linear import gemms_skipped

    calls = layer_calls(monkeypatch)
    runner = ModelRunner(tiny_model("llama", seed=3), skinny_gemm="auto", profile=MachineProfile("cpu"))
    runner.linear = all_native(runner)
    runner.prefill(list(range(3, 20)))
    with gemms_skipped():
        hidden = runner.forward([7]).hidden
    norm = runner.model.model.norm
    embedded = runner.model.model.embed_tokens(torch.tensor([7]))
    assert calls[-1] == 1
    torch.testing.assert_close(hidden, norm(embedded), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(runner.forward([7]).hidden, hidden)


def test_a_plan_chosen_among_other_kernels_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    profile = MachineProfile("cpu")
    plan = LinearPlan({"8x16": {b: "w_xt" for b in BUCKETS}})
    file = profile.folder / "linear-float32.json"
    quiet = {"at": "2025-01-01T00:00:00+00:00", "other_cores": 0.0, "steal": 0.0, "busy": False}
    data = {"candidates": candidates(), "load": [quiet], **plan.to_dict()}
    profile.write(file, data)
    assert profile.load_plan(file)[0].kernels == plan.kernels
    data["candidates"] = ["f_linear", "w_xt", "onednn", "native-0123456789ab"]  # another build of native.c
    file.write_text(json.dumps(data))
    assert profile.load_plan(file)[0].kernels == {}


def test_without_a_compiler_the_plan_goes_without_the_native_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))  # no library built here yet
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native._library.cache_clear()
    native.unavailable_reason.cache_clear()
    try:
        assert native.unavailable_reason() in ("no C compiler (cc, gcc or $CC)", "the CPU lacks AVX2 + FMA")
        assert not native.available(torch.device("cpu"), torch.float32)
        weight = torch.randn(8, 16)
        plan = measure_plan({"8x16": (weight, None)}, rounds=1, cache_bytes=1 << 12)
        assert "native" in KERNELS and all("native" not in s for s in plan.seconds["8x16"].values())
    finally:
        native._library.cache_clear()
        native.unavailable_reason.cache_clear()  # the next caller, with a compiler, builds it again


@needs_native
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call():
    gen = torch.Generator().manual_seed(1)
    # 72 panels of 8 outputs in blocks of 3; 2 panels (the last padded); 7 panels (blocks 3, 3, 1)
    for shape in ((576, 576), (13, 37), (50, 19)):
        weight, bias = torch.randn(*shape, generator=gen) / shape[1] ** 0.5, torch.randn(shape[0], generator=gen)
        packed = native.pack(weight)
        x = torch.randn(17, shape[1], generator=gen)
        alone = torch.cat([native.linear(x[i:i + 1], packed, shape[0], bias) for i in range(17)])
        torch.testing.assert_close(alone, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        for rows in (2, 3, 4, 5, 7, 8, 9, 12, 16, 17):  # rows go 8 (AVX-512) or 4 (AVX2) at a time
            assert torch.equal(native.linear(x[:rows], packed, shape[0], bias), alone[:rows])


@needs_native
def test_a_weight_the_native_kernel_cannot_read_falls_back_to_f_linear():
    """A plan names a kernel per shape, not per dtype: a bf16 weight of a shape planned on the
    native (fp32) kernel is computed by F.linear; a transposed view is packed from its values."""
    gen = torch.Generator().manual_seed(2)
    path = LinearPath(LinearPlan({"8x16": {b: "native" for b in BUCKETS}}))
    x = torch.randn(3, 16, generator=gen)
    with torch.inference_mode():
        half = torch.randn(8, 16, generator=gen).bfloat16()
        assert path.route(half, None, 3)(x.bfloat16()).dtype == torch.bfloat16
        torch.testing.assert_close(path.route(half, None, 3)(x.bfloat16()),
                                   torch.nn.functional.linear(x.bfloat16(), half),
                                   rtol=0, atol=0)
        view = torch.randn(16, 8, generator=gen).T  # [8, 16], not contiguous
        torch.testing.assert_close(path.route(view, None, 3)(x), torch.nn.functional.linear(x, view), rtol=1e-5,
                                   atol=1e-5)


@needs_native
def test_a_weight_of_bf16_values_streams_bf16_panels_with_the_fp32_bits():
    """A weight whose every value is a bfloat16 (a draft stored in bf16, loaded in fp32) is packed as
    bf16 panels, half the bytes, and computes bit for bit what its fp32 panels compute, over padded
    panels and every row grouping; any other fp32 weight keeps fp32 panels."""
    gen = torch.Generator().manual_seed(4)
    for out_features, in_features in ((576, 576), (13, 37), (50, 19)):
        weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).bfloat16().float()
        bias = torch.randn(out_features, generator=gen)
        half, full = native.pack(weight), native.pack(weight, bf16=False)
        assert half.dtype == torch.bfloat16 and full.dtype == torch.float32
        assert half.nbytes * 2 == full.nbytes
        x = torch.randn(17, in_features, generator=gen)
        for rows in (1, 2, 3, 5, 8, 9, 16, 17):
            assert torch.equal(native.linear(x[:rows], half, out_features, bias),
                               native.linear(x[:rows], full, out_features, bias))
        unrounded = weight + torch.randn(out_features, in_features, generator=gen) * 1e-4
        assert not native.bf16_exact(unrounded) and native.pack(unrounded).dtype == torch.float32
        with pytest.raises(ValueError, match="bf16 panels need a weight of bf16 values"):
            native.pack(unrounded, bf16=True)


@needs_native
def test_a_model_of_bf16_values_runs_bf16_layers_with_the_fp32_bits(monkeypatch):
    """A model whose weights are bf16 values (a draft LM or head as stored) runs its native layers
    on bf16 panels, and its prefill, tree verify and steps give the logits, hidden states and cache
    of the same model on fp32 panels, bit for bit."""
    results, masks = [], []
    original = native.pack
    for force_fp32 in (False, True):
        if force_fp32:
            monkeypatch.setattr(native, "pack", lambda weight, bf16=None: original(weight, bf16=False))
        model = tiny_model("llama", seed=9)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        runner = ModelRunner(model, skinny_gemm="auto", profile=MachineProfile("cpu"))
        runner.linear = all_native(runner)
        assert all(key.endswith(":bf16") for key in runner.linear.plan.kernels)
        results.append(prefill_verify_steps(runner, prompt_length=9))
        masks.append({layer.native.bf16 for layer in runner.fused.layers if getattr(layer, "native", None)})
    assert masks == [{0b1111}, {0}]  # every projection of every layer on bf16 panels; then none
    (half_out, half_cache), (full_out, full_cache) = results
    for a, b in zip(half_out, full_out):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    for (ka, va), (kb, vb) in zip(half_cache, full_cache):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@needs_native
def test_every_projection_of_the_embedded_model_is_within_fp32s_error_bound_of_float64(embedded):
    """Every shape the embedded model's native forward multiplies (the fused q/k/v, o, the fused
    gate/up, down, the lm head and the drafts' 8,192-row head), fp32 and bf16 panels, at the row
    counts of a step, a verification and a prefill, against a float64 reference: each output is one
    fp32 FMA chain over the inputs, so it stays within (n + 1) u of the sum of the terms' magnitudes
    (u = 2^-24, n the inputs; the bias's add the +1). A kernel that rounded the activations to bf16,
    dropped a panel or misread a padded one is off by orders of magnitude more."""
    config = embedded[0].config
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    shapes = [(qkv, hidden), (hidden, hidden), (2 * config.intermediate_size, hidden),
              (hidden, config.intermediate_size), (config.vocab_size, hidden), (8192, hidden)]
    gen = torch.Generator().manual_seed(11)
    u = 2.0 ** -24
    for out_features, in_features in shapes:
        weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).bfloat16().float()
        bias = torch.randn(out_features, generator=gen)
        x = torch.randn(64, in_features, generator=gen)
        for packed in (native.pack(weight, bf16=True), native.pack(weight, bf16=False)):
            for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 64):
                got = native.linear(x[:rows], packed, out_features, bias).double()
                exact = x[:rows].double() @ weight.double().T + bias.double()
                magnitude = x[:rows].double().abs() @ weight.double().abs().T + bias.double().abs()
                excess = (got - exact).abs() - (in_features + 1) * u * magnitude
                assert excess.max() <= 0, (out_features, in_features, packed.dtype, rows)
