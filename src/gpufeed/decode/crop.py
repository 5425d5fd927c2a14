"""Decode and crop on the CPU: one sample decoded (down to the crop's rows and columns where it can be),
cropped, resized and flipped, written in place into its ring slot.

The resize is OpenCV's, by the factor left after the decoder's DCT-domain reduction (``reduction_for``):
plain bilinear up to 1.3x (beyond, it aliases); from 1.3x to 2.6x bilinear to twice the size, then an exact
2x area average (OpenCV's fast path, half the cost of INTER_AREA for the same PSNR against torchvision's
antialiased resize); INTER_AREA beyond (BENCHMARKS.md#cpu-crops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cv2
import numpy as np
from PIL import Image

from ..augment.params import CropBox, RandomCrop, RandomCropAt, ResizeCrop
from .exif import apply_orientation

if TYPE_CHECKING:
    from .cpu import CpuDecoder

cv2.setNumThreads(1)  # parallelism comes from worker processes, not from OpenCV's pool

_LINEAR_MAX_FACTOR = 1.3


_MIN_REMAINING_FACTOR = 1.25


def reduction_for(box: CropBox, out_size: int) -> int:
    """The largest DCT reduction in {1, 2, 4, 8} that leaves the crop at least 1.25x ``out_size``.

    Why the margin: measured against torchvision's antialiased resize on fine texture, a DCT-domain
    1/k decode followed by a near-1x resample (remaining factor 1.0-1.1) scored 27.5-30 dB PSNR,
    while with 1.2x or more left for the area filter every case scored >= 35 dB.
    """
    shorter = min(box.width, box.height)
    for k in (8, 4, 2):
        if shorter >= _MIN_REMAINING_FACTOR * k * out_size:
            return k
    return 1


def crop_bounds(box: CropBox, full_size: tuple[int, int], size: tuple[int, int]) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of ``box`` (full-resolution coordinates) in an image of ``size`` = (w, h), which is
    the full ``full_size`` image or a DCT-reduced decode of it. At least one pixel each way."""
    fw, fh = full_size
    w, h = size
    sx, sy = w / fw, h / fh
    x0, y0 = int(box.x * sx), int(box.y * sy)
    x1 = max(x0 + 1, min(w, int(round((box.x + box.width) * sx))))
    y1 = max(y0 + 1, min(h, int(round((box.y + box.height) * sy))))
    return x0, y0, x1, y1


def resize_flip_into(crop: np.ndarray, flip: bool, out: np.ndarray) -> None:
    """Resize ``crop`` ((h, w, 3) uint8) to ``out``'s size, mirrored if ``flip``; ``out`` written whole."""
    size = (out.shape[1], out.shape[0])
    factor = max(crop.shape[1] / size[0], crop.shape[0] / size[1])
    if factor <= _LINEAR_MAX_FACTOR:
        interp = cv2.INTER_LINEAR
    elif factor <= 2 * _LINEAR_MAX_FACTOR:  # each step within what its filter handles
        crop = cv2.resize(crop, (2 * size[0], 2 * size[1]), interpolation=cv2.INTER_LINEAR)
        interp = cv2.INTER_AREA
    else:
        interp = cv2.INTER_AREA
    if flip:
        cv2.flip(cv2.resize(crop, size, interpolation=interp), 1, dst=out)
    else:
        cv2.resize(crop, size, dst=out, interpolation=interp)


def crop_resize_into(image: np.ndarray, box: CropBox, full_size: tuple[int, int], out: np.ndarray) -> None:
    """Crop ``box`` (full-resolution coordinates) from ``image``, resize to ``out``'s size, flip.

    image: (h, w, 3) uint8, possibly a DCT-reduced decode of a ``full_size``
    (width, height) image. out: (S, S, 3) uint8, C-contiguous, written whole.
    """
    x0, y0, x1, y1 = crop_bounds(box, full_size, (image.shape[1], image.shape[0]))
    resize_flip_into(image[y0:y1, x0:x1], box.flip, out)


