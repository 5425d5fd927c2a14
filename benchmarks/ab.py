"""The reference a/b harness: this working tree against a reference tree, in fresh processes, alternating.

    python benchmarks/ab.py DATA --ref REV|DIR [--ref REV|DIR ...] [--rows none,resnet50,resnet18,recipe,
        compiled-resnet50] [--rounds 3] [--epochs 4] [--batch-size 256] [--workers N] [--device cuda] [--json OUT]

``--ref``: a commit of this repository (exported with ``git archive`` into ``~/.cache/gpufeed/ab/<commit>``,
its cropped-decode extension built there) or a folder holding a tree's ``src/``; several may be given, each
compared with the working tree. Each round runs every row with each tree in turn (the order reversed every
other round, so that drift over the run falls on all), each run a fresh process of ``plain_loop.py`` with
that tree's ``src`` first on PYTHONPATH. Rows: ``none`` (loader only), a model (its share of its own rate, the
ceiling measured in the same process), ``recipe`` (trivialaugment-mix with ResNet-50), ``compiled-MODEL``,
``validation`` (whole ``train=False`` passes). Prints per row the median and spread of each tree, the change
paired by round and the verdict: faster or slower when every run of one tree beats every run of the other,
else within noise.

``--bench`` adds ``gpufeed bench --pipelines gpufeed`` of the working tree to every round, beside its plain
loop and with the same loader settings, and prints how far the bench's figure is from the loop's: the
bench's own check that it measures what a training script gets. ``--ref`` may then be left out.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, bench_cmd, bench_figure, describe, figure, fresh_run, paired, plain_loop_cmd, verdict


def reference_tree(ref: str) -> Path:
    """The reference's root (holding ``src/gpufeed``): ``ref`` itself when it is such a folder, else the commit
    ``ref`` of this repository, exported once and its extension built."""
    if (Path(ref) / "src" / "gpufeed").is_dir():
        return _with_extension(Path(ref).resolve())
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--ref {ref!r}: neither a folder with src/gpufeed nor a commit of {REPO} ({e})") from None
    root = Path.home() / ".cache" / "gpufeed" / "ab" / commit
    if not (root / "src" / "gpufeed").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return _with_extension(root)


def _with_extension(root: Path) -> Path:
    """``root`` with its cropped-decode extension built where it can be (a tree without it decodes whole
    images on the CPU, about a fifth more work a sample: each run records whether it had it)."""
    if (root / "setup.py").exists():
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, capture_output=True)
    return root


class _Stopped(Exception):
    """SIGTERM arrived (a `timeout` around the harness)."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped


