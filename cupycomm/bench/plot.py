"""``--plot``: time and bus bandwidth against size, log axes, one line per implementation.

One row of two panels per collective (time on the left, busbw on the right); a line per
implementation (one colour each) and mode (solid out-of-place, dashed in-place). Drawn with
matplotlib's object API and the Agg canvas, so no display and no global pyplot state are
needed; saved with a 256-colour palette, which keeps a nine-collective figure small enough to
commit.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .report import IN_PLACE, Row, replacing

__all__ = ["plot"]


def _series(rows: Sequence[Row]) -> Dict[str, Dict[Tuple[str, str], List[Row]]]:
    """collective -> (implementation, mode) -> rows in size order."""
    out: Dict[str, Dict[Tuple[str, str], List[Row]]] = {}
    for row in rows:
        if row.size > 0:   # a log axis has no room for an empty message
            out.setdefault(row.collective, {}).setdefault((row.impl, row.mode), []).append(row)
    return out


def plot(path: str, rows: Sequence[Row], title: str) -> None:
    """Write the figure of ``rows`` to ``path`` (PNG); needs matplotlib (the plot extra).

    Example::

        plot("allreduce.png", rows, "2 ranks, host (MPI)")
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from PIL import Image   # matplotlib's own dependency
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'cupycomm[plot]'") from None
    series = _series(rows)
    figure = Figure(figsize=(10, 2.6 * max(1, len(series))), dpi=72, layout="constrained")
    canvas = FigureCanvasAgg(figure)
    axes = figure.subplots(max(1, len(series)), 2, squeeze=False)
    colors = {impl: f"C{k}" for k, impl in enumerate(dict.fromkeys(r.impl for r in rows))}
    for (time_ax, bw_ax), (collective, lines) in zip(axes, series.items()):
        for (impl, mode), points in lines.items():
            sizes = [r.size for r in points]
            style = dict(color=colors[impl], linestyle="--" if mode == IN_PLACE else "-",
                         marker=".", label=f"{impl} {mode}")
            time_ax.plot(sizes, [r.time_us for r in points], **style)
            bw_ax.plot(sizes, [max(r.busbw, 1e-6) for r in points], **style)
        time_ax.set(xscale="log", yscale="log", ylabel="time (µs)", title=collective)
        bw_ax.set(xscale="log", yscale="log", ylabel="busbw (GB/s)", title=collective)
        time_ax.legend(fontsize="x-small")
        for ax in (time_ax, bw_ax):
            ax.set_xlabel("size (bytes)")
            ax.grid(True, which="major", alpha=0.3)
    figure.suptitle(title, fontsize="small")
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba())
    with replacing(path, "wb") as out:
        image.convert("RGB").quantize(256).save(out, format="PNG", optimize=True)
