"""Lists in the docs that name what the code registers: a method, model or method file added without
its line in the docs fails here."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from methods.base import available_methods, method_origin
from tests.conftest import REPO

DOCS = REPO / "docs"


def suite_methods() -> set[str]:
    """The registry's methods, less those a test registered (tests/test_add_a_method.py)."""
    return {name for name in available_methods() if method_origin(name).startswith("methods.")}


def test_benchmarks_md_lists_every_registered_method():
    row = re.search(r"`method=([^`]+)`", (DOCS / "benchmarks.md").read_text()).group(1)
    listed = row.replace("\\|", "|").split("|")
    assert set(listed) == suite_methods() and len(listed) == len(set(listed))


def test_benchmarks_md_lists_every_model_config():
    row = next(line for line in (DOCS / "benchmarks.md").read_text().splitlines() if line.startswith("| `model=…`"))
    listed = {name for name in re.findall(r"`([^`]+)`", row.split("|")[2]) if "/" not in name}
    assert listed == {path.stem for path in (REPO / "conf" / "model").glob("*.yaml")}


def test_architecture_md_lists_every_module_and_no_other():
    """docs/architecture.md has a line for every module of methods/, harness/ and hydra_plugins/ (and
    native.c), and names no module of theirs that is gone."""
    text = (DOCS / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `((?:methods|harness|hydra_plugins)/[\w/]+\.(?:py|c))` \|", text, re.M))
    modules = {str(path.relative_to(REPO)) for folder in ("methods", "harness", "hydra_plugins")
               for path in (REPO / folder).rglob("*") if path.suffix in (".py", ".c")
               and "__pycache__" not in path.parts}
    assert modules - listed == set(), f"modules without their line in docs/architecture.md: {sorted(modules - listed)}"
    assert listed - modules == set(), f"docs/architecture.md lists modules that are gone: {sorted(listed - modules)}"


# --- Docs that point at nothing ---------------------------------------------------------------------
# Every `make <target>`, `python -m <module>`, script path, conf/ path and relative Markdown link named
# in README.md and docs/*.md must exist. Written to hold for any rewrite of those files, not for their
# present text.


DOC_FILES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
PLACEHOLDER = re.compile(r"[*<>…{}$]|\.\.\.")
MAKE_OPTIONS_WITH_ARG = {"-C", "-f", "-I", "-o", "-W", "--directory", "--file", "--makefile"}
SHELL_SEPARATORS = {"&&", "||", ";", "|", "(", ")", "\\", ">", ">>", "2>", "2>&1", "<", "&>"}


def split_markdown(text: str) -> tuple[list[str], list[str], str]:
    """(fenced code blocks, inline code spans, prose with both blanked out)."""
    blocks = [match.group(2) for match in FENCE.finditer(text)]
    rest = FENCE.sub("\n", text)
    spans = SPAN.findall(rest)
    return blocks, spans, SPAN.sub(" ", rest)


def makefile_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        match = re.match(r"^([^\s#:=][^:=]*?)\s*::?(?!=)", line)
        if match and not line.startswith("\t"):
            targets.update(name for name in match.group(1).split() if "$" not in name)
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
    return targets - {".PHONY"}


def shell_words(line: str) -> list[str]:
    try:
        lexer = shlex.shlex(line, posix=True)
        lexer.whitespace_split, lexer.commenting = True, True
        return list(lexer)
    except ValueError:  # an unbalanced quote (a span cut mid-command): drop the quoted tail
        return re.sub(r"#.*", "", re.sub(r"\"[^\"]*\"?|'[^']*'?", "X", line)).split()


def make_targets_named(code: str) -> set[str]:
    """The targets of every `make ...` command in a piece of code: `make bench METHOD=sps`,
    `make -n headline`, `make setup && make bench`, `make report RUNS=…  # comment`."""
    named = set()
    for line in code.replace("\\\n", " ").splitlines():
        words = shell_words(line)
        for start, word in enumerate(words):
            if word != "make" or (start and words[start - 1] not in SHELL_SEPARATORS | {"$", "sudo"}):
                continue
            skip = False
            for arg in words[start + 1:]:
                if arg in SHELL_SEPARATORS or arg.endswith(";") or re.match(r"\d?[<>]", arg):
                    break
                if skip:
                    skip = False
                elif arg.startswith("-"):
                    skip = arg in MAKE_OPTIONS_WITH_ARG
                elif "=" not in arg and not PLACEHOLDER.search(arg):
                    named.add(arg)
    return named


def repo_module_exists(module: str) -> bool:
    path = REPO.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def github_slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (and any <a id/name> in it)."""
    slugs, seen = set(), {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("\n", markdown), re.M):
        heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        heading = re.sub(r"<[^>]+>", "", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    slugs.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", markdown))
    return slugs


def broken_references(doc) -> list[str]:
    text = doc.read_text()
    blocks, spans, prose = split_markdown(text)
    code = blocks + spans
    broken = []

    targets = makefile_targets()
    named = set().union(*(make_targets_named(piece) for piece in code))
    # in prose only a hyphenated word after "make" is surely a target ("make the step faster" is English)
    named |= set(re.findall(r"\bmake (\w+(?:-\w+)+)\b", prose))
    broken += [f"make {target}: no such Makefile target" for target in sorted(named - targets)]

    everything = "\n".join([*code, prose])
    for module in sorted(
        set(re.findall(r"\b(?:python[\d.]*|torchrun(?:\s+--?[\w-]+(?:=\S+)?)*)\s+-m\s+([A-Za-z_][\w.]*)", everything))
    ):
        module = module.rstrip(".")
        top = module.split(".")[0]
        if (REPO / top).is_dir() or (REPO / f"{top}.py").is_file():
            if not repo_module_exists(module):
                broken.append(f"python -m {module}: no such module in the repository")
        elif importlib.util.find_spec(top) is None:
            broken.append(f"python -m {module}: not importable")

    paths = set(re.findall(r"\bpython[\d.]*\s+([\w./-]+\.py)\b", everything))
    paths |= set(re.findall(r"(?<![\w/.])(scripts/[\w./-]*\w)", everything))
    paths |= set(re.findall(r"(?<![\w/.])(conf/[^\s`'\"),;:|\]]*)", everything))
    for path in sorted(paths):
        path = path.rstrip(".")
        if not PLACEHOLDER.search(path) and not (REPO / path).exists():
            broken.append(f"{path}: no such file")

    links = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    links += re.findall(r"^[ \t]*\[[^\]]+\]:[ \t]*(\S+)", prose, re.M)
    for link in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (doc.parent / target).resolve() if target else doc
        if not file.exists():
            broken.append(f"[...]({link}): {target} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in github_slugs(file.read_text()):
            broken.append(f"[...]({link}): no heading #{anchor} in {file.relative_to(REPO)}")
    return broken


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda doc: str(doc.relative_to(REPO)))
def test_docs_point_at_nothing_that_is_not_there(doc):
    broken = broken_references(doc)
    assert not broken, f"{doc.relative_to(REPO)} names what does not exist:\n  " + "\n  ".join(broken)


def test_reference_extraction():
    """The extraction the test above relies on finds what it should."""
    assert make_targets_named('make bench METHOD=pld ARGS="batch_size=4 x=y"') == {"bench"}
    assert make_targets_named("make setup && make bench     # install, then make nothing") == {"setup", "bench"}
    assert make_targets_named("make -n headline HEADLINE=vicuna-7b") == {"headline"}
    assert make_targets_named("make -C . report RUNS=results/.multirun/<stamp> \\\n  ARGS=x") == {"report"}
    assert make_targets_named('make perf ARGS="--dtype float32') == {"perf"}
    assert make_targets_named("make bench > log; make>out") == {"bench"}
    assert make_targets_named("make") == set() and make_targets_named("cmake build") == set()
    assert {"bench", "perf-gpu", "train-drafts", "setup"} <= makefile_targets()
    assert "the-step-on-a-gpu-static-steps-and-cuda-graphs-methodsenginegraphspy-make-perf-gpu" in github_slugs(
        "## The step on a GPU: static steps and CUDA graphs (`methods/engine/graphs.py`, `make perf-gpu`)")
    assert github_slugs("# A\n```\n# not a heading\n```\n# A\n") == {"a", "a-1"}
