"""GPU decode throughput on files already in memory (no file reading), and decode + fused augment.

    python3 benchmarks/decode_only.py DATA_DIR [--batch 256] [--rounds 3]

Prints images/s (median of rounds, the CUDA stream synchronised before the clock is read) for each
GPU decoder that works here, then for the whole GPU stage (decode + one fused crop/resize/flip/normalise
kernel) fed by pre-read EncodedBatches.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time

import numpy as np
import torch

from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.cpu import CpuDecoder

from gpufeed.gpu_stage import EncodedBatch, GpuDecodeAugment, _Part
from gpufeed.ring import KIND_BYTES


def _decoders(device):
    out = []
    try:
        from gpufeed.decode.nvimgcodec import NvImageCodecDecoder

        out.append(("nvimgcodec hw only", lambda: [NvImageCodecDecoder(device, hw_only=True)]))
        out.append(("nvimgcodec hw only, 2 threads", lambda: [NvImageCodecDecoder(device, hw_only=True)
                                                              for _ in range(2)]))
        out.append(("nvimgcodec hw then cuda, 2 threads", lambda: [NvImageCodecDecoder(device) for _ in range(2)]))
        out.append(("nvimgcodec hw then cuda, 3 threads", lambda: [NvImageCodecDecoder(device) for _ in range(3)]))
    except Exception as e:
        print(f"nvimgcodec unavailable: {e}")
    try:
        from gpufeed.decode.nvjpeg_hw import NvJpegHwDecoder as Nv

        for k in (1, 2):
            for roi in (False, True):
                out.append((f"nvjpeg hw direct, {k} thread{'s' * (k > 1)}{', crop boxes only' * roi}",
                            lambda k=k, roi=roi: [Nv(device, roi=roi) for _ in range(k)]))
    except Exception as e:
        print(f"nvjpeg direct unavailable: {e}")
    from gpufeed.decode.torchvision_gpu import TorchvisionGpuDecoder

    out.append(("torchvision nvjpeg", lambda: [TorchvisionGpuDecoder(device)]))
    return out


def _time(fn, rounds):
    fn()  # warm-up: handles, buffers, kernels
    rates = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = fn()
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="run the paths whose name contains this (e.g. 'nvjpeg')")
    args = p.parse_args()
    files = sorted(glob.glob(f"{args.data}/*/*.jpg"))
    datas = [open(f, "rb").read() for f in files]
    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    batches = [datas[i : i + args.batch] for i in range(0, len(datas) - args.batch + 1, args.batch)]
    rows = []
    spec, cpu = AugmentSpec(), CpuDecoder()
    encoded = []
    for bi, b in enumerate(batches):
        cap = max(map(len, b))
        meta = np.zeros((len(b), 9), np.int64)
        arena = np.zeros((len(b), cap), np.uint8)
        for i, d in enumerate(b):
            w, h, _ = cpu.header(d, "x")
            box = spec.draw(w, h, seed=0, epoch=0, index=bi * args.batch + i)
            meta[i] = (KIND_BYTES, len(d), w, h, box.x, box.y, box.width, box.height, int(box.flip))
            arena[i, : len(d)] = np.frombuffer(d, np.uint8)
        encoded.append(EncodedBatch(torch.zeros(len(b), dtype=torch.int64), meta, arena,
                                    np.zeros((len(b), 224, 224, 3), np.uint8), lambda i: "x"))
    for name, make in _decoders(device):
        if args.only not in name:
            continue
        try:
            decs = make()
        except Exception as e:  # one path failing must not lose the others
            rows.append((name, 0.0, [], f"FAILED: {type(e).__name__}: {e}"))
            continue
        stage = GpuDecodeAugment(decs, device=device, image_size=224, mean=(0.485, 0.456, 0.406),
                                 std=(0.229, 0.224, 0.225), dtype=torch.float32, channels_last=True,
                                 max_pixels=10**8)
        ok = []
        # decode only: each batch straight into views of one device buffer, as the stage does
        flat = torch.empty(max(int((e.meta[:, 2] * e.meta[:, 3]).sum()) * 3 for e in encoded), dtype=torch.uint8,
                           device=device)
        offsets = [np.concatenate([[0], np.cumsum(e.meta[:, 2] * e.meta[:, 3] * 3)[:-1]]) for e in encoded]
        box_offsets = [np.concatenate([[0], np.cumsum(e.meta[:, 6] * e.meta[:, 7] * 3)[:-1]]) for e in encoded]

        def run(stage=stage, ok=ok):
            ok.clear()
            with torch.cuda.stream(stream):
                for e, offs, roffs in zip(encoded, offsets, box_offsets):
                    n = len(e.meta)
                    part = (_Part(range(n), np.arange(n), flat, roffs, e.meta[:, 7], e.meta[:, 6], rows=None)
                            if stage._roi else
                            _Part(range(n), np.arange(n), flat, offs, e.meta[:, 3], e.meta[:, 2], rows=None))
                    ok.append(sum(stage._await_decode(stage._submit_decode(e, part))))
            return sum(len(e.meta) for e in encoded)

        med, rates = _time(run, args.rounds)
        rows.append((f"decode only: {name}", med, rates, f"{sum(ok)}/{sum(len(b) for b in batches)} decoded"))

        def run_stage(stage=stage):  # as the Prefetcher runs it: batch k+1 started before batch k finishes
            with torch.cuda.stream(stream):
                pending = None
                for e in encoded:
                    started = stage.start(e)
                    if pending is not None:
                        stage.finish(pending)
                    pending = started
                stage.finish(pending)
            return sum(len(e.meta) for e in encoded)

        stage.decoded_by.clear()
        med, rates = _time(run_stage, args.rounds)
        rows.append((f"decode + fused augment: {name}", med, rates, dict(stage.decoded_by)))
    print(f"\n{len(datas)} files, batch {args.batch}, {torch.cuda.get_device_name()}")
    print("| path | images/s (median) | rounds | note |\n|---|---|---|---|")
    for name, med, rates, note in rows:
        print(f"| {name} | {med:,.0f} | {', '.join(f'{r:,.0f}' for r in rates)} | {note} |")


if __name__ == "__main__":
    main()
