"""The figure of ``engram profile plot``: hit rate against cached fraction (log x axis, a tick at
each fraction measured), one curve per corpus and policy, each corpus's cold ceiling
(1 - distinct rows / reads) as a sparse dotted line and its best static set as a broad pale one. Needs
matplotlib (the ``profile`` extra).

Policies differ by marker, marker size and line style (their curves often coincide: the larger,
hollow markers stay visible under the smaller, filled ones); corpora by colour. The y axis runs a
little past 100% so that curves at 100% stay inside the frame."""

from __future__ import annotations

from pathlib import Path

__all__ = ["require_matplotlib", "hit_rate_figure", "plot_hit_rates", "POLICY_STYLES"]

POLICY_STYLES = {
    # policy: (marker, marker size, filled, line style)
    "lru": ("s", 9, False, "-"),
    "dynamic": ("o", 7, False, "--"),
    "set-lru": ("D", 4, True, "-."),
    "static": ("^", 6, True, ":"),
}
_OTHER_STYLE = ("x", 6, True, "-")
CEILING_LABEL = "ceiling, cold start (1 - distinct rows / reads)"
BEST_STATIC_LABEL = "best static: the text's own top rows, loaded before it (starts warm: may pass the ceiling)"
_Y_TOP = 1.04


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
    results (dicts with ``policy``, ``fraction``, ``hit_rate``, ``ceiling``, ``best_static_hit_rate``)."""
    plt = require_matplotlib()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    figure, axes = plt.subplots(figsize=(12, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fractions = sorted({r["fraction"] for results in curves.values() for r in results})
    for index, (corpus, results) in enumerate(curves.items()):
        color = colors[index % len(colors)]
        for policy in dict.fromkeys(r["policy"] for r in results):
            marker, size, filled, style = POLICY_STYLES.get(policy, _OTHER_STYLE)
            points = sorted((r["fraction"], r["hit_rate"]) for r in results if r["policy"] == policy)
            axes.plot([p[0] for p in points], [p[1] for p in points], marker=marker, markersize=size,
                      markerfacecolor=color if filled else "none", markeredgecolor=color, linestyle=style,
                      color=color, clip_on=False, zorder=3, label=f"{corpus}: {policy}")
        best = sorted({(r["fraction"], r["best_static_hit_rate"]) for r in results})
        axes.plot([p[0] for p in best], [p[1] for p in best], linestyle="-", linewidth=5, color=color, alpha=0.2,
                  clip_on=False, label=f"{corpus}: {BEST_STATIC_LABEL}")
        axes.axhline(results[0]["ceiling"], linestyle=(0, (1, 3)), linewidth=1, color=color,
                     label=f"{corpus}: {CEILING_LABEL}")
    axes.set_xscale("log")
    if fractions:
        axes.xaxis.set_major_locator(FixedLocator(fractions))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _percent(value)))
        axes.xaxis.set_minor_locator(NullLocator())
        axes.set_xlim(fractions[0] / 1.25, fractions[-1] * 1.25)
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: _percent(round(value, 4)) if value <= 1 else ""))
    axes.set_xlabel("cached fraction of each table's rows")
    axes.set_ylabel("row reads served from HBM")
    axes.set_ylim(0, _Y_TOP)
    axes.grid(True, which="major", alpha=0.3)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.text(0.01, 0.01, "The cold ceiling bounds every policy that starts empty (a row's first read misses); "
                "best static is chosen with hindsight on the text itself and loaded before it.", fontsize=7)
    figure.tight_layout(rect=(0, 0.03, 1, 1))
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
