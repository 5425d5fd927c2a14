"""What one CPU decode costs on this machine, alone and with other processes decoding at the same time.

    python3 benchmarks/cpu_decode_cost.py DATA_DIR [--n 400] [--procs 1,13]

Per step, time per image (one process; with ``--procs`` P > 1, P processes run the same loop at once and
the median of their per-image times is shown): simplejpeg's full decode; the cropped decoder
(``_turbo_crop``) over the whole image; the GPU path's CPU share as the workers do it (``decode_box_into``
for the RandomResizedCrop box the loader draws, resize to 224 and flip), for all samples and for the
cheapest quarter by ``cpu_cost`` (the samples the CPU is given); and the resize alone. Also prints which
libjpeg the cropped decoder loaded, the CPU model, and whether libjpeg-turbo's SIMD is disabled
(``JSIMD_FORCENONE``), so that two machines' numbers can be told apart.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time

import numpy as np


def _samples(data: str, n: int):
    from gpufeed.augment.params import AugmentSpec
    from gpufeed.decode.cpu import CpuDecoder
    from gpufeed.sources import folder_source
    from gpufeed.workers import PipelineSpec, inspect_sample

    source = folder_source(data)
    spec = PipelineSpec(source, AugmentSpec(), 10**8, gpu_bytes_capacity=1 << 24)
    decoder = CpuDecoder()
    out = [inspect_sample(spec, decoder, 0, 0, i) for i in range(min(n, len(source)))]
    return decoder, [s for s in out if s.gpu_ok]


def _per_image(fn, items, rounds: int = 3) -> float:
    fn(items[0])  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for it in items:
            fn(it)
        best = min(best, (time.perf_counter() - t0) / len(items))
    return best


def measure(data: str, n: int) -> dict[str, float]:
    import cv2
    import simplejpeg

    from gpufeed.augment.cpu import decode_box_into
    from gpufeed.decode import cpu as cpu_decode

    decoder, samples = _samples(data, n)
    out = np.empty((224, 224, 3), np.uint8)
    cheap = sorted(samples, key=lambda s: s.cpu_cost())[: len(samples) // 4]
    box = lambda s: decode_box_into(decoder, s.data, s.path, s.box, s.header[:2], s.header[2], out)
    res = {
        "simplejpeg full decode": _per_image(lambda s: simplejpeg.decode_jpeg(s.data, "RGB"), samples),
        "decode_box_into, all samples": _per_image(box, samples),
        "decode_box_into, cheapest quarter": _per_image(box, cheap),
    }
    if cpu_decode._turbo_crop is not None:
        res["cropped decoder, whole image"] = _per_image(
            lambda s: cpu_decode._turbo_crop.decode_crop(s.data, 0, 0, s.header[0], s.header[1], 1), samples)
    crops = [simplejpeg.decode_jpeg(s.data, "RGB")[: s.box.height, : s.box.width] for s in samples[:100]]
    res["cv2 resize of the crop to 224"] = _per_image(
        lambda c: cv2.resize(c, (224, 224), dst=out, interpolation=cv2.INTER_LINEAR), crops)
    return res


def _worker(args):
    data, n, cpu = args
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    return measure(data, n)


def _libjpeg() -> str:
    from gpufeed.decode import cpu as cpu_decode

    if cpu_decode._turbo_crop is None:
        return "cropped decoder not built"
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "libjpeg" in line})
    return ", ".join(os.path.realpath(p) for p in libs) or "?"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--procs", default="1")
    args = p.parse_args()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    print(f"CPU: {model}, {os.cpu_count()} CPUs; libjpeg: {_libjpeg()}; "
          f"JSIMD_FORCENONE={os.environ.get('JSIMD_FORCENONE', '')!r}")
    for procs in (int(x) for x in args.procs.split(",")):
        cpus = sorted(os.sched_getaffinity(0))
        if procs == 1:
            results = [measure(args.data, args.n)]
        else:
            with mp.get_context("spawn").Pool(procs) as pool:
                results = pool.map(_worker, [(args.data, args.n, cpus[-1 - i] if procs <= len(cpus) else None)
                                             for i in range(procs)])
        print(f"\n{procs} process(es) at once, ms per image (median over processes of each one's best of 3)")
        print("| step | ms/image |\n|---|---|")
        for key in results[0]:
            print(f"| {key} | {1e3 * statistics.median(r[key] for r in results):.3f} |")


if __name__ == "__main__":
    main()
