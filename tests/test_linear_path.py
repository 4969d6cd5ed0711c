"""The engine's linear path: every kernel computes F.linear's result (same dtype class) for every
shape and token count, the plan routes by measured choice, and nothing changes outside the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from methods.engine import hardware
from methods.engine.linear import (
    BUCKETS,
    KERNELS,
    NATIVE_SLACK,
    LinearPath,
    LinearPlan,
    choose,
    onednn_available,
    prepack,
    run_kernel,
    shape_key,
)
from methods.engine.runner import ModelRunner
from methods.machine.plan import measure_plan
from methods.machine.profile import MachineProfile
from tests.conftest import tiny_model


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 64), (17, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_equals_f_linear(kernel, shape, bias):
    if kernel == "onednn" and not onednn_available(torch.device("cpu")):
        pytest.skip("oneDNN not available in this torch build")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    b = torch.randn(shape[0], generator=gen) if bias else None
    packed = prepack(kernel, weight)
    for rows in (1, 2, 3, 4, 7, 8, 16, 24, 32, 40):
        for lead in ((rows,), (1, rows)):  # with and without a batch dimension
            x = torch.randn(*lead, shape[1], generator=gen)
            got = run_kernel(kernel, x, weight, b, packed)
            assert got.shape == (*lead, shape[0]) and got.dtype == torch.float32
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_measured_plan_names_a_kernel_per_shape_and_bucket():
    layer = nn.Linear(64, 48)
    plan = measure_plan({shape_key(layer.weight, layer.bias): (layer.weight, layer.bias)}, rounds=1,
                        cache_bytes=1 << 16)
    chosen = plan.kernels["48x64+b"]
    assert set(chosen) == set(BUCKETS) and set(chosen.values()) <= set(KERNELS)
    assert all(set(plan.seconds["48x64+b"][b]) >= {"f_linear", "w_xt"} for b in BUCKETS)
    assert LinearPlan.from_dict(plan.to_dict()).kernels == plan.kernels


def test_the_native_kernel_is_kept_within_its_slack_of_the_fastest():
    """A whole layer runs as one native call only where all four projections are native: the plan
    keeps native within NATIVE_SLACK of the fastest, and takes the fastest beyond it; a stored plan
    is decided again from its seconds."""
    assert choose({"f_linear": 1.0, "w_xt": 1.1, "native": 1.2}) == "native"
    assert choose({"f_linear": 1.0, "native": NATIVE_SLACK * 1.01}) == "f_linear"
    assert choose({"f_linear": 1.0, "w_xt": 0.9}) == "w_xt"
    stored = {"kernels": {"8x16": {"1": "f_linear"}}, "seconds": {"8x16": {"1": {"f_linear": 1.0, "native": 1.1}}}}
    assert LinearPlan.from_dict(stored).kernels == {"8x16": {1: "native"}}


def test_the_path_routes_inside_the_engine_only(monkeypatch):
    layer = nn.Linear(16, 8)
    calls = []
    original = run_kernel

    def spy(kernel, *args):
        calls.append(kernel)
        return original(kernel, *args)

    monkeypatch.setattr("methods.engine.linear.run_kernel", spy)
    path = LinearPath(LinearPlan({"8x16+b": {b: "w_xt" for b in BUCKETS}}))
    bystander = nn.Linear(16, 8)  # a linear of a model the engine was not given: never routed
    path.adopt(nn.Sequential(layer))
    assert type(layer) is not nn.Linear and isinstance(layer, nn.Linear) and type(bystander) is nn.Linear
    assert nn.Linear.forward is not type(layer).forward  # nn.Linear itself is left as it is
    x = torch.randn(3, 16)
    expected = F.linear(x, layer.weight, layer.bias)
    with torch.inference_mode():
        with path.active():
            torch.testing.assert_close(layer(x), expected)
            layer(torch.randn(40, 16))  # above the largest bucket: a prefill stays on F.linear
            bystander(x)
        assert calls == ["w_xt"]
        layer(x)  # outside: stock
    assert calls == ["w_xt"]
    with LinearPath(None).active(), torch.inference_mode():  # off
        layer(x)
    assert calls == ["w_xt"]


def test_auto_dtype_on_a_cpu_is_decided_by_timing(monkeypatch, tiny_chat_model_dir):
    """dtype=auto on a CPU times the target in fp32 and in each half precision the CPU can run (bf16w
    where the native kernels build; bfloat16 too on AVX512-BF16/AMX) through the machine profile, and
    takes the fastest only where it is clearly faster at 1 and 4 tokens; the ratios are kept in the
    profile (measured again when measured busy, or for another set of candidates); without a model
    to time the flags decide."""
    from methods.machine import dtype as dtype_module
    from methods.machine import load
    from methods.models.specs import ModelSpec

    cpu, spec = torch.device("cpu"), ModelSpec(path=str(tiny_chat_model_dir))
    flags = {"avx2", "avx512f", "avx512_bf16"}
    monkeypatch.setattr(dtype_module, "auto_dtype", lambda device: hardware.auto_dtype(device, flags))
    timed, half = [], {}  # each timing: the precisions timed together (interleaved), at which sizes
    def latencies(runners, sizes, repeats):
        timed.append((tuple(runner.precision for runner in runners.values()), tuple(sizes)))
        return {name: {1: 1.0, 4: 1.2} if name == "float32" else half[name] for name in runners}
    monkeypatch.setattr(dtype_module, "forward_latencies", latencies)
    monkeypatch.setattr(MachineProfile, "linear_path", lambda self, models: LinearPath(None))  # no plan to measure
    busy = [False]  # the machine's load while the ratios were measured, as the profile judges it
    monkeypatch.setattr(load, "is_busy", lambda record: busy[0])
    stored = lambda: sorted(hardware.profile_dir(cpu).glob("dtype-tiny-*.json"))  # noqa: E731
    for file in stored():
        file.unlink()
    half.update(bfloat16={1: 0.9, 4: 0.7}, bf16w={1: 0.85, 4: 0.9})  # faster, neither clearly at both sizes
    dtype, why = MachineProfile(cpu).dtype("auto", spec, "tiny")
    assert dtype == torch.float32, why
    assert "bfloat16 0.90x (1 token), 0.58x (4 tokens); bf16w 0.85x (1 token), 0.75x (4 tokens)" in why
    assert timed == [(("float32", "bfloat16", "bf16w"), (1, 4))] and len(stored()) == 1  # loaded together
    assert MachineProfile(cpu).dtype("auto", spec, "tiny") == (dtype, why) and len(timed) == 1  # kept: nothing timed
    busy[0] = True  # measured beside other work: measured again by the next run
    half.update(bfloat16={1: 0.6, 4: 0.66}, bf16w={1: 0.55, 4: 0.6})  # both clearly faster: bf16w at both sizes
    dtype, why = MachineProfile(cpu).dtype("auto", spec, "tiny")
    assert dtype == "bf16w" and why.endswith("bf16w, clearly faster") and len(timed) == 2
    busy[0] = False
    flags.difference_update({"avx512f", "avx512_bf16"})  # an AVX2 CPU: bf16w alone is a candidate
    assert MachineProfile(cpu).dtype("auto", spec, "tiny")[0] == "bf16w" and timed[2:] == [(("float32", "bf16w"),
                                                                                           (1, 4))]
    stored()[0].unlink()
    parameters = dtype_module._parameter_count(dtype_module.AutoConfig.from_pretrained(tiny_chat_model_dir))
    monkeypatch.setattr(dtype_module, "_available_memory", lambda: 2 * 9 * parameters)  # fp32 + bf16w: 10 bytes
    assert MachineProfile(cpu).dtype("auto", spec, "tiny")[0] == "bf16w" and timed[3:] == [(("float32",), (1, 4)),
                                                                                           (("bf16w",), (1, 4))]
    stored()[0].unlink()  # too large to load together: each timed alone, one after another
    assert MachineProfile(cpu).dtype("auto", None)[0] == torch.float32  # no model to time: the flags decide
    assert MachineProfile(cpu).dtype("float32", spec) == (torch.float32, "dtype=float32 asked for")
    flags.update({"avx512f", "avx512_bf16"})  # native bf16, and fp32 weights too large to load twice
    monkeypatch.setattr(dtype_module, "_available_memory", lambda: 1000)
    dtype, why = MachineProfile(cpu).dtype("auto", spec, "tiny")
    assert dtype == torch.bfloat16 and "more than half the memory" in why and len(timed) == 5 and not stored()


def test_off_switch_and_bad_mode():
    model = tiny_model("llama", seed=3, vocab_size=32, hidden=32, layers=1)
    assert ModelRunner(model, skinny_gemm="off").linear.plan is None
    with pytest.raises(ValueError, match="engine.skinny_gemm='fast'; valid: auto, off"):
        ModelRunner(model, skinny_gemm="fast")


def test_auto_dtype_follows_the_cpu_and_says_why():
    cpu = torch.device("cpu")
    assert hardware.auto_dtype(cpu, {"avx2", "fma"}) == (torch.float32, hardware.auto_dtype(cpu, {"avx2"})[1])
    dtype, why = hardware.auto_dtype(cpu, {"avx2", "avx512f", "avx512_bf16"})
    assert dtype == torch.bfloat16 and "native bf16" in why
    assert "emulated" in hardware.auto_dtype(cpu, {"avx2"})[1]
    assert hardware.cpu_isa({"avx2", "avx512f"}) == "avx512" and hardware.cpu_isa({"amx_bf16"}) == "amx"


def test_a_weight_of_bf16_values_is_planned_apart():
    """The plan keys a weight of bf16 values (a draft as stored) apart from an fp32 weight of the same
    shape: the native kernel streams it in half the bytes, so its kernels are measured on it."""
    weight = torch.randn(8, 16)
    assert shape_key(weight, None) == "8x16"
    assert shape_key(weight.bfloat16().float(), torch.zeros(8)) == "8x16+b:bf16"
    assert shape_key(weight.bfloat16(), None) == "8x16"  # a bf16 weight is its own dtype's plan
