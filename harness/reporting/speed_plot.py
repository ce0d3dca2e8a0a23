"""A speed document's series (`harness.reporting.speed_report`) drawn as a PNG: fused / unfused per
token count, one line per series, the quartiles of the paired ratios as error bars where the
measurement has them, and the 1x line (below it the fused model is slower).

matplotlib is optional (`pip install 'fusion-harness[plot]'`): `available()` says whether it
imported, and `write_png` raises `PlotUnavailable` with the install command where it does not.
The figure is built with matplotlib's object API on the Agg canvas, never `pyplot`, so no
global figure state or GUI backend is touched.
"""

from __future__ import annotations

from pathlib import Path

from harness.reporting.speed_report import SpeedDocument

try:  # optional: only the plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ImportError as exc:
    FigureCanvasAgg = Figure = None
    IMPORT_ERROR = str(exc)
else:
    IMPORT_ERROR = ""

INSTALL_HINT = "pip install matplotlib (or the package's [plot] extra)"


class PlotUnavailable(RuntimeError):
    """matplotlib does not import here (the message says how to install it)."""


def available() -> bool:
    """Whether matplotlib imported."""
    return Figure is not None


def write_png(document: SpeedDocument, path: Path, title: str = "") -> Path:
    """Draw `document` to `path` (PNG) and return the path. Series without points are left
    out (the Markdown lists why they were not measured). Raises `PlotUnavailable` without
    matplotlib and OSError where `path` cannot be written."""
    if Figure is None or FigureCanvasAgg is None:
        raise PlotUnavailable(f"the plot needs matplotlib ({IMPORT_ERROR}): {INSTALL_HINT}")
    figure = Figure(figsize=(8, 4.8), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    tokens: set[int] = set()
    for series in document.series:
        if not series.points:
            continue
        xs = [p.tokens for p in series.points]
        ys = [p.ratio for p in series.points]
        tokens.update(xs)
        label = series.label + (f" ({series.verdict})" if series.verdict else "")
        if all(p.low is not None and p.high is not None for p in series.points):
            below = [p.ratio - p.low for p in series.points]
            above = [p.high - p.ratio for p in series.points]
            axes.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, label=label)
        else:
            axes.plot(xs, ys, marker="o", label=label)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    if tokens:
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted(tokens), [str(t) for t in sorted(tokens)])
    axes.set_xlabel("tokens")
    axes.set_ylabel("fused / unfused (above 1: fused faster)")
    what = "benchmark" if document.kind == "bench" else "performance verdict"
    axes.set_title(title or f"{what}: {document.machine}", fontsize=8, wrap=True)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, format="png")
    return path