def _region_request(box: CropBox, size: tuple[int, int], out_size: int) -> tuple[tuple[int, int, int, int], int]:
    """(bounds in the reduced image, DCT reduction) for decoding ``box`` of a ``size`` = (width, height) JPEG
    that ends ``out_size`` square."""
    width, height = size
    reduce = reduction_for(box, out_size)
    scaled = (-(-width // reduce), -(-height // reduce))  # libjpeg's ceil(W / k) x ceil(H / k)
    return crop_bounds(box, size, scaled), reduce


def decode_box_into(decoder: "CpuDecoder", data: bytes, path: str, box: CropBox, size: tuple[int, int], fast: bool,
                    out: np.ndarray, orientation: int = 1) -> None:
    """Decode ``data`` (a ``size`` = (width, height) image as displayed after ``orientation``) and write
    crop ``box`` into ``out`` ((S, S, 3) uint8), resized and flipped. Plain JPEGs decode at the DCT
    reduction the output allows, and only the crop's rows and columns where the cropped decoder can."""
    reduce = 1
    if fast and orientation == 1:
        bounds, reduce = _region_request(box, size, out.shape[0])
        region = decoder.decode_region(data, path, bounds, reduce)
        if region is not None:
            resize_flip_into(region, box.flip, out)
            return
    image = apply_orientation(decoder.decode(data, path, fast=fast, reduce=reduce), orientation)
    crop_resize_into(image, box, size, out)


def decode_box_rows_into(decoder: "CpuDecoder", data: bytes, path: str, box: CropBox, size: tuple[int, int],
                         out_size: int, out: np.ndarray) -> tuple[int, int, int, int, int, int] | None:
    """Decode crop ``box`` of a plain JPEG (orientation 1, structure checked) at the DCT reduction an
    ``out_size`` output allows, without resizing: rows of RGB pixels packed into ``out`` (1-D uint8),
    for the GPU kernel to crop, resize and flip. Returns (width, height, x, y, box width, box height):
    the rows' extent and the crop's place in them; None when they need more room than ``out`` has or
    the cropped decoder is not built here (nothing written: resize on the CPU instead). The rows keep
    a row above and below the crop and 16 columns each side where the image has them, so the kernel's
    filter reads the same neighbours as on a whole decoded image: the same pixels out as a GPU decode."""
    (x0, y0, x1, y1), reduce = _region_request(box, size, out_size)
    top = max(0, y0 - 1)
    done = decoder.decode_region_into(data, path, (x0, top, x1, y1 + 1), reduce, out)
    if done is None:
        return None
    width, height, x = done
    return width, height, x, y0 - top, x1 - x0, y1 - y0


def decode_resize_crop_into(decoder: "CpuDecoder", data: bytes, path: str, geometry: ResizeCrop, size: tuple[int, int],
                            fast: bool, out: np.ndarray, orientation: int = 1) -> None:
    """Validation: decode ``data`` (a ``size`` = (width, height) image as displayed after ``orientation``) and
    write into ``out`` ((S, S, 3) uint8) exactly what torchvision's ``Resize`` + ``CenterCrop`` give on the PIL
    image: the whole image decoded (libjpeg-turbo gives Pillow's pixels), Pillow's antialiased bilinear resize
    to ``geometry``'s extent, then its crop. The whole extent is resized, as torchvision resizes it: a resize of
    the crop's area alone (Pillow's ``box``) or of a DCT-reduced decode differs by a level here and there, and
    validation's pixels must not depend on which path an image took (BENCHMARKS.md#validation-crops)."""
    s = out.shape[0]
    image = apply_orientation(decoder.decode(data, path, fast=fast), orientation)
    resized = Image.fromarray(image).resize((geometry.width, geometry.height), Image.BILINEAR)
    out[:] = np.asarray(resized.crop((geometry.left, geometry.top, geometry.left + s, geometry.top + s)))


def decode_random_crop_into(decoder: "CpuDecoder", data: bytes, path: str, crop: RandomCrop, at: RandomCropAt,
                            size: tuple[int, int], fast: bool, out: np.ndarray, orientation: int = 1) -> None:
    """Training with RandomCrop: decode ``data`` (a ``size`` = (width, height) image as displayed after
    ``orientation``) and write into ``out`` ((S, S, 3) uint8) what torchvision's [``Resize``] + ``RandomCrop``
    [+ ``RandomHorizontalFlip``] give on the PIL image for the draw ``at``: Pillow's antialiased bilinear
    resize of the whole image (a resize of the crop's area alone differs in a level here and there; JPEGs 4x
    the resized size or more are shrunk in the DCT domain first, a level or two from torchvision's pixels),
    the padding as torchvision pads PIL images (the fill, or ``np.pad``'s edge, reflect or symmetric; in two
    steps for ``crop.two_steps``), the crop, the flip."""
    s = out.shape[0]
    if crop.resize:
        extent = (at.width, at.height)
        image = _decode_for_resize(decoder, data, path, size, extent, fast, orientation)
        image = np.asarray(Image.fromarray(image).resize(extent, Image.BILINEAR))
    else:
        image = apply_orientation(decoder.decode(data, path, fast=fast), orientation)
    x, y = at.left - at.padding[0], at.top - at.padding[1]  # the crop's corner in the unpadded image
    if 0 <= x and 0 <= y and x + s <= at.width and y + s <= at.height:  # inside: no padding to make
        window = image[y : y + s, x : x + s]
    else:
        window = _padded(image, crop, at.padding)[at.top : at.top + s, at.left : at.left + s]
    out[:] = window[:, ::-1] if at.flip else window


def _padded(image: np.ndarray, crop: RandomCrop, padding: tuple[int, int, int, int]) -> np.ndarray:
    """(H, W, 3) uint8 padded by ``padding`` (left, top, right, bottom) as torchvision pads a PIL image: the
    fill, or ``np.pad``'s mode; with ``crop.two_steps`` the crop's own padding first, then the rest."""
    left, top, right, bottom = padding
    if crop.padding_mode == "constant":
        h, w = image.shape[:2]
        out = np.empty((h + top + bottom, w + left + right, 3), np.uint8)
        out[:] = crop.fill
        out[top : top + h, left : left + w] = image
        return out
    steps = [padding]
    if crop.two_steps and padding != crop.padding:  # the padding, then what pad_if_needed adds
        steps = [crop.padding, tuple(a - b for a, b in zip(padding, crop.padding))]
    for left, top, right, bottom in steps:
        image = np.pad(image, ((top, bottom), (left, right), (0, 0)), mode=crop.padding_mode)
    return image


def _decode_for_resize(decoder: "CpuDecoder", data: bytes, path: str, size: tuple[int, int],
                       extent: tuple[int, int], fast: bool, orientation: int) -> np.ndarray:
    """The image RandomCrop's ``Resize`` takes from ``size`` to ``extent``: plain JPEGs shrunk in the DCT domain
    where at least 2x is left for the resize."""
    reduce = 1
    if fast and orientation == 1:
        shrink = min(size[0] / extent[0], size[1] / extent[1])
        reduce = next((k for k in (8, 4, 2) if shrink >= 2 * k), 1)
    return apply_orientation(decoder.decode(data, path, fast=fast, reduce=reduce), orientation)
