"""The one fixed-width text table of the harness: `fusion-harness run`'s summary, `perf`'s
verdicts and `bench`'s speedups all print through `render`.

Layout (the contract the printed tables and their tests rely on): the header line, a rule of
dashes as wide as each column, then one line per row. Columns are as wide as their widest cell
(or as given), separated by two spaces; cells are left-aligned except the columns named in
`right`; trailing spaces are stripped from every line but the rule. Pure string work: no
imports beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

GAP = "  "
"""Between two columns."""


def column_widths(rows: Sequence[Sequence[str]]) -> list[int]:
    """The width of each column: its widest cell (`rows` includes the header)."""
    return [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def render(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Collection[int] = (),
    widths: Sequence[int] | None = None,
    fit: Callable[[str, int], str] | None = None,
) -> str:
    """The table of `header` and `rows` (see the module docstring). `widths` overrides the
    natural widths (a cell longer than its column is then passed through `fit`, which must
    return at most that many characters; without `fit` it overflows)."""
    widths = list(widths) if widths is not None else column_widths([header, *rows])

    def line(row: Sequence[str]) -> str:
        cells = (
            (fit(c, w) if fit else c).rjust(w) if i in right else (fit(c, w) if fit else c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        )
        return GAP.join(cells).rstrip()

    rule = GAP.join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])
