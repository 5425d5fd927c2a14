"""Loader-only images/s for several worker counts, CPU shares and decoders, each a fresh ImageLoader.

    python3 benchmarks/sweep.py DATA_DIR [--device cuda] [--epochs 3] [--batch-size 256] [CONFIG ...]

CONFIG is ``<workers>,<cpu share>,<decode>``: e.g. ``16,auto,gpu`` (the defaults on a 16-core GPU machine),
``16,0,nvjpeg`` (the engines alone), ``16,1,cpu`` (CPU decode). Per config: one warm-up epoch, then
``--epochs`` timed epochs (each batch reaches the device and is read once, as in ``gpufeed bench --model
none``). Printed per config: images/s (median epoch), images/s within epochs (second batch to last: what
an epoch boundary costs is left out), the CPU share at the end, and the cores the process tree kept busy.
Prints what it measured with the machine and the command, then a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from gpufeed import ImageLoader
from gpufeed.bench.monitor import Monitor
from gpufeed.bench.run import machine_description


def parse(config: str) -> tuple[int, float | str, str]:
    try:
        workers, share, decode = config.split(",")
        return int(workers), share if share == "auto" else float(share), decode
    except ValueError:
        raise SystemExit(f"config must be <workers>,<cpu share>,<decode>, e.g. 16,auto,gpu; got {config!r}") from None


def run(data: str, config: str, epochs: int, batch_size: int, device: torch.device) -> str:
    workers, share, decode = parse(config)
    loader = ImageLoader(data, batch_size=batch_size, num_workers=workers, device=device, decode=decode,
                         cpu_share=share)
    monitor = Monitor(device.index if device.type == "cuda" else None)
    rates, inner = [], []
    try:
        for e in range(epochs + 1):
            if e == 1:
                monitor.start()
            n, t0, arrivals = 0, time.perf_counter(), []
            for images, _ in loader:
                images.sum()
                n += images.shape[0]
                arrivals.append(time.perf_counter())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if e >= 1:
                rates.append(n / (time.perf_counter() - t0))
                if len(arrivals) > 2:
                    inner.append(batch_size * (len(arrivals) - 2) / (arrivals[-1] - arrivals[1]))
        monitor.stop()
        stats = loader.stats
    finally:
        loader.close()
    within = f"{statistics.median(inner):,.0f}" if inner else "-"
    return (f"| {config} | {stats['decode_backend']} | {statistics.median(rates):,.0f} "
            f"({', '.join(f'{r:,.0f}' for r in rates)}) | {within} | {stats['cpu_share']:.2f} | "
            f"{monitor.cores_busy or 0:.1f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("configs", nargs="*")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_intermixed_args(argv)
    device = torch.device(args.device)
    configs = args.configs or (["16,auto,gpu", "16,0,gpu", "16,1,cpu"] if device.type == "cuda" else ["2,1,cpu"])
    m = machine_description()
    print(f"{time.strftime('%Y-%m-%d')}, {m['cpu_cores']} CPU cores, GPU {m['gpu'] or 'none'}, torch {m['torch']}; "
          f"python3 benchmarks/sweep.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    rows = [run(args.data, c, args.epochs, args.batch_size, device) for c in configs]
    print("| config (workers,share,decode) | decoder | images/s median (epochs) | within epochs | share at end "
          "| cores busy |\n|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
