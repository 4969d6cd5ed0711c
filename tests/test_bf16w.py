"""bf16w, the weights-only half precision (`dtype=bf16w`): every weight matrix rounded to bf16 values and
kept in fp32 tensors, fp32 arithmetic. The engine streams those weights as bf16 panels (half the bytes)
and decodes exactly what `transformers.generate` decodes on the same rounded model."""

from __future__ import annotations

import pytest
import torch

from methods.ar import AutoregressiveDecoder
from methods.engine import native
from methods.engine.native import dtype_name
from methods.engine.runner import ModelRunner
from methods.engine.stopping import StopCondition
from methods.machine.probes import streamed_weights
from methods.models.loading import compute_dtype, load_model, round_weights
from methods.models.specs import ModelSpec
from tests.conftest import hf_greedy, tiny_model
from tests.test_native import all_native, needs_native


def test_bf16w_rounds_every_weight_matrix_and_keeps_the_rest(tiny_chat_model_dir):
    cpu, spec = torch.device("cpu"), ModelSpec(path=str(tiny_chat_model_dir))
    fp32, half = load_model(spec, torch.float32, cpu), load_model(spec, "bf16w", cpu)
    matrices = 0
    for (name, a), (_, b) in zip(fp32.named_parameters(), half.named_parameters(), strict=True):
        assert b.dtype == torch.float32, name
        if a.dim() >= 2:
            matrices += 1
            assert torch.equal(b, a.to(torch.bfloat16).float()) and not torch.equal(a, b), name
        else:  # norms stay as loaded
            assert torch.equal(a, b), name
    assert matrices > 5
    assert (native.precision(half), native.precision(fp32)) == ("bf16w", "float32")
    assert (ModelRunner(half).precision, ModelRunner(fp32).precision) == ("bf16w", "float32")
    assert (dtype_name("bf16w"), dtype_name(torch.bfloat16), compute_dtype("bf16w")) == ("bf16w", "bfloat16",
                                                                                          torch.float32)
    values, fp32_bytes = streamed_weights(fp32)
    assert fp32_bytes == 4 * values
    if native.unavailable_reason() is None:  # the native kernels read bf16 panels: 2 bytes a matrix value
        vectors = sum(p.numel() for p in half.parameters() if p.dim() == 1)
        assert streamed_weights(half) == (values, 2 * (values - vectors) + 4 * vectors)


def test_a_model_with_one_fp32_matrix_is_not_bf16w():
    model = tiny_model("llama", seed=2)
    round_weights(model, torch.bfloat16)
    assert native.precision(model) == "bf16w"
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6  # one value off the bf16 grid
    assert native.precision(model) == "float32"


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16w_target_streams_bf16_panels_and_decodes_as_generate(arch, monkeypatch):
    """Every linear on the native kernel (whole layers in one call), each packed as bf16 panels; the
    greedy tokens are `generate`'s on the same rounded weights, and a 6-row verification's logits
    match the stock forward's."""
    model, reference = tiny_model(arch, seed=5), tiny_model(arch, seed=5)
    for m in (model, reference):
        round_weights(m, torch.bfloat16)
    runner = ModelRunner(model, skinny_gemm="auto")
    runner.linear = all_native(runner)
    halves, heads = [], []  # which projections of each layer call stream bf16 panels; the LM head's panels
    layer, linear = native.NativeLayer.__call__, native.linear
    monkeypatch.setattr(native.NativeLayer, "__call__", lambda self, *a: halves.append(self.bf16) or layer(self, *a))
    monkeypatch.setattr(native, "linear", lambda x, packed, *a: heads.append(packed.dtype) or linear(x, packed, *a))
    prompt = list(range(3, 23))
    tokens = AutoregressiveDecoder(runner).generate(prompt, StopCondition(max_new_tokens=40)).tokens
    assert tokens == hf_greedy(reference, prompt, 40)
    assert halves and set(halves) == {0b1111} and heads and set(heads) == {torch.bfloat16}
    runner.reset()
    runner.prefill(prompt)
    stock = ModelRunner(reference, skinny_gemm="off", decoder="transformers")
    stock.prefill(prompt)
    torch.testing.assert_close(runner.forward(prompt[:6]).logits, stock.forward(prompt[:6]).logits,
                               rtol=1e-4, atol=1e-4)
