"""Each per-sample pixel op of a recipe read from torchvision's transform as the device op that runs it
(``augment.ops``); ValueError naming the op whose parameters gpufeed cannot honour."""

from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

import torch
from PIL import Image
from torchvision import tv_tensors

from ..placement.ops import CONTAINERS, UINT8_OPS, inner_ops, interpolation_name
from .ops import (Apply, AugMix, AutoAugment, Blur, Choice, Grayscale, Jitter, Order, Perspective, PixelOp, RandAugment,
                  Sharpen, TrivialAugment, VerticalFlip, container_salt)


def read_pixel_ops(ops: Sequence[Any], names: Sequence[str], size: int) -> list[PixelOp]:
    """The device ops for the pixel ops among ``ops`` (``names``: their class names), in order, for S x S
    images; each container with a stream of its own."""
    out, containers = [], 0
    for i, (op, name) in enumerate(zip(ops, names, strict=True)):
        if name in CONTAINERS:
            out.append(_container(op, size, list(names[:i]), salt=container_salt(containers)))
            containers += 1
        elif name in _PIXEL_READERS or name == "RandomPerspective":
            out.append(_pixel_op(op, size, list(names[:i])))
    return out


def _pixel_op(op: Any, size: int, before: list[str]) -> PixelOp:
    name = type(op).__name__
    if name == "RandomPerspective":
        return _perspective(op, before)
    if name in CONTAINERS:
        return _container(op, size, before)
    return _PIXEL_READERS[name](op, size)


def _container(op: Any, size: int, before: list[str], salt: int | None = None) -> PixelOp:
    """RandomApply, RandomChoice or RandomOrder (of either torchvision API) of pixel ops."""
    name, ops = type(op).__name__, inner_ops(op)
    inner = tuple(_pixel_op(o, size, before) for o in ops)
    kw = {} if salt is None else {"salt": salt}
    if name == "RandomApply":
        return Apply(inner, p=float(op.p), **kw)
    if name == "RandomChoice":
        p = getattr(op, "p", None)  # transforms.RandomChoice keeps None for equal weights
        return Choice(inner, p=tuple(1.0 for _ in inner) if p is None else tuple(float(v) for v in p), **kw)
    return Order(inner, **kw)


def _perspective(op: Any, before: list[str]) -> Perspective:
    fill = fill_for_input(op.fill, before)
    if fill is not None:
        fill = (float(fill),) if isinstance(fill, numbers.Number) else tuple(float(v) for v in fill)
    return Perspective(distortion_scale=float(op.distortion_scale), p=float(op.p),
                       interpolation=interpolation_name(op, "bilinear"), fill=fill)


def fill_for_input(fill: Any, before: list[str]) -> Any:
    """An op's ``fill`` for the input it gets after the ops ``before`` it (a PIL image, or the tensor ToImage
    or PILToTensor made): v2 may keep one per input type, looked up as torchvision looks it up (that type's,
    else the "others" one, else None)."""
    if not isinstance(fill, dict):
        return fill
    made = [n for n in before if n in UINT8_OPS]
    kind = Image.Image if not made else tv_tensors.Image if made[-1] == "ToImage" else torch.Tensor
    return fill.get(kind, fill.get("others"))



def _interpolation(op: Any, name: str) -> str:
    """The auto-augment op's interpolation, as a string for the op to check; ValueError for a fill other
    than 0."""
    fill = getattr(op, "fill", None)
    values = list(fill.values()) if isinstance(fill, dict) else [fill]
    if any(v not in (None, 0, 0.0) and v != [0] and v != [0.0] for v in values):
        raise ValueError(f"{name} fills with 0 here, got fill={fill}")
    return interpolation_name(op, "nearest")


def _auto_augment(op: Any, size: int) -> AutoAugment:
    policies = getattr(op, "_policies", getattr(op, "policies", None))  # torchvision's table: v2's name, v1's
    if policies is None:
        raise ValueError(f"AutoAugment({op.policy}): this torchvision keeps its policy table where gpufeed does "
                         "not look (AutoAugment._policies or .policies)")
    table = tuple(tuple((str(n), float(p), None if i is None else int(i)) for n, p, i in sub) for sub in policies)
    return AutoAugment(policies=table, interpolation=_interpolation(op, "AutoAugment"))


def _pair(value: Any) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))


def _blur(op: Any, size: int) -> Blur:
    kx, ky = (int(k) for k in op.kernel_size)
    blur = Blur(kernel_size=(kx, ky), sigma=_pair(op.sigma))
    blur.check_size(size)
    return blur


def _jitter(op: Any, size: int) -> Jitter:
    return Jitter(*(_pair(getattr(op, k)) for k in ("brightness", "contrast", "saturation", "hue")))


# each pixel op read from torchvision's transform (and the image size, for what depends on it)
_PIXEL_READERS: dict[str, Callable[[Any, int], PixelOp]] = {
    "RandomVerticalFlip": lambda op, size: VerticalFlip(p=float(op.p)),
    "ColorJitter": _jitter,
    "RandomGrayscale": lambda op, size: Grayscale(p=float(op.p)),
    "GaussianBlur": _blur,
    "RandomAdjustSharpness": lambda op, size: Sharpen(factor=float(op.sharpness_factor), p=float(op.p)),
    "TrivialAugmentWide": lambda op, size: TrivialAugment(num_bins=op.num_magnitude_bins,
                                                          interpolation=_interpolation(op, "TrivialAugmentWide")),
    "RandAugment": lambda op, size: RandAugment(num_ops=op.num_ops, magnitude=op.magnitude,
                                                num_bins=op.num_magnitude_bins,
                                                interpolation=_interpolation(op, "RandAugment")),
    "AutoAugment": _auto_augment,
    "AugMix": lambda op, size: AugMix(severity=op.severity, mixture_width=op.mixture_width,
                                      chain_depth=op.chain_depth, alpha=op.alpha, all_ops=bool(op.all_ops),
                                      interpolation=_interpolation(op, "AugMix")),
}
