"""The run figures of README.md and docs/headline.md are written by `make docs`
(scripts/generate_docs.py) from the committed results: a generated block that differs from what the
generator writes, a hand-edited number included, fails here."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def generator():
    sys.path.insert(0, str(REPO / "scripts"))  # the generator imports scripts/method_configs.py
    try:
        spec = importlib.util.spec_from_file_location("generate_docs", REPO / "scripts" / "generate_docs.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "scripts"))


@pytest.fixture(scope="module")
def expected(generator):
    return generator.expected_files()


def test_every_generated_file_is_up_to_date(generator, expected):
    stale = [str(path.relative_to(REPO)) for path in generator.stale_files(expected)]
    assert not stale, f"stale generated docs: {stale}; run `make docs`"


def test_readme_and_headline_carry_the_generated_blocks(generator, expected):
    readme, headline = expected[REPO / "README.md"], expected[REPO / "docs" / "headline.md"]
    names = lambda text: {m["name"] for m in generator.BLOCK.finditer(text)}  # noqa: E731
    assert names(readme) == {"figure", "quickstart", "methods", "reference"}
    assert names(expected[REPO / "docs" / "models.md"]) == {"models"}
    assert names(headline) == {"latest", "run-sets"}
    for match in generator.BLOCK.finditer(readme + headline):
        assert match["body"].strip(), f"block {match['name']} is empty"


def test_a_hand_edited_number_is_caught_and_rewritten(generator, expected, tmp_path):
    readme = expected[REPO / "README.md"]
    block = next(m for m in generator.BLOCK.finditer(readme) if m["name"] == "reference")
    number = re.search(r"\d\.\d\d×", block["body"])
    edited_body = block["body"][: number.start()] + "9.99×" + block["body"][number.end():]
    edited = readme[: block.start("body")] + edited_body + readme[block.end("body"):]
    copy = tmp_path / "README.md"
    copy.write_text(edited)
    assert generator.stale_files({copy: readme}) == [copy]
    blocks = {m["name"]: m["body"] for m in generator.BLOCK.finditer(readme)}
    assert generator.fill(edited, blocks, copy) == readme  # `make docs` puts the measured number back


def test_an_unknown_block_is_refused(generator, tmp_path):
    text = "<!-- generated: speedups (make docs) -->\n1.5×\n<!-- end generated: speedups -->\n"
    with pytest.raises(SystemExit, match="unknown generated block 'speedups'"):
        generator.fill(text, {"reference": ""}, tmp_path / "x.md")


def test_the_reference_table_is_the_newest_headline_run_set(generator):
    sets = generator.headline_sets(generator.run_sets())
    newest = sets[0]
    assert all(s["date"] <= newest["date"] for s in sets)
    body = generator.block_reference(generator.run_sets())
    for row in newest["rows"]:  # every method of that run set, its speedup and τ as the report computes them
        assert f"| `{row['name']}` | {row['speedup']:.2f}×" in body and f"| {row['tau']:.2f} |" in body


def test_the_readme_stays_within_10_kib():
    """Room for the two commands, their prerequisites, what has run on a GPU, and the generated tables."""
    size = len((REPO / "README.md").read_bytes())
    assert size <= 10240, f"README.md is {size} bytes; keep it within 10 KiB (details belong in docs/)"
