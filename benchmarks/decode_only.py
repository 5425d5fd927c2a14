"""Decode throughput per backend on files already in memory (no file reading), and the GPU stage's.

    python3 benchmarks/decode_only.py DATA_DIR [--batch 256] [--rounds 3] [--n 2560]

Rows: the CPU decoder (libjpeg-turbo through simplejpeg, full decode, one thread), then for each GPU
decoder that works here (nvJPEG's engines called directly, nvImageCodec, torchvision): its decode alone
(one decoder, batches into one device buffer, calls of its ``job_images``), and the whole GPU stage as the
loader runs it (its decoder threads, then one fused crop/resize/flip/normalise kernel; batch k+1 started
before batch k is finished). images/s is the median of ``--rounds``, the device synchronised before the
clock is read, after a warm-up round. A decoder that does not work here gets a row saying why. Prints the
machine and the command, then the table.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch

from gpufeed.augment.params import AugmentSpec
from gpufeed.bench.run import machine_description
from gpufeed.decode.base import DecodeJob
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.stage.gpu import GpuDecodeAugment
from gpufeed.placement import create_gpu_decoders, gpu_memory
from gpufeed.ring import KIND_BYTES, SlotView
from gpufeed.records import HostBatch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _time(fn: Callable[[], int], rounds: int, sync: Callable[[], None]) -> tuple[float, list[float]]:
    fn()  # warm-up: handles, buffers, kernels
    rates = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        n = fn()
        sync()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def encoded_batches(datas: list[bytes], batch: int, size: int = 224) -> list[HostBatch]:
    """The files as the workers leave them for a GPU decoder: bytes and a crop box per sample."""
    spec, cpu, out = AugmentSpec(image_size=size), CpuDecoder(), []
    for b in range(len(datas) // batch):
        part = datas[b * batch : (b + 1) * batch]
        meta = np.zeros((batch, 9), np.int64)
        arena = np.zeros((batch, max(map(len, part))), np.uint8)
        for i, d in enumerate(part):
            w, h, _ = cpu.header(d, "x")
            box = spec.draw(w, h, seed=0, epoch=0, index=b * batch + i)
            meta[i] = (KIND_BYTES, len(d), w, h, box.x, box.y, box.width, box.height, int(box.flip))
            arena[i, : len(d)] = np.frombuffer(d, np.uint8)
        slot = SlotView(np.zeros((batch, size, size, 3), np.uint8), np.zeros(batch, np.int64), meta, arena)
        out.append(HostBatch(torch.zeros(batch, dtype=torch.int64), slot, indices=list(range(batch)), consumed=batch,
                             release=lambda: None, path=lambda i: "x"))
    return out


def decode_only(decoder, batches: list[HostBatch], device: torch.device) -> Callable[[], int]:
    """Each batch decoded whole into one device buffer by one decoder, in calls of its ``job_images``."""
    extents = [b.slot.meta[:, 2] * b.slot.meta[:, 3] * 3 for b in batches]
    flat = torch.empty(int(max(e.sum() for e in extents)), dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    jobs = []
    for b, e in zip(batches, extents):
        meta, arena = b.slot.meta, b.slot.arena
        offsets = np.concatenate([[0], np.cumsum(e)[:-1]])
        job = DecodeJob((arena.ctypes.data + np.arange(len(meta)) * arena.strides[0]).astype(np.uint64),
                        meta[:, 1].astype(np.uint64), (flat.data_ptr() + offsets).astype(np.uint64), meta[:, 3],
                        meta[:, 2], device, (arena, flat))
        step = decoder.job_images
        jobs += [job[a : a + step] for a in range(0, len(job), step)]

    def run() -> int:
        return sum(int(decoder.decode(j, stream).sum()) for j in jobs)

    return run


def whole_stage(decoders: list, batches: list[HostBatch], device: torch.device) -> Callable[[], int]:
    batch = len(batches[0].labels)
    memory = gpu_memory(batch_size=batch, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=1)
    stage = GpuDecodeAugment(decoders, device=device, image_size=224, mean=MEAN, std=STD, dtype=torch.float32,
                             channels_last=True, max_pixels=10**8, buffer_bytes=memory.buffer_bytes)
    stream = torch.cuda.Stream(device)

    def run() -> int:  # as the Prefetcher runs it: batch k+1 started before batch k finishes
        with torch.cuda.stream(stream):
            pending = None
            for b in batches:
                started = stage.start(b)
                if pending is not None:
                    stage.finish(pending)
                pending = started
            stage.finish(pending)
        return sum(len(b.labels) for b in batches)

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=2560, help="files to read (whole batches of them are used)")
    args = p.parse_args(argv)
    files = sorted(glob.glob(f"{args.data}/*/*.jpg"))[: args.n]
    datas = [open(f, "rb").read() for f in files]
    batch = min(args.batch, len(datas))
    used = len(datas) // batch * batch
    rows = []
    cpu = CpuDecoder()
    med, rates = _time(lambda: sum(1 for d in datas[:used] if cpu.decode(d, "x", fast=True) is not None), args.rounds,
                       lambda: None)
    rows.append(("cpu (libjpeg-turbo), one thread, decode only", med, rates, ""))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    batches = encoded_batches(datas[:used], batch) if cuda else []
    for choice in ("nvjpeg", "nvimgcodec", "torchvision"):
        try:
            decoders, how = create_gpu_decoders(choice, device)
        except ValueError as e:  # not on this machine: say why, keep the other rows
            rows.append((choice, None, [], f"unavailable: {e}"))
            continue
        med, rates = _time(decode_only(decoders[0], batches, device), args.rounds, sync)
        rows.append((f"{choice}: decode only, one decoder", med, rates, how))
        med, rates = _time(whole_stage(decoders, batches, device), args.rounds, sync)
        rows.append((f"{choice}: decode + fused augment, {len(decoders)} decoder thread(s)", med, rates, ""))
    m = machine_description()
    print(f"{time.strftime('%Y-%m-%d')}, {m['cpu_cores']} CPU cores, GPU {m['gpu'] or 'none'}, torch {m['torch']}; "
          f"python3 benchmarks/decode_only.py {' '.join(sys.argv[1:] if argv is None else argv)}; "
          f"{used} files in memory, batch {batch}")
    print("| path | images/s (median) | rounds | note |\n|---|---|---|---|")
    for name, med, rates, note in rows:
        rate = "-" if med is None else f"{med:,.0f}"
        print(f"| {name} | {rate} | {', '.join(f'{r:,.0f}' for r in rates)} | {note} |")


if __name__ == "__main__":
    main()
