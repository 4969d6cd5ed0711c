"""The native kernels' bindings (`methods/engine/native.py`): C trusts every size it is given, so
each entry point checks dtype, device, layout and shape first and raises `ValueError` naming the
argument, before any pointer reaches C. Each case here would read or write outside its tensors
through an unchecked wrapper. Also: the AVX-512 and AVX2 builds compute the same bits."""

from __future__ import annotations

import pytest
import torch

from methods.engine import hardware, native

needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")
pytestmark = needs_native


def test_pack_and_linear_refuse_what_they_cannot_read():
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = native.pack(weight)
    x = torch.randn(3, 24)
    torch.testing.assert_close(native.linear(x, packed, 40, bias), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)
    cases = {
        "x must be float32": lambda: native.linear(x.double(), packed, 40, bias),
        r"x has shape \[3, 23\], expected \[\.\.\., 24\]": lambda: native.linear(x[:, :23], packed, 40, bias),
        r"bias has shape \[39\]": lambda: native.linear(x, packed, 40, bias[:39]),
        "bias must be contiguous": lambda: native.linear(x, packed, 40, torch.randn(80)[::2]),
        "out_features 64 does not match": lambda: native.linear(x, packed, 64, None),
        "out_features 8 does not match": lambda: native.linear(x, packed, 8, None),
        "packed has shape": lambda: native.linear(x, packed.reshape(packed.shape[0], -1, 4), 40, bias),
        "packed must be contiguous": lambda: native.linear(x, packed.transpose(0, 1), 40, bias),
        "weight must be float32": lambda: native.pack(weight.half()),
        r"weight has shape \[24\], expected \[\*, \*\]": lambda: native.pack(weight[0]),
        "must be float32 on the CPU, got torch.float32 on meta": lambda: native.linear(x.to("meta"), packed, 40, bias),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=message):
            call()
    # a transposed x is read as its values (made contiguous), not refused
    torch.testing.assert_close(native.linear(x.T.contiguous().T, packed, 40, bias), native.linear(x, packed, 40, bias))


def test_rms_norm_and_rope_store_refuse_what_they_cannot_read():
    x, w = torch.randn(2, 5, 32), torch.randn(32)
    with pytest.raises(ValueError, match=r"weight has shape \[31\], expected \[32\]"):
        native.rms_norm(x, w[:31], 1e-5)
    with pytest.raises(ValueError, match="x must be float32"):
        native.rms_norm(x.bfloat16(), w, 1e-5)
    batch, n, heads, kv, d = 1, 3, 4, 2, 16
    qkv, cos, sin = torch.randn(batch, n, heads + 2 * kv, d), torch.randn(batch, n, 1, d), torch.randn(batch, n, 1, d)
    keys, values = torch.zeros(batch, kv, 8, d), torch.zeros(batch, kv, 8, d)
    native.rope_store(qkv, cos, sin, keys, values, 5, heads, kv)  # positions 5..7 of 8: fits
    cases = {
        r"positions 6\.\.8 outside the cache's capacity 8": lambda: native.rope_store(
            qkv, cos, sin, keys, values, 6, heads, kv
        ),
        r"positions -1\.\.1 outside": lambda: native.rope_store(qkv, cos, sin, keys, values, -1, heads, kv),
        r"qkv has shape \[1, 3, 8, 16\], expected \[\*, \*, 9, \*\]": lambda: native.rope_store(
            qkv, cos, sin, keys, values, 0, 5, kv
        ),
        r"cos has shape": lambda: native.rope_store(qkv, cos[:, :2], sin, keys, values, 0, heads, kv),
        "keys must be contiguous": lambda: native.rope_store(
            qkv, cos, sin, torch.zeros(batch, kv, d, 8).transpose(2, 3), values, 0, heads, kv
        ),
        r"values has shape \[1, 2, 4, 16\], expected \[1, 2, 8, 16\]": lambda: native.rope_store(
            qkv, cos, sin, keys, values[:, :, :4].contiguous(), 0, heads, kv
        ),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=message):
            call()


def layer_parts(hidden=32, heads=4, kv=2, d=8, inter=48, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) / i ** 0.5
               for o, i in (((heads + 2 * kv) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter))]
    norms = (torch.ones(hidden), torch.ones(hidden))
    return norms, [native.pack(w) for w in weights], [None] * 4, (heads, kv, d, inter)


