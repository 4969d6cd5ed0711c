"""Task quality of answers, for runs whose outputs may differ from the target's greedy output
(LazyLLM, Medusa's typical acceptance, sampling). A dataset config maps categories to a metric:

    quality: {math_reasoning: gsm8k_exact_match}      # or {"*": metric} for every category

Each metric scores one answer text against the question's reference and returns 0..1.
"""

from __future__ import annotations

import re
from typing import Callable

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


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
    reference = reference[0] if isinstance(reference, list) else reference
    gold = _number(str(reference).split("####")[-1])
    predicted = _number(answer)
    return float(gold is not None and predicted is not None and abs(gold - predicted) < 1e-6)


def contains_reference(answer: str, reference) -> float:
    """Any reference string appears in the answer (retrieval tasks)."""
    references = reference if isinstance(reference, list) else [reference]
    return float(any(str(r).strip() and str(r).strip() in answer for r in references))


METRICS: dict[str, Callable[[str, object], float]] = {
    "gsm8k_exact_match": gsm8k_exact_match,
    "contains_reference": contains_reference,
}


def score_records(records: list[dict], references: dict, metric_by_category: dict | None) -> dict:
    """Mean score per metric (and per category) over the questions that have a metric and a reference."""
    if not metric_by_category:
        return {}
    scores: dict[str, dict[str, list[float]]] = {}
    for record in records:
        metric = metric_by_category.get(record["category"], metric_by_category.get("*"))
        reference = references.get(record["question_id"])
        if metric is None or reference is None:
            continue
        if metric not in METRICS:
            raise ValueError(f"unknown quality metric {metric!r}; valid: {', '.join(sorted(METRICS))}")
        value = METRICS[metric](record["choices"][0]["turns"][-1], reference)
        scores.setdefault(metric, {}).setdefault(record["category"], []).append(value)
    result = {}
    for metric, by_category in scores.items():
        values = [v for category in by_category.values() for v in category]
        result[metric] = {"score": sum(values) / len(values), "questions": len(values),
                          "by_category": {c: sum(v) / len(v) for c, v in sorted(by_category.items())}}
    return result
