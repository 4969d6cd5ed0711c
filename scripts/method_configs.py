"""Writes what follows from the methods' settings classes: `conf/method/<name>.yaml` of every method
of the suite and the settings table of docs/methods.md.

    make docs                                   # writes them (scripts/generate_docs.py)
    python scripts/generate_docs.py --check     # exit 1, naming the files, if any differs

A method's settings are declared once, in its `Settings` class (`methods/settings/params.py`); these
files are written from them, and tests/test_settings.py checks that they are up to date.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from methods.base import available_methods, method_settings  # noqa: E402
from methods.settings.params import settings_table  # noqa: E402

DOCS = REPO / "docs" / "methods.md"
BEGIN, END = "<!-- settings: written by scripts/method_configs.py -->", "<!-- end of settings -->"


def suite_methods() -> list[str]:
    """The methods of this repository (not those registered by tests or other packages)."""
    return [name for name in available_methods() if method_settings(name).__module__.startswith("methods.")]


def settings_markdown() -> str:
    import pandas as pd  # lazy: pandas, only for the Markdown table

    rows = [{"method": f"`{name}`", **row} for name in suite_methods() for row in settings_table(method_settings(name))]
    frame = pd.DataFrame(rows).map(lambda cell: cell.replace("|", "\\|"))
    frame["setting"] = "`" + frame["setting"] + "`"
    frame["default"] = "`" + frame["default"] + "`"
    return frame.to_markdown(index=False, tablefmt="github")


def expected_files() -> dict[Path, str]:
    """Every written file and the text it should hold."""
    files = {REPO / "conf" / "method" / f"{name}.yaml": method_settings(name).yaml(name) for name in suite_methods()}
    docs = DOCS.read_text()
    block = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not block.search(docs):
        raise SystemExit(f"{DOCS}: no settings block ({BEGIN} ... {END})")
    files[DOCS] = block.sub(lambda _: f"{BEGIN}\n{settings_markdown()}\n{END}", docs)
    return files
