"""Which samples should the CPU take? A model of the loader-only rate for rules that pick each chunk's CPU samples.

    python3 benchmarks/share_split_model.py DATA_DIR [--n 1600] [--cpu-cores 3,4,5,6]
        [--engine-ns-per-byte 0.28] [--engine-us-per-image 10.2]

Per sample (first ``--n`` files, boxes drawn as the loader draws them, epoch 0): the cropped CPU decode's
time measured here (best of 2), and the engines' time from the fit ``benchmarks/engine_cost.py`` made on the
GPU machine (defaults: S6-9 on the H200). For each rule, chunks of 8 give their k cheapest samples by that
rule to the CPU (k and k + 1 mixed for shares between); the rate at a share is the smaller of the engines'
(1 / engine seconds per image) and the CPU's (``--cpu-cores`` of this machine's decode time per image);
printed: the best rate over shares and where. A model: it leaves out the workers' other work, the engines'
use of several threads and everything the two sides do to each other; it ranks rules, it does not predict rates.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import gpufeed.workers as workers
from gpufeed.augment.cpu import decode_box_into
from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.loader import GPU_BYTES_CAPACITY
from gpufeed.sources import folder_source


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--n", type=int, default=1600)
    p.add_argument("--cpu-cores", default="3,4,5,6")
    p.add_argument("--engine-ns-per-byte", type=float, default=0.28)
    p.add_argument("--engine-us-per-image", type=float, default=10.2)
    args = p.parse_args()
    workers._keep_heap()
    src = folder_source(args.data)
    n = min(args.n, len(src)) // 8 * 8
    spec = workers.PipelineSpec(src, AugmentSpec(), 10**8, gpu_bytes_capacity=GPU_BYTES_CAPACITY)
    dec = CpuDecoder(max_pixels=10**8)
    samples = [workers.inspect_sample(spec, dec, 0, 0, i) for i in range(n)]
    out = np.zeros((224, 224, 3), np.uint8)
    cpu = np.full(n, np.inf)
    for _ in range(2):
        for i, s in enumerate(samples):
            t0 = time.perf_counter()
            decode_box_into(dec, s.data, s.path, s.box, s.header[:2], s.header[2], out)
            cpu[i] = min(cpu[i], time.perf_counter() - t0)
    nbytes = np.array([len(s.data) for s in samples], np.float64)
    engine = args.engine_ns_per_byte * 1e-9 * nbytes + args.engine_us_per_image * 1e-6
    cost = np.array([s.cpu_cost() for s in samples])
    per_image_bytes = args.engine_us_per_image * 1e3 / args.engine_ns_per_byte  # the per-image time in bytes
    rules = {"cpu_cost (the loader's)": cost, "cpu_cost / engine cost": cost / (nbytes + per_image_bytes),
             "measured CPU / engine time": cpu / engine, "random": np.random.default_rng(0).random(n)}

    def split(score, k):  # (engine seconds, CPU seconds) per image when each chunk's k lowest go to the CPU
        on_cpu = np.zeros(n, bool)
        for a in range(0, n, 8):
            on_cpu[a + np.argsort(score[a : a + 8])[:k]] = True
        return engine[~on_cpu].sum() / n, cpu[on_cpu].sum() / n

    print(f"{n} samples: CPU decode {cpu.mean() * 1e6:.0f} us mean here (r = {np.corrcoef(cost, cpu)[0, 1]:.3f} "
          f"against cpu_cost), engines {engine.mean() * 1e6:.1f} us mean by the fit")
    print("| CPU cores for decode | " + " | ".join(rules) + " |\n|---|" + "---|" * len(rules))
    for cores in (float(c) for c in args.cpu_cores.split(",")):
        cells = []
        for score in rules.values():
            ec = [split(score, k) for k in range(9)]
            best = (0.0, 0.0)
            for share in np.linspace(0, 1, 257):
                k = min(int(share * 8), 7)
                f = share * 8 - k
                e, c = (ec[k][j] * (1 - f) + ec[k + 1][j] * f for j in (0, 1))
                best = max(best, (min(1 / e if e else np.inf, cores / c if c else np.inf), share))
            cells.append(f"{best[0]:,.0f} at {best[1]:.2f}")
        print(f"| {cores:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
