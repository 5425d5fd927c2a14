"""What a JPEG costs the hardware engines, against its bytes and its pixels (research for the CPU share).

    python3 benchmarks/engine_cost.py DATA_DIR [--groups 48] [--size 96] [--rounds 5]

The CPU's share of a batch goes to the samples cheapest to decode on the CPU; whether the engines would
have spent much or little on them is not known. Here: groups of ``--size`` files (half of them runs of
neighbours in order of bytes per pixel, half in order of pixels, so that the two vary apart), each decoded
by one batched nvJPEG call on the engines (1 thread, stream synchronised; best of ``--rounds``); then a
least-squares fit of a group's time = a * bytes + b * pixels + c * images, with the fit's r^2 and the
share of an average file's time that its bytes and its pixels explain.
"""

from __future__ import annotations

import argparse
import glob
import time

import numpy as np
import torch

from gpufeed.decode.cpu import CpuDecoder
from gpufeed.decode.nvjpeg_hw import NvJpegHwDecoder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--groups", type=int, default=48)
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    files = sorted(glob.glob(f"{args.data}/*/*.jpg"))
    cpu = CpuDecoder()
    datas = [np.frombuffer(open(f, "rb").read(), np.uint8) for f in files]
    sizes = np.array([cpu.header(d.tobytes(), f)[:2] for d, f in zip(datas, files)])  # (w, h)
    nbytes = np.array([d.nbytes for d in datas], np.float64)
    pixels = sizes[:, 0].astype(np.float64) * sizes[:, 1]
    dec, stream = NvJpegHwDecoder(device), torch.cuda.Stream(device)
    # groups that separate bytes from pixels: half cut from the files in order of bytes per pixel, half
    # in order of pixels (each group a run of neighbours in that order)
    half = max(1, args.groups // 2)
    step = max(1, len(files) // (half * args.size))
    picks = [order[g * args.size * step : (g + 1) * args.size * step : step]
             for order in (np.argsort(nbytes / pixels), np.argsort(pixels)) for g in range(half)]
    rows = []
    for idx in picks:
        if len(idx) < args.size:
            continue
        outs = [torch.empty((int(sizes[i, 1]), int(sizes[i, 0]), 3), dtype=torch.uint8, device=device) for i in idx]
        ds = [datas[i] for i in idx]
        best = float("inf")
        for r in range(args.rounds + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            ok = dec.decode_into(ds, outs, stream)
            stream.synchronize()
            if r:  # the first call warms up
                best = min(best, time.perf_counter() - t0)
        if all(ok):
            rows.append((nbytes[idx].sum(), pixels[idx].sum(), len(idx), best))
    a = np.array([r[:3] for r in rows])
    t = np.array([r[3] for r in rows])
    coef, *_ = np.linalg.lstsq(a, t, rcond=None)
    pred = a @ coef
    r2 = 1 - ((t - pred) ** 2).sum() / ((t - t.mean()) ** 2).sum()
    mb, mp = nbytes.mean(), pixels.mean()
    per = coef[0] * mb + coef[1] * mp + coef[2]
    print(f"{len(rows)} groups of {args.size} ({len(files)} files: mean {mb / 1e3:.0f} KB, {mp / 1e3:.0f} kpx), "
          f"{torch.cuda.get_device_name(device)}")
    print(f"time per group = {coef[0] * 1e9:.2f} ns/byte * bytes + {coef[1] * 1e9:.2f} ns/px * pixels "
          f"+ {coef[2] * 1e6:.1f} us/image; r^2 = {r2:.3f}")
    print(f"an average file: {per * 1e6:.1f} us = bytes {coef[0] * mb / per:.0%} + pixels {coef[1] * mp / per:.0%} "
          f"+ per image {coef[2] / per:.0%}; groups {t.min() * 1e3:.2f}-{t.max() * 1e3:.2f} ms "
          f"({args.size / t.max():,.0f}-{args.size / t.min():,.0f} images/s on one thread)")


if __name__ == "__main__":
    main()
