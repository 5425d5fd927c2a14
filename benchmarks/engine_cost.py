"""What one image decoded on the NVJPG engines costs a model training beside it, by the format nvJPEG writes,
and which device work each format launches.

    python3 benchmarks/engine_cost.py DATA [--model resnet18] [--formats rgbi,yuv] [--paces 0,5000]
        [--call 128] [--seconds 4] [--rounds 2] [--json OUT]

1. ``--images`` baseline 4:2:0 JPEGs of DATA (the kind the GPU path sends to the engines) are read into
   page-locked memory once.
2. Per format, the engines alone: a call of ``--call`` images, its wall time (median of 10); and, last, under
   torch.profiler every kernel and copy it launches on the device (name, count, device us per image).
   ``rgbi``: interleaved RGB with libjpeg-turbo's chroma upsampling (what the GPU path asks for);
   ``yuv``: the planes as coded (Y full size, Cb and Cr at half width and height), no colour conversion.
3. The model trains on one GPU-resident batch (bf16, channels_last, SGD) while two decoder threads, each with
   its own decoder and stream as the loader's, decode calls of ``--call`` images without pause (pace 0) or at
   a pace in images/s. Per (format, pace): the training's images/s, the images decoded per second, and the
   training's time lost per image decoded, in us: (1 - beside / alone) / decoded per second. The model alone
   is measured before and after each round; the variants alternate within a round.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image, JpegImagePlugin

from gpufeed.bench.run import machine_description
from gpufeed.bench.train import make_train_step, model_rate, resident_batch
from gpufeed.decode.base import DecodeJob
from gpufeed.decode.jpeg_check import gpu_safe_jpeg
from gpufeed.decode import nvjpeg_hw as nv

_OUTPUT_YUV, _CSS_420 = 1, 2


class YuvDecoder(nv.NvJpegHwDecoder):
    """The same engines and calls, asked for the coded planes (4:2:0 input only): Y, then Cb and Cr at half
    width and height, one after another at each image's place."""

    def __init__(self, device: torch.device, *, max_side: int, call_images: int) -> None:
        super().__init__(device, max_side=max_side, call_images=call_images)
        with torch.cuda.device(device):
            for state, _ in self._states:
                self._check("nvjpegDecodeBatchedPreAllocate", self._lib.nvjpegDecodeBatchedPreAllocate(
                    self._handle, state, call_images, max_side, max_side, _CSS_420, _OUTPUT_YUV))

    def _batched(self, job: DecodeJob, stream: torch.cuda.Stream) -> bool:
        lib, n = self._lib, len(job)
        w, h = job.widths.astype(np.uint64), job.heights.astype(np.uint64)
        cw, ch = (w + 1) // 2, (h + 1) // 2
        images = np.zeros((n, 8), np.uint64)
        images[:, 0] = job.dst
        images[:, 1] = job.dst + w * h
        images[:, 2] = job.dst + w * h + cw * ch
        images[:, 4], images[:, 5], images[:, 6] = w, cw, cw
        src = np.ascontiguousarray(job.src, np.uint64)
        lengths = np.ascontiguousarray(job.lengths, np.uint64)
        state, done = self._states[self._turn]
        self._turn = (self._turn + 1) % len(self._states)
        done.synchronize()
        status = lib.nvjpegDecodeBatchedInitialize(self._handle, state, n, 1, _OUTPUT_YUV)
        if status == 0:
            status = lib.nvjpegDecodeBatched(self._handle, state, src.ctypes.data, lengths.ctypes.data,
                                             images.ctypes.data, ctypes.c_void_p(stream.cuda_stream))
        done.record(stream)
        return status == 0


