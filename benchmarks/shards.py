"""Pre-resized shards against the original JPEGs: what `gpufeed shards --max-side` buys the loader and the
training, and what the resize changes in the training crops.

    python3 benchmarks/shards.py [DATA] [--n 10000] [--max-side 320] [--rounds 2] [--epochs 3]
        [--device cuda] [--batch-size 256] [--workers N] [--work DIR] [--psnr-images 200]

DATA: a JPEG ImageFolder (default: ``--n`` synthetic images, ``gpufeed synth``, seed 0, under ``--work``).

1. Conversion: ``write_shards(DATA, WORK/shards, max_side, local engine, --workers processes)`` timed; images/s
   and per worker process.
2. Loops, each in a fresh process, alternating (original, shards) for ``--rounds`` rounds: ``for x, y in
   loader: step(x, y)`` over ``ImageLoader(..., batch_size, device, dtype=bfloat16, channels_last=True)``
   (RandomResizedCrop 224 + flip), the device synchronised at each epoch's end, every epoch printed;
   images/s is the median of the epochs after the first. Loader only (``step`` does nothing), then
   ResNet-18 training (bf16 autocast, channels_last, SGD), whose own rate on one GPU-resident batch is
   measured first in the same process (the ceiling).
3. PSNR of RandomResizedCrop outputs: ``--psnr-images`` resized samples, one crop box each drawn on the
   original (torchvision's RandomResizedCrop parameters, scale 0.08-1, ratio 3/4-4/3), the same box scaled
   onto the resized image; both cropped and resized to each of ``--psnr-sizes`` with Pillow's antialiased
   bilinear filter (float boxes: the same region of the scene); PSNR in dB (mean and 10th percentile).

The table printed last: loader-only images/s, shards against original; ResNet-18 images/s and its % of
its own rate.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from gpufeed import ImageLoader
from gpufeed.bench.run import machine_description
from gpufeed.shards import ShardOptions, ShardSize, write_shards
from gpufeed.shards.plan import order_of
from gpufeed.sources import create_source
from gpufeed.synth import create_synthetic_dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data", nargs="?", help="a JPEG ImageFolder (default: --n synthetic images)")
    p.add_argument("--n", type=int, default=10_000, help="synthetic images when DATA is not given")
    p.add_argument("--max-side", type=int, default=320)
    p.add_argument("--shard-size", default="256MB")
    p.add_argument("--rounds", type=int, default=2, help="rounds of fresh processes, each variant once per round")
    p.add_argument("--epochs", type=int, default=3, help="epochs per process; the first is a warm-up")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, help="conversion processes and loader workers (default: the usable cores)")
    p.add_argument("--ceiling-seconds", type=float, default=3.0, help="seconds of the model alone")
    p.add_argument("--work", help="folder for the synthetic data and the shards (default: a temporary one)")
    p.add_argument("--psnr-images", type=int, default=200)
    p.add_argument("--psnr-sizes", default="128,160,192,224")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # VARIANT MODE DATA RESULT: one loop, in a fresh process
    args = p.parse_args(argv)
    if args.epochs < 2 or args.rounds < 1:
        p.error(f"--epochs must be >= 2 (the first is a warm-up) and --rounds >= 1, got {args.epochs}, {args.rounds}")
    return args


def convert(data: str, out: Path, args: argparse.Namespace) -> dict:
    workers = args.workers or len(os.sched_getaffinity(0))
    options = ShardOptions(max_side=args.max_side, shard_size=ShardSize.parse(args.shard_size), workers=workers)
    t0 = time.perf_counter()
    manifest = write_shards(data, out, options)
    seconds = time.perf_counter() - t0
    rate = manifest["inputs"] / seconds
    return {"seconds": seconds, "images_per_s": rate, "per_worker": rate / workers, "workers": workers,
            "resized": manifest["resized"], "inputs": manifest["inputs"], "shards": len(manifest["shards"]),
            "bytes": sum(s["size"] for s in manifest["shards"])}


# -- one loop, in a fresh process ----------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(device: torch.device):
    import torchvision

    model = torchvision.models.resnet18(num_classes=1000).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def own_rate(step, args: argparse.Namespace, device: torch.device) -> float:
    """The model's images/s on one batch already on the device: the median of about 1 s windows."""
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device,
                         dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    for _ in range(3):
        step(images, labels)
    rates, end = [], time.perf_counter() + args.ceiling_seconds
    while time.perf_counter() < end or not rates:
        _sync(device)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min(1.0, args.ceiling_seconds) or n == 0:
            step(images, labels)
            n += args.batch_size
        _sync(device)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def child(args: argparse.Namespace) -> None:
    variant, mode, data, result = args.child
    device = torch.device(args.device)
    step = _train_step(device) if mode == "train" else (lambda x, y: None)
    ceiling = own_rate(step, args, device) if mode == "train" else None
    loader = ImageLoader(data, batch_size=args.batch_size, image_size=args.image_size, device=device,
                         dtype=torch.bfloat16, channels_last=True, num_workers=args.workers)
    rates = []
    with loader:
        for epoch in range(args.epochs):
            n, t0 = 0, time.perf_counter()
            for x, y in loader:
                step(x, y)
                n += len(y)
            _sync(device)
            rates.append(n / (time.perf_counter() - t0))
            print(f"  {variant:8s} {mode:6s} epoch {epoch}: {n} images, {rates[-1]:,.0f} images/s", flush=True)
        stats = {k: loader.stats[k] for k in ("decode_backend", "decoded_by", "cpu_share", "shards")}
    Path(result).write_text(json.dumps({"rates": rates, "ceiling": ceiling, "stats": stats}))


