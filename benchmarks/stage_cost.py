"""What each stage of the GPU decode path costs a training beside it, stage by stage.

    python3 benchmarks/stage_cost.py DATA [--model resnet18] [--rate 5000] [--seconds 4] [--batch 128]

A model trains on one GPU-resident batch (bf16, channels_last, SGD, as ``gpufeed bench``) while a thread of
the same process runs one stage of the GPU path on its own stream, ``--batch`` images at a time, paced at
``--rate`` images/s, on JPEGs of DATA already in page-locked memory:

- ``engines``: nvJPEG's hardware decode of the JPEGs into a device buffer (``NvJpegHwDecoder``);
- ``kernel``: the fused crop/resize/flip/normalise kernel over decoded images (RandomResizedCrop boxes) into
  a (B, 3, 224, 224) float32 channels_last batch;
- ``engines+kernel``: both, as the loader runs them;
- ``copies``: host-to-device copies of as many bytes as the CPU path's decoded crop rows would be;
- ``kernel8``: the fused kernel writing the crops' uint8 pixels (B, 3, 224, 224), as it does for a recipe with
  pixel ops;
- ``ops``: the trivialaugment-mix recipe's per-sample ops (``gpufeed bench --recipe trivialaugment-mix``:
  TrivialAugmentWide, normalising into float32 channels_last, RandomErasing) from uint8 crops, drawn for a
  new epoch each batch (``SampleOps.from_pixels``);
- ``mix``: that recipe's MixUp/CutMix on a float32 channels_last batch, in place (``BatchMix``; as for a batch
  from the GPU stage's own outputs, a recipe without pixel ops);
- ``recipe``: ``kernel8``, ``ops`` and ``mix``, as the loader runs them for that recipe (MixUp into a new batch
  where its kernel runs, since the ops made the batch).

A stage name may end in options after ``:``, comma-separated: ``prio`` (its stream at high priority),
``plain`` (nvJPEG without ``NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION``: chroma upsampled by replication).

Per stage: the training's rate beside it over its rate alone (the mean of the rates measured before and
after all stages), the stage's own device time per batch on CUDA events with nothing else running, and the
training time the stage took per 1,000 images it processed. The stages are where the GPU path's cost
beside a training can come from; the sum over the stages against the loader's measured cost says what is
left (synchronisation, the loader's Python).
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import statistics
import sys
import threading
import time

import numpy as np
import torch

from gpufeed.augment.fused import normalize_constants, resized_crop_triton
from gpufeed.augment.mix import read_batch_transform
from gpufeed.augment.ops import SampleOps
from gpufeed.augment.recipe import read_transform
from gpufeed.bench.recipes import load_recipe
from gpufeed.bench.run import machine_description, make_train_step, model_rate
from gpufeed.decode.base import DecodeJob
from gpufeed.decode.cpu import CpuDecoder

SIZE = 224


def _box(w: int, h: int, rng: random.Random) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (scale 0.08-1, ratio 3/4-4/3), as torchvision draws it, else the centre."""
    for _ in range(10):
        area = w * h * rng.uniform(0.08, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        bw, bh = int(round((area * ratio) ** 0.5)), int(round((area / ratio) ** 0.5))
        if 0 < bw <= w and 0 < bh <= h:
            return rng.randint(0, w - bw), rng.randint(0, h - bh), bw, bh
    s = min(w, h)
    return (w - s) // 2, (h - s) // 2, s, s


class Stage:
    """One stage's batch on the device, run on a stream of its own: ``run()`` queues it."""

    def __init__(self, kind: str, datas: list[np.ndarray], images: list[np.ndarray], device: torch.device) -> None:
        kind, _, opts = kind.partition(":")
        opts = set(filter(None, opts.split(",")))
        self.kind, self.stream = kind, torch.cuda.Stream(device, priority=-1 if "prio" in opts else 0)
        sizes = [im.nbytes for im in images]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.flat = torch.empty(int(sum(sizes)), dtype=torch.uint8, device=device)
        for im, off in zip(images, offsets):  # the decoded images, for the kernel alone
            self.flat[int(off) : int(off) + im.nbytes].copy_(torch.from_numpy(im).view(-1))
        rng = random.Random(0)
        table = np.zeros((len(images), 8), np.int64)
        for j, im in enumerate(images):
            h, w = im.shape[:2]
            table[j] = (offsets[j], h, w, *_box(w, h, rng), rng.random() < 0.5)
        self.table = torch.from_numpy(table).to(device)
        self.out = torch.empty(len(images), SIZE, SIZE, 3, device=device).permute(0, 3, 1, 2)
        self.crops = torch.empty(len(images), 3, SIZE, SIZE, dtype=torch.uint8, device=device)
        self.batches = 0  # each batch of the ops draws for a new epoch
        if kind in ("ops", "mix", "recipe"):
            bench = load_recipe("trivialaugment-mix")
            r = read_transform(bench.transform)
            self.ops = SampleOps(pixel=r.pixel, erasing=r.erasing, mean=r.mean, std=r.std)
            self.mix = read_batch_transform(bench.batch_transform)
            self.labels = torch.randint(0, 1000, (len(images),), device=device)
            self.indices = list(range(len(images)))
        self.scale, self.shift = normalize_constants((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        outs = [self.flat[int(o) : int(o) + im.nbytes].view(im.shape) for o, im in zip(offsets, images)]
        self.job = DecodeJob.of(datas, outs)
        self.decoder = None
        if "engines" in kind:
            from gpufeed.decode import nvjpeg_hw

            flag = nvjpeg_hw._FLAG_UPSAMPLING_WITH_INTERPOLATION
            if "plain" in opts:
                nvjpeg_hw._FLAG_UPSAMPLING_WITH_INTERPOLATION = 0
            try:
                self.decoder = nvjpeg_hw.NvJpegHwDecoder(device)
            finally:
                nvjpeg_hw._FLAG_UPSAMPLING_WITH_INTERPOLATION = flag
        # the CPU path's rows: about a crop's decoded rows per image (mean box area, 3 bytes a pixel)
        rows = int(np.mean([t[5] * t[6] * 3 for t in table]))
        self.host = torch.empty(len(images) * rows, dtype=torch.uint8).pin_memory()
        self.dev = torch.empty_like(self.host, device=device)

    def run(self) -> None:
        with torch.cuda.stream(self.stream):
            if self.decoder is not None:
                ok = self.decoder.decode(self.job, self.stream)
                if not ok.all():
                    raise RuntimeError(f"the engines decoded {int(ok.sum())} of {len(ok)}")
            if "kernel" in self.kind and self.kind != "kernel8":
                resized_crop_triton(self.flat, self.table, SIZE, self.scale, self.shift, self.out)
            if self.kind == "copies":
                self.dev.copy_(self.host, non_blocking=True)
            if self.kind in ("kernel8", "recipe") or (self.kind == "ops" and self.batches == 0):
                # the crops' own pixels, as the GPU stage writes them for pixel ops (no normalising)
                resized_crop_triton(self.flat, self.table, SIZE, [1.0] * 3, [0.0] * 3, self.crops)
            images = self.out
            if self.kind in ("ops", "recipe"):
                images = self.ops.from_pixels(self.crops, self.indices, 0, self.batches, dtype=torch.float32,
                                              channels_last=True)
            if self.kind in ("mix", "recipe"):  # the ops' new batch may be replaced (fresh), the stage's is not
                self.mix(images, self.labels, 0, self.batches, self.batches, fresh=self.kind == "recipe")
            self.batches += 1

    def device_ms(self, n: int = 20) -> tuple[float, float]:
        """(the batch's device time on CUDA events, the host CPU time queuing it took), nothing else running,
        medians of ``n``, in ms."""
        self.run()  # a first batch: Triton's compile, cached sizes
        self.stream.synchronize()
        times, host = [], []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(self.stream)
            c0 = time.thread_time()
            self.run()
            host.append(1000 * (time.thread_time() - c0))
            b.record(self.stream)
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times), statistics.median(host)

    def profile(self, n: int = 10) -> list[tuple[str, float, float]]:
        """(kernel name, device ms per batch, launches per batch) of ``n`` batches, largest first (each batch
        draws anew: MixUp or CutMix, and which samples take which op)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                self.run()
            self.stream.synchronize()
        rows = [(e.key, e.device_time_total / 1000 / n, e.count / n) for e in prof.key_averages()
                if e.device_time_total > 0]
        return sorted(rows, key=lambda r: -r[1])


class Paced(threading.Thread):
    """Runs ``stage`` at most ``rate`` images/s until stopped; waits for each batch before the next."""

    def __init__(self, stage: Stage, rate: float, batch: int) -> None:
        super().__init__(daemon=True)
        self.stage, self.rate, self.batch = stage, rate, batch
        self.stop, self.images, self.error = threading.Event(), 0, None

    def run(self) -> None:
        try:
            t0 = time.perf_counter()
            while not self.stop.is_set():
                self.stage.run()
                self.stage.stream.synchronize()
                self.images += self.batch
                ahead = t0 + self.images / self.rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
        except Exception as e:  # reported by the main thread
            self.error = e


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--rate", type=float, default=5000.0)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--stages", default="engines,kernel,engines+kernel,copies")
    p.add_argument("--profile", action="store_true", help="each stage's kernels' device time (not the engines')")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("stage_cost.py needs a CUDA GPU")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"machine: {machine_description()}\ncommand: {' '.join(sys.argv)}")
    files = sorted(glob.glob(os.path.join(args.data, "**", "*.jp*g"), recursive=True))[: args.batch]
    if len(files) < args.batch:
        p.error(f"{args.data} has {len(files)} JPEGs, fewer than --batch {args.batch}")
    raw = [open(f, "rb").read() for f in files]
    images = [CpuDecoder().decode(d, f, fast=True) for d, f in zip(raw, files)]
    pinned = torch.empty(sum(len(d) for d in raw), dtype=torch.uint8).pin_memory()
    datas, at = [], 0
    for d in raw:  # the JPEGs in page-locked memory, as in the loader's ring
        view = pinned[at : at + len(d)].numpy()
        view[:] = np.frombuffer(d, np.uint8)
        datas.append(view)
        at += len(d)
    step = make_train_step(args.model, device)
    x = torch.randn(256, 3, SIZE, SIZE, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (256,), device=device)
    for _ in range(20):
        step(x, y)
    before = model_rate(step, x, y, args.seconds)
    rows = []
    for kind in args.stages.split(","):
        stage = Stage(kind, datas, images, device)
        ms, host = stage.device_ms()
        if args.profile and "engines" not in kind:
            kernels = stage.profile()
            print(f"\n{kind}: {sum(k[1] for k in kernels):.3f} device ms per batch in {sum(k[2] for k in kernels):.1f} "
                  "launches; largest:")
            for name, kms, count in kernels[:12]:
                print(f"  {kms:7.3f} ms  {count:5.1f}x  {name[:110]}")
        paced = Paced(stage, args.rate, args.batch)
        paced.start()
        time.sleep(0.5)
        n0, t0 = paced.images, time.perf_counter()
        rate = model_rate(step, x, y, args.seconds)
        got = (paced.images - n0) / (time.perf_counter() - t0)
        paced.stop.set()
        paced.join()
        if paced.error is not None:
            raise paced.error
        rows.append((kind, rate, ms, host, got))
    after = model_rate(step, x, y, args.seconds)
    alone = (before + after) / 2
    print(f"\n{args.model} alone: {before:,.0f} / {after:,.0f} images/s; stages paced at {args.rate:,.0f} images/s "
          f"in batches of {args.batch}")
    print("| stage | training beside it, images/s | of alone | stage's device ms per batch, alone | host CPU ms per "
          "batch, alone | stage ran, images/s | training ms lost per 1,000 stage images |")
    print("|---|---|---|---|---|---|---|")
    for kind, rate, ms, host, got in rows:
        lost = 1000 * (1 / rate - 1 / alone) * rate / max(got, 1e-9) * 1000  # per second of training
        print(f"| {kind} | {rate:,.0f} | {100 * rate / alone:.1f}% | {ms:.2f} | {host:.2f} | {got:,.0f} | {lost:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
