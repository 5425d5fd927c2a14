"""GPU memory of the loader over many epochs, and of the JPEG decoders on their own.

    python3 benchmarks/gpu_memory.py DATA_DIR [--epochs 20] [--decode auto] [--batch-size 256]
    python3 benchmarks/gpu_memory.py DATA_DIR --probe      # the nvJPEG engines' decoder alone

Loader only (default): at the end of each epoch, the device synchronised, NVML's "used" above the start
(everything the process holds on the GPU: PyTorch's reserved memory, the decoders' own allocations,
loaded kernels) and PyTorch's reserved memory above the start; "outside" is the difference. Prints one
row per epoch and the growth from the end of epoch 1 to the end of the run.

``--probe``: one nvJPEG hardware decoder, calls of growing size (the smallest files, then the largest), NVML
"used" after each: how the decoder's own memory follows the images of a call, when it takes the least
memory at first and when it takes room for a whole call at once (as the loader makes it).

``--sizes 128x1024,128x640,...``: what a decoder (two decode states) takes when made with room for calls of N
images of up to S x S, each made and dropped in turn.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np
import torch

from gpufeed import ImageLoader
from gpufeed.bench.run import machine_description
from gpufeed.decode.base import DecodeJob
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.placement import GPU_MAX_SIDE

MB = 1 << 20


class _Nvml:
    """NVML "used" of one device, in bytes."""

    def __init__(self, index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nv, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)

    def used(self) -> int:
        return int(self._nv.nvmlDeviceGetMemoryInfo(self._h).used)


def _nvml_index(device: torch.device) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return int(visible.split(",")[device.index or 0]) if visible else (device.index or 0)


def loader_epochs(args: argparse.Namespace, device: torch.device, nvml: _Nvml) -> None:
    torch.cuda.synchronize(device)
    used0, reserved0 = nvml.used(), torch.cuda.memory_reserved(device)
    loader = ImageLoader(args.data, batch_size=args.batch_size, device=device, decode=args.decode,
                         num_workers=args.workers or None, image_size=224)
    rows = []
    try:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            for _images, _labels in loader:
                pass
            torch.cuda.synchronize(device)
            used, reserved = nvml.used() - used0, torch.cuda.memory_reserved(device) - reserved0
            rows.append((epoch + 1, used, reserved, used - reserved))
        decoded_by = dict(loader.stats.get("decoded_by", {}))
        budget = loader.stats.get("gpu_memory_budget")
    finally:
        loader.close()
    print(f"decode={args.decode}: decoded by {decoded_by}; budget {budget / MB if budget else 0:.0f} MB")
    print("| epoch | NVML used added, MB | PyTorch reserved added, MB | outside PyTorch, MB |\n|---|---|---|---|")
    for e, used, reserved, outside in rows:
        print(f"| {e} | {used / MB:.1f} | {reserved / MB:.1f} | {outside / MB:.1f} |")
    first, rest = rows[0], rows[1:] or rows
    grow = [max(r[k] for r in rest) - first[k] for k in (1, 2, 3)]
    print(f"growth after epoch 1 (MB): NVML {grow[0] / MB:+.1f}, PyTorch {grow[1] / MB:+.1f}, "
          f"outside {grow[2] / MB:+.1f}")


def probe(args: argparse.Namespace, device: torch.device, nvml: _Nvml) -> None:
    files = sorted(glob.glob(f"{args.data}/*/*.jpg"), key=os.path.getsize, reverse=True)[:1024]
    datas = [open(f, "rb").read() for f in files]
    cpu = CpuDecoder()
    heads = [cpu.header(d, "x")[:2] for d in datas]
    arena = np.zeros((len(datas), max(map(len, datas))), np.uint8)
    for i, d in enumerate(datas):
        arena[i, : len(d)] = np.frombuffer(d, np.uint8)
    lengths = np.array([len(d) for d in datas], np.uint64)
    widths = np.array([w for w, _ in heads], np.int64)
    heights = np.array([h for _, h in heads], np.int64)
    extents = widths * heights * 3
    small = np.argsort(lengths)
    flat = torch.empty(int(max(extents[:256].sum(), extents[small[:256]].sum())), dtype=torch.uint8, device=device)
    for preallocate in (False, True):
        _probe_calls(device, nvml, arena, lengths, widths, heights, extents, flat, preallocate)


def _probe_calls(device, nvml, arena, lengths, widths, heights, extents, flat, preallocate: bool) -> None:
    from gpufeed.decode import nvjpeg_hw

    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    used0 = nvml.used()
    if preallocate:  # as the loader makes it: room for a call of 256 images of the largest size it gives
        decoder = nvjpeg_hw.NvJpegHwDecoder(device, call_images=256, max_side=GPU_MAX_SIDE)
        note = f", memory taken for 256 images of {GPU_MAX_SIDE} x {GPU_MAX_SIDE}"
    else:  # the least nvJPEG takes: it grows as calls need more
        decoder = nvjpeg_hw.NvJpegHwDecoder(device, call_images=1, max_side=1)
        note = ", memory taken for 1 image of 1 x 1"
    torch.cuda.synchronize(device)
    print(f"nvJPEG {decoder.version}, {decoder.engines} engines; decoder made{note}: "
          f"{(nvml.used() - used0) / MB:+.1f} MB")
    print("| call | images | bitstream MB | decoded MB | NVML used added, MB |\n|---|---|---|---|---|")

    def call(name: str, idx: np.ndarray) -> None:
        offsets = np.concatenate([[0], np.cumsum(extents[idx])[:-1]])
        job = DecodeJob((arena.ctypes.data + idx * arena.strides[0]).astype(np.uint64), lengths[idx],
                        (flat.data_ptr() + offsets).astype(np.uint64), heights[idx], widths[idx], device,
                        (arena, flat))
        ok = decoder.decode(job, stream)
        stream.synchronize()
        print(f"| {name} | {int(ok.sum())}/{len(idx)} | {lengths[idx].sum() / MB:.1f} | "
              f"{extents[idx].sum() / MB:.1f} | {(nvml.used() - used0) / MB:+.1f} |")

    # the smallest files first, then the largest: does the decoder's memory follow bytes or images?
    small = np.argsort(lengths)
    for k in (16, 64, 256):
        for turn in range(2):  # two decode states, used in turn
            call(f"{k} smallest, state {turn}", small[:k])
    for k in (16, 64, 128, 256):
        for turn in range(2):
            call(f"{k} largest, state {turn}", np.arange(k))


def sizes(args: argparse.Namespace, device: torch.device, nvml: _Nvml) -> None:
    import gc

    from gpufeed.decode import nvjpeg_hw

    print("| room for (images x side) | decoder made, NVML used added, MB |\n|---|---|")
    for spec in args.sizes.split(","):
        n, side = (int(v) for v in spec.split("x"))
        torch.cuda.synchronize(device)
        used0 = nvml.used()
        decoder = nvjpeg_hw.NvJpegHwDecoder(device, call_images=n, max_side=side)
        torch.cuda.synchronize(device)
        print(f"| {n} x {side} | {(nvml.used() - used0) / MB:+.1f} |", flush=True)
        del decoder
        gc.collect()
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--decode", default="auto")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=0, help="0: the loader's default")
    p.add_argument("--probe", action="store_true")
    p.add_argument("--sizes", help="N1xS1,N2xS2,...: decoders made with room for N images of S x S")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_memory.py needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=device)  # the CUDA context is not the loader's
    nvml = _Nvml(_nvml_index(device))
    m = machine_description()
    print(f"{time.strftime('%Y-%m-%d')}, {m['cpu_cores']} CPU cores, GPU {m['gpu']}, torch {m['torch']}; "
          f"python3 benchmarks/gpu_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    (sizes if args.sizes else probe if args.probe else loader_epochs)(args, device, nvml)


if __name__ == "__main__":
    main()
