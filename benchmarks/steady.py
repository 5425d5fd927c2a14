"""Whether the loader's rate holds where users train: every epoch's rate in four scenarios, each in a fresh
process, with plain loops.

    python3 benchmarks/steady.py DATA [--scenarios fresh,after-loaders,after-validation,hog] [--model none]
        [--epochs 6] [--batch-size 256] [--workers N] [--device cuda] [--hog-cores N] [--json OUT]

- ``fresh``: the training loader's epochs in a new process.
- ``after-loaders``: the usual DataLoader and an ``ImageLoader(device="cpu")`` run an epoch each in the
  process first (and are closed), as a script comparing loaders would; then the training loader's epochs.
- ``after-validation``: a whole validation pass (``ImageLoader(train=False)`` over the same folder, made once,
  as ``examples/train.py`` does) before the fourth and the sixth training epochs; the passes' rates are
  printed too.
- ``hog``: ``--hog-cores`` busy processes (default half the cores) run through the third and fourth epochs;
  the rate and the CPU share are read every half second, so that how fast placement follows the cores
  actually free shows as a curve.

Per scenario: every epoch's images/s (loader only, or with ``--model`` trained on each batch); the steady rate,
the median of the epochs from the third on that nothing marks (a validation pass before, the hog during);
epoch 2, the slowest unmarked later epoch and the slowest marked one, each as a share of the steady rate. It
uses ImageLoader's public arguments and ``stats`` alone, and the plain loop's training step (``plain_loop.py``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import fresh_run
from plain_loop import ceiling, make_step, plain_epoch

from gpufeed import ImageLoader
from gpufeed.cores import IdleCores

SCENARIOS = ("fresh", "after-loaders", "after-validation", "hog")
WINDOW_S = 0.5  # the hog scenario's reading interval
VALIDATION_BEFORE, HOG_DURING = (3, 5), (2, 3)  # the marked epochs (0-based)


def _hog(stop: "mp.synchronize.Event") -> None:
    """One busy core until ``stop`` is set (or the parent is gone)."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


class Hog:
    """``cores`` busy processes, started and stopped on demand."""

    def __init__(self, cores: int) -> None:
        self.cores, self._procs, self._stop = cores, [], mp.get_context("spawn").Event()

    def start(self) -> None:
        self._stop.clear()
        ctx = mp.get_context("spawn")
        self._procs = [ctx.Process(target=_hog, args=(self._stop,), daemon=True) for _ in range(self.cores)]
        for p in self._procs:
            p.start()

    def stop(self) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._procs = []


class _Windows:
    """The hog scenario's curve: images/s and the CPU share over each ``WINDOW_S`` window."""

    def __init__(self, loader, device) -> None:
        self.loader, self.device, self.rows, self.t0 = loader, device, [], time.perf_counter()
        self._n, self._start, self.hog = 0, self.t0, False
        self._cores = IdleCores()  # what the share's rule reads, read here on its own

    def restart(self) -> None:
        """At an epoch's start: the partial window of the last epoch is dropped (the time between epochs,
        a hog starting, is not the loader's)."""
        self._n, self._start = 0, time.perf_counter()

    def __call__(self, images: int) -> None:
        self._n += images
        now = time.perf_counter()
        if now - self._start >= WINDOW_S:
            share = self.loader.stats["cpu_share"] if self.loader.stats["decode_backend"] != "cpu" else None
            self.rows.append({"t": round(now - self.t0, 2), "images_per_s": self._n / (now - self._start),
                              "cpu_share": share, "hog": self.hog, "idle_cores": _rounded(self._cores.poll())})
            self._n, self._start = 0, now


def _rounded(idle: float | None) -> float | None:
    return None if idle is None else round(idle, 2)


