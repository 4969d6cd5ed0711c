"""Writes every generated part of the docs: the blocks of README.md and docs/headline.md that hold
run figures (from the committed results under results/reference/), the model and method tables
(from conf/model/*.yaml and the methods' settings classes), and what scripts/method_configs.py
writes (conf/method/*.yaml, the settings table of docs/methods.md).

    make docs                                  # write them
    python scripts/generate_docs.py --check    # exit 1, naming the stale files (tests/test_generated_docs.py)

A generated block sits between `<!-- generated: NAME ... -->` and `<!-- end generated: NAME -->`;
everything outside the markers is prose, which carries no run figure. A number typed by hand
inside a block makes the check fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import method_configs  # noqa: E402  (scripts/ is on sys.path when this runs as a script)
from omegaconf import OmegaConf  # noqa: E402

from harness.perf.peers import COLUMNS as PEER_COLUMNS  # noqa: E402
from harness.reporting.breakdown import breakdown_rows  # noqa: E402
from harness.reporting.curves import find_curves  # noqa: E402
from harness.reporting.serving import (  # noqa: E402
    find_serve_runs,
    group_folder,
    group_table,
    groups,
    policy,
    read_points,
    read_settings,
)
from harness.reporting.tables import build_tables, find_runs  # noqa: E402
from harness.running.environment import hardware_name  # noqa: E402
from harness.running.results import read_answers  # noqa: E402
from harness.stats import decoder_stats  # noqa: E402
from harness.stats.text import format_summary  # noqa: E402
from harness.training.loop import corpus_manifest, default_corpus  # noqa: E402
from methods.base import available_methods, method_settings  # noqa: E402
from methods.settings.params import ConfigError  # noqa: E402

REFERENCE = REPO / "results" / "reference"
HEADLINE = REPO / "conf" / "headline" / "smollm2-135m.yaml"
QUICKSTART = REFERENCE / "quickstart"  # `make bench` as the README runs it, committed for its sample output
BLOCK = re.compile(r"(?P<open><!-- generated: (?P<name>[\w-]+)[^>]*-->\n)(?P<body>.*?)(?P<close><!-- end generated: "
                   r"(?P=name) -->)", re.S)
PERF = REFERENCE / "perf"  # `make perf`'s draft split and `make perf-batch`'s files, committed from a quiet run
BATCH = REFERENCE / "batch"  # a `make sweep` of batch sizes (docs/batching.md), not a headline run set
SERVE = REFERENCE / "serve"  # `make serve-sweep`'s runs (docs/serving.md)
SERVE_PLOTS = REPO / "plots" / "reference" / "serving" / "summary"
DOCUMENTS = (REPO / "README.md", REPO / "docs" / "headline.md", REPO / "docs" / "performance.md",
             REPO / "docs" / "batching.md", REPO / "docs" / "serving.md", REPO / "docs" / "drafts.md",
             REPO / "docs" / "models.md")
DRAFTS = REPO / "drafts" / "smollm2-135m"  # the embedded model's drafts (docs/drafts.md)


# ------------------------------------------------------------------------------------------
# The committed run sets


def run_date(records) -> str:
    """The day (UTC) a run set's last answer was recorded."""
    stamp = max(record["tstamp"] for record in records)
    return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%d")


def environment(run_folder: str) -> dict:
    path = Path(run_folder) / "environment.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def variant_name(row, rows) -> str:
    """A row's method, and where the table runs it more than once (the headline's `sam` and
    `sam@eagle2`), the first of its settings (in the method's order) whose value tells the runs apart,
    unless this run has it at its default (`sam`, `sam auxiliary=eagle2`)."""
    others = [r.config for r in rows if r.method == row.method]
    for field in fields(method_settings(row.method)) if len(others) > 1 else ():
        if len({str(config.get(field.name)) for config in others}) > 1:
            value = row.config.get(field.name)
            return row.method if value == field.default else f"{row.method} {field.name}={value}"
    return row.method


