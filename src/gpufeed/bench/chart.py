"""`gpufeed bench --chart`: a PNG bar chart of each row's images/s, with the spread of its plain epochs."""

from __future__ import annotations

import textwrap
from typing import Any

from .report import plain_rates, step_name


def _label(row: dict[str, Any]) -> str:
    """The row's name and what ran (the baseline: torchvision ImageFolder + DataLoader and its workers)."""
    return "\n".join(textwrap.wrap(f"{step_name(row['name'])}: {row.get('detail') or row['pipeline']}", 40))


def draw(result: dict[str, Any]):
    """A matplotlib Figure: bars of steady-state images/s, each with a whisker from its slowest plain epoch
    to its fastest; the share of the model's own rate and GPU busy where measured. ValueError when no row
    has a rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("images_per_s")]
    if not rows:
        raise ValueError("no chart: no pipeline was measured")
    rates = [r["images_per_s"] for r in rows]
    spread = [[rate - min(plain_rates(r) or [rate]) for r, rate in zip(rows, rates)],
              [max(plain_rates(r) or [rate]) - rate for r, rate in zip(rows, rates)]]
    fig, ax = plt.subplots(figsize=(10, 0.8 * len(rows) + 1.8))
    colours = ["#888" if r["name"] == "ceiling" or r["name"].startswith("baseline") else "#2a7" for r in rows]
    bars = ax.barh(range(len(rows)), rates, color=colours, xerr=spread, capsize=4, error_kw={"ecolor": "#333"})
    ax.set_yticks(range(len(rows)), [_label(r) for r in rows], fontsize=8)
    for bar, r, high in zip(bars, rows, spread[1]):
        label = f"{r['images_per_s']:,.0f}/s"
        if len(plain_rates(r)) > 1:
            label += f" ({min(plain_rates(r)):,.0f}-{max(plain_rates(r)):,.0f})"
        if r.get("of_ceiling") is not None:
            label += f", {100 * r['of_ceiling']:.0f}% of its own rate"
        if r.get("gpu_busy") is not None:
            label += f", GPU {r['gpu_busy']:.0f}% busy"
        ax.text(bar.get_width() + high, bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("images/s: median of the plain epochs; whiskers: slowest to fastest plain epoch")
    ax.set_xlim(0, max(r + h for r, h in zip(rates, spread[1])) * 1.7)  # room for the labels right of the bars
    m, c = result["machine"], result["config"]
    ax.set_title("\n".join(textwrap.wrap(f"{m['cpu_cores']} CPU cores, GPU {m['gpu'] or 'none'}, model "
                                          f"{c['model'] or 'none (loader only)'}, batch {c['batch_size']}", 70)),
                 fontsize=10)
    return fig


def write_chart(result: dict[str, Any], path: str) -> None:
    """``draw``'s chart as a PNG; title and labels shown whole."""
    import matplotlib.pyplot as plt

    fig = draw(result)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # nothing cut at the edges, however long a label is
    plt.close(fig)
