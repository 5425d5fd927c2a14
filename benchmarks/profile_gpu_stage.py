"""Where the GPU stage's time goes, per batch of 256 files already in memory (nvImageCodec needed).

    python3 benchmarks/profile_gpu_stage.py DATA_DIR [--batches 8]

Each line is the median over batches of one step's host wall time in ms, with the device
synchronised before and after the step, so steps do not hide in each other's queues.
The last lines time whole decodes with several decoders, each with its own thread and stream.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import threading
import time

import numpy as np
import torch

from gpufeed.augment.fused import pack_images, resized_crop_triton
from gpufeed.decode.nvimgcodec import NvImageCodecDecoder


def timed(label, fn, reps, results):
    vals, out = [], None
    for r in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(r)
        torch.cuda.synchronize()
        vals.append((time.perf_counter() - t0) * 1e3)
    results.append((label, statistics.median(vals)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--batches", type=int, default=8)
    args = p.parse_args()
    files = sorted(glob.glob(f"{args.data}/*/*.jpg"))[: 256 * args.batches]
    raw = [open(f, "rb").read() for f in files]
    B, nb = 256, args.batches
    cap = max(map(len, raw))
    arenas = []
    for b in range(nb):
        a = np.zeros((B, cap), np.uint8)
        for i, d in enumerate(raw[b * B : (b + 1) * B]):
            a[i, : len(d)] = np.frombuffer(d, np.uint8)
        arenas.append(a)
    lens = [[len(d) for d in raw[b * B : (b + 1) * B]] for b in range(nb)]
    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    nv = NvImageCodecDecoder(dev, hw_only=True)
    dec, params, n = nv._decoder, nv._params, nv._nv
    res: list = []
    torch.cuda.set_stream(stream)
    s = stream.cuda_stream
    timed("arena rows -> bytes (tobytes)", lambda r: [arenas[r][i, : lens[r][i]].tobytes() for i in range(B)],
                  nb, res)
    all_bytes = [[arenas[r][i, : lens[r][i]].tobytes() for i in range(B)] for r in range(nb)]
    timed("CodeStream(bytes) x256", lambda r: [n.CodeStream(d) for d in all_bytes[r]], nb, res)
    timed("CodeStream(numpy view) x256", lambda r: [n.CodeStream(arenas[r][i, : lens[r][i]]) for i in range(B)],
          nb, res)
    css = [[n.CodeStream(d) for d in all_bytes[r]] for r in range(nb)]
    dec.decode(css[0], params=params, cuda_stream=s)  # warm-up
    host = []

    def decode_only(r):
        t0 = time.perf_counter()
        imgs = dec.decode(css[r], params=params, cuda_stream=s)
        host.append((time.perf_counter() - t0) * 1e3)
        return imgs

    timed("decode(256) hw engine, to sync", decode_only, nb, res)
    res.append(("  of which the decode() call returning", statistics.median(host)))
    imgs = [dec.decode(css[r], params=params, cuda_stream=s) for r in range(nb)]
    timed("torch.as_tensor x256", lambda r: [torch.as_tensor(im, device=dev) for im in imgs[r]], nb, res)
    timed("dlpack x256", lambda r: [torch.from_dlpack(im) for im in imgs[r]], nb, res)
    all_t = [[torch.as_tensor(im, device=dev) for im in imgs[r]] for r in range(nb)]
    timed("pack_images (torch.cat)", lambda r: pack_images(all_t[r]), nb, res)
    reuse = [dec.decode(css[r], params=params, cuda_stream=s) for r in range(2)]
    timed("decode(256) reusing Images", lambda r: dec.decode(css[r], images=reuse[r % 2], params=params,
                                                              cuda_stream=s), nb, res)
    from gpufeed.decode.nvimgcodec import _DeviceView

    views0 = [t.view(t.shape) for t in all_t[0]]
    timed("as_image(torch view) x256", lambda r: [n.as_image(v, s) for v in views0], nb, res)
    timed("as_image(_DeviceView) x256", lambda r: [n.as_image(_DeviceView(v), s) for v in views0], nb, res)
    # GIL: how much a Python thread gets done while decode() runs, against the same time idle
    counts = []

    def spin(stop, out):
        k = 0
        while not stop.is_set():
            k += 1
        out.append(k)

    for label, fn in (("idle", lambda: time.sleep(0.1)),
                      ("decode()", lambda: [dec.decode(css[r], params=params, cuda_stream=s) for r in range(nb)])):
        stop, out = threading.Event(), []
        th = threading.Thread(target=spin, args=(stop, out))
        th.start()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        stop.set()
        th.join()
        counts.append((label, out[0] / dt))
    print(f"GIL: a spinning Python thread ran at {counts[1][1] / counts[0][1]:.0%} of its idle rate during decode()")
    ext_ok = "no"
    try:
        flat, offs = pack_images(all_t[0])
        views = [flat[o : o + t.numel()].view(t.shape) for o, t in zip(offs, all_t[0])]
        ext = [n.as_image(v, s) for v in views]
        flat.zero_()
        out = dec.decode(css[0], images=ext, params=params, cuda_stream=s)
        torch.cuda.synchronize()
        same = all(torch.equal(v, t) for v, t in zip(views, all_t[0]))
        ext_ok = f"returned {sum(o is not None for o in out)}, pixels equal: {same}"
        timed("decode(256) into external views of one buffer", lambda r: dec.decode(css[0], images=ext,
              params=params, cuda_stream=s), nb, res)
    except Exception as e:
        ext_ok = f"{type(e).__name__}: {e}"
    print("decode into external buffer:", ext_ok)
    out = torch.empty((B, 3, 224, 224), dtype=torch.float32, device=dev).contiguous(memory_format=torch.channels_last)
    rng = np.random.default_rng(0)

    def table(r):
        flat, offs = pack_images(all_t[r])
        rows = [[o, t.shape[0], t.shape[1], 0, 0, t.shape[1], t.shape[0], int(rng.integers(2))]
                for o, t in zip(offs, all_t[r])]
        return flat, torch.tensor(rows, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)

    prepared = [table(r) for r in range(nb)]
    timed("rows table build + upload", lambda r: table(r)[1], nb, res)
    timed("fused kernel (full image -> 224)", lambda r: resized_crop_triton(prepared[r][0], prepared[r][1], 224,
          [1.0] * 3, [0.0] * 3, out), nb, res)
    imgs = all_t = reuse = prepared = None  # free them before timing frees

    def free(r):
        im = dec.decode(css[r], params=params, cuda_stream=s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        del im
        return time.perf_counter() - t0

    frees = [free(r) * 1e3 for r in range(nb)]
    res.append(("freeing 256 decoded Images", statistics.median(frees)))
    for label, ms in res:
        print(f"| {label} | {ms:.2f} ms | {B / ms * 1e3:,.0f} img/s |")
    for threads, hw_only, load in ((1, True, 1.0), (2, True, 1.0), (3, True, 1.0), (2, False, 1.0),
                                   (2, False, 0.65), (3, False, 0.65), (4, False, 0.5)):
        decs = [NvImageCodecDecoder(dev, hw_only=hw_only, hw_load=load) for _ in range(threads)]
        streams = [torch.cuda.Stream(dev) for _ in range(threads)]

        def work(k, decs=decs, streams=streams, threads=threads):
            for r in range(k, nb * 3, threads):
                decs[k]._decoder.decode(css[r % nb], params=params, cuda_stream=streams[k].cuda_stream)
            streams[k].synchronize()

        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ths = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            rate = nb * 3 * B / (time.perf_counter() - t0)
        kind = "hw only" if hw_only else f"hw load {load} + hybrid"
        print(f"| {threads} decoder(s), own thread + stream, {kind} | {rate:,.0f} img/s |")


if __name__ == "__main__":
    main()