def run_scenario(name: str, args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    result: dict = {"scenario": name, "model": args.model, "pid": os.getpid(), "epochs": [], "marked": [],
                    "validation": [], "windows": []}
    step = None
    if args.model != "none":
        if device.type != "cuda":
            raise SystemExit("--model needs a CUDA device")
        step = make_step(args.model, device, False)
        result["ceiling"] = ceiling(step, args.batch_size, device, 2.0)
    kwargs = dict(batch_size=args.batch_size, num_workers=args.workers, device=device)
    if name == "after-loaders":
        from gpufeed.bench.baseline import create_baseline_loader

        for _ in create_baseline_loader(args.data, batch_size=args.batch_size, num_workers=args.workers or 4):
            pass
        with ImageLoader(args.data, **{**kwargs, "device": "cpu"}) as cpu_loader:
            for _ in cpu_loader:
                pass
    validation = ImageLoader(args.data, train=False, **kwargs) if name == "after-validation" else None
    hog = Hog(args.hog_cores) if name == "hog" else None
    with ImageLoader(args.data, channels_last=step is not None, **kwargs) as loader:
        windows = _Windows(loader, device) if hog is not None else None
        try:
            for epoch in range(args.epochs):
                if validation is not None and epoch in VALIDATION_BEFORE:
                    result["validation"].append(plain_epoch(validation, None, device))
                    result["marked"].append(epoch)
                if hog is not None and epoch in (HOG_DURING[0], HOG_DURING[-1] + 1):
                    (hog.start if epoch == HOG_DURING[0] else hog.stop)()
                    windows.hog = epoch == HOG_DURING[0]
                if hog is not None and epoch in HOG_DURING:
                    result["marked"].append(epoch)
                loader.set_epoch(epoch)
                if windows is not None:
                    windows.restart()
                result["epochs"].append(plain_epoch(loader, step, device, windows))
        finally:
            if hog is not None:
                hog.stop()
            if validation is not None:
                validation.close()
        result["cpu_share"] = loader.stats["cpu_share"]
        result["decode_backend"] = loader.stats["decode_backend"]
    if windows is not None:
        result["windows"] = windows.rows
    unmarked = [r for i, r in enumerate(result["epochs"]) if i >= 2 and i not in result["marked"]]
    result["steady"] = statistics.median(unmarked or result["epochs"][1:])
    return result


def _in_fresh_process(name: str, args) -> dict:
    cmd = [sys.executable, __file__, args.data, "--one", name, "--model", args.model, "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--device", args.device, "--hog-cores", str(args.hog_cores)]
    return {"scenario": name, **fresh_run(cmd + (["--workers", str(args.workers)] if args.workers else []),
                                          timeout=args.timeout)}


def _share(value: float, steady: float) -> str:
    return f"{100 * value / steady:.0f}%"


def report(results: list[dict]) -> None:
    print("| scenario | images/s by epoch (* marked) | steady | epoch 2 | slowest unmarked | slowest marked | "
          "validation passes, images/s |\n|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['scenario']} | FAILED: {r['error'][-200:]!r} | | | | | |")
            continue
        e, steady, marked = r["epochs"], r["steady"], set(r["marked"])
        rates = ", ".join(f"{x:,.0f}" + ("*" if i in marked else "") for i, x in enumerate(e))
        second = _share(e[1], steady) if len(e) > 1 else "-"
        unmarked = [x for i, x in enumerate(e) if i >= 2 and i not in marked]
        slowest = _share(min(unmarked), steady) if unmarked else "-"
        worst_marked = _share(min(e[i] for i in marked), steady) if marked else "-"
        val = ", ".join(f"{x:,.0f}" for x in r["validation"]) or "-"
        print(f"| {r['scenario']} | {rates} | {steady:,.0f} | {second} | {slowest} | {worst_marked} | {val} |")
    for r in results:
        if r.get("windows"):
            print(f"\n{r['scenario']}: every {WINDOW_S} s (t in s from the first epoch's start; the hog through the "
                  "third and fourth epochs)")
            print("| t | images/s | CPU share | idle cores | hog |\n|---|---|---|---|---|")
            for w in r["windows"]:
                share = "-" if w["cpu_share"] is None else f"{w['cpu_share']:.2f}"
                idle = "-" if w.get("idle_cores") is None else f"{w['idle_cores']:.1f}"
                print(f"| {w['t']} | {w['images_per_s']:,.0f} | {share} | {idle} | {'on' if w['hog'] else ''} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--model", default="none")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hog-cores", type=int, default=max(1, len(os.sched_getaffinity(0)) // 2))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a scenario may take")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one scenario in this process (the fresh process)
    p.add_argument("--json")
    args = p.parse_args()
    if args.epochs < 5 and not args.one and {"hog", "after-validation"} & set(args.scenarios.split(",")):
        p.error("the hog and after-validation scenarios need --epochs 5 or more (they mark the third to the "
                "sixth epochs)")
    if args.one:
        result = run_scenario(args.one, args)
        if args.json:
            Path(args.json).write_text(json.dumps(result))
        return 0
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    print(f"{args.data}: model {args.model}, batch {args.batch_size}, {args.epochs} epochs a scenario, "
          f"device {args.device}")
    results = []
    for name in names:
        results.append(_in_fresh_process(name, args))
        print(f"{name}: " + (results[-1].get("error", "")[-300:] or ", ".join(
            f"{x:,.0f}" for x in results[-1]["epochs"]) + " images/s by epoch"), flush=True)
    print()
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
