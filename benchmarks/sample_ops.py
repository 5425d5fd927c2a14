"""What each per-sample op costs a batch: gpufeed's batched op on the device against torchvision's transform
on one image at a time on one CPU core (uint8, as a DataLoader worker runs it before ToTensor).

    python3 benchmarks/sample_ops.py [--device cuda] [--batch 256] [--size 224] [--rounds 5] [--tv-images 64]

For each op, and for all of them in one recipe: gpufeed's ms per batch through ``SampleOps.from_pixels``
(the uint8 crops in, as the loader hands them over, normalised after; its draws in Python included; the
device synchronised; the median of ``--rounds``), the calling thread's CPU time in that call before the device is synchronised (the host
time the training's process pays), of which the draws alone (each sample's random choices), its images/s,
and torchvision's ms per image on one core (the mean over ``--tv-images`` images). The last column is how
many CPU cores torchvision would need to keep up with gpufeed's rate. ``GPUFEED_OPS_KERNELS=0`` times the
PyTorch passes in place of the Triton kernels on CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torchvision.transforms import v2

from gpufeed.augment.ops import SampleOps, kernels
from gpufeed.augment.recipe import read_transform
from gpufeed.bench.run import machine_description

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def recipes(size: int) -> dict[str, list]:
    """Each op as a torchvision transform, by the name its row takes."""
    ops = {
        "RandomVerticalFlip": [v2.RandomVerticalFlip()],
        "ColorJitter": [v2.ColorJitter(0.4, 0.4, 0.4, 0.1)],
        "RandomGrayscale": [v2.RandomGrayscale(0.2)],
        "GaussianBlur (10% kernel)": [v2.GaussianBlur(size // 10 * 2 + 1, (0.1, 2.0))],
        "RandomAdjustSharpness": [v2.RandomAdjustSharpness(2.0)],
        "TrivialAugmentWide": [v2.TrivialAugmentWide()],
        "RandAugment": [v2.RandAugment()],
        "AutoAugment": [v2.AutoAugment()],
        "AugMix": [v2.AugMix()],
    }
    ops["all of the above, in order"] = [t for ts in ops.values() for t in ts]
    return ops


def gpufeed_ms(transforms: list, images: torch.Tensor, rounds: int) -> tuple[float, float, float]:
    """Median ms for SampleOps on the uint8 crops ``images`` (on their device), the CPU time of the calling
    thread in it before the device is synchronised (the host time a training's process pays), and its draws
    alone, over ``rounds`` epochs."""
    size = images.shape[-1]
    recipe = read_transform(v2.Compose([v2.RandomResizedCrop(size), *transforms]))
    ops = SampleOps(pixel=recipe.pixel, mean=MEAN, std=STD)
    indices = list(range(len(images)))
    times, host, draws = [], [], []
    for epoch in range(rounds + 1):  # the first: a warm-up (kernels, the magnitude tables)
        if images.is_cuda:
            torch.cuda.synchronize(images.device)
        start, cpu = time.perf_counter(), time.thread_time()
        ops.from_pixels(images, indices, 0, epoch, dtype=torch.float32, channels_last=False)
        host.append(time.thread_time() - cpu)
        if images.is_cuda:
            torch.cuda.synchronize(images.device)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for op in ops.pixel:
            ops.draws(op, indices, 0, epoch, size)
        draws.append(time.perf_counter() - start)
    return tuple(1e3 * statistics.median(x[1:]) for x in (times, host, draws))


def torchvision_ms(transforms: list, pixels: torch.Tensor) -> float:
    """Mean ms per image for torchvision's transforms on (3, S, S) uint8 images, one at a time, one thread."""
    t = v2.Compose(transforms)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t(pixels[0])
        start = time.perf_counter()
        for img in pixels:
            t(img)
        return 1e3 * (time.perf_counter() - start) / len(pixels)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tv-images", type=int, default=64, help="images torchvision's per-image time is taken over")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (args.batch, 3, args.size, args.size), dtype=torch.uint8, generator=g)
    images = pixels.to(device)
    m = machine_description()
    print(f"{time.strftime('%Y-%m-%d')}, {m['cpu_cores']} CPU cores, GPU {m['gpu']}, torch {m['torch']}, device "
          f"{device}; python3 benchmarks/sample_ops.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"batch {args.batch} x 3 x {args.size} x {args.size}")
    print(f"auto-augment colour and point operations on CUDA: {kernels.describe()}")
    print("| op | gpufeed ms per batch | host CPU ms | of which draws | gpufeed images/s "
          "| torchvision ms per image, 1 core | cores to keep up |\n|---|---|---|---|---|---|---|")
    for name, transforms in recipes(args.size).items():
        ours, host, draws = gpufeed_ms(transforms, images, args.rounds)
        theirs = torchvision_ms(transforms, pixels[: args.tv_images])
        rate = args.batch / ours * 1e3
        print(f"| {name} | {ours:,.2f} | {host:,.2f} | {draws:,.3f} | {rate:,.0f} | {theirs:.3f} "
              f"| {rate * theirs / 1e3:,.1f} |")


if __name__ == "__main__":
    main()
