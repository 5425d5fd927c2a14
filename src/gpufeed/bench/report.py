"""What `gpufeed bench` prints at the end: a table that fits a terminal (markdown), CSV or JSON.

Light to import (no torch): ``gpufeed bench --help`` lists the columns from ``COLUMNS``.
"""

from __future__ import annotations

import csv
import io
import json
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

FORMATS = ("markdown", "csv", "json")
WIDTH = 100  # a terminal's columns: the markdown table and every line around it fit
GB = 1e9


def _gb(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: None if r.get(key) is None else r[key] / GB


def _percent(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: None if r.get(key) is None else 100 * r[key]


@dataclass(frozen=True)
class Column:
    """A column of the markdown table: its header, its value in a row (None: not measured), how the value
    is written, and what it means (listed under the table and in ``--help``). ``gpu``: read on a GPU alone,
    left out without one."""

    header: str
    value: Callable[[dict[str, Any]], Any]
    spec: str
    meaning: str
    suffix: str = ""
    gpu: bool = False

    def cell(self, row: dict[str, Any]) -> str:
        value = self.value(row)
        return "-" if value is None else f"{value:{self.spec}}{self.suffix}"


COLUMNS = (
    Column("images/s", lambda r: r.get("images_per_s"), ",.0f",
           "median of the plain epochs, which run the training loop and nothing else (epoch 1, the warm-up with "
           "the start-up, is not counted)"),
    Column("spread", _percent("plain_spread"), ".1f",
           "how far apart the plain epochs ran: the fastest over the slowest, less one (two rows whose plain "
           "epochs overlap are said under the table to be within their spread)", "%"),
    Column("vs baseline", lambda r: r.get("vs_baseline"), ".2f",
           "images/s over the baseline's (torchvision ImageFolder + DataLoader)", "x"),
    Column("of its own rate", _percent("of_ceiling"), ".1f",
           "images/s over the model's own rate on one batch already on the GPU, measured in this run", "%"),
    Column("GPU busy", lambda r: r.get("gpu_busy"), ".0f",
           "NVML utilisation, read every 50 ms in the monitored epochs (the memory epoch where no epoch "
           "is monitored) by a sampler process", "%", gpu=True),
    Column("cores busy", lambda r: r.get("cpu_cores_busy"), ".1f",
           "CPU seconds of the pipeline's process tree over the wall time, in the monitored epochs (the "
           "memory epoch where no epoch is monitored)"),
    Column("epoch 1 s", lambda r: r.get("first_epoch_s"), ".2f", "seconds of the warm-up epoch, start-up included"),
    Column("PSS added GB", _gb("added_pss_bytes"), ".2f",
           "host memory the pipeline added, shared pages split among its processes; read once, halfway through "
           "an extra epoch that counts for nothing else"),
    Column("GPU mem added GB", _gb("gpu_mem_added_bytes"), ".2f",
           "NVML's \"used\" peak less what was used before the loader was made", gpu=True),
)
RATE = COLUMNS[0]  # shown in every table: a row that failed says so in it

# Where the columns do not fit in WIDTH, they are left out in this order (the first least missed).
LEAVE_OUT = ("epoch 1 s", "GPU mem added GB", "PSS added GB", "cores busy", "GPU busy")


def step_name(name: str) -> str:
    """How a step is called where it is shown: the ceiling is the model alone."""
    return "model alone" if name == "ceiling" else name


def _name(row: dict[str, Any]) -> str:
    return step_name(row["name"])


def _table(columns: list[Column], rows: list[dict[str, Any]]) -> list[str]:
    """Markdown table lines: the pipeline's name first, numbers right-aligned."""
    headers = ["pipeline", *(c.header for c in columns)]
    cells = [[_name(r), *("FAILED" if r.get("error") and c is RATE else c.cell(r) for c in columns)]
             for r in rows]
    widths = [max(len(x) for x in col) for col in zip(headers, *cells)]

    def line(values: list[str]) -> str:
        first, *rest = values
        return "| " + " | ".join([first.ljust(widths[0]), *(v.rjust(w) for v, w in zip(rest, widths[1:]))]) + " |"

    sep = "|" + "|".join(["-" * (widths[0] + 2), *("-" * (w + 1) + ":" for w in widths[1:])]) + "|"
    return [line(headers), sep, *(line(c) for c in cells)]


def _fitted(result: dict[str, Any]) -> tuple[list[Column], list[str]]:
    """The columns shown: images/s and those measured in some row (GPU ones only on a GPU), less, in
    ``LEAVE_OUT``'s order, what does not fit in ``WIDTH`` (one left out early is taken back where the later
    ones made room); and the headers left out for width."""
    gpu = bool(result["machine"].get("gpu")) and result["config"]["device"] != "cpu"
    measured = [c for c in COLUMNS if (gpu or not c.gpu) and (c is RATE or any(c.value(r) is not None
                                                                            for r in result["rows"]))]

    def fits(columns: list[Column]) -> bool:
        return max(len(line) for line in _table(columns, result["rows"])) <= WIDTH

    shown, dropped = list(measured), []
    for header in LEAVE_OUT:
        if fits(shown):
            break
        if any(c.header == header for c in shown):
            shown = [c for c in shown if c.header != header]
            dropped.append(header)
    for header in reversed(dropped[:-1]):
        tried = [c for c in measured if c in shown or c.header == header]
        if fits(tried):
            shown = tried
            dropped.remove(header)
    return shown, dropped


def wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def epochs_text(kinds: list[str]) -> str:
    """A pipeline's epochs, counted by kind: "5 epochs (1 warm-up, 2 plain, 1 monitored, 1 memory)"."""
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    return f"{len(kinds)} epochs ({counts}; the rate is the plain epochs')"


def settings(config: dict[str, Any]) -> str:
    """Batch, workers, model and recipe of a ``BenchConfig`` (as a dict)."""
    model = f"model {config['model']}" + (" (torch.compile)" if config.get("compile") else "") \
        if config["model"] else "loader only"
    workers = config["workers"]
    return (f"batch {config['batch_size']}, {workers} worker{'s' if workers != 1 else ''}, {model}, "
            f"recipe {config.get('recipe') or 'crop + flip + normalise'}")


def caption(result: dict[str, Any]) -> list[str]:
    """What was measured, on what: the lines above the table."""
    m = result["machine"]
    gpu = f"GPU {m['gpu']}" if m.get("gpu") else "no GPU"
    lines = wrap(f"gpufeed bench, {result['date']}: {m['cpu_cores']} CPU cores, {gpu}, torch {m['torch']}"
                 + (f", {m['ranks']} ranks" if m.get("ranks", 1) > 1 else "")
                 + (f"; NVML {result['nvml']}" if m.get("gpu") else ""))
    lines += wrap(f"each pipeline: {epochs_text(result['epoch_kinds'])}, {settings(result['config'])}", "  ")
    return lines + wrap(f"data: {result['dataset']}", "  ")


def format_table(result: dict[str, Any]) -> str:
    """The caption, the table (at most ``WIDTH`` columns), what each pipeline ran, the warnings, and what
    each shown column means."""
    columns, dropped = _fitted(result)
    rows = result["rows"]
    lines = [*caption(result), "", *_table(columns, rows), ""]
    for r in rows:
        lines += wrap(f"{_name(r)}: {r.get('detail') or r['pipeline']}", "  ")
    notes: dict[str, list[str]] = {}  # a warning -> the rows it concerns, said once
    for r in rows:
        for w in [*r.get("warnings", []), *([f"FAILED: {r['failure']}"] if r.get("error") else [])]:
            notes.setdefault(w, []).append(_name(r))
    for a, b in result.get("within_spread", []):
        notes.setdefault(_overlap_note(rows, a, b), []).extend([step_name(a), step_name(b)])
    if notes:
        lines.append("warnings:")
        for w, names in notes.items():
            lines += wrap(f"- {', '.join(names)}: {w}", "  ")
    lines.append("")
    for c in columns:
        lines += wrap(f"{c.header}: {c.meaning}.", "  ")
    lines += wrap("Each pipeline ran in a fresh process." if result.get("isolated", True) else
                   "The pipelines ran one after another in each rank's process.")
    if dropped:
        lines += wrap(f"Left out for width: {', '.join(dropped)} (--format csv or json has every figure).")
    return "\n".join(lines)


# CSV: one row per pipeline, raw numbers, the same columns on every machine (empty where not measured).
CSV_FIELDS = {
    "pipeline": lambda r: r["name"],
    "detail": lambda r: r.get("detail") or r["pipeline"],
    "images_per_s": lambda r: r.get("images_per_s"),
    "plain_min_images_per_s": lambda r: _plain(r, min),
    "plain_max_images_per_s": lambda r: _plain(r, max),
    "plain_spread": lambda r: r.get("plain_spread"),
    "vs_baseline": lambda r: r.get("vs_baseline"),
    "of_its_own_rate": lambda r: r.get("of_ceiling"),
    "gpu_busy_percent": lambda r: r.get("gpu_busy"),
    "cpu_cores_busy": lambda r: r.get("cpu_cores_busy"),
    "first_epoch_s": lambda r: r.get("first_epoch_s"),
    "steady_epoch_s": lambda r: r.get("steady_epoch_s"),
    "peak_rss_bytes": lambda r: r.get("peak_rss_bytes"),
    "added_rss_bytes": lambda r: r.get("added_rss_bytes"),
    "added_pss_bytes": lambda r: r.get("added_pss_bytes"),
    "gpu_mem_added_bytes": lambda r: r.get("gpu_mem_added_bytes"),
    "bench_overhead": lambda r: r.get("bench_overhead"),
    "warnings": lambda r: "; ".join(r.get("warnings", [])),
    "failed": lambda r: r.get("failure", "") if r.get("error") else "",
}


def plain_rates(row: dict[str, Any]) -> list[float]:
    """The images/s of a row's plain epochs (those its rate is the median of)."""
    return [e["images_per_s"] for e in row.get("epochs", []) if e["kind"] == "plain"]


def _plain(row: dict[str, Any], pick: Callable) -> float | None:
    rates = plain_rates(row)
    return pick(rates) if rates else None


def within_spread(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The pairs of pipelines (names, in the rows' order) whose plain epochs' ranges overlap: a difference
    between their rates is within their own spread, so this run does not tell them apart."""
    ranged = [(r["name"], min(p), max(p)) for r in rows
              if r["name"] != "ceiling" and not r.get("error") and len(p := plain_rates(r)) > 1]
    return [[a, b] for i, (a, low_a, high_a) in enumerate(ranged) for b, low_b, high_b in ranged[i + 1:]
            if low_a <= high_b and low_b <= high_a]


def _overlap_note(rows: list[dict[str, Any]], a: str, b: str) -> str:
    ranges = [(min(p), max(p)) for name in (a, b) for p in [plain_rates(next(r for r in rows if r["name"] == name))]]
    return (f"plain epochs overlap ({ranges[0][0]:,.0f}-{ranges[0][1]:,.0f} against {ranges[1][0]:,.0f}-"
            f"{ranges[1][1]:,.0f} images/s): the difference between these two is within their spread; more "
            f"epochs (--epochs) or a second run tell them apart")


def row_outcome(row: dict[str, Any]) -> str:
    """One line on a row just measured: its rate and the spread of its plain epochs, or why it failed."""
    if row.get("error"):  # why, under the table: said there with storage options' values redacted
        return f"{_name(row)}: FAILED (why: under the table, the details after it)"
    rates = plain_rates(row)
    text = f"{_name(row)}: {row['images_per_s']:,.0f} images/s"
    if len(rates) > 1:
        text += f" (plain epochs {min(rates):,.0f}-{max(rates):,.0f})"
    warned = len(row.get("warnings", []))
    return text + (f"; {warned} warning{'s' if warned > 1 else ''} under the table" if warned else "")


def format_csv(result: dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for r in result["rows"]:
        writer.writerow(["" if v is None else v for v in (f(r) for f in CSV_FIELDS.values())])
    return out.getvalue().rstrip("\n")


def format_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)


def format_result(result: dict[str, Any], fmt: str) -> str:
    """``result`` (``run_bench``'s) as ``fmt``, one of ``FORMATS``."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    return {"markdown": format_table, "csv": format_csv, "json": format_json}[fmt](result)


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        f.write(format_json(result))


def columns_help() -> str:
    """The table's columns and their meaning, for ``--help``."""
    lines = ["columns of the table (--format markdown; csv and json hold every figure, raw):"]
    for c in COLUMNS:
        lines += textwrap.wrap(f"{c.header}: {c.meaning}" + (" (on a GPU only)" if c.gpu else ""), WIDTH - 2,
                               initial_indent="  ", subsequent_indent="      ")
    lines += textwrap.wrap("A column measured in no row is left out; so is, where the table would "
                           "be wider than 100 columns, the least needed (" + ", ".join(LEAVE_OUT[:3]) + ", ...).",
                           WIDTH - 2, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)
