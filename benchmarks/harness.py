"""What the a/b harness (``ab.py``) uses: one measurement in a fresh process (``plain_loop.py`` or
``gpufeed bench``), and the verdict on two sets of runs."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def fresh_run(cmd: list[str], *, src: Path | None = None, timeout: float = 600.0,
              log: Path | None = None) -> dict:
    """Run ``cmd`` (which takes ``--json PATH``) in a fresh process, with ``src`` first on PYTHONPATH; returns
    its JSON, or ``{"error": ...}`` when it failed or ran past ``timeout`` seconds."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="gpufeed-ab-") as tmp:
        out = Path(tmp) / "run.json"
        began = time.monotonic()
        try:
            proc = subprocess.run([*cmd, "--json", str(out)], env=env, timeout=timeout, capture_output=True,
                                  text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"past {timeout:.0f} s: {' '.join(cmd)}"}
        if log is not None:
            with open(log, "a") as f:
                f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit status {proc.returncode}: {proc.stderr.strip()[-600:]}"}
        # the process's whole life, start-up and exit included: what a round of the harness costs
        return {**json.loads(out.read_text()), "wall_s": time.monotonic() - began}


def plain_loop_cmd(data: str, row: str, args) -> list[str]:
    """The plain loop's command for a row: none (loader only), a model name, "recipe" (trivialaugment-mix with
    ResNet-50), "compiled-MODEL" or "validation" (whole train=False passes, loader only)."""
    cmd = [sys.executable, str(HERE / "plain_loop.py"), data, "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--device", args.device,
           "--ceiling-seconds", str(getattr(args, "ceiling_seconds", 5.0))]
    return cmd + _row_args(row, args)


def _row_args(row: str, args) -> list[str]:
    """A row's arguments, the same for the plain loop and for gpufeed bench."""
    extra = ["--workers", str(args.workers)] if args.workers else []
    if row == "validation":
        return extra + ["--model", "none", "--validation"]
    if row == "recipe":
        return extra + ["--model", "resnet50" if args.device.startswith("cuda") else "none", "--recipe",
                        "trivialaugment-mix"]
    if row.startswith("compiled-"):
        return extra + ["--model", row[len("compiled-"):], "--compile"]
    return extra + ["--model", row]


def bench_cmd(data: str, row: str, args) -> list[str]:
    """``gpufeed bench`` of its gpufeed pipeline alone, with the plain loop's settings for ``row``."""
    return [sys.executable, "-m", "gpufeed", "bench", "--data", data, "--pipelines", "gpufeed",
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--device", args.device,
            *_row_args(row, args)]


def bench_figure(run: dict) -> dict:
    """The bench's JSON as a plain loop's result: its gpufeed row's rate, share and epochs."""
    if "error" in run:
        return run
    row = next(r for r in run["rows"] if r["pipeline"].startswith("gpufeed"))
    if row.get("error"):
        return {"error": row["pipeline"]}
    return {"images_per_s": row["images_per_s"], "of_ceiling": row.get("of_ceiling"), "wall_s": run.get("wall_s"),
            "epochs": [e["images_per_s"] for e in row["epochs"]], "bench_overhead": row.get("bench_overhead")}


def figure(run: dict) -> float | None:
    """What a run is judged by: the share of the model's own rate, or images/s for the loader alone."""
    if "error" in run or run.get("unsupported") or run.get("images_per_s") is None:
        return None
    return run["of_ceiling"] if run.get("of_ceiling") is not None else run["images_per_s"]


def describe(values: list[float], share: bool) -> str:
    """'median (min-max)' of a row's runs, as percentages for shares."""
    if not values:
        return "-"
    f = (lambda v: f"{100 * v:.1f}%") if share else (lambda v: f"{v:,.0f}")
    return f"{f(statistics.median(values))} ({f(min(values))}-{f(max(values))})"


def paired(reference: list[dict], current: list[dict]) -> str:
    """The median over rounds of current / reference within each round (runs made minutes apart, so the
    machine's drift over the comparison cancels), with its range; "-" without a round where both ran."""
    ratios = [c / r - 1 for r, c in zip(map(figure, reference), map(figure, current))
              if r is not None and c is not None]
    if not ratios:
        return "-"
    return (f"{100 * statistics.median(ratios):+.1f}% ({100 * min(ratios):+.1f} to {100 * max(ratios):+.1f}%)"
            if len(ratios) > 1 else f"{100 * ratios[0]:+.1f}% (1 round)")


def verdict(reference: list[float], current: list[float]) -> str:
    """faster / slower when every run of one tree beats every run of the other, else within noise (the runs'
    own spread is the noise); with fewer than two runs of either there is no spread to judge by."""
    if len(reference) < 2 or len(current) < 2:
        return f"too few runs ({len(reference)} and {len(current)})"
    if min(current) > max(reference):
        return "faster"
    if max(current) < min(reference):
        return "slower"
    return "within noise"
