"""torchvision's ``RandomPerspective`` on uint8 batches: each sample's corners drawn as ``make_params`` draws
them for one image, and warped as ``perspective`` warps a uint8 tensor (the same coefficient solve, grid and
fill), the samples that drew a warp ``ROWS`` at a time."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import torch
from torch.nn.functional import grid_sample

from ...placement.ops import PERSPECTIVE_INTERPOLATIONS
from ..params import SampleRandom
from .pixels import DrawFailed, each_group, on

Corners = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]  # (x, y): TL, TR, BR, BL
_COLLAPSE = "collapse the image (no perspective maps the image's corners there; torchvision's solve fails on them too)"
_WAY_OUT = ("a distortion_scale below 1 keeps each corner in its own quarter of the image, where such corners are "
            "far rarer")


@dataclass(frozen=True)
class Perspective:
    """``RandomPerspective(distortion_scale, p, interpolation, fill)``: ``fill`` one value or one per channel,
    or None (torchvision's zeros with no fill pass: a bilinear edge fades to black rather than to ``fill``)."""

    distortion_scale: float = 0.5
    p: float = 0.5
    interpolation: str = "bilinear"
    fill: tuple[float, ...] | None = (0.0,)
    salt: ClassVar[int] = 0x7A1B_000B
    uniforms: ClassVar[int] = 9  # the p draw and eight corner coordinates

    def __post_init__(self) -> None:
        if not 0 <= self.distortion_scale <= 1:
            raise ValueError(f"RandomPerspective(distortion_scale={self.distortion_scale!r}) needs a value in [0, 1]")
        if self.distortion_scale == 1:
            warnings.warn(f"gpufeed: RandomPerspective(distortion_scale=1) can draw corners that {_COLLAPSE}, and "
                          f"such a draw stops the epoch with a ValueError; {_WAY_OUT}", stacklevel=3)
        if not 0 <= self.p <= 1:
            raise ValueError(f"RandomPerspective(p={self.p!r}) needs a probability in [0, 1]")
        if self.interpolation not in PERSPECTIVE_INTERPOLATIONS:
            raise ValueError(f"RandomPerspective(interpolation={self.interpolation!r}) runs on the device with "
                             f"{' or '.join(PERSPECTIVE_INTERPOLATIONS)}")
        if self.fill is not None and len(self.fill) not in (1, 3):
            raise ValueError(f"RandomPerspective(fill={self.fill!r}) needs one value or one per channel (3)")

    def draw(self, rnd: SampleRandom, size: int) -> Corners | None:
        """Where the corners of an S x S image go, or None (no warp): torchvision's draw, a uniform below ``p``
        then each corner's x and y uniform over its ``distortion_scale`` share of the half size."""
        if rnd.uniform() >= self.p:
            return None
        bound = int(self.distortion_scale * (size // 2)) + 1
        near, far = (0, bound - 1), (size - bound, size - 1)
        tl = (rnd.randint(*near), rnd.randint(*near))
        tr = (rnd.randint(*far), rnd.randint(*near))
        br = (rnd.randint(*far), rnd.randint(*far))
        bl = (rnd.randint(*near), rnd.randint(*far))
        return tl, tr, br, bl

    def apply(self, images: torch.Tensor, choices: Sequence[Corners | None]) -> torch.Tensor:
        """(B, 3, S, S) uint8 -> the same with sample i warped so its corners go to ``choices[i]``."""
        return each_group(images, [c is not None for c in choices],
                          lambda x, _, members: warp(x, [choices[i] for i in members], self.interpolation, self.fill),
                          skip=False)


def _solves(a: np.ndarray, b: torch.Tensor) -> bool:
    """Whether one sample's system (1, 8, 8) solves alone, as torchvision solves it."""
    try:
        torch.linalg.lstsq(torch.from_numpy(a), b, driver="gels")
    except torch.linalg.LinAlgError:
        return False
    return True


def coefficients(corners: Sequence[Corners], width: int, height: int) -> np.ndarray:
    """(n, 8) float32: ``_get_perspective_coeffs(startpoints, corners[i])`` for a ``width`` x ``height`` image,
    torchvision's least squares in float64 (LAPACK's gels) rounded to float32, all samples in one batched call."""
    start = np.array([[0, 0], [width - 1, 0], [width - 1, height - 1], [0, height - 1]], np.float64)
    end = np.asarray(corners, np.float64).reshape(-1, 4, 2)
    a = np.zeros((len(end), 8, 8), np.float64)
    x, y = end[..., 0], end[..., 1]
    a[:, 0::2, 0], a[:, 0::2, 1], a[:, 0::2, 2] = x, y, 1.0
    a[:, 1::2, 3], a[:, 1::2, 4], a[:, 1::2, 5] = x, y, 1.0
    a[:, 0::2, 6], a[:, 0::2, 7] = -start[:, 0] * x, -start[:, 0] * y
    a[:, 1::2, 6], a[:, 1::2, 7] = -start[:, 1] * x, -start[:, 1] * y
    b = torch.from_numpy(np.broadcast_to(start.reshape(1, 8, 1), (len(end), 8, 1)).copy())
    try:
        solved = torch.linalg.lstsq(torch.from_numpy(a), b, driver="gels").solution
    except torch.linalg.LinAlgError:  # corners that collapse the image: the first whose own solve fails
        drawn = next(c for i, c in enumerate(corners) if not _solves(a[i : i + 1], b[i : i + 1]))
        raise DrawFailed(f"RandomPerspective drew the corners {drawn} for a {width} x {height} image, which "
                         f"{_COLLAPSE}; {_WAY_OUT}", drawn) from None
    return solved.squeeze(-1).to(torch.float32).numpy()


ROWS = 64  # samples warped at a time: float32 scratch of ~1.6 MB a sample at 224 held to ~100 MB, a few launches a part


def warp(images: torch.Tensor, corners: Sequence[Corners], interpolation: str,
         fill: tuple[float, ...] | None) -> torch.Tensor:
    """(n, 3, H, W) uint8, sample i through ``perspective(images[i], startpoints, corners[i], interpolation,
    fill)``: torchvision's grid (``_perspective_grid``) for each sample in a batched product, ``grid_sample``
    on the image and on the mask of ones torchvision adds as a channel for ``fill`` (each channel sampled on
    its own, so the same numbers), the fill blended in as it blends it. ``ROWS`` samples at a time, into one
    uint8 batch."""
    n, c, h, w = images.shape
    coeffs = coefficients(corners, w, h)
    # (n, 3, 2) each: the affine part transposed and divided by the half sizes in float32, as torchvision
    # divides it, and the denominator's row twice; one upload for both
    theta = coeffs[:, :6].reshape(n, 2, 3).transpose(0, 2, 1) / np.array([0.5 * w, 0.5 * h], np.float32)
    below = np.stack([coeffs[:, 6], coeffs[:, 7], np.ones(n, np.float32)], axis=1)
    thetas = on(images.device, np.ascontiguousarray(np.stack([theta, np.repeat(below[:, :, None], 2, 2)])))
    value = None if fill is None else _fill(fill, images.device)
    out = torch.empty_like(images)
    for at in range(0, n, ROWS):
        rows = slice(at, min(at + ROWS, n))
        out[rows].copy_(_warp_rows(images[rows], thetas[:, rows], interpolation, value))  # rounded, cast as .to
    return out


def _warp_rows(images: torch.Tensor, thetas: torch.Tensor, interpolation: str,
               value: torch.Tensor | None) -> torch.Tensor:
    """(m, 3, H, W) uint8 and (2, m, 3, 2) float32 -> (m, 3, H, W) float32, rounded to whole levels."""
    m, _, h, w = images.shape
    base = _base_grid(h, w, images.device).view(1, h * w, 3).expand(m, -1, -1)
    grid = base.bmm(thetas[0]).div_(base.bmm(thetas[1])).sub_(1.0).view(m, h, w, 2)
    x = grid_sample(images.float(), grid, mode=interpolation, padding_mode="zeros", align_corners=False)
    if value is not None:  # how much of each output pixel fell inside the image
        ones = _ones(h, w, images.device).expand(m, -1, -1, -1)
        mask = grid_sample(ones, grid, mode=interpolation, padding_mode="zeros", align_corners=False)
        if interpolation == "nearest":
            x = torch.where(mask < 0.5, value, x, out=x)
        else:
            x = x.sub_(value).mul_(mask).add_(value)
    return x.round_()


@functools.cache
def _fill(fill: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """(1, C, 1, 1) float32 ``fill`` on ``device``, made once per fill and device: a blocking copy, finished
    before it is returned, so any stream may read it."""
    return torch.tensor(fill, dtype=torch.float32, device=device).view(1, -1, 1, 1)


@functools.cache
def _ones(h: int, w: int, device: torch.device) -> torch.Tensor:
    """(1, 1, h, w) float32 ones on ``device`` (the mask before the warp, one for every sample), made once per
    size and device and finished before it is returned."""
    ones = torch.ones(1, 1, h, w, dtype=torch.float32, device=device)
    if ones.is_cuda:
        torch.cuda.current_stream(device).synchronize()
    return ones


@functools.cache
def _base_grid(h: int, w: int, device: torch.device) -> torch.Tensor:
    """(1, h, w, 3) float32: torchvision's perspective grid before the matrix (pixel centres from 0.5, then 1),
    made once per size and device; finished before it is returned, so any stream may read it."""
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace(0.5, w + 0.5 - 1.0, steps=w, device=device, dtype=torch.float32))
    base[..., 1].copy_(torch.linspace(0.5, h + 0.5 - 1.0, steps=h, device=device, dtype=torch.float32).unsqueeze_(-1))
    base[..., 2].fill_(1)
    if base.is_cuda:
        torch.cuda.current_stream(device).synchronize()  # once per size: later readers on other streams
    return base