def run_sets(paths=(REFERENCE,)) -> list[dict]:
    """Every table of the committed results with what the docs say of it, newest first."""
    sets = []
    with contextlib.chdir(REPO):  # a run's summary names its AR answers relative to the repository
        tables = build_tables([run for run in find_runs(list(paths)) if BATCH not in run.path.resolve().parents])
    for table in tables:
        records = [r for row in table.rows.values() for r in row.records.values()]
        runs = sorted({REPO / run for row in table.rows.values() for run in row.runs})
        envs = [environment(run) for run in runs]
        rows = breakdown_rows(table.rows, table.settings)
        for row, (_, table_row) in zip(rows, sorted(table.rows.items())):
            row["name"] = variant_name(table_row, table.rows.values())
            ttft, base = (
                decoder_stats(list(side.values()))["mean_ttft"] for side in (table_row.records, table_row.baseline)
            )
            row["ttft_speedup"] = base / ttft if ttft else None
        sets.append({
            "table": table, "slug": table.slug, "rows": rows, "date": run_date(records),
            "stamp": max(record["tstamp"] for record in records),  # its last answer: which of a day's sets is newest
            "questions": len(table.questions), "settings": table.settings,
            "commits": sorted({env.get("git", {}).get("commit", "")[:7] for env in envs} - {""}),
            "cores": sorted({env.get("cpu_count") for env in envs} - {None}),
        })
    return sorted(sets, key=lambda s: (s["stamp"], s["slug"]), reverse=True)


def headline_sets(sets: list[dict], dtype: str | None = None) -> list[dict]:
    """The run sets made with `make headline`'s settings (conf/headline/smollm2-135m.yaml); with `dtype`,
    only those in that precision."""
    config = OmegaConf.load(HEADLINE)
    return [s for s in sets if s["settings"]["model"] == config.model and s["settings"]["dataset"] == config.dataset
            and s["questions"] == config.limit and s["settings"]["max_new_tokens"] == config.max_new_tokens
            and dtype in (None, s["settings"]["dtype"])]


def headline_dtype() -> str | None:
    """The precision `make headline` runs in (its config's `dtype=` override); None for `auto`, which each
    machine resolves to its own."""
    given = [o.split("=", 1)[1] for o in OmegaConf.load(HEADLINE).get("overrides", []) if o.startswith("dtype=")]
    return None if not given or given[-1] == "auto" else given[-1]


def machine(s: dict) -> str:
    cores = "/".join(map(str, s["cores"])) or "?"
    return f"{s['settings']['hardware']}, {cores} cores"


def describe(s: dict, with_model: bool = True) -> str:
    """One line: the run set's setting (its model and dataset unless the context names them), machine,
    engine, commit, date and AR's speed."""
    st = s["settings"]
    ar = [row["ar_tokens_per_second"] for row in s["rows"]]
    commits = ", ".join(s["commits"]) or "unrecorded"
    model = f"{st['model']}, {st['dataset']}, " if with_model else ""
    return (f"{model}{s['questions']} questions, {st['max_new_tokens']} new tokens, {st['sampling']}, {st['dtype']}; "
            f"{machine(s)}; engine `{st['engine']}` (commit {commits}), {s['date']}; "
            f"AR {min(ar):.0f}–{max(ar):.0f} tokens/s")


def speedup_cell(row: dict, interval: bool = True) -> str:
    text = f"{row['speedup']:.2f}×"
    if interval and row["ci_low"] is not None:
        text += f" [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"
    if not row["lossless"] and row["ttft_speedup"]:
        text += f", TTFT {row['ttft_speedup']:.2f}×"
    return text


def differ_cell(row: dict) -> str:
    return f"{row['differ_from_ar']}/{row['questions']}" + ("" if row["lossless"] else " (lossy)")


def per_step(row: dict) -> str:
    if row["step_verify"] is None:
        return "–"
    return " / ".join(f"{row[f'step_{k}']:.2f}" for k in ("verify", "draft", "other"))


def results_table(s: dict, labels: bool) -> str:
    """The run set's rows by speedup; with `labels`, each method's label (its settings) and whether
    its outputs differ from AR's, else the method's name alone."""
    head = "| method | speedup [95% CI] | τ | verify / draft / other |" + (" differ from AR |" if labels else "")
    lines = [head, "|---|---|---|---|" + ("---|" if labels else "")]
    for row in sorted(s["rows"], key=lambda r: -r["speedup"]):
        name = row["method"] if labels else f"`{row['name']}`"
        line = f"| {name} | {speedup_cell(row)} | {row['tau']:.2f} | {per_step(row)} |"
        lines.append(line + (f" {differ_cell(row)} |" if labels else ""))
    return "\n".join(lines)


def fidelity_line(s: dict) -> str:
    """Whether every lossless method's outputs equal AR's, counted."""
    lossless = [row for row in s["rows"] if row["lossless"]]
    differ = [row["name"] for row in lossless if row["differ_from_ar"]]
    if not differ:
        return f"every lossless method's {s['questions']} outputs equal AR's"
    return f"outputs that differ from AR's: {', '.join(differ)} (docs/headline.md)"


