"""The statistics of runs, computed once from the answer records (see REFERENCE: Metrics): the numbers
and the decisions that every report of a speedup reads (a run's summary, `make report`'s tables, a
sweep's jobs); the words that show them to people are `text.py`'s, beside it.

* speedup, Spec-Bench form: mean_i(tokens_i / wall_i) of the method over the same of AR, where
  tokens and wall time of a question are summed over its turns; both sides count tokens the
  same way (our own token ids, no re-tokenization).
* speedup, per question: the median of the per-question ratios. Both speedups carry a 95% interval:
  the percentile bootstrap over questions (`scipy.stats.bootstrap`, paired, 2000 resamples, seed 0).
* τ (Spec-Bench's mean accepted tokens): new tokens / decoding steps over all questions, which
  is the mean of the records' accept lengths (defined once: docs/benchmarks.md, "τ").
* α: accepted draft tokens / proposed draft tokens; per draft position d: steps where a depth-d
  draft was accepted / steps where one was tested (every earlier depth accepted).
* TTFT: mean seconds from the call to the first token, per turn.
* throughput (`batch_size` > 1: docs/batching.md): tokens per second summed over the batch, every
  batch's wall time counted once; its speedup over AR's at the same batch size; per-request
  latency (a turn's time from its batch's start to its own last token) and TTFT (its batch's
  prefill). At batch size 1 the throughput is the tokens over the wall time.
* fidelity: questions whose tokens differ from AR's, the first differing position, and each
  divergence of a lossless greedy run classified from the logit margins at it: a near-tie (both
  top-2 gaps within the dtype's rounding, NEAR_TIE) or a mismatch (docs/benchmarks.md, "fidelity").
* the speedup, explained (`decomposition`): per decoding step after the prefill, τ (tokens per
  step), the target's verify time, the drafter's time and the loop's other overhead, each in units
  of the same run's mean AR decoding step; τ / (verify + draft + other) is the decoding speedup
  they predict, shown beside the measured one (which also pays the prefill).
* caveats (`caveats`): what limits the trust a speedup deserves (n, busy questions, near-ties and
  mismatches, a speedup above τ, a wide interval and why), kept beside every speedup and printed
  with it (`caveat_note`, harness/stats/text.py).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import numpy as np
import scipy.stats

from methods.engine.native import WEIGHTS_BF16, dtype_name
from methods.machine.load import BUSY_CORES, BUSY_STEAL, is_busy


def question_speed(record: dict) -> tuple[int, float]:
    choice = record["choices"][0]
    return sum(choice["new_tokens"]), sum(choice["wall_time"])


def bootstrap_interval(statistic, samples: tuple[list[float], ...], reps: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float | None, float | None]:
    """The percentile bootstrap interval (`scipy.stats.bootstrap`) of `statistic(*samples, axis)` over
    questions: the samples are paired (one value each per question) and resampled together. One
    question is its own interval; none, no interval."""
    if not samples[0]:
        return None, None
    arrays = tuple(np.asarray(sample, dtype=float) for sample in samples)
    if len(arrays[0]) < 2:
        value = float(statistic(*arrays, axis=-1))
        return value, value
    interval = scipy.stats.bootstrap(arrays, statistic, n_resamples=reps, paired=True, vectorized=True,
                                     confidence_level=level, method="percentile",
                                     rng=np.random.default_rng(seed)).confidence_interval
    return float(interval.low), float(interval.high)


def bootstrap_median_interval(values: list[float], reps: int = 2000, seed: int = 0, level: float = 0.95):
    return bootstrap_interval(np.median, (values,), reps, seed, level)


def ratio_of_means(method: np.ndarray, baseline: np.ndarray, axis: int = -1) -> np.ndarray:
    """Spec-Bench's speedup: the mean of the method's tokens/s over the mean of AR's."""
    return np.mean(method, axis=axis) / np.mean(baseline, axis=axis)


