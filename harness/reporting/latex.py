"""A report's table as LaTeX: booktabs, its labels, notes and header escaped, its values as written."""

from __future__ import annotations

import pandas as pd


def latex_table(frame: pd.DataFrame, caption: str, column_format: str) -> str:
    """The frame as a booktabs LaTeX table: the first and last columns (labels and notes) and the
    header escaped, the values as written (they may hold LaTeX: `$\\times$`)."""
    escape = lambda text: "".join(LATEX_SPECIAL.get(char, char) for char in str(text))  # noqa: E731
    styled = frame.style.hide(axis="index").format(escape="latex", subset=[frame.columns[0], frame.columns[-1]])
    tex = styled.format_index(escape="latex", axis=1).to_latex(
        column_format=column_format, position="t", position_float="centering", hrules=True, caption=escape(caption))
    return tex.replace("τ", r"$\tau$").replace("α", r"$\alpha$")


LATEX_SPECIAL = {"_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}"}
