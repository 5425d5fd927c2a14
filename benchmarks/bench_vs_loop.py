"""`gpufeed bench` against a plain training loop over the same loader, in fresh processes, alternating: the
bench's own check that it measures what a training script gets.

    python benchmarks/bench_vs_loop.py DATA [--models none,resnet50,resnet18] [--rounds 2] [--epochs 4]
        [--batch-size 256] [--workers N] [--device cuda] [--json OUT]

Each round runs, for each model, ``gpufeed bench --pipelines gpufeed`` and ``plain_loop.py`` with the same
loader settings, the order swapped every other round. Prints per model both figures (images/s for the loader
alone, else the share of the model's own rate, each against the ceiling measured in its own run) and how far
the bench is from the loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from harness import describe, figure, fresh_run, plain_loop_cmd


def bench_cmd(data: str, model: str, args) -> list[str]:
    cmd = [sys.executable, "-m", "gpufeed", "bench", "--data", data, "--pipelines", "gpufeed", "--model", model,
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--device", args.device]
    return cmd + (["--workers", str(args.workers)] if args.workers else [])


def bench_figure(run: dict) -> dict:
    """The bench's JSON as a plain loop's result: its gpufeed row's rate and share."""
    if "error" in run:
        return run
    row = next(r for r in run["rows"] if r["pipeline"].startswith("gpufeed"))
    return {"images_per_s": row["images_per_s"], "of_ceiling": row.get("of_ceiling"),
            "epochs": [e["images_per_s"] for e in row["epochs"]], "bench_overhead": row.get("bench_overhead")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--models", default="none,resnet50,resnet18")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json")
    args = p.parse_args()
    models = args.models.split(",")
    runs = {(m, k): [] for m in models for k in ("bench", "loop")}
    for rnd in range(args.rounds):
        for model in models:
            for kind in (("bench", "loop") if rnd % 2 == 0 else ("loop", "bench")):
                if kind == "bench":
                    run = bench_figure(fresh_run(bench_cmd(args.data, model, args), timeout=args.timeout))
                else:
                    run = fresh_run(plain_loop_cmd(args.data, model, args), timeout=args.timeout)
                runs[(model, kind)].append(run)
                print(f"round {rnd + 1} {model} {kind}: " + (run.get("error") or
                      ", ".join(f"{x:,.0f}" for x in run["epochs"]) + " images/s by epoch"), flush=True)
    print(f"\ngpufeed bench against a plain loop; {args.rounds} rounds, {args.epochs} epochs a run, "
          f"batch {args.batch_size}")
    print("| model | gpufeed bench | plain loop | bench against loop |\n|---|---|---|---|")
    for model in models:
        bench = [v for v in map(figure, runs[(model, "bench")]) if v is not None]
        loop = [v for v in map(figure, runs[(model, "loop")]) if v is not None]
        share = model != "none"
        gap = f"{100 * (statistics.median(bench) / statistics.median(loop) - 1):+.1f}%" if bench and loop else "-"
        print(f"| {model} ({'of its own rate' if share else 'images/s'}) | {describe(bench, share)} | "
              f"{describe(loop, share)} | {gap} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{m}/{k}": v for (m, k), v in runs.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
