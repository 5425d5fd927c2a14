"""Batched pixel operations on uint8 images with a value per sample: torchvision's functional ops on
``(n, 3, S, S)`` uint8 tensors (CUDA or CPU), computed as torchvision computes them for one image, with
``factors[i]`` (a Python float) for sample i. Each returns a new uint8 batch."""

from __future__ import annotations

import functools
import math
from typing import Callable, Hashable, Sequence

import numpy as np
import torch
from torch.nn.functional import grid_sample, pad
from torchvision.transforms.v2 import functional as F

try:  # torchvision's own pieces, so a whole group's affine and hue are computed as its ops compute them
    from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv
    from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix
except ImportError:  # another torchvision: every sample through the public ops instead (the same pixels, slower)
    _get_inverse_affine_matrix = _hsv_to_rgb = _rgb_to_hsv = None

BATCHED_GEOMETRY = _get_inverse_affine_matrix is not None


def on(device: torch.device, values, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values`` as a tensor on ``device``: through page-locked memory without waiting on CUDA, since a copy
    from ordinary memory would first wait for all the work queued on the stream (the training's). Keep
    ``values`` small (parameters, not masks or images): a CPU copy past PyTorch's grain (32,768 elements)
    wakes its intra-op threads, whose spinning takes the cores the workers decode on (BENCHMARKS.md,
    "Training recipes")."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class DrawFailed(ValueError):
    """A sample's draw that its op cannot apply (RandomPerspective's corners that collapse the image):
    ``draw`` is that draw, so ``SampleOps`` can name the sample that drew it."""

    def __init__(self, message: str, draw: object) -> None:
        super().__init__(message)
        self.draw = draw


def each_group(images: torch.Tensor, keys: Sequence[Hashable],
               fn: Callable[[torch.Tensor, Hashable, list[int]], torch.Tensor], skip: Hashable = None) -> torch.Tensor:
    """(n, ...) -> the same with ``fn(images[members], key, members)`` in the rows of each distinct key of
    ``keys`` (one per sample) but ``skip``: one pass per key for all the samples that drew it. ``images``
    itself when every key is ``skip``. The samples are gathered once, group after group, each group's pass
    reads its slice, and one copy puts them back: a few launches per batch whatever the number of groups,
    rather than a gather, a scatter and an index upload per group."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        if key != skip:
            groups.setdefault(key, []).append(i)
    if not groups:
        return images
    if list(groups.values()) == [list(range(len(images)))]:  # the whole batch: no gather, no scatter
        return fn(images, *next(iter(groups.items())))
    rows = on(images.device, [i for members in groups.values() for i in members], torch.int64)
    picked = images.index_select(0, rows)
    done, start = [], 0
    for key, members in groups.items():
        done.append(fn(picked[start : start + len(members)], key, members))
        start += len(members)
    return images.index_copy(0, rows, done[0] if len(done) == 1 else torch.cat(done))


def per_sample(images: torch.Tensor, op: Callable[[torch.Tensor, float], torch.Tensor],
               values: Sequence[float]) -> torch.Tensor:
    """``op(images[i:i+1], values[i])`` for each sample: the public op where a batched form is missing."""
    return torch.cat([op(images[i : i + 1], float(v)) for i, v in enumerate(values)])


def grey(images: torch.Tensor) -> torch.Tensor:
    """(n, 3, H, W) uint8 -> (n, 1, H, W) float32: the luma torchvision computes for uint8 images, floored."""
    r, g, b = images.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze_(-3).floor_()


def grayscale(images: torch.Tensor) -> torch.Tensor:
    """``rgb_to_grayscale(images, num_output_channels=3)``."""
    return grey(images).to(torch.uint8).expand_as(images).contiguous()


def _blend(images: torch.Tensor, factors: Sequence[float], other: torch.Tensor | None) -> torch.Tensor:
    """torchvision's ``_blend``: ``image * factor + other * (1 - factor)``, the weights rounded to float32
    as its scalars are, the product and sum fused as its kernel fuses them."""
    if other is None:
        return images.mul(on(images.device, factors).view(-1, 1, 1, 1)).clamp_(0, 255).to(torch.uint8)
    weights = on(images.device, [list(factors), [1.0 - f for f in factors]])  # one upload: (2, n) float32
    out = images.mul(weights[0].view(-1, 1, 1, 1))
    out.addcmul_(other, weights[1].view(-1, 1, 1, 1))
    return out.clamp_(0, 255).to(torch.uint8)


def brightness(images: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
    """``adjust_brightness`` by ``factors[i]``."""
    return _blend(images, factors, None)


def saturation(images: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
    """``adjust_saturation`` by ``factors[i]``."""
    return _blend(images, factors, grey(images))


def contrast(images: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
    """``adjust_contrast`` by ``factors[i]``."""
    return _blend(images, factors, grey(images).mean(dim=(-3, -2, -1), keepdim=True))


_BLEND_OTHER = {"Brightness": 0, "Color": 1, "Contrast": 2}  # blended with: black, the grey image, its mean


def blends(images: torch.Tensor, kinds: Sequence[str], factors: Sequence[float]) -> torch.Tensor:
    """Sample i through ``kinds[i]`` ("Brightness", "Color" or "Contrast") by ``factors[i]``: one pass for all
    three, each sample blended with what its operation blends with (``brightness``, ``saturation``,
    ``contrast``: the same pixels)."""
    if len(set(kinds)) == 1:
        return {"Brightness": brightness, "Color": saturation, "Contrast": contrast}[kinds[0]](images, factors)
    g = grey(images)
    kind = on(images.device, [_BLEND_OTHER[k] for k in kinds], torch.int64).view(-1, 1, 1, 1)
    other = torch.where(kind == 1, g, torch.where(kind == 2, g.mean(dim=(-3, -2, -1), keepdim=True), 0.0))
    return _blend(images, factors, other)


def point_parameters(name: str, magnitude: float) -> tuple[float, int]:
    """(threshold, bit mask) of one point operation: values at or above the threshold are inverted
    (Solarize's ``255 x magnitude``, 0 for Invert, 256 for none), then masked (Posterize keeps
    ``int(magnitude)`` bits)."""
    threshold = 255.0 * magnitude if name == "Solarize" else 0.0 if name == "Invert" else 256.0
    bits = int(magnitude)
    return threshold, ((1 << bits) - 1) << (8 - bits) if name == "Posterize" and bits < 8 else 0xFF


def point_ops(images: torch.Tensor, names: Sequence[str], magnitudes: Sequence[float]) -> torch.Tensor:
    """Sample i through ``names[i]`` ("Posterize" to ``int(magnitudes[i])`` bits, "Solarize" above
    ``255 x magnitudes[i]``, "Invert"): one pass for all three, as torchvision's ops compute them."""
    thresholds, masks = zip(*(point_parameters(n, m) for n, m in zip(names, magnitudes)))
    threshold = on(images.device, thresholds).view(-1, 1, 1, 1)  # float32, as torchvision's comparison rounds it
    out = torch.where(images >= threshold, images.bitwise_not(), images)
    return out.bitwise_and_(on(images.device, masks, torch.uint8).view(-1, 1, 1, 1))


def autocontrast(images: torch.Tensor) -> torch.Tensor:
    """``autocontrast``: each channel stretched from its own lowest and highest value to 0-255 in float32, as
    torchvision computes it (a channel of one value left as it is), in half its calls."""
    if images.numel() == 0:
        return images
    f = images.float()
    low, high = f.amin(dim=(-2, -1), keepdim=True), f.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    scale = (high - low).mul_(1.0 / 255).masked_fill_(flat, 1.0)
    return f.sub_(low.masked_fill_(flat, 0.0)).div_(scale).clamp_(0, 255).to(torch.uint8)


def equalize(images: torch.Tensor) -> torch.Tensor:
    """``equalize``: each channel through PIL's equalising lookup table, computed as torchvision computes it
    for uint8 images (a channel with fewer than 255 pixels below its brightest value left as it is), in half
    its calls: the table for value k from the count of pixels below k (``cum - hist``) needs no shifted copy."""
    if images.numel() == 0:
        return images
    index = images.flatten(-2).long()
    hist = torch.zeros(*index.shape[:-1], 256, dtype=torch.int32, device=images.device)
    hist.scatter_add_(-1, index, hist.new_ones(1).expand_as(index))
    cum = hist.cumsum(-1)
    step = (index.shape[-1] - hist.gather(-1, cum.argmax(-1, keepdim=True))).div_(255, rounding_mode="floor")
    lut = cum.sub_(hist).add_(step // 2).div_(step.clamp(min=1), rounding_mode="floor").clamp_(0, 255)
    out = lut.to(torch.uint8).gather(-1, index).view_as(images)
    return torch.where(step.ne(0).unsqueeze(-1), out, images)


def sharpness(images: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
    """``adjust_sharpness`` by ``factors[i]``: torchvision's 3x3 smoothing kernel (1/13 around, 5/13 in the
    middle) blended in, the border kept. The kernel is summed as shifted views, not a convolution: cuDNN builds
    a plan for each new batch shape, and the samples that drew an op are a different count in every batch
    (milliseconds of host time per call)."""
    if images.shape[-1] <= 2 or images.shape[-2] <= 2:
        return images
    out = images.to(torch.float32, copy=True)
    rows = out[..., :, :-2] + out[..., :, 1:-1] + out[..., :, 2:]
    box = rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :]  # the 9 pixels, an exact integer sum
    inner = out[..., 1:-1, 1:-1]
    blurred = box.add_(inner, alpha=4.0).div_(13.0).round_()  # (sum of 8 + 5 x middle) / 13, rounded
    inner.addcmul_(blurred.sub_(inner), on(images.device, [1.0 - f for f in factors]).view(-1, 1, 1, 1))
    return out.clamp_(0, 255).to(torch.uint8)


def hue(images: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
    """``adjust_hue`` by ``factors[i]`` (in [-0.5, 0.5]): through HSV in float32, back with torchvision's
    scaled cast."""
    if _rgb_to_hsv is None:
        return per_sample(images, lambda x, f: F.adjust_hue(x, hue_factor=f), factors)
    h, s, v = _rgb_to_hsv(images.to(torch.float32).mul_(1.0 / 255)).unbind(dim=-3)
    h = h.add(on(images.device, factors).view(-1, 1, 1)).remainder_(1.0)
    return _hsv_to_rgb(torch.stack((h, s, v), dim=-3)).mul_(255 + 1.0 - 1e-3).to(torch.uint8)


def gaussian_blur(images: torch.Tensor, kernel_size: tuple[int, int], sigmas: Sequence[float]) -> torch.Tensor:
    """``gaussian_blur(images[i], kernel_size, [sigmas[i]] * 2)``: reflect padding, torchvision's kernel,
    applied as two passes of its 1-D factors, each a sum of shifted views weighted per sample (no cuDNN
    convolution: it builds a plan for each new batch shape, see ``sharpness``)."""
    n, c, h, w = images.shape
    kx, ky = kernel_size
    x = pad(images.to(torch.float32), [kx // 2, kx // 2, ky // 2, ky // 2], mode="reflect")
    sigmas = on(images.device, sigmas)
    wx, wy = _gaussian_1d(kx, sigmas).view(n, 1, 1, 1, kx), _gaussian_1d(ky, sigmas).view(n, 1, 1, 1, ky)
    across = x[..., 0:w].mul(wx[..., 0])
    for k in range(1, kx):
        across.addcmul_(x[..., k : k + w], wx[..., k])
    out = across[..., 0:h, :].mul(wy[..., 0])
    for k in range(1, ky):
        out.addcmul_(across[..., k : k + h, :], wy[..., k])
    return out.round_().to(torch.uint8)


def _gaussian_1d(size: int, sigmas: torch.Tensor) -> torch.Tensor:
    """(n, size): torchvision's 1-D Gaussian kernel for each sigma."""
    lim = (size - 1) / (2.0 * math.sqrt(2.0))
    x = torch.linspace(-lim, lim, steps=size, device=sigmas.device)
    return torch.softmax(x.div(sigmas.view(-1, 1)).pow(2).neg(), dim=1)


def affine(images: torch.Tensor, matrices: Sequence[Sequence[float]], interpolation: str) -> torch.Tensor:
    """Each image through its own inverse affine matrix (``_get_inverse_affine_matrix``'s 6 numbers):
    torchvision's grid (``_affine_grid``) per sample in one batched product, then one ``grid_sample``
    (``interpolation``: "nearest" or "bilinear") with zeros outside, rounded back to uint8."""
    n, _, h, w = images.shape
    device = images.device
    # (n, 3, 2): each matrix transposed and divided by the half sizes, in float32 as torchvision divides it,
    # here before the upload rather than in two launches after it
    theta = np.asarray(matrices, np.float32).reshape(n, 2, 3).transpose(0, 2, 1)
    rescaled = on(device, np.ascontiguousarray(theta / np.array([0.5 * w, 0.5 * h], np.float32)))
    base = _base_grid(h, w, device)
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(rescaled).view(n, h, w, 2)
    out = grid_sample(images.float(), grid, mode=interpolation, padding_mode="zeros", align_corners=False)
    return out.round_().to(torch.uint8)


@functools.cache
def _base_grid(h: int, w: int, device: torch.device) -> torch.Tensor:
    """(1, h, w, 3) float32: torchvision's affine grid before the matrix (pixel centres, then 1), made once
    per size and device rather than in six launches per call; kept for good (a few sizes at most) and
    finished before it is returned, so any stream may read it."""
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    if base.is_cuda:
        torch.cuda.current_stream(device).synchronize()  # once per size: later readers on other streams
    return base


def inverse_matrix(name: str, magnitude: float, w: int, h: int) -> list[float]:
    """The inverse affine matrix torchvision's ``affine``/``rotate`` build for an auto-augment geometry
    operation (ShearX/Y, TranslateX/Y, Rotate) of ``magnitude`` on a ``w`` x ``h`` image."""
    if name in ("ShearX", "ShearY"):
        shear = math.degrees(math.atan(magnitude))
        return _get_inverse_affine_matrix([-w * 0.5, -h * 0.5], 0.0, [0.0, 0.0], 1.0,
                                          [shear, 0.0] if name == "ShearX" else [0.0, shear])
    if name in ("TranslateX", "TranslateY"):
        shift = float(int(magnitude))
        return _get_inverse_affine_matrix([0.0, 0.0], 0.0, [shift, 0.0] if name == "TranslateX" else [0.0, shift],
                                          1.0, [0.0, 0.0])
    if name == "Rotate":
        return _get_inverse_affine_matrix([0.0, 0.0], -(magnitude % 360), [0.0, 0.0], 1.0, [0.0, 0.0])
    raise ValueError(f"no affine operation {name!r}")
