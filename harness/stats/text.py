"""The statistics of a run in words for people (the numbers and decisions: `harness/stats/__init__.py`): a
speedup's caveats in one line (`caveat_note`), a sweep job's status line (`speedup_status`), the
outputs that differ from AR's (`describe_fidelity`, `fidelity_lines`) and the printout at the end of a
run (`format_summary`, led by `headline_lines`)."""

from __future__ import annotations

from pathlib import Path

from harness.stats import MIN_INTERVAL_N, caveats


def above_tau_reason(c: dict) -> str:
    """Why a speedup above τ cannot be trusted as it stands."""
    if c.get("busy"):
        return (f"a speedup above τ ({c['tau']:.2f}) on a busy machine is not to be trusted: a decoding step costs at "
                "least one AR step, so AR was timed during a slowdown; rerun on a quiet machine")
    return (f"a speedup above τ ({c['tau']:.2f}): a decoding step costs at least one AR step, so only a cheaper "
            "prefill or a slower AR measurement gives more; check both before quoting it")


def caveat_note(c: dict | None) -> str:
    """One line of a speedup's caveats: `n 18; BUSY 18/18 (others used up to 3.2 cores); 14/18
    differ from AR: 14 near-ties (max gap 0.875), 0 mismatches; speedup > τ on a busy machine:
    not to be trusted`. Every status line, job list and table that prints a speedup prints it."""
    if not c:
        return "caveats not recorded"
    n = c["questions"]
    parts = [f"n {n}"]
    if c["busy"] is None:
        parts.append("busy not recorded")
    elif c["busy"]:
        parts.append(f"BUSY {c['busy']}/{n} (others used up to {c['max_other_cores'] or 0:.1f} cores)")
    else:
        parts.append(f"quiet (others used at most {c['max_other_cores'] or 0:.2f} cores)")
    fid = c.get("fidelity")
    if fid:
        parts.append(describe_fidelity(fid, fid.get("lossless", True), of=n).replace(" differ", " differ from AR", 1))
    if c.get("above_tau"):
        parts.append("speedup > τ on a busy machine: not to be trusted" if c.get("busy") else "speedup > τ: check it")
    if c.get("interval_wide"):
        parts.append(f"wide interval: {', '.join(c['interval_reasons'])}")
    if c.get("too_few_for_interval"):
        parts.append(f"no interval from fewer than {MIN_INTERVAL_N} questions")
    return "; ".join(parts)


def speedup_status(speedup: float | None, interval: list | None, tau: float | None, c: dict | None) -> str:
    """A sweep job's numbers in one line, its caveats included: `speedup 1.51x [1.22, 1.80], τ 1.11;
    n 18; BUSY 18/18 …` (the sweep's status lines and `python -m harness.report --jobs`)."""
    numbers = []
    if speedup is not None:
        low, high = interval or (None, None)
        shown = low is not None and not (c or {}).get("too_few_for_interval")
        numbers.append(f"speedup {speedup:.2f}x" + (f" [{low:.2f}, {high:.2f}]" if shown else ""))
    if tau is not None:
        numbers.append(f"τ {tau:.2f}")
    return "; ".join([", ".join(numbers), caveat_note(c)] if numbers else [caveat_note(c)])


def describe_fidelity(fid: dict, lossless: bool = True, of: int | None = None) -> str:
    """'5 differ: 5 near-ties (max gap 0.25), 0 mismatches' ('5/13 differ' with `of`), or why the
    divergences are not classified."""
    differ = fid["differing_questions"]
    count = f"{differ}/{of}" if of is not None else str(differ)
    if not differ:
        return f"{count} differ"
    if not lossless:
        return f"{count} differ (lossy)"
    if not fid.get("classified", False):
        return f"{count} differ (sampling: not compared token by token)"
    gap = fid.get("max_near_tie_gap")
    text = f"{count} differ: {fid['near_ties']} near-tie{'s' * (fid['near_ties'] != 1)}"
    text += f" (max gap {gap:.3g})" if gap is not None else ""
    text += f", {fid['mismatches']} mismatch{'es' * (fid['mismatches'] != 1)}"
    return text + (f", {fid['unclassified']} unclassified (no logit margins recorded)" if fid.get("unclassified")
                   else "")