def load_jpegs(data: str, count: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(page-locked arena, byte offsets, lengths, widths, heights) of the first ``count`` baseline 4:2:0
    JPEGs under ``data`` that pass the GPU path's structural check."""
    blobs, widths, heights = [], [], []
    for path in sorted(Path(data).rglob("*.jp*g")):
        raw = path.read_bytes()
        if not gpu_safe_jpeg(raw):
            continue
        with Image.open(path, formats=["JPEG"]) as im:
            if JpegImagePlugin.get_sampling(im) != 2 or im.mode != "RGB":
                continue
            widths.append(im.width)
            heights.append(im.height)
        blobs.append(raw)
        if len(blobs) == count:
            break
    if not blobs:
        raise SystemExit(f"{data}: no baseline 4:2:0 JPEG found")
    lengths = np.array([len(b) for b in blobs], np.uint64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
    arena = torch.empty(int(lengths.sum()), dtype=torch.uint8).pin_memory()
    view = arena.numpy()
    for b, o in zip(blobs, offsets):
        view[int(o) : int(o) + len(b)] = np.frombuffer(b, np.uint8)
    return arena, offsets, lengths, np.array(widths, np.int64), np.array(heights, np.int64)


class Jobs:
    """Calls of ``call`` images cycling through the loaded JPEGs, each decoded into its own place of a device
    buffer (two buffers per thread, taken in turn)."""

    def __init__(self, loaded, call: int, device: torch.device) -> None:
        self.arena, self.offsets, self.lengths, self.widths, self.heights = loaded
        self.call, self.device, self.n = call, device, len(self.lengths)
        self.room = (self.widths * self.heights * 3).astype(np.uint64)
        biggest = int(np.sort(self.room)[-call:].sum())
        self.buffers = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(4)]
        self.cursor = 0

    def next(self, buffer: int) -> DecodeJob:
        idx = (self.cursor + np.arange(self.call)) % self.n
        self.cursor = (self.cursor + self.call) % self.n
        room = self.room[idx]
        dst = self.buffers[buffer].data_ptr() + np.concatenate([[0], np.cumsum(room)[:-1]]).astype(np.uint64)
        return DecodeJob((self.arena.data_ptr() + self.offsets[idx]).astype(np.uint64), self.lengths[idx],
                         dst.astype(np.uint64), self.heights[idx], self.widths[idx], self.device,
                         (self.arena, self.buffers[buffer]))


def make_decoders(fmt: str, device: torch.device, call: int, max_side: int) -> list:
    cls = YuvDecoder if fmt == "yuv" else nv.NvJpegHwDecoder
    return [cls(device, max_side=max_side, call_images=call) for _ in range(2)]


def alone(decoders, jobs: Jobs, calls: int = 10) -> float:
    """Median wall ms of one call, the engines otherwise idle."""
    stream = torch.cuda.Stream()
    times = []
    for k in range(calls + 2):
        job = jobs.next(k % 2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        assert decoders[0].decode(job, stream).all(), "a decode call failed"
        stream.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def kernels(decoders, jobs: Jobs, calls: int = 4) -> list[tuple[str, int, float]]:
    """(name, launches, device us per image) of what ``calls`` calls launch on the device."""
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    decoders[0].decode(jobs.next(0), stream)
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(calls):
            decoders[0].decode(jobs.next(k % 2), stream)
        stream.synchronize()
    us, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name[:80]] += e.time_range.elapsed_us()
            count[e.name[:80]] += 1
    n = calls * jobs.call
    return sorted(((k, count[k], v / n) for k, v in us.items()), key=lambda r: -r[2])


class Decoding(threading.Thread):
    """One decoder thread: calls back to back (``pace`` 0) or no faster than ``pace`` images/s for its part."""

    def __init__(self, decoder, jobs: Jobs, buffers: tuple[int, int], pace: float, lock: threading.Lock) -> None:
        super().__init__(daemon=True)
        self.decoder, self.jobs, self.buffers, self.pace, self.lock = decoder, jobs, buffers, pace, lock
        self.stream = torch.cuda.Stream()
        self.stop, self.images, self.error = threading.Event(), 0, None

    def run(self) -> None:
        try:
            t0, k = time.perf_counter(), 0
            while not self.stop.is_set():
                with self.lock:
                    job = self.jobs.next(self.buffers[k % 2])
                if not self.decoder.decode(job, self.stream).all():
                    raise RuntimeError("a decode call failed")
                self.stream.synchronize()
                self.images += len(job)
                k += 1
                if self.pace:
                    ahead = t0 + self.images / self.pace - time.perf_counter()
                    if ahead > 0:
                        time.sleep(ahead)
        except Exception as e:
            self.error = e


def beside(step, images, labels, decoders, jobs: Jobs, pace: float, seconds: float) -> tuple[float, float]:
    """(training images/s, images decoded per second) with two decoder threads running."""
    lock = threading.Lock()
    threads = [Decoding(d, jobs, (2 * i, 2 * i + 1), pace / 2, lock) for i, d in enumerate(decoders)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    n0, t0 = sum(t.images for t in threads), time.perf_counter()
    rate = model_rate(step, images, labels, seconds)
    n1, t1 = sum(t.images for t in threads), time.perf_counter()
    for t in threads:
        t.stop.set()
    for t in threads:
        t.join()
        if t.error is not None:
            raise t.error
    return rate, (n1 - n0) / (t1 - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--formats", default="rgbi,yuv")
    p.add_argument("--paces", default="0,5000", help="images/s of both decoder threads together; 0: no pause")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--call", type=int, default=128)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("engine_cost.py needs a CUDA GPU with JPEG engines")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"machine: {machine_description()}\ncommand: {' '.join(sys.argv)}", flush=True)
    loaded = load_jpegs(args.data, args.images)
    jobs = Jobs(loaded, args.call, device)
    max_side = int(max(loaded[3].max(), loaded[4].max()))
    print(f"{jobs.n} JPEGs, mean {loaded[2].mean() / 1e3:.0f} KB, mean {loaded[3].mean():.0f} x "
          f"{loaded[4].mean():.0f}", flush=True)
    formats = args.formats.split(",")
    decoders = {f: make_decoders(f, device, args.call, max_side) for f in formats}
    result = {"command": sys.argv, "formats": {}, "rounds": []}
    for f in formats:
        ms = alone(decoders[f], jobs)
        result["formats"][f] = {"call_ms": ms}
        print(f"{f}: a call of {args.call} alone {ms:.2f} ms ({args.call / ms * 1e3:,.0f} images/s, one thread)",
              flush=True)
    step = make_train_step(args.model, device)
    images, labels = resident_batch(256, device)
    model_rate(step, images, labels, 2.0)
    paces = [float(x) for x in args.paces.split(",")]
    for r in range(args.rounds):
        row = {"alone": [model_rate(step, images, labels, args.seconds)]}
        for pace in paces:
            for f in formats:
                row[f"{f}@{pace:.0f}"] = beside(step, images, labels, decoders[f], jobs, pace, args.seconds)
        row["alone"].append(model_rate(step, images, labels, args.seconds))
        result["rounds"].append(row)
        print(f"round {r + 1}: alone {row['alone'][0]:,.0f} / {row['alone'][1]:,.0f}", flush=True)
    print(f"\n| variant | {args.model} images/s by round | of alone | decoded images/s | training us lost per image "
          "decoded |\n|---|---|---|---|---|")
    for key in [k for k in result["rounds"][0] if k != "alone"]:
        cells, shares, decoded, lost = [], [], [], []
        for row in result["rounds"]:
            base = statistics.mean(row["alone"])
            train, dec = row[key]
            cells.append(f"{train:,.0f}")
            shares.append(train / base)
            decoded.append(dec)
            lost.append((1 - train / base) / dec * 1e6 if dec else float("nan"))
        print(f"| {key} | {', '.join(cells)} | {', '.join(f'{100 * s:.1f}%' for s in shares)} | "
              f"{', '.join(f'{d:,.0f}' for d in decoded)} | {', '.join(f'{x:.1f}' for x in lost)} |")
    alone_all = [a for row in result["rounds"] for a in row["alone"]]
    print(f"\n{args.model} alone: {', '.join(f'{a:,.0f}' for a in alone_all)} images/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for f in formats:  # last: where the profiler cannot trace, it may end the process
        ks = kernels(decoders[f], jobs)
        result["formats"][f]["kernels"] = ks
        print(f"\n{f}: device work launched per image decoded:", flush=True)
        for name, n, us in ks[:12]:
            print(f"  {us:7.2f} us  x{n:<5} {name}")
        print(f"  {sum(r[2] for r in ks):7.2f} us in all", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
