"""The figure of ``engram profile plot``: hit rate against cached fraction (log x axis), one curve
per corpus and policy, each corpus's ceiling (1 - first touches / reads) as a dotted line and its
best static set as a dashed one. Needs matplotlib (the ``profile`` extra)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["require_matplotlib", "plot_hit_rates"]

_MARKERS = {"dynamic": "o", "lru": "s", "static": "^", "set-lru": "D", "lru-8way": "D"}


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


def plot_hit_rates(curves: dict[str, list[dict]], out: str | Path, title: str = "", image_format: str = "png") -> None:
    """``curves``: corpus name -> :func:`engram.profile.evaluate` results (dicts with ``policy``,
    ``fraction``, ``hit_rate``, ``ceiling``, ``best_static_hit_rate``). Writes the figure to exactly
    ``out``, in ``image_format`` (a matplotlib format name: ``"png"``, ``"svg"``, ...)."""
    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(11, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (corpus, results) in enumerate(curves.items()):
        color = colors[index % len(colors)]
        for policy in dict.fromkeys(r["policy"] for r in results):
            points = sorted((r["fraction"], r["hit_rate"]) for r in results if r["policy"] == policy)
            axes.plot([p[0] for p in points], [p[1] for p in points], marker=_MARKERS.get(policy, "o"), color=color,
                      label=f"{corpus}: {policy}")
        best = sorted({(r["fraction"], r["best_static_hit_rate"]) for r in results})
        axes.plot([p[0] for p in best], [p[1] for p in best], linestyle="--", color=color, alpha=0.6,
                  label=f"{corpus}: best static (chosen on itself)")
        axes.axhline(results[0]["ceiling"], linestyle=":", color=color, label=f"{corpus}: ceiling")
    axes.set_xscale("log")
    axes.set_xlabel("cached fraction of each table's rows")
    axes.set_ylabel("row reads served from HBM")
    axes.set_ylim(0, 1)
    axes.grid(True, which="both", alpha=0.3)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(out, dpi=120, format=image_format)
    plt.close(figure)