def decoder_stats(records: list[dict]) -> dict:
    tokens = steps = forwards = drafted = accepted = 0
    wall = ttft_sum = batch_wall = 0.0
    turns = 0
    proposed: list[int] = []
    tested: list[int] = []
    hit: list[int] = []
    phases: dict[str, float] = defaultdict(float)
    # LazyLLM: prompt tokens computed per layer (prefill; whole run with revivals), prompt-weighted
    layer_fraction: dict[str, list[float]] = {}
    prompt_tokens = 0
    block_iterations: list[int] = []  # Jacobi: iterations per block
    for record in records:
        choice = record["choices"][0]
        tokens += sum(choice["new_tokens"])
        steps += sum(choice["decoding_steps"])
        wall += sum(choice["wall_time"])
        # each batch's wall time once: its share per member (batch_size 1 runs record neither key)
        batch_wall += sum(w / n for w, n in zip(choice.get("batch_wall_time", choice["wall_time"]),
                                                choice.get("batch_size", [1] * len(choice["wall_time"]))))
        for turn_steps, turn_stats in zip(choice["decoding_steps"], choice["stats"]):
            turns += 1
            # target forwards, the prefill included (records without it: the steps and a prefill)
            forwards += turn_stats.get("steps", turn_steps + (not turn_stats.get("prefill_step", False)))
            ttft_sum += turn_stats["ttft"]
            drafted += turn_stats["drafted_tokens"]
            accepted += turn_stats["accepted_drafts"]
            for d, counts in enumerate(zip(turn_stats["position_proposed"], turn_stats["position_tested"],
                                           turn_stats["position_accepted"])):
                if d >= len(tested):
                    for total in (proposed, tested, hit):
                        total.append(0)
                for total, count in zip((proposed, tested, hit), counts):
                    total[d] += count
            for phase, seconds in turn_stats["phase_time"].items():
                phases[phase] += seconds
            extra = turn_stats.get("extra", {})
            if "layer_token_fraction" in extra:
                weight = extra["prompt_tokens"]
                prompt_tokens += weight
                for key in ("prefill_layer_token_fraction", "layer_token_fraction"):
                    previous = layer_fraction.get(key) or [0.0] * len(extra[key])
                    layer_fraction[key] = [a + weight * b for a, b in zip(previous, extra[key])]
            block_iterations += extra.get("iterations_per_block", [])
    speeds = [t / w for t, w in map(question_speed, records) if w > 0]
    ttft_by_category: dict[str, list[float]] = defaultdict(list)
    for record in records:
        ttft_by_category[record["category"]].extend(s["ttft"] for s in record["choices"][0]["stats"])
    return {
        "questions": len(records),
        "turns": turns,
        "new_tokens": tokens,
        "decoding_steps": steps,
        "target_forwards": forwards,
        "wall_time": wall,
        "tokens_per_second": tokens / wall if wall else 0.0,
        "throughput_tokens_per_second": tokens / batch_wall if batch_wall else 0.0,
        "mean_latency": wall / turns if turns else 0.0,
        "mean_question_tokens_per_second": statistics.fmean(speeds) if speeds else 0.0,
        "tau": tokens / steps if steps else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "drafted_tokens": drafted,
        "accepted_drafts": accepted,
        "acceptance_per_position": [a / t if t else None for a, t in zip(hit, tested)],
        "position_proposed": proposed,
        "position_tested": tested,
        "position_accepted": hit,
        "mean_ttft": ttft_sum / turns if turns else 0.0,
        "mean_ttft_by_category": {c: statistics.fmean(v) for c, v in sorted(ttft_by_category.items())},
        "time_fractions": {k: v / wall for k, v in phases.items()} if wall else {},
        "phase_seconds": dict(phases),
        **({key: [v / prompt_tokens for v in values] for key, values in layer_fraction.items()} if prompt_tokens
           else {}),
        **({"mean_iterations_per_block": statistics.fmean(block_iterations)} if block_iterations else {}),
    }


def decomposition(stats: dict, baseline: dict) -> dict | None:
    """Why the speedup is what it is, from two `decoder_stats`: per decoding step (the target
    forwards after each turn's prefill), the tokens it added (`tau`: decoding only, the prefill's
    token left out, so AR's is 1) and the cost of verifying, drafting and the rest, in units of AR's
    mean decoding step in the same run."""
    steps, ar_steps = stats["target_forwards"] - stats["turns"], baseline["target_forwards"] - baseline["turns"]
    if steps <= 0 or ar_steps <= 0:
        return None
    decode = lambda phases: sum(v for k, v in phases.items() if k != "prefill")  # noqa: E731
    ar_step = decode(baseline["phase_seconds"]) / ar_steps
    if ar_step <= 0:
        return None
    cost = lambda *names: sum(stats["phase_seconds"].get(n, 0.0) for n in names) / steps / ar_step  # noqa: E731
    parts = {"verify": cost("verify"), "draft": cost("draft"), "other": cost("accept", "commit", "other")}
    tau = (stats["new_tokens"] - stats["turns"]) / steps
    return {"tau": tau, **parts, "predicted_decode_speedup": tau / sum(parts.values()) if sum(parts.values()) else None,
            "ar_step_seconds": ar_step, "prefill_fraction": stats["time_fractions"].get("prefill", 0.0)}


