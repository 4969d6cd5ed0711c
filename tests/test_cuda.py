"""On a GPU (skipped without one): every lossless method decodes AR's greedy tokens on CUDA with
CUDA graphs on and off, equal to `transformers` `generate` there; sampling runs with a CUDA
generator; a captured step is captured once and replayed after. `make test` runs these wherever
CUDA is available (the CPU tests prove the same step eagerly: tests/test_static_step.py)."""

import pytest
import torch

from methods.base import available_methods, get_method
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from tests.conftest import tiny_model
from tests.test_static_step import PROMPTS, method_context

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
LOSSLESS = [m for m in available_methods() if m != "lazyllm" and not m.startswith(("toy", "echo"))]


def cuda_target(seed=3, layers=8):
    return tiny_model("llama", seed=seed, layers=layers).to("cuda")


def generated(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", LOSSLESS)
def test_greedy_tokens_on_cuda_equal_generate_with_graphs_on_and_off(method, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = cuda_target()
    context = method_context(target, tmp_path)
    expected = [generated(target, prompt, 40) for prompt in PROMPTS]
    for mode in ("off", "on"):
        runner = ModelRunner(target, cuda_graphs=mode)
        assert runner.graph_mode == ("graphs" if mode == "on" else "off")
        decoder = get_method(method)(runner, {"name": method}, context)
        got = [decoder.generate(prompt, StopCondition(40)).tokens for prompt in PROMPTS]
        assert got == expected, f"cuda_graphs={mode}"
        if mode == "on":
            assert runner.static.captures >= 1 and runner.cache.regrowths == 0


@pytest.mark.parametrize("method", ["ar", "sps", "eagle2", "medusa", "pld"])
def test_sampling_runs_on_cuda_with_a_cuda_generator(method, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = cuda_target(seed=4)
    decoder = get_method(method)(ModelRunner(target), {"name": method}, method_context(target, tmp_path))
    generator = torch.Generator(device="cuda").manual_seed(0)
    out = decoder.generate(PROMPTS[0], StopCondition(32), SamplingConfig(temperature=0.8), generator)
    assert len(out.tokens) == 32 and all(0 <= t < target.config.vocab_size for t in out.tokens)


def test_a_graph_is_captured_once_per_size_and_replayed():
    target = cuda_target(seed=5)
    runner = ModelRunner(target)  # auto: graphs on a GPU
    decoder = get_method("ar")(runner, {"name": "ar"}, None)
    first = [decoder.generate(prompt, StopCondition(24)).tokens for prompt in PROMPTS]
    captures = runner.static.captures
    again = [decoder.generate(prompt, StopCondition(24)).tokens for prompt in PROMPTS]
    assert first == again and captures == 1 and runner.static.captures == 1
