"""SPEED-Bench: its rows (fixtures in the Hub's parquet schema) into the suite's schema, prompts stored
by src_id rebuilt or refused, the offline message, the dataset configs through the harness's
loader and validator, and the report's columns per category and per entropy tier."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from data_scripts import speed_bench
from data_scripts.prepare import DATASETS, HubUnavailable, prepare
from harness.reporting.report import report
from harness.reporting.tables import OVERALL
from harness.running.datasets import load_questions
from methods.settings.params import ConfigError
from tests.conftest import REPO
from tests.test_report import cells, record, write_run

# The Hub's parquet schema of every SPEED-Bench config (its card's dataset_info features).
SCHEMA = pa.schema([("question_id", pa.string()), ("category", pa.string()), ("sub_category", pa.string()),
                    ("turns", pa.list_(pa.string())), ("source", pa.string()), ("src_id", pa.string()),
                    ("difficulty", pa.string()), ("multiturn", pa.bool_())])
HOLD = speed_bench.PLACEHOLDER + "\n\n"


def row(qid, category, turns, source="writingbench", src_id="wb_1", sub="general", difficulty="medium", multiturn=None):
    return {"question_id": qid, "category": category, "sub_category": sub, "turns": turns, "source": source,
            "src_id": src_id, "difficulty": difficulty, "multiturn": len(turns) > 1 if multiturn is None else multiturn}


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def dataset_config(name, path):
    cfg = OmegaConf.load(REPO / "conf" / "dataset" / f"{name}.yaml")
    cfg.path = str(path)
    return cfg


QUALITATIVE = [row(f"{i:032x}", category, [f"A {category} question number {i}."], sub=f"{category}-sub",
                   difficulty=("easy", "hard")[i % 2]) for i, category in enumerate(speed_bench.CATEGORIES)]
QUALITATIVE.append(row("f" * 32, "reasoning", ["First, a puzzle.", "Now explain your answer."], source="mt-bench-like",
                       src_id="x_3"))


def test_qualitative_rows_keep_their_fields_and_load_through_the_harness(tmp_path):
    fixture = write_parquet(tmp_path / "test.parquet", QUALITATIVE)
    out = prepare("speed_bench", out=tmp_path / "qualitative.jsonl", local_files=[str(fixture)])
    records = read_jsonl(out)
    assert len(records) == 12
    assert records[0] == {"question_id": "0" * 32, "category": "coding", "turns": ["A coding question number 0."],
                          "reference": None, "sub_category": "coding-sub", "difficulty": "easy",
                          "source": "writingbench", "src_id": "wb_1", "multiturn": False, "config": "qualitative"}
    assert "entropy_tier" not in records[0]
    questions = load_questions(dataset_config("speed_bench", out))
    assert {q.category for q in questions} == set(speed_bench.CATEGORIES)
    two_turns = next(q for q in questions if q.question_id == "f" * 32)
    assert two_turns.turns == ["First, a puzzle.", "Now explain your answer."]  # answered turn by turn, as MT-bench's
    assert records[-1]["multiturn"] is True
    # a limit picks round robin over the 11 categories
    assert len({q.category for q in load_questions(dataset_config("speed_bench", out), limit=11)}) == 11
    cfg = dataset_config("speed_bench", out)
    cfg.categories = ["rag", "math"]
    assert sorted(q.category for q in load_questions(cfg)) == ["math", "rag"]


@pytest.mark.parametrize("config", [c for c in speed_bench.CONFIGS if c != "qualitative"])
def test_throughput_rows_carry_their_entropy_tier(tmp_path, config):
    name = speed_bench.dataset_name(config)
    rows = [row(f"{t}{i}".ljust(32, "0"), tier, [f"{tier} prompt {i} " * 5], source="repobench", src_id=f"rb_{i}",
                sub=("code", "needle", "writing")[t]) for t, tier in enumerate(speed_bench.ENTROPY_TIERS)
                for i in range(2)]
    fixture = write_parquet(tmp_path / "test.parquet", rows)
    out = prepare(name, out=tmp_path / f"{config}.jsonl", local_files=[str(fixture)])
    records = read_jsonl(out)
    assert [r["entropy_tier"] for r in records] == [r["category"] for r in rows]
    assert {r["config"] for r in records} == {config}
    cfg = OmegaConf.load(REPO / "conf" / "dataset" / f"{name}.yaml")
    assert cfg.name == name and cfg.loader == "prepared" and cfg.path == f"data/speed_bench/{config}.jsonl"
    assert DATASETS[name].out == cfg.path  # the loader reads where prepare writes
    questions = load_questions(dataset_config(name, out), limit=3)
    assert [q.category for q in questions] == list(speed_bench.ENTROPY_TIERS)


def test_resolved_files_from_nvidia_scripts_are_taken_as_they_stand(tmp_path):
    """specdec_bench writes the Hub's parquet with the turns filled in; NeMo-Skills writes `messages`."""
    filled = write_parquet(tmp_path / "test.parquet",
                           [row("a" * 32, "summarization", ["Summarize this: a long article."],
                                                              source="abisee/cnn_dailymail", src_id="abc")])
    out = prepare("speed_bench", out=tmp_path / "a.jsonl", local_files=[str(filled)])
    assert read_jsonl(out)[0]["turns"] == ["Summarize this: a long article."]
    messages = {k: v for k, v in row("b" * 32, "qa", []).items() if k != "turns"}
    messages["messages"] = [{"role": "user", "content": "Q1?"}, {"role": "user", "content": "Q2?"}]
    (tmp_path / "nemo.jsonl").write_text(json.dumps(messages) + "\n")
    out = prepare("speed_bench", out=tmp_path / "b.jsonl", local_files=[str(tmp_path / "nemo.jsonl")])
    assert read_jsonl(out)[0]["turns"] == ["Q1?", "Q2?"]