def report_links(s: dict, up: str) -> str:
    folder = REFERENCE / "report" / s["slug"]
    plots = REPO / "plots" / "reference" / s["slug"]
    links = [f"[tables]({up}{folder.relative_to(REPO)}/breakdown.md)" if folder.is_dir() else None,
             f"[figures]({up}{plots.relative_to(REPO)}/)" if plots.is_dir() else None]
    return ", ".join(link for link in links if link) or "no report committed"


# ------------------------------------------------------------------------------------------
# The blocks


def block_reference(sets) -> str:
    """README: the newest `make headline` run set in its config's precision."""
    latest = headline_sets(sets, headline_dtype())[0]
    line = f"{describe(latest, with_model=False)}; {fidelity_line(latest)}"
    return f"{line}.\n\n{results_table(latest, labels=False)}\n"


def block_figure(sets) -> str:
    """README: the newest `make headline` run set's speedup against τ (in its config's precision)."""
    latest = headline_sets(sets, headline_dtype())[0]
    figure = REPO / "plots" / "reference" / latest["slug"] / "speedup_vs_tau.png"
    if not figure.is_file():
        raise SystemExit(f"{figure}: missing (make figures RUNS=results/reference)")
    return (f"![speedup against τ]({figure.relative_to(REPO)})\n\n"
            f"*`make headline`, {machine(latest)}, {latest['date']}; dashed: speedup = τ.*\n")


def block_latest(sets) -> str:
    """docs/headline.md: the newest `make headline` run set of each CPU class and precision; where a class
    has more than one precision, each method's speedup in each beside the other's."""
    newest: dict[tuple[str, str], dict] = {}
    for s in headline_sets(sets):
        newest.setdefault((s["settings"]["hardware"], s["settings"]["dtype"]), s)
    parts = []
    for (hardware, dtype), s in newest.items():
        parts.append(f"### {machine(s)}, {dtype}, {s['date']}\n\n{describe(s)}; {report_links(s, '../')}.\n\n"
                     f"{results_table(s, labels=True)}\n")
    for hardware in dict.fromkeys(h for h, _ in newest):
        pair = [s for (h, _), s in newest.items() if h == hardware]
        if len(pair) > 1:
            parts.append(precision_table(pair))
    return "\n".join(parts)


def precision_table(same_class: list[dict]) -> str:
    """One class's newest headline in each precision: AR's tokens/s and each method's speedup over AR
    in the same precision, side by side (a faster baseline leaves a method less to gain)."""
    dtypes = [s["settings"]["dtype"] for s in same_class]
    by_dtype = {s["settings"]["dtype"]: {row["name"]: row for row in s["rows"]} for s in same_class}
    names = sorted({name for rows in by_dtype.values() for name in rows},
                   key=lambda name: -by_dtype[dtypes[0]].get(name, {"speedup": 0})["speedup"])
    ar = {d: [row["ar_tokens_per_second"] for row in rows.values()] for d, rows in by_dtype.items()}
    lines = [f"### {machine(same_class[0])}: each method's speedup in {' and in '.join(dtypes)}, each over AR in "
             "the same precision\n",
             "AR: " + "; ".join(f"{d} {min(v):.0f}–{max(v):.0f} tokens/s" for d, v in ar.items()) + ".\n",
             "| method | " + " | ".join(f"speedup in {d} | τ in {d}" for d in dtypes) + " |",
             "|---|" + "---|---|" * len(dtypes)]
    for name in names:
        cells = []
        for d in dtypes:
            row = by_dtype[d].get(name)
            cells += [speedup_cell(row, interval=False), f"{row['tau']:.2f}"] if row else ["–", "–"]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def block_run_sets(sets) -> str:
    """docs/headline.md: every committed run set."""
    lines = ["| run set | date | machine | questions | engine (commit) | methods | report |",
             "|---|---|---|---|---|---|---|"]
    for s in sets:
        methods = ", ".join(sorted({row["name"] for row in s["rows"]}))
        lines.append(f"| `{s['slug']}` | {s['date']} | {machine(s)} | {s['questions']} | `{s['settings']['engine']}` "
                     f"({', '.join(s['commits']) or 'unrecorded'}) | {methods} | {report_links(s, '../')} |")
    return "\n".join(lines) + "\n"


