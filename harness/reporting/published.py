"""Our numbers beside the published ones, where a run set's settings match a published setting:
`make report` writes them as `<table>/published.md` and into `report.md`.

The published tables are data (`docs/published/*.json`, each with its source: repository, file and
commit, or paper): Spec-Bench's leaderboard (A100: Vicuna-7B/13B/33B; RTX 3090: Vicuna-7B) and
the EAGLE-2 paper's Vicuna-7B table. A table of `make report` (one model, dataset, dtype, sampling,
max_new_tokens and question set) gets a comparison when the published file's setting agrees:
the model, the dtype, greedy or not, max_new_tokens where the source states it, and the number of
questions (Spec-Bench: all 480). Hardware is not part of the match: each comparison names the
published hardware and ours. Per method and published column (Spec-Bench's six tasks, where its
"Multi-turn Conversation" is the 8 MT-bench categories, and overall), our speedup is Spec-Bench's
form over those questions (`harness.stats.speedup_stats`) and our τ the suite's
(`harness.stats.decoder_stats`), beside the published value and the ratio ours ÷ published.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.stats import busy_questions, caveats, compare_outputs, decoder_stats, speedup_stats
from harness.stats.text import caveat_note
from methods.models.specs import PROJECT_ROOT as REPO

PUBLISHED = REPO / "docs" / "published"


@dataclass(frozen=True)
class Published:
    """One published table: its source, the setting it was measured in and, per method, the metrics."""

    id: str
    title: str
    source: str
    hardware: str
    model: str
    setting: dict      # questions: {dataset: n}, max_new_tokens, sampling, dtype (None = not stated)
    columns: dict      # column -> {dataset, categories (absent = all)}
    # method -> {"speedup": {column: x}, "tau": {column: x}}, and "settings" where the published row is
    # one variant of our method (Spec-Bench's samd: our sam with auxiliary=eagle2)
    methods: dict

    def numbers(self, method: str, config: dict) -> dict | None:
        """The published metrics of a run of `method` with `config` (its recorded settings), if any."""
        numbers = self.methods.get(method)
        if not numbers or any(config.get(k) != v for k, v in (numbers.get("settings") or {}).items()):
            return None
        return numbers


def load(folder: Path = PUBLISHED) -> list[Published]:
    tables = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        for t in data["tables"]:
            tables.append(Published(t["id"], t["title"], t["source"], t["hardware"], t["model"],
                                    data["setting"], data["columns"], t["methods"]))
    return tables


def matches(settings: dict, questions: int, published: Published) -> bool:
    """Whether a report table (its `settings`, `questions` answered) ran the published setting."""
    setting = published.setting
    dataset = settings["dataset"]
    wanted_questions = (setting.get("questions") or {}).get(dataset)
    return (settings["model"] == published.model
            and any(c["dataset"] == dataset for c in published.columns.values())
            and settings["sampling"] == setting.get("sampling", "greedy")
            and setting.get("dtype") in (None, settings["dtype"])
            and setting.get("max_new_tokens") in (None, settings["max_new_tokens"])
            and wanted_questions in (None, questions))


def comparisons(table, published: list[Published] | None = None) -> list[tuple[Published, list[dict]]]:
    """For a `harness.reporting.tables.Table`: per matching published table, one line per (method variant,
    column) that both report."""
    published = load() if published is None else published
    out = []
    for pub in published:
        if not matches(table.settings, len(table.questions), pub):
            continue
        lines = []
        for label, row in table.rows.items():
            numbers = pub.numbers(row.method, row.config)
            if not numbers:
                continue
            for column, spec in pub.columns.items():
                if spec["dataset"] != table.settings["dataset"]:
                    continue
                keys = [k for k, r in row.records.items()
                        if not spec.get("categories") or r["category"] in spec["categories"]]
                if not keys:
                    continue
                records, baseline = [row.records[k] for k in keys], [row.baseline[k] for k in keys]
                speed, tau = speedup_stats(records, baseline, reps=200), decoder_stats(records)["tau"]
                ours = {"speedup": speed["specbench"], "tau": tau}
                lossless = row.config.get("lossless", True)
                caveat = caveats(speed, tau, compare_outputs(records, baseline, table.settings, lossless),
                                 busy_questions(records, baseline), lossless)
                theirs = {m: numbers.get(m, {}).get(column) for m in ("speedup", "tau")}
                lines.append(
                    {
                        "method": label,
                        "column": column,
                        "questions": len(keys),
                        **{
                            f"{kind}_{m}": value
                            for m in ours
                            for kind, value in (("ours", ours[m]), ("published", theirs[m]))
                        },
                        "speedup_ratio": ours["speedup"] / theirs["speedup"]
                        if ours["speedup"] and theirs["speedup"]
                        else None,
                        "caveats": caveat_note(caveat),
                    }
                )
        if lines:
            out.append((pub, lines))
    return out


def _x(value, suffix="") -> str:
    return "–" if value is None else f"{value:.2f}{suffix}"


def markdown(table, published: list[Published] | None = None) -> str:
    """The comparison section of a report table ("" when no published setting matches)."""
    sections = []
    for pub, lines in comparisons(table, published):
        head = (
            f"**Published: {pub.title}** — {pub.source}; {pub.hardware}. Ours: {table.settings['hardware']}, "
            f"{table.settings['dtype']}, n = {len(table.questions)}, max_new_tokens {table.settings['max_new_tokens']}."
        )
        rows = ["| method | column | n | speedup | published | ours ÷ published | τ | published τ | our caveats |",
                "|" + "---|" * 9]
        rows += [f"| {r['method']} | {r['column']} | {r['questions']} | {_x(r['ours_speedup'], '×')} | "
                 f"{_x(r['published_speedup'], '×')} | {_x(r['speedup_ratio'])} | {_x(r['ours_tau'])} | "
                 f"{_x(r['published_tau'])} | {r['caveats']} |" for r in lines]
        sections.append("\n".join([head, "", *rows]))
    return "\n\n".join(sections)