def fidelity_lines(summary: dict) -> list[str]:
    fid = summary["fidelity"]
    lossless = summary.get("lossless", True)
    threshold = (
        f"; near-tie: both top-2 gaps <= {fid['threshold']:g} in {summary.get('dtype')}" if fid.get("threshold") else ""
    )
    lines = [f"outputs vs AR ({fid['compared']} questions): {describe_fidelity(fid, lossless)}"
             + (threshold if fid["differing_questions"] and fid.get("classified") and lossless else "")]
    if fid.get("mismatches"):
        bad = [d for d in fid["first_divergence"] if d.get("kind") == "mismatch"]
        lines.append("!" * 100)
        lines.append(
            f"FIDELITY MISMATCH: {len(bad)} output(s) of a lossless method differ from AR's beyond a near-tie:"
        )
        for d in bad[:10]:
            gaps = ", ".join(f"{name} {'-' if v is None else f'{v:.3g}'}"
                             for name, v in (("AR's gap", d["ar_gap"]), ("its gap", d["gap"])))
            lines.append(f"  question {d['question_id']} turn {d['turn']} token {d['position']}: AR {d['ar_token']}, "
                         f"method {d['token']} ({gaps})")
        lines.append("!" * 100)
    return lines


def headline_lines(summary: dict) -> list[str]:
    """The lines a run's printout leads with: one speedup (Spec-Bench's form) with its 95% interval
    and n; in words, why the interval is wide and why a speedup above τ is suspect; every caveat
    in one line (`caveat_note`); the busy questions by id."""
    c = summary.get("caveats") or caveats(None, None, None, summary.get("busy") or {}, questions=summary["questions"])
    speedup = summary.get("speedup")
    lines = []
    if speedup and speedup.get("specbench") is not None:
        value, (low, high) = speedup["specbench"], speedup["specbench_ci95"]
        mine, base = summary["decoder"], summary["baseline"]
        interval = ("too few questions for an interval" if c.get("too_few_for_interval")
                    else f"95% interval [{low:.2f}, {high:.2f}]")
        lines.append(f"SPEEDUP {value:.2f}x over AR, {interval}, n = {c['questions']} questions "
                     f"(Spec-Bench form: mean tokens/s per question, {mine['mean_question_tokens_per_second']:.2f} vs "
                     f"AR's {base['mean_question_tokens_per_second']:.2f})")
        if c["interval_wide"]:
            lines.append(f"  the interval is wide ({low:.2f} to {high:.2f}x): {'; '.join(c['interval_reasons'])}; "
                         "read the speedup as a rough estimate")
        if c["above_tau"]:
            lines.append(f"  {above_tau_reason(c)}")
    lines.append(f"caveats: {caveat_note(c)}")
    busy = summary.get("busy") or {}
    if busy.get("questions"):
        lines.append(f"BUSY MACHINE: {len(busy['questions'])} of {summary['questions']} questions were measured beside "
                     f"other work ({busy['rule']}; up to {busy['max_other_cores']:.2f} cores used by others): "
                     f"{', '.join(map(str, busy['questions'][:10]))}{' …' if len(busy['questions']) > 10 else ''}")
    busy_profiles = [Path(f).name for f, p in ((summary.get("engine") or {}).get("profiles") or {}).items()
                     if not p["quiet"]]
    if busy_profiles:
        lines.append(f"BUSY PROFILE: {', '.join(busy_profiles)} measured beside other work chose this run's kernels "
                     "or sizes; the next run measures again")
    shared = summary.get("shared_node") or {}
    if shared.get("questions"):
        lines.append(f"SHARED NODE: {len(shared['questions'])} of {summary['questions']} questions were measured while "
                     f"up to {shared['max_other_jobs']} other SLURM job(s) ran on the node "
                     "(hydra.launcher.exclusive=true avoids it)")
    return lines


def batch_line(summary: dict) -> str:
    """A batched run's throughput (summed over the batch), latency and TTFT, beside AR's at the
    same batch size."""
    mine, base = summary["decoder"], summary.get("baseline")
    line = (f"batch size {summary['batch_size']}: throughput {mine['throughput_tokens_per_second']:.2f} tok/s summed "
            f"over the batch, per-request latency {mine['mean_latency']:.2f} s, TTFT {1000 * mine['mean_ttft']:.1f} ms")
    if base and summary.get("throughput_speedup") is not None:
        line += (f"; AR at the same batch size {base['throughput_tokens_per_second']:.2f} tok/s, latency "
                 f"{base['mean_latency']:.2f} s: throughput speedup {summary['throughput_speedup']:.2f}x")
    return line


def sizing_curve_line(summary: dict) -> str | None:
    """What sized the method's `auto` draft: this run's latency curve v(n) = t(n) / t(1) (the machine
    profile measures it at the run's start) at the sizes up to the one chosen (EAGLE-2's adaptive size:
    up to 16), and the size `auto` chose; None for a method sized otherwise."""
    sizing = (summary.get("method_config") or {}).get("sizing") or {}
    if sizing.get("curve_t1"):
        curve = {int(n): float(v) for n, v in sizing["curve_t1"].items()}
    elif sizing.get("seconds_by_size"):
        seconds = {int(n): float(v) for n, v in sizing["seconds_by_size"].items()}
        curve = {n: v / seconds[min(seconds)] for n, v in seconds.items()}
    else:
        return None
    chosen = sizing.get("verify_tokens")
    shown = [n for n in sorted(curve) if 1 < n <= (chosen or 16)]
    line = "sized by this run's latency curve, v(n) = t(n)/t(1): " + ", ".join(f"v({n}) {curve[n]:.2f}" for n in shown)
    if chosen:
        line += f"; auto chose {chosen} tokens per verification (the most at v(n) <= {sizing.get('verify_budget_t1')})"
    return line