SOURCES = {  # (repo, config) -> the source's rows, in the shapes the Hub gives them
    ("abisee/cnn_dailymail", "3.0.0"): [{"id": "n1", "article": "Rain fell all day.", "highlights": "Rain."},
                                        {"id": "n2", "article": "The sun came out.", "highlights": "Sun."}],
    ("Helsinki-NLP/opus-100", "de-en"): [{"translation": {"de": "Hallo.", "en": "Hello."}},
                                         {"translation": {"de": "Danke.", "en": "Thanks."}}],
    ("livecodebench/code_generation_lite", None): [{"question_id": "lc7", "question_content": "Sum a list.",
                                                    "starter_code": "def f(xs):"}],
    ("deepmind/code_contests", None): [{"name": "1A. Theatre", "description": "Cover the square with flagstones."}],
    ("mtbench101/mt-bench-101", None): [{"history": [{"user": "u0", "bot": "b0"}]},
                                        {"history": [{"user": "Hi!", "bot": "Hello."},
                                                     {"user": "And now?", "bot": "x"}]}],
    ("cais/hle", None): [{"id": "h9", "question": "What is the 10th Busy Beaver number?"}],
}
PLACEHELD = [
    row("1" * 32, "summarization", [HOLD + "Summarize the article:\n{article}"], source="abisee/cnn_dailymail",
        src_id="n2"),
    row("2" * 32, "multilingual", [HOLD + "Translate into English: {question[de]}"], source="Helsinki-NLP/opus-100",
        src_id="opus_de-en_1"),
    row("3" * 32, "coding", [HOLD + "{question}\n\n{starter_code}"], source="livecodebench/code_generation_lite",
        src_id="lc7"),
    row("4" * 32, "coding", [HOLD + "Solve: {question}"], source="deepmind/code_contests", src_id="1A. Theatre"),
    row("5" * 32, "reasoning", [speed_bench.PLACEHOLDER, speed_bench.PLACEHOLDER],
        source="https://example.org/mtbench101/mt-bench-101/data.jsonl", src_id="mtbench101_1"),
    row("6" * 32, "qa", [speed_bench.PLACEHOLDER], source="cais/hle", src_id="h9"),
    row("7" * 32, "writing", ["Written out in the row."]),
]


def fake_opener(opened):
    def opener(table):
        opened.append(table.repo)
        return iter(SOURCES[(table.repo, table.config)])
    return opener