# Near-tie thresholds: the largest top-2 logit gap, per dtype of the target's forward, that a
# difference between two correct forwards of different shapes (AR's one-token step, a verification
# of several tokens) can flip. Measured on the embedded model (SmolLM2-135M, logits up to ±45, CPU):
# between AR's steps and 6-token chain verifications of the same tokens, a logit moved by at most
# 1.0e-4 in float32 and 1.0 in bfloat16, and the gap between the top two tokens by at most 6.1e-5
# and 0.375. Two forwards disagree on the argmax only when both gaps are below that change.
# float32: 1e-3, 16x the measured change (bigger models, longer contexts and GPU kernels add to
# it, a real bug leaves gaps of whole logits). bfloat16: 1.0, 8 of its ulps at logits 16-32
# (2.7x the measured change; its argmax did flip in 2 of 5 questions). float16: 0.125, the same 8
# ulps at its 3 more mantissa bits (fp16 could not be measured on this CPU). bf16w (weights of bf16
# values, fp32 arithmetic) computes as float32 does, so float32's threshold and its failure rule.
NEAR_TIE = {"float32": 1e-3, WEIGHTS_BF16: 1e-3, "bfloat16": 1.0, "float16": 0.125}
FP32_ARITHMETIC = ("float32", WEIGHTS_BF16)  # precisions whose forwards compute in fp32


def _margin(record: dict, turn: int, position: int) -> float | None:
    margins = record["choices"][0].get("logit_margins")
    try:
        return margins[turn][position]
    except (TypeError, IndexError):
        return None


def fidelity(records: list[dict], baseline: list[dict], dtype: str | None = None, classify: bool = True) -> dict:
    """The questions whose tokens differ from AR's and, per question, the first differing token.
    With `classify` (a lossless method, greedy), each divergence is a **near-tie** when AR's and
    the method's logit margins at that token (the top-2 gaps of the forwards that chose it) are
    both within NEAR_TIE[dtype], else a **mismatch**; `unclassified` when the records carry no
    margins (written before they were recorded) or the dtype has no threshold."""
    threshold = NEAR_TIE.get(dtype_name(dtype)) if classify else None
    by_id = {r["question_id"]: r for r in baseline}
    differing, first_positions = [], []
    for record in records:
        other = by_id.get(record["question_id"])
        if other is None:
            continue
        mine, theirs = record["choices"][0]["output_ids"], other["choices"][0]["output_ids"]
        for turn, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                differing.append(record["question_id"])
                entry = {"question_id": record["question_id"], "turn": turn, "position": position,
                         "ar_token": b[position] if position < len(b) else None,
                         "token": a[position] if position < len(a) else None,
                         "ar_gap": _margin(other, turn, position), "gap": _margin(record, turn, position)}
                if classify:
                    entry["kind"] = classify_divergence(entry, threshold)
                first_positions.append(entry)
                break
    kinds = [d.get("kind") for d in first_positions]
    near = [max(abs(d["ar_gap"]), abs(d["gap"])) for d in first_positions if d.get("kind") == "near-tie"]
    return {"compared": len(records), "differing_questions": len(differing), "classified": classify,
            "threshold": threshold, "near_ties": kinds.count("near-tie"), "mismatches": kinds.count("mismatch"),
            "unclassified": kinds.count("unclassified"), "max_near_tie_gap": max(near, default=None),
            "first_divergence": first_positions}


def compare_outputs(records: list[dict], baseline: list[dict], settings: dict, lossless: bool) -> dict:
    """`fidelity` of a report table's records (`settings`: its dtype and sampling name): divergences
    classified for a lossless greedy variant."""
    classify = lossless and settings.get("sampling", "greedy") == "greedy"
    return fidelity(records, baseline, settings.get("dtype"), classify=classify)


