"""Helpers the test modules share: image comparison and textured test images (nothing is downloaded)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from PIL import Image


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two arrays of 0-255 values (any dtype, the same shape); identical arrays give about 168 dB
    (the error floored at 1e-12) rather than infinity, so medians and prints stay finite."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"psnr compares arrays of one shape, got {a.shape} and {b.shape}")
    mse = np.mean((a - b) ** 2)
    return 10 * math.log10(255**2 / max(mse, 1e-12))


def textured(width: int, height: int, seed: int, tint: tuple[int, int, int] | None = None) -> Image.Image:
    """An RGB image of smooth random texture (noise on a grid of 4 pixels, resized bilinear), so two crops or
    two flips of it differ in their pixels; with ``tint``, 70 % that flat colour and 30 % texture, so the mean
    colour still names the tint."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (height // 4 + 2, width // 4 + 2, 3), dtype=np.uint8)
    pixels = np.asarray(Image.fromarray(noise).resize((width, height), Image.BILINEAR), np.float64)
    if tint is not None:
        pixels = 0.7 * np.asarray(tint, np.float64) + 0.3 * pixels
    return Image.fromarray(pixels.round().clip(0, 255).astype(np.uint8))



def shared_memory_mapped(*pids: int) -> set[str]:
    """The names of the POSIX shared-memory blocks and semaphores (files in /dev/shm) that processes ``pids``
    (this one without any) map now (Linux): what a pool or a training process made, told apart from what other
    processes on the machine make meanwhile. A process gone by then counts for nothing."""
    names = set()
    for pid in pids or ("self",):
        try:
            with open(f"/proc/{pid}/maps") as f:
                names |= {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line}
        except OSError:  # exited meanwhile
            pass
    return names


def torchvision_ops(ops: list, image: np.ndarray, seed: int, epoch: int, index: int) -> np.ndarray:
    """``ops`` as torchvision runs them on a PIL image, seeded as gpufeed's workers seed sample ``index``
    (``augment.worker_ops.sample_seed``): (H, W, 3) uint8."""
    from gpufeed.augment.worker_ops import sample_seed

    value = sample_seed(seed, epoch, index)
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value & 0xFFFF_FFFF)
    x = Image.fromarray(image)
    for op in ops:
        x = op(x)
    return np.asarray(x)


def tinted_classes(root, colours, sizes, seed_step: int, quality: int):
    """``root``/c<k>/<i>.jpg: one class per colour, each a tint over texture (``textured``) at each of
    ``sizes`` (width, height), image i of class k seeded ``seed_step * k + i``; returns ``root``."""
    for c, colour in enumerate(colours):
        (root / f"c{c}").mkdir()
        for i, (w, h) in enumerate(sizes):
            textured(w, h, seed_step * c + i, colour).save(root / f"c{c}" / f"{i:02d}.jpg", quality=quality)
    return root


def denormalised_uint8(x: torch.Tensor, mean, std) -> np.ndarray:
    """Normalised (B, 3, H, W) images back on the 0-255 scale, as a float numpy array on the host."""
    m = torch.tensor(mean, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, device=x.device).view(1, 3, 1, 1)
    return ((x.float() * s + m) * 255).cpu().numpy()