def format_summary(summary: dict) -> str:
    """The printout at the end of a run: the headline speedup and its caveats (`headline_lines`),
    the decoders' table, then what explains the speedup and the rest of the numbers."""
    rows = []
    decoders = [("ar (baseline)", summary.get("baseline")), (summary["method"], summary["decoder"])]
    if summary.get("baseline") is None:
        decoders = decoders[1:]
    header = f"{'decoder':<16}{'tok/s':>8}{'τ':>7}{'α':>7}{'TTFT ms':>9}{'tokens':>8}{'wall s':>9}"
    rows.append(header)
    rows.append("-" * len(header))
    for name, stats in decoders:
        alpha = "-" if stats["acceptance_rate"] is None else f"{stats['acceptance_rate']:.2f}"
        rows.append(
            f"{name:<16}{stats['mean_question_tokens_per_second']:>8.2f}{stats['tau']:>7.2f}{alpha:>7}"
            f"{1000 * stats['mean_ttft']:>9.1f}{stats['new_tokens']:>8}{stats['wall_time']:>9.1f}"
        )
    rows.append("tok/s: the mean over questions of tokens / wall time (Spec-Bench's form; the speedup is their ratio)")
    if summary.get("batch_size", 1) > 1:
        rows.append(batch_line(summary))
    lossy = "" if summary.get("lossless", True) else " [LOSSY]"
    lines = [
        f"{summary['method']}{lossy} on {summary.get('model')} / {summary.get('dataset')} "
        f"({summary['questions']} questions, {summary.get('dtype')}, {summary.get('hardware')})",
        *headline_lines(summary),
        *rows,
    ]
    speedup = summary.get("speedup")
    if speedup:
        explained = summary.get("explained")
        if explained:
            lines.append(
                f"why, per decoding step in AR steps ({1000 * explained['ar_step_seconds']:.1f} ms): "
                f"tokens {explained['tau']:.2f} / (verify {explained['verify']:.2f} + draft {explained['draft']:.2f} + "
                f"other {explained['other']:.2f}) = {explained['predicted_decode_speedup']:.2f}x predicted for "
                "decoding; "
                f"measured {speedup['specbench']:.2f}x with the prefill ({100 * explained['prefill_fraction']:.0f}% of "
                "its time)")
        curve = sizing_curve_line(summary)
        if curve:
            lines.append(curve)
        low, high = speedup["median_ratio_ci95"]
        lines.append(f"median per-question speedup: {speedup['median_ratio']:.2f}x [{low:.2f}, {high:.2f}] "
                     "(less moved by one question timed during a slowdown)")
        cats = ", ".join(f"{c} {v:.2f}x" for c, v in speedup["by_category"].items() if v is not None)
        lines.append(f"by category: {cats}")
        lines += fidelity_lines(summary)
        lines.append(f"TTFT speedup over AR's prefill: {summary['ttft_speedup']:.2f}x ("
                     + ", ".join(f"{c} {v:.2f}x" for c, v in summary["ttft_speedup_by_category"].items()) + ")")
    for name, scores in (summary.get("quality") or {}).items():
        for metric, v in scores.items():
            lines.append(f"quality {name}: {metric} {v['score']:.3f} on {v['questions']} questions ("
                         + ", ".join(f"{c} {s:.2f}" for c, s in v["by_category"].items()) + ")")
    for key, label in (("prefill_layer_token_fraction", "in prefill"), ("layer_token_fraction", "with revivals")):
        if key in summary["decoder"]:
            lines.append(f"prompt tokens computed per layer {label}: "
                         + " ".join(f"{v:.2f}" for v in summary["decoder"][key]))
    if "mean_iterations_per_block" in summary["decoder"]:
        lines.append(f"Jacobi iterations per block: {summary['decoder']['mean_iterations_per_block']:.2f}")
    per_position = summary["decoder"]["acceptance_per_position"]
    if per_position:  # α with its counts: a deep position is tested rarely
        hits, tested = summary["decoder"]["position_accepted"], summary["decoder"]["position_tested"]
        lines.append("acceptance per draft position (accepted/tested): " + " ".join(
            f"{d}:{'-' if a is None else f'{a:.2f} ({h}/{t})'}"
            for d, (a, h, t) in enumerate(zip(per_position, hits, tested), start=1)))
    fractions = summary["decoder"]["time_fractions"]
    if fractions:
        lines.append("time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in fractions.items()))
    return "\n".join(lines)
