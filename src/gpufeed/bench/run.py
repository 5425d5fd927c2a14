"""`gpufeed bench`: the pipelines side by side on the same data, each in a fresh process.

    run_bench ─► child process: the model's own rate (the ceiling), with a model
              ─► child process per pipeline: its epochs (``bench.pipeline``), read by a sampler process
              ─► one table and JSON (``bench.report``)

Each pipeline runs in a process of its own, started after the last one exited, as a training script would
run it: nothing one pipeline leaves behind (worker processes, pinned host memory, the CUDA caching allocator's
blocks) is in the next one's way. Under torchrun (an initialised process group) every rank runs the same
in its own process, one pipeline after another: the model is wrapped in DDP (the ceiling too), each rank
loads its shard, epochs start together, and images/s are summed over the ranks; rank 0 reports (GPU busy and
memory of its own GPU, host memory of its own process tree).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..cores import usable_cores
from .monitor import Monitor
from .pipeline import CEILING, PIPELINES, ceiling_row, check_baseline_reads, describe, epoch_kinds, run_pipeline
from .progress import QUIET_S, EpochBar, EpochReport, FileCount, Progress, follow
from .report import epochs_text, row_outcome, settings, step_name, within_spread, wrap
from .ranks import ranks, together
from .recipes import load_recipe
from .train import make_train_step

# A child process that has not finished after this long is stopped (its row says so): far above any
# pipeline's few epochs on the default data, below what would hide a hang.
CHILD_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class BenchConfig:
    """What to run; see ``gpufeed bench --help``."""

    data: str | None = None
    n: int = 2000
    batch_size: int = 64
    workers: int = 2
    epochs: int = 4
    model: str | None = None
    device: str = "cpu"
    pipelines: tuple[str, ...] = ("baseline", "gpufeed")
    storage_options: dict[str, Any] | None = None  # fsspec's, for a URL in ``data``
    recipe: str | None = None  # a training recipe both ways (``bench.recipes``); None: crop + flip + normalise
    compile: bool = False  # the model through torch.compile (its ceiling too)
    cache_dir: str = field(default_factory=lambda: os.path.expanduser("~/.cache/gpufeed"))

    def __post_init__(self) -> None:
        for name, value in (("n", self.n), ("batch_size", self.batch_size), ("workers", self.workers)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.epochs < 2:
            raise ValueError(f"epochs must be >= 2 (the first is the warm-up, with the start-up), got {self.epochs}")
        unknown = [p for p in self.pipelines if p not in PIPELINES]
        if unknown:
            raise ValueError(f"unknown pipeline(s) {unknown}; choose from {PIPELINES}")
        if self.model is not None and self.device == "cpu":
            raise ValueError("--model needs a CUDA device (training on the CPU measures the CPU, not the loader)")
        if self.compile and self.model is None:
            raise ValueError("--compile needs --model (it compiles the model that trains)")
        if self.data and any(p.startswith("baseline") for p in self.pipelines):
            check_baseline_reads(self.data)  # said before any process starts, not as a failed row at the end


def synthetic_root(cfg: BenchConfig) -> Path:
    """Where the synthetic data set of ``cfg.n`` images is made and cached."""
    return Path(cfg.cache_dir) / f"synth-{cfg.n}-seed0"


def dataset_root(cfg: BenchConfig, progress: Progress) -> str:
    """``cfg.data``, or the synthetic data set, made (by rank 0) unless an earlier run cached it."""
    if cfg.data:
        return cfg.data
    root = synthetic_root(cfg)
    if ranks()[0] == 0:
        t0 = time.perf_counter()
        made = make_synthetic(root, cfg.n, progress)
        progress.say(f"synthetic data: made {made:,} JPEGs in {time.perf_counter() - t0:.0f} s; cached for the next run"
                     if made else "synthetic data: reused, as cached by an earlier run")
    together()
    return str(root)


# The synthetic data set, made in a process of its own (``make_synthetic``).
_MAKE = ("import sys; from gpufeed.synth import create_synthetic_dataset as make; "
         "make(sys.argv[1], n=int(sys.argv[2]), seed=0, progress=False)")  # counted by the bench: one bar


class SyntheticDataError(RuntimeError):
    """The synthetic data set could not be made (its process's error precedes this one)."""


def make_synthetic(root: Path, n: int, progress: Progress, quiet_s: float = QUIET_S) -> int:
    """``create_synthetic_dataset(root, n=n, seed=0)`` in a process of its own, its files counted aloud here
    meanwhile (``FileCount``); returns how many it wrote (0: the set was cached). ``SyntheticDataError``
    naming ``root`` when it fails."""
    count = FileCount(progress, root, n, quiet_s)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with subprocess.Popen([sys.executable, "-c", _MAKE, str(root), str(n)], env=env) as proc:
        status = count.follow(proc)
    if status != 0:
        raise SyntheticDataError(f"making the synthetic data set under {root} failed (exit status {status}; its "
                                 "error is above); give --data a folder of your own, or free the room it needs")
    return count.written()


def _device(cfg: BenchConfig) -> torch.device:
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def measure(what: str, cfg: BenchConfig, root: str, report: EpochReport | None = None) -> dict[str, Any]:
    """In this process: the ceiling (``what`` "ceiling") or pipeline ``what``'s row, its epochs reported to
    ``report`` (``run_pipeline``); a failure becomes a row that says so (under DDP it raises: the other ranks
    would wait in its collectives)."""
    device = _device(cfg)
    with Monitor(device.index if device.type == "cuda" else None) as monitor:
        try:
            step = make_train_step(cfg.model, device, cfg.compile) if cfg.model else None
            if what == "ceiling":
                row = ceiling_row(step, cfg.batch_size, device, monitor)
            else:
                recipe = load_recipe(cfg.recipe) if cfg.recipe else None
                row = run_pipeline(what, root, cfg, device, step, monitor, recipe, report)
        except Exception as e:  # one pipeline failing must not lose the others' numbers
            if ranks()[1] > 1:
                raise
            return _failed(what, f"{type(e).__name__}: {_first_line(str(e))}", traceback.format_exc())
        row["nvml"], row["process"] = monitor.nvml, os.getpid()
        return row


def _first_line(text: str, most: int = 300) -> str:
    """An error's first line, cut at a space before ``most`` characters ("..." where it is cut): the reason
    and the way out stay whole in the table's notes; the traceback follows the table."""
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= most else line[:most].rsplit(" ", 1)[0] + " ..."


def _failed(what: str, why: str, detail: str) -> dict[str, Any]:
    return {"name": what, "pipeline": f"{what} (FAILED: {why})", "failure": why, "images_per_s": None,
            "error": detail, "epochs": [], "warnings": []}


def _step_bar(what: str, cfg: BenchConfig, progress: Progress) -> EpochBar:
    return EpochBar(step_name(what), [] if what == "ceiling" else epoch_kinds(cfg.epochs), progress)


def _here(what: str, cfg: BenchConfig, root: str, progress: Progress) -> dict[str, Any]:
    """``measure(what, ...)`` in this process (each rank's, under torchrun), its epochs shown as they end."""
    bar = _step_bar(what, cfg, progress)
    try:
        return measure(what, cfg, root, bar)
    finally:
        bar.close()


def _in_child(what: str, cfg: BenchConfig, root: str, progress: Progress) -> dict[str, Any]:
    """``measure(what, ...)`` in a fresh Python process (``bench.child``), which has exited on return; its
    epochs shown here as it reports them (``progress.follow``)."""
    with tempfile.TemporaryDirectory(prefix="gpufeed-bench-") as tmp:
        out = Path(tmp) / "row.json"
        read_end, write_end = os.pipe()
        request = json.dumps({"what": what, "config": asdict(cfg), "root": root, "out": str(out),
                              "progress_fd": write_end})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        bar = _step_bar(what, cfg, progress)
        try:
            try:
                proc = subprocess.Popen([sys.executable, "-m", "gpufeed.bench.child"], stdin=subprocess.PIPE,
                                        text=True, env=env, pass_fds=(write_end,))
            finally:
                os.close(write_end)  # the child's copy alone: the pipe ends when the child is done with it
            with proc:
                proc.stdin.write(request)
                proc.stdin.close()
                if not follow(proc, read_end, bar, time.monotonic() + CHILD_TIMEOUT_S):
                    proc.kill()
                    return _failed(what, f"no result within {CHILD_TIMEOUT_S:.0f} s", "the child process was stopped")
        finally:
            bar.close()
            os.close(read_end)
        if not out.exists():
            return _failed(what, f"its process exited with status {proc.returncode}", "see the output above")
        return json.loads(out.read_text())


def machine_description() -> dict[str, Any]:
    desc = {"host": platform.node(), "cpu_cores": usable_cores(), "python": sys.version.split()[0],
            "torch": torch.__version__, "gpu": None, "ranks": ranks()[1]}
    if torch.cuda.is_available():
        desc["gpu"] = torch.cuda.get_device_name()
        if desc["ranks"] > 1:
            desc["gpu"] = f"{desc['ranks']}x {desc['gpu']}"
    return desc


def steps(cfg: BenchConfig) -> list[str]:
    """What runs, in order: the model alone (its own rate, with a model), then each pipeline."""
    return (["ceiling"] if cfg.model else []) + list(cfg.pipelines)


def plan(cfg: BenchConfig, data: str) -> list[str]:
    """The lines said before anything runs: the machine, the steps, each pipeline's epochs and settings, and
    ``data`` (what the data set is)."""
    from .. import __version__

    m = machine_description()
    kinds = epoch_kinds(cfg.epochs)
    gpu = f"GPU {m['gpu']}" + (" (not used: --device cpu)" if cfg.device == "cpu" else "") if m["gpu"] else "no GPU"
    names = [step_name(w) for w in steps(cfg)]
    where = ("each in a fresh process" if ranks()[1] == 1 else f"in each of {ranks()[1]} ranks' processes")
    return [*wrap(f"gpufeed bench: {m['cpu_cores']} CPU cores, {gpu}; torch {m['torch']}, gpufeed {__version__}"),
            *wrap(f"runs: {', '.join(names)}; one after another, {where}", "  "),
            *wrap(f"each: {epochs_text(kinds)}, {settings(asdict(cfg))}", "  "),
            *wrap(f"data: {data}", "  ")]


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The ceiling (with a model) and every pipeline in ``cfg``, each in a fresh process (in this one, one
    after another, under torchrun), saying each step to ``progress`` (None: nothing said); returns the
    results as plain data (what --json writes)."""
    progress = progress or Progress(quiet=True)
    if cfg.recipe:
        load_recipe(cfg.recipe)  # a recipe that cannot be read fails here, before any process starts
    root = dataset_root(cfg, progress)
    run = _here if ranks()[1] > 1 else _in_child
    rows, whats = [], steps(cfg)
    for i, what in enumerate(whats, 1):
        progress.say(f"[{i}/{len(whats)}] {step_name(what)}: "
                     f"{CEILING if what == 'ceiling' else describe(what, None, cfg.workers)}")
        rows.append(run(what, cfg, root, progress))
        progress.say(f"[{i}/{len(whats)}] {row_outcome(rows[-1])}")
    ceiling = rows[0]["images_per_s"] if cfg.model else None
    base = next((r["images_per_s"] for r in rows if r["pipeline"] == "baseline"), None)
    for r in rows:
        rate = r["images_per_s"]
        r["vs_baseline"] = rate / base if base and rate else None
        r["of_ceiling"] = rate / ceiling if ceiling and rate else None
    nvml = next((r["nvml"] for r in rows if "nvml" in r), None)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["gpufeed", *sys.argv[1:]]) if Path(sys.argv[0]).name == "gpufeed" else " ".join(sys.argv),
        "machine": machine_description(),
        "config": asdict(cfg),
        "dataset": root,
        "nvml": nvml if nvml is not None else "not read",
        "isolated": run is _in_child,
        "epoch_kinds": epoch_kinds(cfg.epochs),
        "rows": rows,
        "within_spread": within_spread(rows),
    }
