"""`make perf-gpu`'s measurements, run on the CPU with a tiny shape (the GPU run differs in device only)."""

import pytest
import torch

from harness.perf import gpu


def test_a_shape_is_measured_end_to_end(monkeypatch, capsys):
    monkeypatch.setitem(gpu.SHAPES, "tiny", dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    monkeypatch.setattr(gpu, "read_bandwidth", lambda *a, **k: 1e10)
    monkeypatch.setattr(gpu, "SIZES", (1, 2, 4))
    monkeypatch.setattr(gpu, "COMPILED_SIZES", (1, 4))
    result = gpu.measure_shape("tiny", torch.float32, torch.device("cpu"), new_tokens=12, gammas=(1, 3),
                               compile_modes=("on",))  # Inductor's C++ on a CPU, as it is Triton on a GPU
    assert result["agreement_with_graphs"] == {"ar, graphs": 1.0, "ar, graphs, on": 1.0, "ar, no graphs": 1.0,
                                               "generate": 1.0}
    curves = result["forward_seconds_by_tokens"]
    assert set(curves) == {"graphs", "eager", "transformers", "graphs, on"}
    assert set(curves["graphs, on"]) == set(gpu.COMPILED_SIZES)
    assert result["static_step_rows"] == [1, 2, 4]  # the static step ran (eagerly: a CPU)
    assert all(rate > 0 for rate in result["oracle_tokens_per_second_by_gamma"].values())
    assert "oracle chain" in capsys.readouterr().out


def test_bad_shapes_and_a_missing_gpu_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--shapes", "nope"])
    assert "unknown shape(s) nope; valid: smollm2-135m, vicuna-7b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["--compile", "fast"])
    assert "unknown --compile mode(s) fast; valid: none, on, max-autotune" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu.main([])
        assert "no CUDA device" in capsys.readouterr().err