def _compared(row: str, before: list[dict], after: list[dict]) -> tuple[list[float], list[float], list[str]]:
    """Two sets of runs of a row: their figures, and the table's cells (the row, the median and spread of
    ``before``, of ``after``, the change of the medians, the change paired by round)."""
    old, new = [v for v in map(figure, before) if v is not None], [v for v in map(figure, after) if v is not None]
    share = any(r.get("of_ceiling") is not None for r in before + after)
    change = f"{100 * (statistics.median(new) / statistics.median(old) - 1):+.1f}%" if old and new else "-"
    return old, new, [f"{row} ({'of its own rate' if share else 'images/s'})", describe(old, share),
                      describe(new, share), change, paired(before, after)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--ref", action="append", default=[], help="a commit or a folder with src/; repeatable")
    p.add_argument("--bench", action="store_true", help="also time gpufeed bench of the working tree each round")
    p.add_argument("--rows", default="none,resnet50,resnet18,recipe,compiled-resnet50")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--ceiling-seconds", type=float, default=5.0, help="how long each run times the model alone")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before it is stopped")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole comparison: no round is begun that would end past it")
    p.add_argument("--log", help="append every run's output to this file")
    p.add_argument("--json")
    args = p.parse_args()
    start = time.monotonic()  # --budget counts the references' export and build too
    signal.signal(signal.SIGTERM, _stop)  # a `timeout` ending the step still gets the tables of the runs made
    if not args.ref and not args.bench:
        p.error("give --ref REV|DIR (repeatable), --bench, or both")
    trees = {ref: reference_tree(ref) / "src" for ref in args.ref}
    trees["current"] = REPO / "src"
    if args.bench:
        trees["bench"] = REPO / "src"
    rows = args.rows.split(",")
    if args.bench and "validation" in rows:
        p.error("gpufeed bench times training loaders: leave --bench out, or the validation row")
    runs: dict[tuple[str, str], list[dict]] = {(r, t): [] for r in rows for t in trees}
    longest, done = 0.0, 0
    try:
        for rnd in range(args.rounds):
            if args.budget is not None and time.monotonic() - start + longest > args.budget:
                print(f"round {rnd + 1} not begun: it would end past --budget {args.budget:.0f} s "
                      f"(a round took up to {longest:.0f} s)", flush=True)
                break
            began = time.monotonic()
            order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
            for row in rows:
                for tree in order:
                    cmd = bench_cmd(args.data, row, args) if tree == "bench" else plain_loop_cmd(args.data, row, args)
                    run = fresh_run(cmd, src=trees[tree], timeout=args.timeout,
                                    log=Path(args.log) if args.log else None)
                    if tree == "bench":
                        run = bench_figure(run)
                    runs[(row, tree)].append(run)
                    print(f"round {rnd + 1} {row} {tree}: " + (run.get("error") or run.get("unsupported") or
                          ", ".join(f"{x:,.0f}" for x in run["epochs"]) + " images/s by epoch"
                          + (f", {100 * run['of_ceiling']:.1f}% of {run['ceiling']:,.0f}" if run.get("ceiling")
                             else "")) + (f"; {run['wall_s']:.0f} s" if run.get("wall_s") else ""), flush=True)
            longest, done = max(longest, time.monotonic() - began), done + 1
    except _Stopped:
        print(f"stopped (SIGTERM) in round {done + 1}: the tables below count the runs made", flush=True)
    failed = {f"{row}/{tree}": n for (row, tree), rs in runs.items() if (n := sum("error" in r for r in rs))}
    if failed:
        print(f"\nruns that failed, left out of the tables: {failed}")
    ext = {tree: {r.get("cropped_decode") for row in rows for r in runs[(row, tree)] if "error" not in r}
           for tree in trees if tree != "bench"}  # the bench runs the working tree's code
    if len({v for values in ext.values() for v in values}) > 1:
        print(f"\nWARNING: the trees did not all have the cropped-decode extension: {ext}; the CPU decode differs")
    summary = {}
    if args.bench:
        print(f"\ngpufeed bench against a plain loop over the same loader, the working tree; {done} rounds, "
              f"{args.epochs} epochs a run, batch {args.batch_size}")
        print("| row | gpufeed bench | plain loop | bench against loop | paired, by round |\n|---|---|---|---|---|")
        for row in rows:
            loop, bench, (what, loop_cell, bench_cell, gap, by_round) = _compared(row, runs[(row, "current")],
                                                                                 runs[(row, "bench")])
            summary[f"{row}/bench"] = {"bench": bench, "loop": loop}
            print(f"| {what} | {bench_cell} | {loop_cell} | {gap} | {by_round} |")
    for ref in args.ref:
        print(f"\nreference {ref} ({trees[ref].parent}) against the current tree ({REPO}); "
              f"{done} rounds, {args.epochs} epochs a run, batch {args.batch_size}")
        print("| row | reference | current | change | paired, by round | verdict |\n|---|---|---|---|---|---|")
        for row in rows:
            old, cur, cells = _compared(row, runs[(row, ref)], runs[(row, "current")])
            summary[f"{row}/{ref}"] = {"reference": old, "current": cur, "verdict": verdict(old, cur)}
            print(f"| {' | '.join(cells)} | {verdict(old, cur)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"refs": args.ref, "rounds": done, "summary": summary,
                       "runs": {f"{r}/{t}": v for (r, t), v in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