def test_prompts_stored_by_src_id_are_rebuilt_from_their_source():
    opened = []
    rows = speed_bench.resolve_rows(list(enumerate(PLACEHELD)), "qualitative", opener=fake_opener(opened))
    turns = {r["question_id"][0]: speed_bench.convert(r, i, "qualitative")["turns"] for i, r in rows}
    assert turns == {
        "1": ["Summarize the article:\nThe sun came out."],
        "2": ["Translate into English: Danke."],
        "3": ["Sum a list.\n\ndef f(xs):"],
        "4": ["Solve: Cover the square with flagstones."],
        "5": ["Hi!", "And now?"],  # MT-Bench-101: the user turns of the source's history
        "6": ["What is the 10th Busy Beaver number?"],
        "7": ["Written out in the row."],
    }
    assert [i for i, _ in rows] == list(range(len(PLACEHELD)))
    assert sorted(opened) == sorted(repo for repo, _ in SOURCES)  # each source read once


def test_a_src_id_its_source_lacks_stops_naming_the_row():
    lost = row("8" * 32, "summarization", [HOLD + "{article}"], source="abisee/cnn_dailymail", src_id="n404")
    with pytest.raises(speed_bench.Unresolved,
                       match=rf"question_id {'8' * 32} points at id 'n404' of abisee/cnn_dailymail"):
        speed_bench.resolve_rows([(0, lost)], "qualitative", opener=fake_opener([]))
    garbled = row("9" * 32, "multilingual", [HOLD + "{question}"], source="Helsinki-NLP/opus-100", src_id="opus")
    with pytest.raises(speed_bench.Unresolved, match="src_id 'opus' does not read as a reference"):
        speed_bench.resolve_rows([(0, garbled)], "qualitative", opener=fake_opener([]))


@pytest.mark.parametrize("source, config", [("RUCAIBox/BAMBOO/tree/main/datasets/x.jsonl", "throughput_8k"),
                                            ("TIGER-Lab/MMLU-Pro", "qualitative"),
                                            ("Neph0s/CoSER/tree/main/data", "qualitative"),
                                            # HLE is rebuilt in the qualitative split only
                                            ("cais/hle", "throughput_2k"),
                                            ("somewhere/unknown", "qualitative")])
def test_prompts_built_by_nvidias_code_stop_before_reading_any_source(source, config):
    opened = []
    rows = [(0, PLACEHELD[0]), (1, row("c" * 32, "math", [speed_bench.PLACEHOLDER], source=source, src_id="s_1"))]
    name = speed_bench.dataset_name(config)
    with pytest.raises(speed_bench.Unresolved) as err:
        speed_bench.resolve_rows(rows, config, opener=fake_opener(opened))
    message = str(err.value)
    assert message.startswith(f"{name}: 1 row(s) store their prompt by src_id in sources this suite does not rebuild")
    assert f"1 from {source}" in message and f"question_id {'c' * 32}" in message
    assert f"--config {config}" in message and f"python -m data_scripts.prepare {name} --local-files" in message
    assert opened == []


