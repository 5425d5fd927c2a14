"""The table printed at the end of `gpufeed bench`, its JSON and its PNG chart."""

from __future__ import annotations

import json
import textwrap
from typing import Any


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(result: dict[str, Any]) -> str:
    m, c = result["machine"], result["config"]
    head = (f"gpufeed bench: {m['cpu_cores']} CPU cores, GPU {m['gpu'] or 'none'}, torch {m['torch']}; "
            f"batch {c['batch_size']}, {c['workers']} workers, {c['epochs']} epochs (+1 for memory), "
            f"model {c['model'] or 'none (loader only)'}{' (torch.compile)' if c.get('compile') else ''}; recipe {c.get('recipe') or 'crop + flip + normalise'}; "
            f"NVML: {result['nvml']}\n"
            f"data: {result['dataset']}\n")
    cols = ["pipeline", "epoch 1 s", "steady s", "images/s", "vs baseline", "of ceiling", "GPU busy", "CPU cores busy",
            "host RSS GB", "RSS added GB", "PSS added GB", "GPU mem added GB", "bench overhead"]
    rows = []
    for r in result["rows"]:
        rows.append([
            r["pipeline"],
            _fmt(r.get("first_epoch_s"), ".2f"),
            _fmt(r.get("steady_epoch_s"), ".2f"),
            _fmt(r.get("images_per_s"), ",.0f"),
            _fmt(r.get("vs_baseline"), ".2f", "x"),
            _fmt(None if r.get("of_ceiling") is None else 100 * r["of_ceiling"], ".1f", "%"),
            _fmt(r.get("gpu_busy"), ".0f", "%"),
            _fmt(r.get("cpu_cores_busy"), ".1f"),
            _fmt(None if not r.get("peak_rss_bytes") else r["peak_rss_bytes"] / 1e9, ".2f"),
            _fmt(None if r.get("added_rss_bytes") is None else r["added_rss_bytes"] / 1e9, ".2f"),
            _fmt(None if r.get("added_pss_bytes") is None else r["added_pss_bytes"] / 1e9, ".2f"),
            _fmt(None if r.get("gpu_mem_added_bytes") is None else r["gpu_mem_added_bytes"] / 1e9, ".2f"),
            _fmt(None if r.get("bench_overhead") is None else 100 * r["bench_overhead"], "+.1f", "%"),
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    line = lambda cells: "| " + " | ".join(str(x).ljust(w) for x, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    notes = [f"- {r['pipeline'].split(' (')[0]}: {w}" for r in result["rows"] for w in r.get("warnings", [])]
    return head + "\n".join([line(cols), sep, *map(line, rows), *(["warnings:", *notes] if notes else []),
                                   textwrap.fill(READING, 110)])


# How each column is read: printed under every table, so that a figure never stands without its method.
READING = (
    "images/s: median of the plain epochs (a training loop with nothing else in the process); epoch 1 (warm-up, "
    "start-up included) is not counted. of ceiling: images/s over the model's own rate on GPU-resident tensors. "
    "GPU busy, CPU cores busy, RSS: read in the monitored epochs by a sampler process. PSS: read once, halfway "
    "through an extra epoch that counts for nothing else. bench overhead: how much slower the monitored epochs "
    "ran than the plain ones. Each pipeline runs in a fresh process.")


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def write_chart(result: dict[str, Any], path: str) -> None:
    """A bar chart of steady-state images/s (and GPU busy where measured); title and labels shown whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("images_per_s")]
    names = ["\n".join(textwrap.wrap(r["pipeline"], 34)) for r in rows]
    rates = [r["images_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.75 * len(rows) + 1.8))
    colours = ["#888" if "ceiling" in r["pipeline"] or r["pipeline"].startswith("baseline") else "#2a7" for r in rows]
    bars = ax.barh(range(len(rows)), rates, color=colours)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    for bar, r in zip(bars, rows):
        label = f"{r['images_per_s']:,.0f}/s"
        if r.get("of_ceiling") is not None:
            label += f", {100 * r['of_ceiling']:.0f}% of ceiling"
        if r.get("gpu_busy") is not None:
            label += f" ({r['gpu_busy']:.0f}% busy)"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("images/s (steady state)")
    ax.set_xlim(0, max(rates) * 1.6)  # room for the labels right of the longest bar
    m, c = result["machine"], result["config"]
    ax.set_title("\n".join(textwrap.wrap(f"{m['cpu_cores']} CPU cores, GPU {m['gpu'] or 'none'}, model "
                                          f"{c['model'] or 'none (loader only)'}, batch {c['batch_size']}", 70)),
                 fontsize=10)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # nothing cut at the edges, however long a label is
    plt.close(fig)
