"""The docs speak to users only and say only what ran: no line that narrates how the suite was built
(who ran what, when, on which borrowed machine, under which ticket), no run figure that no committed
file holds, no hand-written list of the methods that batch, and no committed reference run measured
on a tree with uncommitted changes."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GENERATED = re.compile(r"<!-- generated: (?P<name>[\w-]+)[^>]*-->\n.*?<!-- end generated: (?P=name) -->", re.S)

# --- A manual, not a diary ----------------------------------------------------------------------------

NARRATION = [
    (r"\b(?:issue|ticket|task)s?\s+#?\d+", "a ticket number"),
    (r"(?<![\w/&`(\[#])#\d{2,4}\b(?![\w-])", "a ticket number"),
    (r"\blent\b", "a lent machine"),
    (r"\bborrowed\b", "a borrowed machine"),
    (r"\b(?:first|second|third|fourth|fifth|this|last|previous|next|earlier|later)\s+session\b",
     "a development session"),
    (r"\b(?:development|GPU|CI|device)\s+session\b", "a development session"),
    (r"\bsession'?s\s+(?:machine|time|budget|device)\b", "a development session"),
    (r",\s*latest\)", "a dated entry"),
    (r"performance-history", "the development diary"),
]
# A doc line, a Makefile line or a comment of the code that any of these match fails.
NARRATED_FILES = [*DOCS, REPO / "Makefile", REPO / "pyproject.toml",
                  *sorted(p for folder in ("methods", "harness", "scripts", "conf", "hydra_plugins", "data_scripts")
                          for p in (REPO / folder).rglob("*")
                          if p.suffix in (".py", ".c", ".yaml", ".md", ".sh") and "__pycache__" not in p.parts)]


def narrated(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in NARRATION:
            if re.search(pattern, line, re.I):
                found.append(f"{number}: {what}: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("path", NARRATED_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_nothing_narrates_the_development(path):
    found = narrated(path.read_text(errors="replace"))
    assert not found, f"{path.relative_to(REPO)} narrates its own development:\n  " + "\n  ".join(found)


def test_the_narration_check_catches_a_diary():
    assert narrated("## The batch cut (2026-11-28, fourth session, latest)")
    assert narrated("measured on a lent H200") and narrated("issue 35's targets") and narrated("see #49")
    assert narrated("Issue 36's curves") and narrated("as this session found") and narrated("### A GPU session")
    assert not narrated("a process session (`start_new_session=True`); the session that measured it; job #0")
    assert not narrated("#define A(m) a##m##0 = x; show(latest)")
    assert not narrated("see [the link](docs/x.md#the-loop) and `#include <immintrin.h>`")


# --- Every run figure traceable -----------------------------------------------------------------------

FIGURE = re.compile(r"(?<![\w.])(?:\d+(?:\.\d+)?(?:×|\s?(?:ms\b|tok/s|tokens/s|GB/s)|%(?! (?:interval|CI|confidence)))"
                    r"|\d+\.\d+x\b)")
TRACE = re.compile(r"(?<![\w/.-])((?:results|drafts)/[\w./<>*{}-]*[\w/])")
# a figure quoted from a paper or an upstream page, with its citation in the same paragraph
CITATION = re.compile(r"\bet al\.|arXiv|https?://|\((?:19|20)\d\d\)|\bpaper\b|\breports?\b|\breported\b", re.I)


def paragraphs(text: str):
    """(first line number, paragraph) for each run of non-blank lines outside the generated blocks
    (a table is one paragraph, as are a heading and the lines under it up to a blank line)."""
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    start, lines = None, []
    for number, line in enumerate(text.splitlines() + [""], 1):
        if line.strip():
            start = start or number
            lines.append(line)
        elif lines:
            yield start, "\n".join(lines)
            start, lines = None, []


def untraceable(text: str) -> list[str]:
    found = []
    for number, paragraph in paragraphs(text):
        figures = FIGURE.findall(paragraph)
        if not figures or CITATION.search(paragraph):
            continue
        paths = [p for p in TRACE.findall(paragraph) if not re.search(r"[<>*{}]", p)]
        if not any((REPO / p).exists() for p in paths):
            found.append(f"line {number}: {', '.join(figures[:4])} (cites {paths or 'no committed file'})")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_run_figure_outside_a_generated_block_cites_its_file(doc):
    found = untraceable(doc.read_text())
    assert not found, (f"{doc.relative_to(REPO)}: run figures outside a generated block that cite no committed "
                       "file under results/ or drafts/ in their paragraph:\n  " + "\n  ".join(found))


def test_the_trace_check_catches_a_typed_number():
    assert untraceable("AR runs at 66.0 tokens/s here.\n")
    assert untraceable("| a | b |\n|---|---|\n| x | 1.25× |\n")
    assert untraceable("PLD gains 1.31x.\n\nSee results/reference/smollm2-135m.\n")  # another paragraph
    assert not untraceable("PLD gains 1.31× (results/reference/smollm2-135m).\n")
    assert untraceable("PLD gains 1.31× (results/reference/no-such-run).\n")
    assert not untraceable("EAGLE-3 reports 6.5× (Li et al. 2025).\n")
    assert not untraceable("<!-- generated: x -->\n1.31×\n<!-- end generated: x -->\n")
    assert not untraceable("questions 1 to 80, 2 cores, a 95% interval, 4 × 64 tokens\n")


# --- One list of the methods that batch ---------------------------------------------------------------


def batchable() -> set[str]:
    from methods.base import available_methods, method_settings
    return {m for m in available_methods() if method_settings(m).batchable}


def test_no_hand_written_list_of_the_methods_that_batch():
    """A sentence about batching that names three or more methods is a list of those that batch: it must be
    generated from the settings classes (inside a generated block) or not be there."""
    from methods.base import available_methods
    methods = set(available_methods())
    found = []
    for doc in [*DOCS, REPO / "conf" / "config.yaml", REPO / "pyproject.toml"]:
        text = GENERATED.sub("", doc.read_text())
        for sentence in re.split(r"(?<=[.;:])\s+|\n\s*\n", text):
            if not re.search(r"\bbatch(?:es|able|ed)?\b|batch_size|batch size", sentence, re.I):
                continue
            named = {m for m in re.findall(r"`?\b([a-z][a-z0-9]+)\b`?", sentence) if m in methods} - {"ar"}
            listed = set(re.findall(r"`([a-z][a-z0-9]+)`", sentence)) & methods
            if len(listed) >= 3 or (doc.suffix == ".yaml" and len(named) >= 3):
                found.append(f"{doc.relative_to(REPO)}: {sentence.strip()[:140]}")
    assert not found, "hand-written lists of methods beside batching (generate them or remove them):\n  " + \
        "\n  ".join(found)


def test_the_generated_batch_list_is_the_settings():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import generate_docs
    finally:
        sys.path.remove(str(REPO / "scripts"))
    body = generate_docs.block_batchable(None)
    assert set(re.findall(r"`([a-z0-9]+)`", body.split(";")[0])) == batchable()


# --- Reference runs from clean commits ----------------------------------------------------------------


def test_every_committed_reference_run_comes_from_a_clean_commit():
    dirty = []
    for path in sorted((REPO / "results" / "reference").rglob("environment.json")):
        env = json.loads(path.read_text())
        if env.get("git", {}).get("dirty", env.get("dirty")) is not False:
            dirty.append(str(path.parent.relative_to(REPO)))
    for path in sorted((REPO / "results" / "reference" / "perf").glob("*.json")):  # `make perf`'s files
        if (json.loads(path.read_text()).get("environment") or {}).get("git", {}).get("dirty") is True:
            dirty.append(str(path.relative_to(REPO)))
    assert not dirty, "reference runs measured on a dirty tree (rerun them from a clean commit):\n  " + \
        "\n  ".join(dirty)