def classify_divergence(entry: dict, threshold: float | None) -> str:
    """near-tie | mismatch | unclassified, for one first divergence (see `fidelity`)."""
    if entry["token"] is None or entry["ar_token"] is None:
        return "mismatch"  # one output stopped where the other went on: no rounding explains that
    if threshold is None or entry["ar_gap"] is None or entry["gap"] is None:
        return "unclassified"
    return "near-tie" if abs(entry["ar_gap"]) <= threshold and abs(entry["gap"]) <= threshold else "mismatch"


def fidelity_failure(summary: dict) -> str | None:
    """The message that fails a run (exit code 1): a lossless method whose greedy output in fp32
    arithmetic (float32, bf16w) differs from AR's beyond a near-tie; None otherwise (other dtypes print
    the mismatches only)."""
    fid = summary.get("fidelity") or {}
    if not fid.get("mismatches") or summary.get("dtype") not in FP32_ARITHMETIC:
        return None
    return (f"FIDELITY FAILURE: {fid['mismatches']} of {fid['compared']} outputs of lossless method "
            f"{summary['method']} differ from AR's beyond a near-tie in {summary['dtype']} (docs/benchmarks.md, "
            "fidelity)")


def paired_speeds(records: list[dict], baseline: list[dict]) -> list[tuple[str, float, float]]:
    """(category, method tokens/s, AR tokens/s) for every question both answered, in question order: the
    bootstrap resamples these pairs, so a run's interval is the same whatever order its answers are read in
    (the summary written as the run goes and the report reading the folder give one interval)."""
    base_by_id = {r["question_id"]: r for r in baseline}
    pairs = []
    for mine in sorted(records, key=lambda r: str(r["question_id"])):
        base = base_by_id.get(mine["question_id"])
        if base is None:
            continue
        (tm, wm), (tb, wb) = question_speed(mine), question_speed(base)
        if wm > 0 and wb > 0:
            pairs.append((mine["category"], tm / wm, tb / wb))
    return pairs


def speedup_stats(records: list[dict], baseline: list[dict], reps: int = 2000, seed: int = 0) -> dict:
    """Spec-Bench's speedup (ratio of mean per-question throughputs) with a bootstrap 95% interval
    over questions, the median per-question ratio with its interval, and per category."""
    pairs = paired_speeds(records, baseline)
    if not pairs:
        return {"specbench": None, "specbench_ci95": [None, None], "median_ratio": None,
                "median_ratio_ci95": [None, None], "by_category": {}, "questions": 0}

    def speedup(sample) -> float:
        return float(ratio_of_means([m for _, m, _ in sample], [b for _, _, b in sample]))

    ratios = [m / b for _, m, b in pairs if b > 0]
    by_category = defaultdict(list)
    for pair in pairs:
        by_category[pair[0]].append(pair)
    return {
        "specbench": speedup(pairs),
        "specbench_ci95": list(bootstrap_interval(ratio_of_means, ([m for _, m, _ in pairs], [b for _, _, b in pairs]),
                                                  reps, seed)),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "median_ratio_ci95": list(bootstrap_median_interval(ratios, reps, seed)),
        "by_category": {c: speedup(p) for c, p in sorted(by_category.items())},
        "per_question_range": [min(ratios), max(ratios)] if ratios else [None, None],
        "questions": len(pairs),
    }


def _machine_states(*sides: list[dict]):
    """(question id, machine state) of every answer that recorded one (`harness.machine`)."""
    for records in sides:
        for record in records or []:
            if record.get("machine") is not None:
                yield record["question_id"], record["machine"]


def busy_questions(*sides: list[dict]) -> dict:
    """The questions some side of which was measured beside other work (`harness.machine`), and the
    most CPU other processes used during any question; `recorded` counts the questions that
    carry a machine state at all (runs before it was recorded carry none)."""
    states = list(_machine_states(*sides))
    return {
        "questions": sorted({qid for qid, state in states if is_busy(state)}, key=str),
        "recorded": len({qid for qid, _ in states}),
        "max_other_cores": max((state.get("other_cores") or 0.0 for _, state in states), default=None),
        "rule": f"other processes >= {BUSY_CORES} cores, steal >= {BUSY_STEAL:.0%}, or other SLURM jobs on the node",
    }


def shared_node_questions(*sides: list[dict]) -> dict | None:
    """Under SLURM: the questions some side of which ran while other jobs ran on the same node
    (`machine.slurm.other_jobs`, harness/cluster/slurm.py), and the most such jobs; None outside SLURM."""
    jobs = [(qid, state["slurm"].get("other_jobs") or 0) for qid, state in _machine_states(*sides)
            if state.get("slurm")]
    if not jobs:
        return None
    return {"questions": sorted({qid for qid, others in jobs if others}, key=str),
            "max_other_jobs": max(n for _, n in jobs)}


