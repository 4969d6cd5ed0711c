"""`breakdown.md/csv` of a report's table: per method variant over all its questions, speed, fidelity
to AR, the caveats and where the time goes (`breakdown_rows`, `write_breakdown`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.reporting.tables import Row, Table, markdown_table
from harness.stats import (
    MIN_INTERVAL_N,
    busy_questions,
    caveats,
    compare_outputs,
    decoder_stats,
    decomposition,
    speedup_stats,
)
from harness.stats.text import caveat_note, describe_fidelity

PHASES = ("prefill", "draft", "verify", "accept", "commit", "other")


def breakdown_rows(rows: dict[str, Row], settings: dict | None = None) -> list[dict]:
    """Per method variant over all its questions: speed, fidelity to AR (each divergence of a
    lossless greedy variant classified as a near-tie or a mismatch) and where the time goes."""
    out = []
    settings = settings or {}
    for label, row in sorted(rows.items()):
        keys = list(row.records)
        records, baseline = [row.records[k] for k in keys], [row.baseline[k] for k in keys]
        lossless = row.config.get("lossless", True)
        stats, speed = decoder_stats(records), speedup_stats(records, baseline)
        fid = compare_outputs(records, baseline, settings, lossless)
        base_stats = decoder_stats(baseline)
        explained = decomposition(stats, base_stats)
        busy = busy_questions(records, baseline)
        caveat = caveats(speed, stats["tau"], fid, busy, lossless)
        positions = sorted(d["position"] for d in fid["first_divergence"])
        out.append({
            "method": label, "questions": len(records), "speedup": speed["specbench"],
            "ci_low": speed["specbench_ci95"][0], "ci_high": speed["specbench_ci95"][1], "tau": stats["tau"],
            "tokens_per_second": stats["tokens_per_second"],
            "ar_tokens_per_second": base_stats["tokens_per_second"],
            **{f"step_{k}": (explained or {}).get(k) for k in ("verify", "draft", "other")},
            "predicted": (explained or {}).get("predicted_decode_speedup"),
            "lossless": lossless, "differ_from_ar": fid["differing_questions"],
            "first_divergence_median": positions[len(positions) // 2] if positions else None,
            "near_ties": fid["near_ties"] if fid["classified"] else None,
            "mismatches": fid["mismatches"] if fid["classified"] else None,
            "max_near_tie_gap": fid["max_near_tie_gap"], "fidelity": describe_fidelity(fid, lossless, of=len(records)),
            "busy": len(busy["questions"]) if busy["recorded"] else None, "max_other_cores": busy["max_other_cores"],
            "above_tau": caveat["above_tau"], "interval_wide": caveat["interval_wide"], "caveats": caveat_note(caveat),
            **{phase: stats["time_fractions"].get(phase, 0.0) for phase in PHASES},
        })
    return out


def _per_step(row: dict) -> str:
    if row["step_verify"] is None:
        return "–"
    return " / ".join(f"{row[f'step_{k}']:.2f}" for k in ("verify", "draft", "other"))


def write_breakdown(table: Table, folder: Path) -> list[Path]:
    """`breakdown.md/csv`: one line per method with speedup (flagged when above τ), τ, tokens/s, how
    many questions' outputs differ from AR's (near-ties and mismatches, and the median first
    differing token), how many were measured on a busy machine (and the most cores others used),
    and the time fractions."""
    lines = breakdown_rows(table.rows, table.settings)
    title = (
        f"**Per method: speed, fidelity, time breakdown (% of wall time)** — {table.caption()}. Per step: the cost "
        "of a decoding step's verify, draft and other work in units of AR's mean decoding step; predicted = the "
        "tokens a decoding step adds after the prefill's / their sum (decoding only; the measured speedup also pays "
        "the prefill). Differ from AR: near-tie = both top-2 logit gaps at the first differing token within the "
        "dtype's rounding, mismatch = beyond it (docs/benchmarks.md, fidelity). Busy: questions measured beside "
        "other work (docs/benchmarks.md, reading the busy flag). tok/s: all tokens / all wall time (the speedup, "
        "Spec-Bench's, divides the mean per-question tokens/s: one slow question moves the two apart). Above τ: a "
        "decoding step costs at least one AR step, so a speedup above τ comes from a slower AR measurement or a "
        "cheaper prefill."
    )
    shown = []
    for r in lines:
        differ = f"{r['differ_from_ar']}/{r['questions']}"
        if r["differ_from_ar"]:  # 5/13 differ: 5 near-ties (max gap 0.25), 0 mismatches
            differ = r["fidelity"] + f" (first at token {r['first_divergence_median']}, median)"
        if r["mismatches"]:
            differ = f"**{differ}**"
        interval = f" [{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if r["questions"] >= MIN_INTERVAL_N else ""
        interval += (" **above τ, busy: not to be trusted**" if r["busy"] else " (above τ)") if r["above_tau"] else ""
        busy = "not recorded" if r["busy"] is None else f"{r['busy']}/{r['questions']}"
        busy += f" (others up to {r['max_other_cores']:.1f} cores)" if r["busy"] else ""
        shown.append({
            "method": r["method"], "questions": str(r["questions"]), "speedup": f"{r['speedup']:.2f}×{interval}",
            "τ": f"{r['tau']:.2f}", "verify / draft / other per step": _per_step(r),
            "predicted": "–" if r["predicted"] is None else f"{r['predicted']:.2f}×",
            "tok/s (AR)": f"{r['tokens_per_second']:.1f} ({r['ar_tokens_per_second']:.1f})", "differ from AR": differ,
            "busy": busy, **{f"{p} %": f"{100 * r[p]:.0f}" for p in PHASES}})
    (folder / "breakdown.md").write_text(markdown_table(pd.DataFrame(shown), title))
    pd.DataFrame([table.settings | r for r in lines], dtype=object).to_csv(folder / "breakdown.csv", index=False)
    return [folder / "breakdown.md", folder / "breakdown.csv"]