def run_child(variant: str, mode: str, data: str, args: argparse.Namespace, argv: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", variant, mode, data, f.name],
                       check=True)
        return json.loads(Path(f.name).read_text())


# -- PSNR of the training crops ------------------------------------------------------------------------------------
def crop_psnr(data: str, shards: Path, args: argparse.Namespace) -> dict[int, list[float]]:
    """{output size: PSNR of each sample's crop from the shards against the same crop from the original}."""
    from torchvision.transforms import RandomResizedCrop

    sizes = [int(s) for s in args.psnr_sizes.split(",")]
    original, stored = create_source(data), create_source(shards)
    manifest = json.loads((shards / "manifest.json").read_text())
    order = order_of(len(original), manifest["options"]["shuffle"])
    generator = torch.Generator().manual_seed(0)
    out: dict[int, list[float]] = {s: [] for s in sizes}
    for i in range(len(stored)):
        if len(out[sizes[0]]) >= args.psnr_images:
            break
        position = int(stored.path(i).rsplit(":", 1)[1].split(".")[0])  # the key: the position in the order
        src = Image.open(io.BytesIO(original.read(int(order[position])))).convert("RGB")
        small = Image.open(io.BytesIO(stored.read(i))).convert("RGB")
        if small.size == src.size:
            continue  # copied as it was: nothing to compare
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        top, left, h, w = RandomResizedCrop.get_params(src, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
        sx, sy = small.width / src.width, small.height / src.height
        for s in sizes:
            a = np.asarray(src.resize((s, s), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)))
            b = np.asarray(small.resize((s, s), Image.Resampling.BILINEAR,
                                        box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy)))
            mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
            out[s].append(10 * np.log10(255**2 / max(mse, 1e-10)))
    return out


# -- the run -------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="gpufeed-shards-bench-"))
    data = args.data or str(create_synthetic_dataset(work / f"synth-{args.n}", n=args.n, seed=0))
    shards = work / f"shards-{args.max_side}"
    if shards.exists():
        import shutil

        shutil.rmtree(shards)
    conv = convert(data, shards, args)
    print(f"conversion: {conv['inputs']} images ({conv['resized']} resized to max side {args.max_side}) into "
          f"{conv['shards']} shards of {conv['bytes'] / 1e6:,.0f} MB in {conv['seconds']:.1f} s: "
          f"{conv['images_per_s']:,.0f} images/s, {conv['per_worker']:,.0f} per process ({conv['workers']} processes)",
          flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for mode in ("loader", "train"):
            for variant, path in (("original", data), ("shards", str(shards))):
                print(f"round {r + 1}: {variant}, {mode}", flush=True)
                results.setdefault((variant, mode), []).append(run_child(variant, mode, path, args, argv))
    psnr = crop_psnr(data, shards, args)
    print(f"\nmachine: {machine_description()}\ncommand: {' '.join([sys.argv[0], *argv])}")
    stats = results[("shards", "loader")][0]["stats"]
    print(f"shards' loader: decode {stats['decode_backend']}, decoded_by {stats['decoded_by']}, "
          f"stats['shards'] {stats['shards']}")
    n = len(next(iter(psnr.values())))
    print(f"\nRandomResizedCrop from the max-side-{args.max_side} shards against the originals ({n} resized samples, "
          "one box each):\n\n| output size | PSNR mean (dB) | 10th percentile (dB) |\n|---|---|---|")
    for s, values in psnr.items():
        if values:
            print(f"| {s} | {np.mean(values):.1f} | {np.percentile(values, 10):.1f} |")

    def rate(variant: str, mode: str) -> float:
        return statistics.median(statistics.median(x["rates"][1:]) for x in results[(variant, mode)])

    def ceiling(variant: str) -> float:
        return statistics.median(x["ceiling"] for x in results[(variant, "train")])

    print(f"\n| data | loader only, images/s | ResNet-18, images/s | ResNet-18 own rate | % of own rate |\n|---|---|---|---|---|")
    for variant in ("original", "shards"):
        print(f"| {variant} | {rate(variant, 'loader'):,.0f} | {rate(variant, 'train'):,.0f} | {ceiling(variant):,.0f} "
              f"| {100 * rate(variant, 'train') / ceiling(variant):.1f}% |")
    print(f"| shards / original | {rate('shards', 'loader') / rate('original', 'loader'):.2f}x | "
          f"{rate('shards', 'train') / rate('original', 'train'):.2f}x | | |")


if __name__ == "__main__":
    main()
