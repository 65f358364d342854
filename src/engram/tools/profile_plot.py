"""The figure of ``engram profile plot``: hit rate against cached fraction (log x axis, a tick at
each fraction measured), one panel per corpus (sharing the y axis), one curve per policy, each
corpus's cold ceiling (1 - distinct rows / reads) as a dotted line and its best static set as a broad
pale one. Needs matplotlib (the ``profile`` extra).

Policies differ by colour, marker, marker size and line style, the same in every panel (their curves
often coincide: the larger, hollow markers stay visible under the smaller, filled ones). One legend
below the panels names them, so the panels keep the figure's width. The y axis runs a little past
100% so that curves at 100% stay inside the frame."""

from __future__ import annotations

from pathlib import Path

__all__ = ["require_matplotlib", "hit_rate_figure", "plot_hit_rates", "POLICY_STYLES"]

POLICY_STYLES = {
    # policy: (colour, marker, marker size, filled, line style)
    "lru": ("tab:blue", "s", 9, False, "-"),
    "dynamic": ("tab:orange", "o", 7, False, "--"),
    "set-lru": ("tab:green", "D", 4, True, "-."),
    "static": ("tab:red", "^", 6, True, ":"),
}
_OTHER_STYLE = ("tab:purple", "x", 6, True, "-")
CEILING_LABEL = "ceiling, cold start (1 - distinct rows / reads)"
BEST_STATIC_LABEL = "best static: the text's own top rows, loaded before it (starts warm: may pass the ceiling)"
_Y_TOP = 1.04
_PANEL_WIDTH = 4.8   # inches per corpus


def require_matplotlib():
    """The ``matplotlib.pyplot`` module on the Agg backend, or a ValueError naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("engram profile plot needs matplotlib, which is not installed: "
                         "pip install 'engram[profile]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _percent(value: float) -> str:
    return f"{value * 100:g}%"


def hit_rate_figure(curves: dict[str, list[dict]], title: str = ""):
    """The figure (not yet saved): ``curves`` maps a corpus name to :func:`engram.tools.profile.evaluate`
    results (dicts with ``policy``, ``fraction``, ``hit_rate``, ``ceiling``, ``best_static_hit_rate``).
    ``figure.axes[i]`` is corpus ``i``'s panel; its lines are labelled ``"<corpus>: <policy>"`` (and
    ``"<corpus>: <ceiling or best static label>"``)."""
    plt = require_matplotlib()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    count = max(1, len(curves))
    figure, panels = plt.subplots(1, count, figsize=(1.2 + _PANEL_WIDTH * count, 5.2), sharey=True, squeeze=False)
    fractions = sorted({r["fraction"] for results in curves.values() for r in results})
    legend: dict[str, object] = {}
    for axes, (corpus, results) in zip(panels[0], curves.items()):
        for policy in dict.fromkeys(r["policy"] for r in results):
            color, marker, size, filled, style = POLICY_STYLES.get(policy, _OTHER_STYLE)
            points = sorted((r["fraction"], r["hit_rate"]) for r in results if r["policy"] == policy)
            (line,) = axes.plot([p[0] for p in points], [p[1] for p in points], marker=marker, markersize=size,
                                markerfacecolor=color if filled else "none", markeredgecolor=color, linestyle=style,
                                color=color, clip_on=False, zorder=3, label=f"{corpus}: {policy}")
            legend.setdefault(policy, line)
        best = sorted({(r["fraction"], r["best_static_hit_rate"]) for r in results})
        (line,) = axes.plot([p[0] for p in best], [p[1] for p in best], linestyle="-", linewidth=6, color="0.5",
                            alpha=0.25, clip_on=False, label=f"{corpus}: {BEST_STATIC_LABEL}")
        legend.setdefault(BEST_STATIC_LABEL, line)
        line = axes.axhline(results[0]["ceiling"], linestyle=(0, (1, 2)), linewidth=1.2, color="black",
                            label=f"{corpus}: {CEILING_LABEL}")
        legend.setdefault(CEILING_LABEL, line)
        axes.set_title(corpus, fontsize=9)
        axes.set_xscale("log")
        if fractions:
            axes.xaxis.set_major_locator(FixedLocator(fractions))
            axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _percent(value)))
            axes.xaxis.set_minor_locator(NullLocator())
            axes.set_xlim(fractions[0] / 1.25, fractions[-1] * 1.25)
        axes.set_xlabel("cached fraction of each table's rows")
        axes.grid(True, which="major", alpha=0.3)
    first = panels[0][0]
    first.yaxis.set_major_formatter(FuncFormatter(lambda value, _: _percent(round(value, 4)) if value <= 1 else ""))
    first.set_ylabel("row reads served from HBM")
    first.set_ylim(0, _Y_TOP)
    figure.suptitle(title, fontsize=10)
    figure.legend(list(legend.values()), list(legend), fontsize=8, loc="lower center", ncol=min(3, len(legend)),
                  frameon=False, bbox_to_anchor=(0.5, 0.06))
    figure.text(0.01, 0.01, "The cold ceiling bounds every policy that starts empty (a row's first read misses); "
                "best static is chosen with hindsight on the text itself and loaded before it.", fontsize=7)
    rows = -(-len(legend) // min(3, len(legend))) if legend else 0
    figure.tight_layout(rect=(0, 0.08 + 0.045 * rows, 1, 1))
    return figure


def plot_hit_rates(curves: dict[str, list[dict]], out: str | Path, title: str = "", image_format: str = "png") -> None:
    """Write :func:`hit_rate_figure` to exactly ``out``, in ``image_format`` (a matplotlib format
    name: ``"png"``, ``"svg"``, ...)."""
    plt = require_matplotlib()
    figure = hit_rate_figure(curves, title)
    try:
        figure.savefig(out, dpi=120, format=image_format)
    finally:
        plt.close(figure)