def test_the_native_layer_refuses_what_it_cannot_read():
    norms, packed, biases, (heads, kv, d, inter) = layer_parts()
    layer = native.NativeLayer(norms, (1e-5, 1e-5), packed, biases, heads, kv, d, inter, d ** -0.5)
    x, cos, sin = torch.randn(1, 3, 32), torch.ones(1, 3, 1, d), torch.zeros(1, 3, 1, d)
    keys, values = torch.zeros(1, kv, 16, d), torch.zeros(1, kv, 16, d)
    mask = torch.zeros(1, 1, 3, 3)
    layer(x, cos, sin, keys, values, 0, mask)
    cases = {
        r"x has shape \[1, 3, 31\], expected \[\*, \*, 32\]": lambda: layer(
            x[..., :31], cos, sin, keys, values, 0, mask
        ),
        r"mask has shape \[1, 1, 3, 3\], expected \[\*, 1, 3, 13\]": lambda: layer(x, cos, sin, keys, values, 10, mask),
        r"positions 14\.\.16 outside the cache's capacity 16": lambda: layer(x, cos, sin, keys, values, 14, None),
        "mask has batch 2, expected 1 or 1": lambda: layer(x, cos, sin, keys, values, 0, torch.zeros(2, 1, 3, 3)),
        r"keys has shape \[1, 3, 16, 8\], expected \[1, 2, \*, 8\]": lambda: layer(
            x, cos, sin, torch.zeros(1, 3, 16, d), values, 0, None
        ),
        "mask must be float32": lambda: layer(x, cos, sin, keys, values, 0, mask.bool()),
        "sin must be float32": lambda: layer(x, cos, sin.double(), keys, values, 0, mask),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=message):
            call()
    # constants are checked once, when the layer is made
    with pytest.raises(ValueError, match=r"packed down has shape"):
        native.NativeLayer(norms, (1e-5, 1e-5), packed[:3] + [packed[2]], biases, heads, kv, d, inter, d ** -0.5)
    with pytest.raises(ValueError, match=r"input norm has shape \[16\], expected \[32\]"):
        native.NativeLayer((torch.ones(16), None), (1e-5, 1e-5), packed, biases, heads, kv, d, inter, d ** -0.5)
    with pytest.raises(ValueError, match="a layer of 4 heads over 3 KV heads"):
        native.NativeLayer(norms, (1e-5, 1e-5), packed, biases, heads, 3, d, inter, d ** -0.5)


def test_a_misspelt_build_is_one_line(monkeypatch):
    monkeypatch.setenv("DECODEBENCH_NATIVE_ISA", "avx3")
    with pytest.raises(ValueError, match="DECODEBENCH_NATIVE_ISA='avx3'; valid: avx2, avx512"):
        native.isa()


@pytest.mark.skipif("avx512f" not in hardware.cpu_flags(), reason="this CPU has no AVX-512")
def test_the_avx512_and_avx2_builds_compute_the_same_bits():
    """Every output is one FMA chain over the inputs in order, whatever the vector width: the two
    builds' GEMMs agree bit for bit, fp32 and bf16 panels, over padded panels and every row grouping."""
    gen = torch.Generator().manual_seed(3)
    builds = {build: native._library(build) for build in ("avx2", "avx512")}
    assert {b: lib.decodebench_panel_width() for b, lib in builds.items()} == {"avx2": 8, "avx512": 16}
    for out_features, in_features in ((960, 576), (50, 19), (13, 37)):
        weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
        x = torch.randn(17, in_features, generator=gen)
        results = []
        for lib in builds.values():
            width = lib.decodebench_panel_width()
            packed = weight.new_empty(-(-out_features // width), in_features, width)
            lib.decodebench_pack_f32(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
            rounded = weight.bfloat16().float()  # and bf16 panels of a weight of bf16 values
            halves = rounded.new_empty(packed.shape, dtype=torch.bfloat16)
            lib.decodebench_pack_bf16(rounded.data_ptr(), halves.data_ptr(), out_features, in_features)
            for rows in (1, 3, 8, 12, 17):
                for kernel, panels in ((lib.decodebench_linear_f32, packed), (lib.decodebench_linear_bf16, halves)):
                    y = torch.empty(rows, out_features)
                    kernel(packed.data_ptr() if panels is packed else panels.data_ptr(), x.data_ptr(),
                           bias.data_ptr(), y.data_ptr(), out_features, in_features, rows)
                    results.append(y)
        half = len(results) // 2
        assert all(torch.equal(a, b) for a, b in zip(results[:half], results[half:]))


def test_the_stream_read_sums_every_float_and_refuses_what_it_cannot_read():
    # sizes below one chunk, at a chunk's edge and past it with a tail: every float counted once
    for n in (0, 1, 8 * native.panel_width() * 256 - 1, 8 * native.panel_width() * 256 * 3 + 17):
        x = torch.rand(n)
        assert native.stream_read(x) == pytest.approx(x.double().sum().item(), rel=1e-5, abs=1e-4)
    x = torch.ones(8 * native.panel_width() * 256 * 2 + 5)
    assert native.stream_read(x) == x.numel()  # exact in fp32: no float counted twice or skipped
    for message, call in {"x must be float32": lambda: native.stream_read(x.double()),
                          "x must be contiguous": lambda: native.stream_read(torch.rand(64)[::2]),
                          "x must be a tensor": lambda: native.stream_read([1.0])}.items():
        with pytest.raises(ValueError, match=message):
            call()