def block_quickstart(_sets) -> str:
    """README: what `make bench` printed when its committed run was made (results/reference/quickstart/),
    and how long its questions took."""
    summaries = sorted(QUICKSTART.rglob("summary.json"))
    if len(summaries) != 1:
        raise SystemExit(f"{QUICKSTART}: expected one committed `make bench` run, found {len(summaries)}")
    summary = json.loads(summaries[0].read_text())
    records = [
        r for name in ("ar", summary["method"]) for r in read_answers(summaries[0].parent / "answers" / f"{name}.jsonl")
    ]
    seconds = sum(sum(r["choices"][0]["wall_time"]) for r in records)
    printed = format_summary(summary).splitlines()
    end = next((i for i, line in enumerate(printed) if line.startswith("why, per decoding step")), 8)
    keep = ("caveats:", "tok/s:", "BUSY", "  ")  # dropped: the caveats in full, the tok/s footnote
    shown = "\n".join(line for line in printed[: end + 1] if not line.startswith(keep) or line.startswith("BUSY 0"))
    env = environment(summaries[0].parent)
    commit = (env.get("git") or {}).get("commit") or "unrecorded"
    return (f"```text\n{shown}\n…\n```\n\n({seconds / 60:.1f} min of answering, {summary['hardware']}, "
            f"engine `{env.get('decoding_code', 'unrecorded')}` (commit {commit[:7]}), {run_date(records)}.)\n")


# a model config's drafts.<kind>, in the order of the README's columns
DRAFT_COLUMNS = {"sps": "draft LM", "eagle": "EAGLE", "eagle3": "EAGLE-3", "medusa": "Medusa", "hydra": "Hydra",
                 "dflash": "DFlash", "pard": "PARD"}


def block_models(_sets) -> str:
    """docs/models.md: every model config, its target and the drafts it names (Hub ids; `ours`: trained by
    the suite, in drafts/), each column naming the methods that draft with it."""
    methods = [m for m in available_methods() if method_settings(m).__module__.startswith("methods.")]
    users = {kind: [m for m in methods if method_settings(m).draft_kind == kind] for kind in DRAFT_COLUMNS}
    unknown = {method_settings(m).draft_kind for m in methods} - set(DRAFT_COLUMNS) - {None}
    if unknown:
        raise SystemExit(f"draft kinds without a README column: {sorted(unknown)} (DRAFT_COLUMNS)")
    header = " | ".join(f"{name} ({', '.join(users[kind])})" for kind, name in DRAFT_COLUMNS.items())
    lines = [f"| `model=` | target | {header} |", "|" + "---|" * (2 + len(DRAFT_COLUMNS))]
    without = []  # models that name no draft: one line under the table
    models = {path.stem: OmegaConf.to_container(OmegaConf.load(path), resolve=True)
              for path in sorted((REPO / "conf" / "model").glob("*.yaml"))}
    for name, config in models.items():
        drafts = config.get("drafts") or {}
        if not any((drafts.get(kind) or {}).get("path") for kind in DRAFT_COLUMNS):
            without.append((name, config.get("path") or "embedded"))
            continue
        cells = [config.get("path") or "embedded"]
        for kind in DRAFT_COLUMNS:
            spec = (drafts.get(kind) or {}).get("path")
            # ours: trained by the suite into drafts/; "ours, untrained": the recipe exists, its draft not yet
            cells.append("–" if not spec else "ours" if (REPO / spec).is_dir() else
                         "ours, untrained" if str(spec).startswith("drafts/") else spec)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    free = [m for m in methods if method_settings(m).draft_kind is None]
    needs = {m: refused_models(m, models) for m in free}
    anywhere = ", ".join(f"`{m}`" for m in free if not needs[m])
    built = ", ".join(f"`{m}`" for m in free if needs[m])
    served = sorted(set(models) - set().union(*needs.values())) if any(needs.values()) else []
    return "\n".join(lines) + (f"\n\nWithout drafts: {name_list(without)}. Every model runs {anywhere}; ours: "
                               "`drafts/<model>/`." + (f" {built} need a datastore built from a corpus: "
                               f"{', '.join(f'`{m}`' for m in served)} build{'s' if len(served) == 1 else ''} "
                               "its own on first use; any other model is refused until one is built and passed "
                               "(`python -m methods.rest --help`, `python -m methods.sam --help`)." if built else "")
                               + "\n")


def refused_models(method: str, models: dict[str, dict]) -> set[str]:
    """The model configs (name: config) a method's default settings refuse (REST and SAM without a datastore)."""
    refused = set()
    for name, config in models.items():
        try:
            method_settings(method)().check_model({**config, "name": name})
        except ConfigError:
            refused.add(name)
    return refused


