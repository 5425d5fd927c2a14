"""A torchvision transform pipeline read as gpufeed's settings.

``ImageLoader(source, transform=T)`` takes the ``Compose`` a training script already has (``torchvision.
transforms.v2`` or the older ``torchvision.transforms``) and runs it the gpufeed way: the crop decided per
sample by the workers, decode and resize where the loader decodes, flip and normalise in the same pass.
Each op is read for its parameters; one whose parameters gpufeed cannot honour raises, naming it, rather
than being changed or skipped: a recipe that silently lost an op would train a different model. An op that
does not run on the device (``placement.ops``: ElasticTransform, a user's own callable, a pixel op before the
crop) runs per sample in the CPU workers as torchvision's own, with the ops around it that its place needs
(``worker_ops``).

    training:    RandomResizedCrop(size, scale, ratio) [RandomHorizontalFlip(p)] [pixel ops]
                 [to tensor] [Normalize] [RandomErasing(p, scale, ratio, value)]
                 or [Resize(int)] RandomCrop(size, padding, pad_if_needed, fill, padding_mode) and the same
    validation:  Resize(int) CenterCrop(size) [to tensor] [Normalize]

RandomCrop takes its crop from the (resized) image without resampling; the CPU workers make those crops on
every device (``placement.gpu_may_take``), as they make validation's.

The pixel ops (``placement.ops.PIXEL_OPS``: RandomVerticalFlip, ColorJitter, RandomGrayscale, GaussianBlur,
RandomAdjustSharpness, TrivialAugmentWide, RandAugment, AutoAugment, AugMix, RandomPerspective, and RandomApply,
RandomChoice, RandomOrder of them) and RandomErasing run per sample on the device (``augment.ops``); the pixel
ops in the order given, on uint8 pixels before the cast to float, as torchvision runs them on PIL images.
Those that give the same pixels either side of a horizontal flip (``FLIP_COMMUTING``) may also stand between
the crop and RandomHorizontalFlip.

"to tensor" is any of ``ToImage``, ``PILToTensor``, ``ToTensor``, ``ToDtype(float, scale=True)``,
``ConvertImageDtype(float)``: the loader always delivers floats scaled to [0, 1] before ``Normalize``.
Without ``Normalize`` the images stay in [0, 1] (mean 0, std 1).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torchvision.transforms import v2

from ..placement.ops import (CONTAINERS, PIXEL_OPS, SIZING as _SIZING, UINT8_OPS as _UINT8_OPS, device_version,
                             flip_commuting, on_device)
from .ops import Erasing, PixelOp
from .params import RandomCrop
from .pixel_readers import fill_for_input, read_pixel_ops
from .worker_ops import WorkerOps, op_name

__all__ = ["Recipe", "read_transform"]

_FLOAT_OPS = {"ToTensor", "ToDtype", "ConvertImageDtype"}
_TENSOR_OPS = {"ToImage", "PILToTensor", "ToPureTensor", "ToTensor", "ToDtype", "ConvertImageDtype"}


@dataclass(frozen=True)
class Recipe:
    """The settings a torchvision pipeline amounts to: the ``AugmentSpec`` fields, ``mean``/``std``, when
    the pipeline casts to one, the output ``dtype`` (None: the loader's ``dtype``), and the per-sample ops:
    ``pixel`` in the pipeline's order, ``erasing``, and the names of the ops they are (``device``);
    ``workers``: the stretch the CPU workers run."""

    train: bool
    image_size: int
    resize_size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.0
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    dtype: torch.dtype | None = None
    pixel: tuple[PixelOp, ...] = ()
    erasing: Erasing | None = None
    device: tuple[str, ...] = ()
    crop: RandomCrop | None = None
    workers: WorkerOps | None = None

    def augment_kwargs(self) -> dict[str, Any]:
        return dict(train=self.train, image_size=self.image_size, resize_size=self.resize_size, scale=self.scale,
                    ratio=self.ratio, hflip=self.hflip, crop=self.crop)


def read_transform(transform: Any) -> Recipe:
    """``transform`` (a ``Compose``, or one op) as a ``Recipe``; ValueError naming an op whose parameters or
    place gpufeed cannot honour. The ops that do not run on the device (``placement.ops.on_device``), and those
    among them, become the stretch the workers run (``workers``, ``_worker_span``). A ``Compose`` within it is
    read as its ops."""
    ops = _flat(list(getattr(transform, "transforms", [transform])))
    names = [type(op).__name__ for op in ops]
    device = on_device(ops)
    span = _worker_span(names, [op_name(op) for op in ops], device)
    if span is None:
        return _read(ops, names)
    start, end = span
    away = [op for op, here in zip(ops[start:end], device[start:end], strict=True) if not here]
    workers = WorkerOps.create(ops[start:end], own=[op_name(op) for op in away], from_decode=start == 0,
                               tensors=any(n in _UINT8_OPS for n in names[:start]),
                               placed=[op_name(op) for op in away if device_version(op)])
    kept, kept_names = ops[:start] + ops[end:], names[:start] + names[end:]
    crop = _crop_made_in_workers(ops[start:end], names[start:end]) if start == 0 else None
    return _replace(_read(kept, kept_names, crop), workers=workers)


def _flat(ops: list[Any]) -> list[Any]:
    """``ops`` with each ``Compose`` among them (of either torchvision API) replaced by its own ops."""
    out = []
    for op in ops:
        out.extend(_flat(list(op.transforms)) if type(op).__name__ == "Compose" else [op])
    return out


def _worker_span(names: list[str], labels: list[str], device: list[bool]) -> tuple[int, int] | None:
    """[start, end) of the ops the workers run, None where every op runs on the device (``device``): from the
    first op that does not to the last, widened to keep the order: back to the end of the crop (and flip)
    gpufeed makes on decode, or to the start of the recipe where a crop or resize stands after that; on over
    any crop, resize or flip after the last. ValueError where one stands after the cast to float (``labels``: the
    ops as messages name them)."""
    away = [i for i, here in enumerate(device) if not here]
    if not away:
        return None
    first, last = away[0], away[-1]
    floats = [i for i, n in enumerate(names) if n in _FLOAT_OPS or n in ("Normalize", "RandomErasing")]
    if floats and last > floats[0]:
        raise ValueError(f"transform: {labels[last]} stands after {names[floats[0]]}; gpufeed runs the ops it has no "
                         f"device version of in its CPU workers, on the uint8 image: place it before "
                         f"{names[floats[0]]}")
    lead = 0  # the crop (and flip) gpufeed makes on decode, before the first
    while lead < first and names[lead] in (*_SIZING, "RandomHorizontalFlip", *_UINT8_OPS):
        lead += 1
    sizing = [i for i, n in enumerate(names) if n in _SIZING]
    start = lead if sizing and sizing[-1] < lead else 0
    geometry = [i for i, n in enumerate(names) if i >= start and (n in _SIZING or n == "RandomHorizontalFlip")]
    return start, 1 + max([last, *geometry])


def _crop_made_in_workers(ops: list[Any], names: list[str]) -> Recipe:
    """The sizes a stretch that crops (run in the workers, from the whole image) makes: its last crop's square
    ``image_size``; training unless that is a CenterCrop."""
    crops = [(op, n) for op, n in zip(ops, names, strict=True) if n in _SIZING and n != "Resize"]
    if not crops or [n for n in names if n in _SIZING][-1] == "Resize":
        raise ValueError(f"transform: the ops run in the workers ({', '.join(names)}) must end their geometry with "
                         f"RandomResizedCrop, RandomCrop or CenterCrop, so that every image comes out square")
    op, name = crops[-1]
    size = _square(op.size, name)
    return Recipe(train=name != "CenterCrop", image_size=size, resize_size=size)


def _read(ops: list[Any], names: list[str], crop: Recipe | None = None) -> Recipe:
    """The recipe of ``ops``, all of which gpufeed runs itself; ``crop``: the sizes, where the workers make
    the crop (then ``ops`` have none)."""
    _check_order(names, {n for op, n in zip(ops, names, strict=True) if flip_commuting(op)})
    recipe = crop if crop is not None else _geometry(ops, names)
    tensor = [op for op, n in zip(ops, names, strict=True) if n in _TENSOR_OPS]
    dtype = _dtype(tensor)
    if "Normalize" in names:
        norm = ops[names.index("Normalize")]
        if not tensor:
            raise ValueError("transform: Normalize needs a float tensor first (ToImage + ToDtype(torch.float32, "
                             "scale=True), or ToTensor)")
        if len(norm.mean) != 3 or len(norm.std) != 3:
            raise ValueError(f"transform: Normalize needs 3 values each (RGB), got mean={list(norm.mean)} "
                             f"std={list(norm.std)}")
        recipe = _replace(recipe, mean=tuple(float(m) for m in norm.mean), std=tuple(float(s) for s in norm.std))
    per_sample = [n for n in names if n in PIXEL_OPS or n == "RandomErasing"]
    if per_sample and not recipe.train:
        raise ValueError(f"transform: {per_sample[0]} is a training op; validation takes Resize + CenterCrop")
    try:
        pixel = read_pixel_ops(ops, names, recipe.image_size)
    except ValueError as e:  # the op's parameters are not ones gpufeed runs: say where they came from
        raise ValueError(f"transform: {e}") from None
    erasing = _erasing(ops[names.index("RandomErasing")]) if "RandomErasing" in names else None
    device = tuple(op_name(op) for op, n in zip(ops, names, strict=True) if n in PIXEL_OPS or n == "RandomErasing")
    return _replace(recipe, dtype=dtype, pixel=tuple(pixel), erasing=erasing, device=device)


def _geometry(ops: list[Any], names: list[str]) -> Recipe:
    """The crop gpufeed makes on decode, read from the recipe's geometric ops."""
    geometry = [n for n in names if _stage(n) == 0]
    crop = geometry[:-1] if geometry[-1:] == ["RandomHorizontalFlip"] else geometry
    flip = ops[names.index("RandomHorizontalFlip")] if "RandomHorizontalFlip" in names else None
    if crop == ["RandomResizedCrop"]:
        return _training(ops[names.index("RandomResizedCrop")], flip)
    if crop in (["RandomCrop"], ["Resize", "RandomCrop"]):
        at = names.index("RandomCrop")
        return _random_crop(ops[names.index("Resize")] if "Resize" in crop else None, ops[at], flip, names[:at])
    if geometry == ["Resize", "CenterCrop"]:
        return _validation(ops[names.index("Resize")], ops[names.index("CenterCrop")])
    raise ValueError(f"transform: the geometric ops must be RandomResizedCrop or [Resize +] RandomCrop, then "
                     f"[RandomHorizontalFlip] (training), or Resize + CenterCrop (validation), in that order; got "
                     f"{geometry}")


def _stage(name: str) -> int:
    """Where each kind of op stands: geometry, the pixel ops, to-tensor ops, Normalize, RandomErasing
    (torchvision's reference recipes' order)."""
    if name in _TENSOR_OPS:
        return 2
    if name in PIXEL_OPS:
        return 1
    return {"Normalize": 3, "RandomErasing": 4}.get(name, 0)


def _check_order(names: list[str], commuting: set[str]) -> None:
    """ValueError for an op where gpufeed cannot run it; ``commuting``: the names of the pixel ops here that
    give the same pixels either side of a horizontal flip (``placement.flip_commuting``)."""
    ordered = [n for n in names if n not in _UINT8_OPS]  # these stand anywhere before the float cast
    for j, b in enumerate(ordered):
        for a in ordered[:j]:
            if _stage(b) < _stage(a) and not (b == "RandomHorizontalFlip" and a in commuting):
                raise ValueError(f"transform: {b} must come before {a}: {_why(a, b)}")
    floats = [i for i, n in enumerate(names) if n in ("ToTensor", "ToDtype", "ConvertImageDtype")]
    late = [n for i, n in enumerate(names) if n in _UINT8_OPS and floats and i > floats[0] and n != "ToPureTensor"]
    if late:
        raise ValueError(f"transform: {late[0]} after the cast to float would make uint8 images again")
    for name in set(names):
        if names.count(name) > 1 and name not in _TENSOR_OPS and name not in CONTAINERS:
            raise ValueError(f"transform: {name} appears {names.count(name)} times; gpufeed runs each op once")


def _why(a: str, b: str) -> str:
    """Why ``b`` cannot follow ``a`` (a pixel op before the crop or a flip runs in the workers: ``placement``)."""
    if b in PIXEL_OPS:
        return (f"gpufeed runs {b} on uint8 pixels before the cast to float, as torchvision runs it on PIL images, "
                "not on the float or normalised batch")
    return "the order is crop and flip, the pixel ops, to tensor, Normalize, RandomErasing"


def _erasing(op: Any) -> Erasing:
    value = op.value
    if value is None or isinstance(value, str):
        raise ValueError("transform: RandomErasing(value='random') is not supported; give a number per channel")
    value = [value] if isinstance(value, (int, float)) else list(value)
    if len(value) not in (1, 3):
        raise ValueError(f"transform: RandomErasing value needs 1 or 3 numbers, got {value}")
    return Erasing(p=float(op.p), scale=tuple(float(v) for v in op.scale), ratio=tuple(float(v) for v in op.ratio),
                   value=tuple(float(v) for v in value))


def _replace(recipe: Recipe, **kw: Any) -> Recipe:
    return Recipe(**{**recipe.__dict__, **kw})


def _square(size: Any, what: str) -> int:
    s = [size] if isinstance(size, int) else list(size)
    if len(s) == 2 and s[0] == s[1]:
        s = s[:1]
    if len(s) != 1:
        raise ValueError(f"transform: {what} must give a square output, got size={size}")
    return int(s[0])


def _bilinear(op: Any, name: str) -> None:
    mode = getattr(op, "interpolation", None)
    if str(getattr(mode, "value", mode)).lower() != "bilinear":
        raise ValueError(f"transform: {name} must use bilinear interpolation (gpufeed's resize), got {mode}")
    if getattr(op, "antialias", True) is False:
        raise ValueError(f"transform: {name}(antialias=False) is not what gpufeed computes (it antialiases)")


def _training(crop: Any, flip: Any | None) -> Recipe:
    _bilinear(crop, "RandomResizedCrop")
    size = _square(crop.size, "RandomResizedCrop")
    return Recipe(train=True, image_size=size, resize_size=max(size, round(size * 256 / 224)),
                  scale=tuple(float(v) for v in crop.scale), ratio=tuple(float(v) for v in crop.ratio),
                  hflip=float(flip.p) if flip is not None else 0.0)


def _resize_size(resize: Any) -> int:
    """Resize's one size, the shorter side's; ValueError for anything else gpufeed does not compute."""
    _bilinear(resize, "Resize")
    sizes = [resize.size] if isinstance(resize.size, int) else list(resize.size)
    if len(sizes) != 1 or getattr(resize, "max_size", None) is not None:
        raise ValueError(f"transform: Resize must take one size (the shorter side) and no max_size, got "
                         f"size={resize.size}")
    return int(sizes[0])


def _validation(resize: Any, crop: Any) -> Recipe:
    resize_size, size = _resize_size(resize), _square(crop.size, "CenterCrop")
    if resize_size < size:
        raise ValueError(f"transform: Resize({resize_size}) is smaller than CenterCrop({size})")
    return Recipe(train=False, image_size=size, resize_size=resize_size)


def _random_crop(resize: Any | None, crop: Any, flip: Any | None, before: list[str]) -> Recipe:
    """[Resize +] RandomCrop: its padding as (left, top, right, bottom), whichever torchvision API made it
    (``transforms.v2`` keeps it parsed as left, right, top, bottom; ``transforms`` as given, and pads what
    ``pad_if_needed`` adds in a second step); its fill for the input it gets after the ops ``before`` it."""
    size, resize_size = _square(crop.size, "RandomCrop"), None if resize is None else _resize_size(resize)
    padding, mode, newer = crop.padding, str(crop.padding_mode), isinstance(crop, v2.RandomCrop)
    if padding is None:
        padding = (0, 0, 0, 0)
    elif newer:
        left, right, top, bottom = padding
        padding = (left, top, right, bottom)
    else:
        given = [padding] if isinstance(padding, numbers.Number) else list(padding)
        if len(given) not in (1, 2, 4):
            raise ValueError(f"transform: RandomCrop padding takes 1, 2 or 4 numbers, got {padding}")
        padding = given * 4 if len(given) == 1 else given * 2 if len(given) == 2 else given
    padded = mode == "constant" and (any(padding) or crop.pad_if_needed)
    try:
        crop = RandomCrop(padding=tuple(int(p) for p in padding), pad_if_needed=bool(crop.pad_if_needed),
                          fill=_fill(crop.fill, before) if padded else (0, 0, 0), padding_mode=mode,
                          resize=resize is not None, two_steps=not newer)
        return Recipe(train=True, image_size=size, resize_size=resize_size or size,
                      hflip=float(flip.p) if flip is not None else 0.0, crop=crop)
    except ValueError as e:
        raise ValueError(f"transform: {e}") from None


def _fill(fill: Any, before: list[str]) -> tuple:
    """RandomCrop's fill as one value per channel: the one for the input it gets after the ops ``before`` it
    (``fill_for_input``), else 0."""
    fill = fill_for_input(fill, before)
    fill = [0] if fill is None else [fill] if isinstance(fill, numbers.Number) else list(fill)
    fill = fill * 3 if len(fill) == 1 else fill
    return tuple(int(v) if float(v).is_integer() else v for v in fill)


def _dtype(tensor_ops: Sequence[Any]) -> torch.dtype | None:
    """The float dtype the pipeline casts to (None: left to the loader); ValueError for a cast to integers or
    one without scaling, which would give values in [0, 255]."""
    dtype, scaled = None, False
    for op in tensor_ops:
        name = type(op).__name__
        scaled = scaled or name == "ToTensor"
        if name == "ToDtype" and scaled and not op.scale:  # already floats in [0, 1]: a plain cast
            d = op.dtype if not isinstance(op.dtype, dict) else op.dtype.get(torch.Tensor, next(iter(op.dtype.values())))
            if d is None or not d.is_floating_point:
                raise ValueError(f"transform: ToDtype to {d}: gpufeed delivers float images")
            dtype = d
            continue
        if name in ("ToDtype", "ConvertImageDtype"):
            d = op.dtype
            if isinstance(d, dict):
                d = d.get(torch.Tensor, next(iter(d.values())))
            if d is None or not d.is_floating_point:
                raise ValueError(f"transform: {name} to {d}: gpufeed delivers float images")
            if name == "ToDtype" and not op.scale:
                raise ValueError("transform: ToDtype(..., scale=False) keeps values in [0, 255]; gpufeed scales to "
                                 "[0, 1] (use scale=True)")
            dtype, scaled = d, True
    if tensor_ops and not scaled:
        raise ValueError("transform: ToImage/PILToTensor alone give uint8 images; gpufeed delivers floats in [0, 1] "
                         "before Normalize: add ToDtype(torch.float32, scale=True)")
    return dtype
