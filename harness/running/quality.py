"""Task quality of answers, for runs whose outputs may differ from the target's greedy output
(LazyLLM, Medusa's typical acceptance, sampling). A dataset config maps categories to metrics:

    quality: {math_reasoning: gsm8k_exact_match, translation: bleu}    # "*" = every category

Scores are 0..1. Per-answer metrics are averaged over questions; BLEU is corpus-level (sacrebleu).
ROUGE comes from `rouge-score`, BLEU from `sacrebleu`, fuzzy code similarity from `rapidfuzz`;
HumanEval's pass@1 runs each program in a separate process (`harness.running.execution`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import sacrebleu
from rapidfuzz import fuzz

from harness.running.execution import humaneval_passes

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _references(reference) -> list[str]:
    if isinstance(reference, dict):
        reference = reference.get("answers", [])
    if isinstance(reference, (list, tuple)):
        flat = []
        for item in reference:
            flat.extend(_references(item) if isinstance(item, (list, tuple)) else [str(item)])
        return flat
    return [str(reference)]


def _number(text: str) -> float | None:
    match = _NUMBER.findall(text or "")
    if not match:
        return None
    try:
        return float(match[-1].replace(",", ""))
    except ValueError:
        return None


def gsm8k_exact_match(answer: str, reference) -> float:
    """The last number of the answer equals the number after '####' in the reference."""
    gold = _number(_references(reference)[0].split("####")[-1])
    predicted = _number(answer)
    return float(gold is not None and predicted is not None and abs(gold - predicted) < 1e-6)


def contains_reference(answer: str, reference) -> float:
    """Any reference string appears in the answer (retrieval tasks)."""
    return float(any(r.strip() and r.strip() in answer for r in _references(reference)))


def normalize_answer(text: str) -> str:
    """SQuAD / NQ / LongBench normalization: lower case, no punctuation, articles or extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _token_f1(prediction: str, truth: str) -> float:
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def nq_f1(answer: str, reference) -> float:
    return max((_token_f1(answer, r) for r in _references(reference)), default=0.0)


def nq_exact_match(answer: str, reference) -> float:
    return float(any(normalize_answer(answer) == normalize_answer(r) for r in _references(reference)))


_ROUGE = None


def rouge_l(answer: str, reference) -> float:
    """ROUGE-L F1 (rouge-score, stemmed), best over references."""
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer  # lazy: rouge_score (imports nltk): ROUGE categories only

        _ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return max((_ROUGE.score(r, answer)["rougeL"].fmeasure for r in _references(reference)), default=0.0)


def bleu_corpus(answers: list[str], references: list) -> float:
    """Corpus BLEU (sacrebleu, default 13a tokenization) / 100."""
    refs = [_references(r) for r in references]
    streams = max(len(r) for r in refs)
    ref_streams = [[r[i] if i < len(r) else r[0] for r in refs] for i in range(streams)]
    return sacrebleu.corpus_bleu(answers, ref_streams).score / 100


def humaneval_pass_at_1(answer: str, reference) -> float:
    return float(humaneval_passes(answer, reference))


# LongBench's task metrics (THUDM/LongBench metrics.py), English tasks.
def _first_line(text: str) -> str:
    return text.lstrip("\n").split("\n")[0]


def longbench_qa_f1(answer: str, reference) -> float:
    return nq_f1(answer, reference)


def longbench_rouge(answer: str, reference) -> float:
    return rouge_l(answer, reference)


def longbench_classification(answer: str, reference) -> float:
    classes = (reference or {}).get("all_classes") or []
    truth = _references(reference)[0]
    matches = [c for c in classes if c in _first_line(answer)]
    matches = [c for c in matches if not (c in truth and c != truth)]
    return 1.0 / len(matches) if truth in matches else 0.0


def longbench_retrieval(answer: str, reference) -> float:
    truth = re.findall(r"Paragraph (\d+)", _references(reference)[0])
    numbers = re.findall(r"\d+", answer)
    return sum(n == truth[0] for n in numbers) / len(numbers) if truth and numbers else 0.0


def longbench_count(answer: str, reference) -> float:
    numbers = re.findall(r"\d+", answer)
    truth = _references(reference)[0]
    return sum(n == str(truth) for n in numbers) / len(numbers) if numbers else 0.0


def longbench_code_sim(answer: str, reference) -> float:
    lines = [line for line in answer.lstrip("\n").split("\n") if not line.strip().startswith(("`", "#", "//"))]
    prediction = lines[0] if lines else ""
    return max((fuzz.ratio(prediction, r) / 100 for r in _references(reference)), default=0.0)


@dataclass(frozen=True)
class Metric:
    per_answer: Callable[[str, object], float] | None = None
    corpus: Callable[[list[str], list], float] | None = None


METRICS: dict[str, Metric] = {
    "gsm8k_exact_match": Metric(gsm8k_exact_match),
    "contains_reference": Metric(contains_reference),
    "nq_f1": Metric(nq_f1),
    "nq_exact_match": Metric(nq_exact_match),
    "rouge_l": Metric(rouge_l),
    "bleu": Metric(corpus=bleu_corpus),
    "humaneval_pass_at_1": Metric(humaneval_pass_at_1),
    "longbench_qa_f1": Metric(longbench_qa_f1),
    "longbench_rouge": Metric(longbench_rouge),
    "longbench_classification": Metric(longbench_classification),
    "longbench_retrieval": Metric(longbench_retrieval),
    "longbench_count": Metric(longbench_count),
    "longbench_code_sim": Metric(longbench_code_sim),
}
FIRST_LINE_CATEGORIES = {"trec", "triviaqa", "samsum"}  # LongBench keeps the first line of these answers


def score_records(records: list[dict], references: dict, metric_by_category: dict | None) -> dict:
    """Score per metric (and per category) over the questions that have a metric and a reference."""
    if not metric_by_category:
        return {}
    items: dict[str, dict[str, list[tuple[str, object]]]] = {}
    for record in records:
        metrics = metric_by_category.get(record["category"], metric_by_category.get("*"))
        reference = references.get(record["question_id"])
        if metrics is None or reference is None:
            continue
        answer = record["choices"][0]["turns"][-1]
        if record["category"] in FIRST_LINE_CATEGORIES:
            answer = _first_line(answer)
        for metric in [metrics] if isinstance(metrics, str) else metrics:
            if metric not in METRICS:
                raise ValueError(f"unknown quality metric {metric!r}; valid: {', '.join(sorted(METRICS))}")
            items.setdefault(metric, {}).setdefault(record["category"], []).append((answer, reference))
    result = {}
    for metric, by_category in items.items():
        score = lambda pairs: _score(METRICS[metric], pairs)  # noqa: E731
        everything = [pair for pairs in by_category.values() for pair in pairs]
        result[metric] = {"score": score(everything), "questions": len(everything),
                          "by_category": {c: score(p) for c, p in sorted(by_category.items())}}
    return result


def _score(metric: Metric, pairs: list[tuple[str, object]]) -> float:
    if metric.corpus is not None:
        return metric.corpus([a for a, _ in pairs], [r for _, r in pairs])
    return sum(metric.per_answer(a, r) for a, r in pairs) / len(pairs)