def name_list(pairs: list[tuple[str, str]]) -> str:
    """`name` = target for each model; models whose names and targets end alike share one entry,
    e.g. `cllm-7b-{math,spider}` = cllm/consistency-llm-7b-{…}."""
    ends = {}
    for name, target in pairs:
        cut = name.rfind("-") + 1
        if cut and target.endswith(name[cut:]):
            ends.setdefault((name[:cut], target[: len(target) - len(name) + cut]), []).append(name[cut:])
    if len(ends) == 1 and len(pairs) > 1:
        (name, target), tails = next(iter(ends.items()))
        return f"`{name}{{{','.join(tails)}}}` = {target}{{…}}"
    return ", ".join(f"`{name}` = {target}" for name, target in pairs)


def block_methods(_sets) -> str:
    """README: each method's paper, whether it is lossless, whether it batches (its draft: the models table)."""

    lines = ["| `method=` | paper (upstream code) | lossless | batch > 1 |", "|---|---|---|---|"]
    for m in available_methods():
        settings = method_settings(m)
        if not settings.__module__.startswith("methods."):
            continue
        batches = "yes" if settings.batchable else f"no: {settings().batch_problem()}"
        lines.append(f"| `{m}` | {settings.paper} | {settings.lossless} | {batches} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# Performance files (results/reference/perf/) and the batch sweep (results/reference/batch/)


def perf_files(prefix: str) -> list[dict]:
    """The committed `<prefix>-<hardware>-float32.json` files, one per machine class."""
    return [json.loads(f.read_text()) for f in sorted(PERF.glob(f"{prefix}-*.json"))]


NOTHING = "No run of it is committed yet (`results/reference/{}`): the command above writes one.\n"


def perf_machine(result: dict) -> str:
    env = result["environment"]
    commit = env.get("git", {}).get("commit", "")[:7] or "unrecorded"
    return f"{result['hardware']}, {env.get('cpu_count', '?')} cores, {result['dtype']}, commit {commit}"


def block_draft_split(_sets) -> str:
    """docs/performance.md: `python -m harness.perf.draft_split`, per machine class."""
    parts = []
    for result in perf_files("draft-split"):
        one = result["t1_seconds"]
        split = result["draft_split"]
        lines = [f"**{perf_machine(result)}**; t(1) {1000 * one:.2f} ms this run; every part in t(1):", "",
                 "| draft | follow | one level: inputs / layer / lm head / top-k | expansion | rerank | step | floor |",
                 "|---|---|---|---|---|---|---|"]
        for method in ("eagle2", "eagle3"):
            if method not in split:
                continue
            part, sec = split[method], split[method]["seconds"]
            level = " / ".join(f"{sec[p] / one:.3f}" for p in ("inputs", "layer", "lm head", "top-k"))
            heads, share = part["head_forwards"], part["forward_weight_share"]
            lines.append(f"| {method}, depth {part['depth']}, top-{part['top_k']} | {sec['follow'] / one:.3f} | "
                         f"{level} | {sec['expansion'] / one:.3f} | {sec['rerank'] / one:.3f} | "
                         f"**{part['step_seconds'] / one:.3f}** | {heads} × {share:.3f} = {heads * share:.3f} |")
        lm = split.get("draft LM")
        if lm:
            sec = lm["seconds"]
            lines += ["", f"Draft-LM token ({lm['draft_vocab'] or 'full'} vocabulary): "
                      f"**{lm['token_seconds'] / one:.3f}** t(1) = forward {sec['forward'] / one:.3f} + lm head "
                      f"{sec['lm head'] / one:.3f} + top-1 {sec['top-1'] / one:.3f}; its weights "
                      f"{lm['weight_share']:.3f} of the target's ({lm['whole_model_weight_share']:.3f} with its whole "
                      "LM head)."]
        blocks = [f"{method} **{part['step_seconds'] / one:.3f}** t(1) ({part['draft_tokens']} drafts, "
                  f"{part['forwards_per_step']:.2f} draft forwards a step, τ {part['tau']:.2f})"
                  for method, part in split.items() if method in ("dflash", "pard")]
        if blocks:
            lines += ["", "Block drafters, a step's draft as a greedy answer ran it: " + "; ".join(blocks) + "."]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts) or NOTHING.format("perf/draft-split-*.json")


