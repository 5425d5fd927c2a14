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
from ..synth import create_synthetic_dataset
from .monitor import Monitor
from .pipeline import PIPELINES, ceiling_row, run_pipeline
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


def dataset_root(cfg: BenchConfig) -> str:
    if cfg.data:
        return cfg.data
    root = Path(cfg.cache_dir) / f"synth-{cfg.n}-seed0"
    if ranks()[0] == 0:
        create_synthetic_dataset(root, n=cfg.n, seed=0)
    together()
    return str(root)


def _device(cfg: BenchConfig) -> torch.device:
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def measure(what: str, cfg: BenchConfig, root: str) -> dict[str, Any]:
    """In this process: the ceiling (``what`` "ceiling") or pipeline ``what``'s row; a failure becomes a row
    that says so (under DDP it raises: the other ranks would wait in its collectives)."""
    device = _device(cfg)
    with Monitor(device.index if device.type == "cuda" else None) as monitor:
        try:
            step = make_train_step(cfg.model, device, cfg.compile) if cfg.model else None
            if what == "ceiling":
                row = ceiling_row(step, cfg.batch_size, device, monitor)
            else:
                recipe = load_recipe(cfg.recipe) if cfg.recipe else None
                row = run_pipeline(what, root, cfg, device, step, monitor, recipe)
        except Exception as e:  # one pipeline failing must not lose the others' numbers
            if ranks()[1] > 1:
                raise
            return _failed(what, f"{type(e).__name__}: {str(e)[:120]}", traceback.format_exc())
        row["nvml"], row["process"] = monitor.nvml, os.getpid()
        return row


def _failed(what: str, why: str, detail: str) -> dict[str, Any]:
    return {"pipeline": f"{what} (FAILED: {why})", "images_per_s": None, "error": detail, "epochs": [], "warnings": []}


def _in_child(what: str, cfg: BenchConfig, root: str) -> dict[str, Any]:
    """``measure(what, ...)`` in a fresh Python process (``bench.child``), which has exited on return."""
    with tempfile.TemporaryDirectory(prefix="gpufeed-bench-") as tmp:
        out = Path(tmp) / "row.json"
        request = json.dumps({"what": what, "config": asdict(cfg), "root": root, "out": str(out)})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            proc = subprocess.run([sys.executable, "-m", "gpufeed.bench.child"], input=request, text=True, env=env,
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return _failed(what, f"no result within {CHILD_TIMEOUT_S:.0f} s", "the child process was stopped")
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


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """The ceiling (with a model) and every pipeline in ``cfg``, each in a fresh process (in this one, one
    after another, under torchrun); returns the results as plain data (what --json writes)."""
    if cfg.recipe:
        load_recipe(cfg.recipe)  # a recipe that cannot be read fails here, before any process starts
    root = dataset_root(cfg)
    run = measure if ranks()[1] > 1 else _in_child
    rows = ([run("ceiling", cfg, root)] if cfg.model else []) + [run(name, cfg, root) for name in cfg.pipelines]
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
        "rows": rows,
    }
