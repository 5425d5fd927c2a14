"""What ``verify_checksums=True`` costs: a loader's first epoch over a `gpufeed shards` folder, with the check
and without, each in a fresh process (the check is paid once per machine and shard, in a folder of answers each
loader makes afresh, so a fresh process is where it shows), alternating round by round.

    python benchmarks/verify_cost.py SHARDS [--rounds 3] [--batch-size 64] [--image-size 64] [--workers 2]

Each run: ImageLoader made, one whole epoch read (CPU, validation crops, fixed order), the time from making
the loader to the epoch's end. Prints the machine, the shards' size, each variant's median seconds and
spread (min-max) and images/s, and the check's cost against the plain run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_epoch(shards: str, verify: bool, batch_size: int, image_size: int, workers: int) -> dict:
    from gpufeed import ImageLoader

    began = time.perf_counter()
    with ImageLoader(shards, batch_size=batch_size, image_size=image_size, device="cpu", num_workers=workers,
                     train=False, drop_last=False, verify_checksums=verify) as loader:
        n = sum(len(labels) for _, labels in loader)
        skipped = loader.stats["skipped_count"]
    return {"seconds": time.perf_counter() - began, "images": n, "skipped": skipped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shards", help="a folder `gpufeed shards` wrote (its manifest.json lists each shard's sha256)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)  # one run, in a fresh process
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_epoch(args.shards, args.child == "on", args.batch_size, args.image_size, args.workers)))
        return

    from gpufeed.bench.run import machine_description

    manifest = json.load(open(os.path.join(args.shards, "manifest.json")))
    size = sum(s["size"] for s in manifest["shards"])
    print(f"machine: {machine_description()}")
    print(f"shards: {args.shards}: {len(manifest['shards'])} shards, {size / 1e6:.0f} MB, {manifest['samples']} "
          f"samples; batch {args.batch_size}, image size {args.image_size}, {args.workers} workers")
    times: dict[str, list[float]] = {"off": [], "on": []}
    images = 0
    for r in range(args.rounds):
        for variant in (("off", "on") if r % 2 == 0 else ("on", "off")):  # alternating: drift hits both
            cmd = [sys.executable, __file__, args.shards, "--child", variant, "--batch-size", str(args.batch_size),
                   "--image-size", str(args.image_size), "--workers", str(args.workers)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            if run["skipped"]:
                raise SystemExit(f"{run['skipped']} samples skipped: the shards are not as their manifest lists them")
            times[variant].append(run["seconds"])
            images = run["images"]
            print(f"round {r + 1}, verify_checksums={variant == 'on'}: {run['seconds']:.2f} s", flush=True)
    print()
    print("| verify_checksums | median s | spread (min-max) | images/s |")
    print("|---|---|---|---|")
    for variant in ("off", "on"):
        t = times[variant]
        med = statistics.median(t)
        print(f"| {variant == 'on'} | {med:.2f} | {min(t):.2f}-{max(t):.2f} | {images / med:,.0f} |")
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"\nthe check's cost: {on - off:+.2f} s a first epoch ({(on - off) / off:+.1%}); "
          f"{(on - off) / (size / 1e9):+.2f} s per GB of shards")
    print(f"command: python benchmarks/verify_cost.py {args.shards} --rounds {args.rounds} --batch-size "
          f"{args.batch_size} --image-size {args.image_size} --workers {args.workers}")


if __name__ == "__main__":
    main()