def block_engine(_sets) -> str:
    """docs/performance.md: `make perf`, per machine class: the probe against the engine's own bandwidth,
    the target's forward against tokens per forward in fp32 and bf16w, AR's tokens/s in each and against
    `generate`."""
    parts = []
    for result in perf_files("engine"):
        curves = {name: {int(n): t for n, t in curve.items()}
                  for name, curve in result["forward_seconds_by_tokens"].items()}
        sizes = sorted(curves["auto"])
        labels = {"auto": f"engine, {result['dtype']}", "bf16w": "engine, bf16w",
                  "transformers": "transformers stack", "off": "transformers, F.linear"}
        lines = [f"**{perf_machine(result)}**"]
        probe, streamed = result.get("read_bandwidth_bytes_per_second"), result.get("engine_gemm_bytes_per_second")
        if probe:
            lines[0] += (f"; read bandwidth: probe {probe / 1e9:.1f} GB/s, the engine's GEMMs "
                         f"{(streamed or 0) / 1e9:.1f} GB/s")
        lines += ["", "| forward | t(1) ms | " + " | ".join(f"t({n}) / t(1)" for n in sizes[1:]) + " |",
                  "|---|---|" + "---|" * (len(sizes) - 1)]
        for name in ("auto", "bf16w", "transformers", "off"):
            if name in curves:
                curve = curves[name]
                lines.append(f"| {labels[name]} | {1000 * curve[1]:.1f} | "
                             + " | ".join(f"{curve[n] / curve[1]:.2f}" for n in sizes[1:]) + " |")
        speeds = result.get("tokens_per_second_median")
        if speeds:
            lines.append(f"\nOur AR {speeds['ar_ours']:.1f} tokens/s against `generate`'s {speeds['ar_generate']:.1f} "
                         f"({result['ratio_ar_ours_over_generate']:.2f}×), {result['prompts']} Spec-Bench prompts × "
                         f"{result['max_new_tokens']} tokens, median of {result['repeats']}.")
        table = (result.get("peers") or {}).get("table")
        if table:
            lines += ["", "| engine | " + " | ".join(title for title, _, _ in PEER_COLUMNS) + " |",
                      "|---|" + "---|" * len(PEER_COLUMNS)]
            lines += ["| " + " | ".join([row["engine"], *("–" if row.get(key) is None else fmt.format(row[key])
                                                          for _, key, fmt in PEER_COLUMNS)]) + " |" for row in table]
            notes = sorted({row["note"] for row in table if row.get("note")})
            lines += [""] + [f"Skipped: {note}." for note in notes] if notes else []
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts) or NOTHING.format("perf/engine-*.json")