def test_offline_the_message_names_the_dataset_the_sources_and_the_remedy(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(HubUnavailable,
                       match=r"speed_bench: could not read nvidia/SPEED-Bench \(qualitative, split test\)"
                                             r".*copy data/speed_bench/qualitative.jsonl here"):
        prepare("speed_bench", out=tmp_path / "q.jsonl")
    # the split from a file, but two rows point into CNN/DailyMail and HLE on the Hub
    fixture = write_parquet(tmp_path / "test.parquet", [PLACEHELD[0], PLACEHELD[5], PLACEHELD[6]])
    with pytest.raises(HubUnavailable) as err:
        prepare("speed_bench", out=tmp_path / "q.jsonl", local_files=[str(fixture)])
    message = str(err.value)
    assert message.startswith("speed_bench: 2 row(s) hold a placeholder for a prompt stored in abisee/cnn_dailymail, "
                              "cais/hle (by src_id)")
    assert "not reachable" in message and "python -m data_scripts.prepare speed_bench --local-files" in message
    assert not (tmp_path / "q.jsonl").exists()


def test_a_row_still_holding_the_placeholder_is_never_written():
    with pytest.raises(speed_bench.Unresolved, match="still holds the placeholder"):
        speed_bench.convert(PLACEHELD[0], 0, "qualitative")


def test_missing_prepared_file_gives_the_prepare_hint(tmp_path):
    for name in ("speed_bench", "speed_bench_throughput_32k"):
        with pytest.raises(FileNotFoundError, match=rf"`python -m data_scripts.prepare {name}`.*--local-files"):
            load_questions(dataset_config(name, tmp_path / "absent.jsonl"))


def test_the_dataset_names_are_valid_choices():
    from harness.running.validate import check_group_choices

    names = ["speed_bench"] + [speed_bench.dataset_name(c) for c in speed_bench.CONFIGS[1:]]
    assert set(names) == {n for n in DATASETS if n.startswith("speed_bench")}
    assert set(names) == {p.stem for p in (REPO / "conf" / "dataset").glob("speed_bench*.yaml")}
    check_group_choices([f"dataset={name}" for name in names[:1]] + ["limit=1"])
    check_group_choices(["-m", "dataset=" + ",".join(names)])
    with pytest.raises(ConfigError, match="speed_bench_throughput_4k.*speed_bench, speed_bench_throughput_16k"):
        check_group_choices(["dataset=speed_bench_throughput_4k"])


def write_baseline(root, dataset, questions):
    base = root / "tiny" / dataset / "ar" / "x"
    (base / "answers").mkdir(parents=True)
    (base / "answers" / "ar.jsonl").write_text("".join(json.dumps(record(q, c, 100, 4.0, 100)) + "\n"
                                                       for q, c in questions))
    return base


def test_reports_break_speedup_and_acceptance_down_by_category(tmp_path):
    root = tmp_path / "results"
    questions = [(2 * i + j, c) for i, c in enumerate(speed_bench.CATEGORIES) for j in range(2)]
    base = write_baseline(root, "speed_bench", questions)
    wall = {c: 1.0 + 0.25 * i for i, c in enumerate(speed_bench.CATEGORIES)}
    steps = {c: 20 + 5 * i for i, c in enumerate(speed_bench.CATEGORIES)}
    write_run(root, "sps", "r", [record(q, c, 100, wall[c], steps[c]) for q, c in questions], base, {"gamma": 4},
              dataset="speed_bench")
    tables = report(root, tmp_path / "report")
    (slug, (columns, table)), = tables.items()
    assert columns == [*speed_bench.CATEGORIES, OVERALL]
    sps = table["sps (gamma=4)"]
    for c in speed_bench.CATEGORIES:
        assert sps[c]["questions"] == 2
        assert sps[c]["speedup"] == pytest.approx((100 / wall[c]) / (100 / 4.0))
        assert sps[c]["acceptance"] == pytest.approx((100 - steps[c]) / (4 * steps[c]))
        assert sps[c]["tau"] == pytest.approx(100 / steps[c])
    assert sps[OVERALL]["questions"] == 22
    header = cells((tmp_path / "report" / slug / "acceptance.md").read_text().splitlines()[2])
    assert header == ["method", *(f"{c} (n=2)" for c in speed_bench.CATEGORIES), "Overall (n=22)", "caveats (Overall)"]


def test_throughput_reports_have_a_column_per_entropy_tier_low_to_high(tmp_path):
    root = tmp_path / "results"
    questions = [(3 * t + j, tier) for t, tier in enumerate(speed_bench.ENTROPY_TIERS) for j in range(3)]
    base = write_baseline(root, "speed_bench_throughput_8k", questions)
    write_run(root, "pld", "r", [record(q, c, 100, 1.0 + q % 3, 50) for q, c in questions], base, {"num_draft": 4},
              dataset="speed_bench_throughput_8k")
    (columns, table), = report(root, tmp_path / "report").values()
    assert columns == ["low_entropy", "mixed", "high_entropy", OVERALL]
    assert table["pld (num_draft=4)"]["mixed"]["speedup"] == pytest.approx(
        sum(100 / (1.0 + q % 3) for q in (3, 4, 5)) / 3 / 25)
