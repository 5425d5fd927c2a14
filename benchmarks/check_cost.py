"""What the bad-input checks cost on clean data, measured two ways, checks on and off interleaved.

    python3 benchmarks/check_cost.py DATA_DIR [--n 400] [--rounds 5]
    python3 benchmarks/check_cost.py DATA_DIR --loader [--decode cpu,gpu] [--workers W] [--batch-size 256]

The checks that run for every clean sample are the structural JPEG test (``gpu_safe_jpeg``: on the CPU
path before a cropped decode, on the GPU path before a file may go to a GPU decoder) and the header's
pixel cap; strict decoding is a flag of the same decode call and costs nothing. The structural test is
switched off through ``PipelineSpec.check_structure`` (which exists for this measurement).

Default: the workers' per-sample function of each path, in this process (``load_sample_into``: read,
decode, crop, resize; ``encode_sample_into``: read, header, box, bytes into the ring).
``--loader``: whole ``ImageLoader`` epochs (loader only: each batch reaches the device and is read once),
two loaders alive side by side, one with the checks and one without, epochs alternating (the order
flips every round); images/s is the median over the rounds. ``gpu`` needs CUDA and a GPU decoder.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import torch

import gpufeed.workers as workers
from gpufeed import ImageLoader
from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.ring import Ring
from gpufeed.sources import folder_source


def per_sample(args) -> None:
    src = folder_source(args.data)
    n = min(args.n, len(src))
    specs = {(path, on): workers.PipelineSpec(src, AugmentSpec(), 10**8, check_structure=on,
                                              gpu_bytes_capacity=(2 << 20) if path == "gpu" else 0)
             for path in ("cpu", "gpu") for on in (True, False)}
    decoders = {on: CpuDecoder(check_structure=on) for on in (True, False)}
    out = np.empty((224, 224, 3), np.uint8)
    shm = shared_memory.SharedMemory(create=True, size=Ring.nbytes(1, n, 224, 2 << 20))
    ring = Ring(shm, 1, n, 224, 2 << 20)

    def run(path: str, on: bool) -> float:
        spec, dec = specs[(path, on)], decoders[on]
        t0 = time.perf_counter()
        for i in range(n):
            if path == "cpu":
                workers.load_sample_into(spec, dec, 0, 0, i, out)
            else:
                workers.encode_sample_into(spec, dec, 0, 0, i, ring, 0, i)
        return (time.perf_counter() - t0) / n

    times = {key: [] for key in specs}
    for path in ("cpu", "gpu"):
        run(path, True)  # warm-up: page cache, allocations
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                times[(path, on)].append(run(path, on))
    ring = None  # drop the views before the block is closed
    shm.close()
    shm.unlink()
    print(f"{n} files from {args.data}, {args.rounds} interleaved rounds, median per-sample time")
    print("| worker path | with checks | without | cost of the checks |\n|---|---|---|---|")
    for path, label in (("cpu", "CPU decode (load_sample_into)"), ("gpu", "GPU path (encode_sample_into)")):
        on, off = statistics.median(times[(path, True)]), statistics.median(times[(path, False)])
        print(f"| {label} | {on * 1e6:.0f} us | {off * 1e6:.0f} us | {100 * (on / off - 1):+.1f}% |")


def _epoch(loader: ImageLoader, device: torch.device) -> float:
    n, t0 = 0, time.perf_counter()
    for images, _ in loader:
        images.to(device, non_blocking=True).sum()
        n += images.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / (time.perf_counter() - t0)


def loaders(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"loader epochs over {args.data}, {args.workers} workers, batch {args.batch_size}, device {device}, "
          f"{args.rounds} rounds of one epoch each, checks on/off alternating")
    print("| path | with checks images/s | without | cost of the checks | rounds (on / off) |\n|---|---|---|---|---|")
    for decode in args.decode.split(","):
        if decode == "gpu" and device.type != "cuda":
            print(f"| {decode} | skipped: no CUDA device here | | | |")
            continue
        pair = {}
        for on in (True, False):
            loader = ImageLoader(args.data, batch_size=args.batch_size, num_workers=args.workers, device=device,
                                 decode=decode)
            if decode == "gpu" and loader.decode_backend == "cpu":
                raise SystemExit(f"no GPU decoder works here: {loader.decode_reason}")
            loader.spec = dataclasses.replace(loader.spec, check_structure=on)  # before the workers start
            _epoch(loader, device)  # warm-up: workers start, page cache, the share controller settles
            pair[on] = loader
        rates = {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                rates[on].append(_epoch(pair[on], device))
        shares = {on: pair[on].stats["cpu_share"] for on in pair}
        for loader in pair.values():
            loader.close()
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        runs = " / ".join(", ".join(f"{x:,.0f}" for x in rates[k]) for k in (True, False))
        share = f" (CPU share {shares[True]:.2f} / {shares[False]:.2f})" if decode == "gpu" else ""
        print(f"| {decode}{share} | {on:,.0f} | {off:,.0f} | {100 * (off / on - 1):+.1f}% | {runs} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--loader", action="store_true")
    p.add_argument("--decode", default="cpu,gpu")
    p.add_argument("--workers", type=int, default=workers.usable_cores())
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args()
    (loaders if args.loader else per_sample)(args)


if __name__ == "__main__":
    main()