def block_mixed_lengths(_sets) -> str:
    """docs/batching.md: `make perf-batch`, per machine class."""
    parts = []
    for result in perf_files("batch-lengths"):
        lines = [f"**{perf_machine(result)}**; prompts of {', '.join(map(str, result['prompt_lengths']))} tokens, "
                 f"{result['max_new_tokens']} new tokens at most, greedy, median of {result['repeats']} rounds "
                 "(tokens/s):", "",
                 f"| method | B = {len(result['prompt_lengths'])} | one at a time | ratio | decoding only: B | "
                 "one at a time | ratio | same tokens |",
                 "|---|---|---|---|---|---|---|---|"]
        for method, r in result["methods"].items():
            m = r["median_tokens_per_second"]
            lines.append(f"| {method} | {m['batch']:.1f} | {m['alone']:.1f} | **{r['batch_over_alone']:.2f}×** | "
                         f"{m['batch decoding']:.1f} | {m['alone decoding']:.1f} | "
                         f"{r['decoding_batch_over_alone']:.2f}× | {'yes' if r['same_tokens'] else 'NO'} |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts) or NOTHING.format("perf/batch-lengths-*.json")


def block_batch_curve(_sets) -> str:
    """docs/batching.md: the committed batch sweep (results/reference/batch/): each method's throughput at
    each batch size beside the AR run at the same batch size, a row per method variant (the headline's
    `sam` and `sam auxiliary=eagle2`), and the figure of its speedups (`make figures`)."""
    with contextlib.chdir(REPO):
        runs = find_runs([BATCH]) if BATCH.is_dir() else []
    if not runs:
        return NOTHING.format("batch/")
    # a variant by its settings, not by the size each job's own latency curve chose for `auto`
    rows = [SimpleNamespace(method=run.summary["method"], summary=run.summary, env=environment(str(run.path)),
                            config={k: v for k, v in (run.summary.get("method_config") or {}).items()
                                    if k not in method_settings(run.summary["method"]).size_keys()})
            for run in runs]
    cells: dict[str, dict[int, str]] = {}
    sizes = set()
    for row in rows:
        summary, batch = row.summary, row.summary.get("batch_size", 1)
        sizes.add(batch)
        d, b = summary["decoder"], summary["baseline"]
        cells.setdefault(variant_name(row, rows), {})[batch] = (
            f"{d['throughput_tokens_per_second']:.1f} vs AR {b['throughput_tokens_per_second']:.1f}: "
            f"**{summary['throughput_speedup']:.2f}×** (τ {d['tau']:.2f})")
    first, env = rows[0].summary, rows[0].env
    commits = ", ".join(sorted({r.env.get("git", {}).get("commit", "")[:7] for r in rows} - {""})) or "unrecorded"
    lines = [f"**{first['hardware']}, {env.get('cpu_count', '?')} cores, {first['dtype']}**, commit {commits}; "
             f"{first['questions']} Spec-Bench questions (ids {', '.join(map(str, first['question_ids']))}), "
             f"{first['max_new_tokens']} new tokens, greedy; throughput (tokens over the batches' wall time) of the "
             "method against the AR run beside it:", "",
             "| method | " + " | ".join(f"B = {n}" for n in sorted(sizes)) + " |",
             "|---|" + "---|" * len(sizes)]
    for name, row in sorted(cells.items()):
        method = name.split()[0]
        refused = "" if method_settings(method).batchable else "does not batch"
        lines.append(f"| {name} | " + " | ".join(row.get(n, refused) for n in sorted(sizes)) + " |")
    with contextlib.chdir(REPO):
        slugs = [c.slug for c in find_curves(build_tables(runs)) if c.axis == "batch_size"]
    figures = [REPO / "plots" / "reference" / slug / "speedup_vs_batch_size.png" for slug in slugs]
    for figure in figures:
        if not figure.is_file():
            raise SystemExit(f"{figure}: missing (make figures RUNS=results/reference/batch)")
        lines += ["", f"![throughput speedup against batch size](../{figure.relative_to(REPO)})"]
    return "\n".join(lines) + "\n"


def block_batchable(_sets) -> str:
    """docs/batching.md: the methods whose settings batch (`Settings.batchable`), and those that refuse a batch."""
    methods = [m for m in available_methods() if method_settings(m).__module__.startswith("methods.")]
    yes = [m for m in methods if method_settings(m).batchable]
    no = [m for m in methods if not method_settings(m).batchable]
    return (f"`batch_size` > 1 runs with {', '.join(f'`{m}`' for m in yes)}; a setting a batch cannot take "
            "(PLD's `branches` > 1) is refused in one line before the model loads.\n\n"
            + "".join(f"`{m}` refuses a batch size above 1 before the model loads: "
                      f"{method_settings(m)().batch_problem()}.\n" for m in no))


def block_serving(_sets) -> str:
    """docs/serving.md: the committed serving runs (results/reference/serve/), per group of runs that served
    the same prompts with the same speculation policy: each method's throughput and TPOT p50 beside AR's at
    each load, and the group's figures (`make serve-sweep`'s report)."""
    runs = find_serve_runs([SERVE]) if SERVE.is_dir() else []
    if not runs:
        return NOTHING.format("serve/")
    envs = [json.loads((run / "environment.json").read_text()) for run in runs]
    commits = ", ".join(sorted({env.get("git", {}).get("commit", "")[:7] for env in envs} - {""})) or "unrecorded"
    dirty = " (uncommitted changes)" if any(env.get("git", {}).get("dirty") for env in envs) else ""
    lines = [f"**{hardware_name(envs[0])}, {envs[0].get('cpu_count', '?')} cores**, commit {commits}{dirty}; "
             "greedy; each method beside the AR point measured next to it.", ""]
    for key, members in groups(runs).items():
        settings = read_settings(members[0])
        loads = sorted({p["load"]["concurrency"] for p in read_points(members[0]) if p["load"]["loop"] == "closed"})
        rate = settings["serve"]["rate"]
        how = (f"closed loops at c = {', '.join(map(str, loads))}" if loads else
               f"an open loop, Poisson arrivals at {rate:g} requests/s, at most {max(settings['serve']['concurrency'])}"
               " decoding at once")
        lines += [f"### {key[0]}, {policy(key[1])}", "",
                  f"{settings['dtype']}, {settings['model']['name']}, {len(settings['questions'])} "
                  f"{settings['dataset']['name']} prompts, {settings['serve']['requests']} requests per point, "
                  f"{settings['max_new_tokens']} new tokens at most; {how}.", "", group_table(members), ""]
        for name, what in (("speedup_vs_concurrency", "output tokens/s over AR's against concurrency"),
                           ("throughput_vs_tpot", "output tokens/s against TPOT p50"))[: 2 if loads else 0]:
            figure = SERVE_PLOTS / group_folder(key) / f"{name}.png"
            if not figure.is_file():
                raise SystemExit(f"{figure}: missing (make serve-sweep's report: python -m harness.reporting.serving "
                                 "results/reference/serve --out results/reference/serve/report "
                                 "--plots plots/reference/serving)")
            lines += [f"![{key[0]}, {policy(key[1])}: {what}](../{figure.relative_to(REPO)})", ""]
    return "\n".join(lines) + "\\* measured partly on a busy machine.\n"


def block_block_drafts(_sets) -> str:
    """docs/drafts.md: the block drafters' drafts of the embedded model (DFlash, PARD), each row from its
    `training.json`, `config.json` and the manifest of the corpus it was trained on."""
    lines = ["| draft | what is trained | data | training | held-out top-1 agreement per draft position, before → "
             "after | file |", "|---|---|---|---|---|---|"]
    for kind in ("dflash", "pard"):
        folder = DRAFTS / kind
        if not (folder / "training.json").is_file():
            lines.append(f"| `{kind}` | not trained yet: `make train-block-drafts` | | | | |")
            continue
        run = json.loads((folder / "training.json").read_text())
        config = json.loads((folder / "config.json").read_text())
        args = run["args"]
        if kind == "dflash":
            ids = config["dflash_config"]["target_layer_ids"]
            what = (f"{config['num_hidden_layers']} decoder layers (from the target's last) + fc over the outputs of "
                    f"layers {', '.join(map(str, ids))} + norm; blocks of {config['block_size']} (mask id "
                    f"{config['dflash_config']['mask_token_id']}), {args['anchors']} anchored blocks per conversation")
        else:
            what = (f"the draft LM (`draft-lm`) adapted by conditional drop-token: {args['para_num']} tokens per "
                    f"position, mask id {config['pard_token']}")
        data = REPO / args["data"] if args.get("data") else default_corpus(args["model"])
        manifest = corpus_manifest(args["model"], data)
        corpus = json.loads(manifest.read_text()) if manifest.is_file() else {}
        source = (f"{run['train']:,} conversations ({run['held_out']} held out) of `{manifest.relative_to(REPO)}`: "
                  f"{corpus['prompts']:,} prompts, {corpus['answer_tokens']:,} answer tokens" if corpus else
                  f"{run['train']:,} conversations ({run['held_out']} held out)")
        agree = " / ".join(f"{run['held_out_acceptance_before'][k]:.2f} → **{v:.2f}**"
                           for k, v in run["held_out_acceptance"].items())
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
        epochs = f"{args['epochs']:g} epoch{'' if args['epochs'] == 1 else 's'}"
        lines.append(f"| `{kind}` | {what} | {source} | {epochs}, {run['steps']} steps of "
                     f"{run['batch']}, lr {args['lr']:g}, {run['seconds'] / 60:.0f} min on {run['machine']} | "
                     f"{agree} | {size:.0f} MB |")
    return "\n".join(lines) + "\n"


BLOCKS = {"figure": block_figure, "batchable": block_batchable, "reference": block_reference, "latest": block_latest,
          "run-sets": block_run_sets,
          "quickstart": block_quickstart, "models": block_models, "methods": block_methods,
          "draft-split": block_draft_split, "engine": block_engine, "mixed-lengths": block_mixed_lengths,
          "batch-curve": block_batch_curve, "serving": block_serving, "block-drafts": block_block_drafts}


def fill(text: str, blocks: dict[str, str], where: Path) -> str:
    """The text with every generated block's body replaced by what the generator writes."""
    def body(match):
        name = match["name"]
        if name not in blocks:
            raise SystemExit(f"{where}: unknown generated block {name!r}; known: {', '.join(blocks)}")
        return match["open"] + blocks[name] + match["close"]

    return BLOCK.sub(body, text)


def expected_files() -> dict[Path, str]:
    """Every generated file and the text it should hold."""
    sets = run_sets()
    blocks: dict[str, str] = {}
    files = {}
    for document in DOCUMENTS:
        text = document.read_text()
        for name in {m["name"] for m in BLOCK.finditer(text)} - set(blocks):
            if name in BLOCKS:
                blocks[name] = BLOCKS[name](sets)
        files[document] = fill(text, blocks, document)
    return files | method_configs.expected_files()


def stale_files(files: dict[Path, str]) -> list[Path]:
    """The files whose text differs from what the generator writes."""
    return [path for path, text in files.items() if not path.is_file() or path.read_text() != text]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args()
    files = expected_files()
    stale = stale_files(files)
    if args.check:
        if stale:
            print("stale (run `make docs`): " + ", ".join(str(p.relative_to(REPO)) for p in stale), file=sys.stderr)
            raise SystemExit(1)
        print(f"{len(files)} generated files up to date")
        return
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