def summarize(method: str, records: list[dict], baseline: list[dict] | None, meta: dict) -> dict:
    summary = {**meta, "method": method, "questions": len(records), "decoder": decoder_stats(records),
               "busy": busy_questions(records, baseline), "shared_node": shared_node_questions(records, baseline)}
    if baseline is None:
        summary["caveats"] = caveats(None, None, None, summary["busy"], questions=len(records))
        return summary
    summary["baseline"] = decoder_stats(baseline)
    summary["speedup"] = speedup_stats(records, baseline)
    greedy = not (meta.get("sampling") or {}).get("temperature")
    summary["fidelity"] = fidelity(records, baseline, meta.get("dtype"), classify=meta.get("lossless", True) and greedy)
    summary["explained"] = decomposition(summary["decoder"], summary["baseline"])
    base_throughput = summary["baseline"]["throughput_tokens_per_second"]
    summary["throughput_speedup"] = (
        summary["decoder"]["throughput_tokens_per_second"] / base_throughput if base_throughput else None
    )
    summary["caveats"] = caveats(summary["speedup"], summary["decoder"]["tau"], summary["fidelity"], summary["busy"],
                                 meta.get("lossless", True))
    base_ttft, ttft = summary["baseline"]["mean_ttft"], summary["decoder"]["mean_ttft"]
    summary["ttft_speedup"] = base_ttft / ttft if ttft else None
    summary["ttft_speedup_by_category"] = {
        c: summary["baseline"]["mean_ttft_by_category"][c] / t
        for c, t in summary["decoder"]["mean_ttft_by_category"].items()
        if t and c in summary["baseline"]["mean_ttft_by_category"]
    }
    return summary


MIN_INTERVAL_N = 5  # below this many questions a speedup is printed without its interval (a bootstrap of 1-4)
WIDE_INTERVAL = 0.25  # a 95% interval wider than this share of its speedup is called wide
FEW_QUESTIONS = 20  # fewer questions than this: too few for a narrow interval (Spec-Bench has 480)
FIDELITY_KEYS = ("differing_questions", "classified", "near_ties", "mismatches", "unclassified", "max_near_tie_gap")


def caveats(speed: dict | None, tau: float | None, fid: dict | None, busy: dict, lossless: bool = True,
            questions: int | None = None) -> dict:
    """What limits the trust a speedup deserves, computed beside every speedup (a run's summary, a
    table's cell, a sweep's job) and printed with it (`caveat_note`): n; the questions measured
    on a busy machine and the most cores other processes used; the outputs that differ from AR's
    (near-ties, mismatches); whether the speedup exceeds τ (a decoding step costs at least one AR
    step, so only a slower AR measurement or a cheaper prefill gives more); whether its 95%
    interval is wide (wider than WIDE_INTERVAL of the speedup) and why: busy questions, few
    questions, or (on a quiet machine) how far the per-question speedups spread; below
    MIN_INTERVAL_N questions there is no interval to speak of."""
    n = speed["questions"] if speed else (questions or 0)
    value = (speed or {}).get("specbench")
    low, high = (speed or {}).get("specbench_ci95") or (None, None)
    busy_count = len(busy["questions"]) if busy.get("recorded") else None
    few = value is not None and n < MIN_INTERVAL_N
    wide = bool(value and not few and low is not None and high is not None and high - low > WIDE_INTERVAL * value)
    reasons = []
    if wide:
        if busy_count:
            reasons.append(f"{busy_count} of {n} questions measured on a busy machine")
        if n < FEW_QUESTIONS:
            reasons.append(f"only {n} question{'s' * (n != 1)}")
        spread = speed.get("per_question_range") or [None, None]
        if not busy_count and spread[0] is not None:
            reasons.append(f"per-question speedups from {spread[0]:.2f} to {spread[1]:.2f}x")
    return {"questions": n, "busy": busy_count, "max_other_cores": busy.get("max_other_cores"),
            "fidelity": {**{k: fid.get(k) for k in FIDELITY_KEYS}, "lossless": lossless} if fid else None,
            "tau": tau, "above_tau": bool(value and tau and value > tau),
            "too_few_for_interval": few, "interval_wide": wide, "interval_reasons": reasons}
