"""The engine's native kernels (`methods/engine/native.c`): RMSNorm and RoPE bit for bit as torch
computes them, the linear kernel inside a whole model token for token as `generate`, a plan
measured again when the kernels change, and a machine without a compiler simply going without."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from methods.engine import hardware, native
from methods.engine.linear import BUCKETS, KERNELS, LinearPath, LinearPlan, linear_shapes, measure_plan
from methods.engine.runner import ModelRunner
from methods.ar import AutoregressiveDecoder
from methods.engine.stopping import StopCondition
from tests.conftest import hf_greedy, tiny_model

needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")


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
def test_rope_is_the_torch_expression_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for batch, n, heads, rotated, d in ((1, 1, 15, 12, 64), (2, 5, 6, 4, 32)):
        qkv = torch.randn(batch, n, heads, d, generator=gen)
        cos, sin = torch.randn(batch, n, 1, d, generator=gen), torch.randn(batch, n, 1, d, generator=gen)
        qk = qkv[:, :, :rotated]
        assert torch.equal(native.rope(qkv, cos, sin, rotated), qk * cos + qk.roll(d // 2, -1) * sin)


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_linear_on_the_native_kernel_decodes_as_generate(arch):
    model = tiny_model(arch, seed=5)
    reference = tiny_model(arch, seed=5)
    runner = ModelRunner(model, skinny_gemm="auto")
    shapes = linear_shapes(model, *runner.fused.linears)
    runner.linear = LinearPath(LinearPlan({key: {b: "native" for b in BUCKETS} for key in shapes}))
    calls = []
    original = native.linear

    def spy(x, weight, bias):
        calls.append(x.numel() // x.shape[-1])
        return original(x, weight, bias)

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
    assert 1 in calls and 6 in calls


def test_a_plan_chosen_among_other_kernels_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    cpu, dtype = torch.device("cpu"), torch.float32
    plan = LinearPlan({"8x16": {b: "w_xt" for b in BUCKETS}})
    hardware._save_plan(cpu, dtype, plan)
    assert hardware._load_plan(cpu, dtype).kernels == plan.kernels
    file = hardware._plan_file(cpu, dtype)
    data = json.loads(file.read_text())
    data["candidates"] = ["f_linear", "w_xt", "onednn", "native-0123456789ab"]  # another build of native.c
    file.write_text(json.dumps(data))
    assert hardware._load_plan(cpu, dtype).kernels == {}


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
    for shape in ((576, 576), (13, 37)):
        weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
        x = torch.randn(9, shape[1], generator=gen)
        alone = torch.cat([native.linear(x[i:i + 1], weight, bias) for i in range(9)])
        for rows in (2, 3, 4, 5, 9):
            assert torch.equal(native.linear(x[:rows], weight, bias), alone[:rows])
