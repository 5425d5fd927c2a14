"""One input sample to what a shard stores: its bytes as they are, or resized and re-encoded, or the
reason it cannot be delivered.

Every input is decoded in full by the loader's own CPU decoder (``decode.cpu.CpuDecoder``, strict about
damaged JPEGs, with the loader's pixel cap), so the shards hold exactly the samples the loader can
decode. An image whose longer side is over ``max_side`` is resized to it with Pillow's Lanczos filter
(aspect ratio kept, the shorter side rounded half up, at least 1 px) and re-encoded as a baseline 4:2:0
JPEG at ``quality``, keeping its EXIF orientation tag; a JPEG at least ``2 x REDUCING_GAP`` times the
target is first decoded at 1/2, 1/4 or 1/8 scale in the DCT domain (libjpeg-turbo), never below
``REDUCING_GAP`` times the target, as Pillow's ``reducing_gap`` does. Any other image is copied byte for
byte, unless its format has no file extension the loader reads (then it is re-encoded at its size). A file
of a format the loader does not read (``decode.pillow.FORMATS``) is broken.
"""

from __future__ import annotations

import io
import re
from typing import NamedTuple

import numpy as np
from PIL import Image

from ..decode.base import DEFAULT_MAX_PIXELS, DecodeError, is_jpeg
from ..decode.cpu import CpuDecoder
from ..decode.exif import ORIENTATION_TAG, read_orientation
from ..sources.base import read_capped

RESAMPLE = "lanczos"  # Pillow's Image.LANCZOS: a windowed sinc scaled to the reduction, antialiased
REDUCING_GAP = 3.0  # Pillow's docs: from 3.0 on, indistinguishable from resampling the full image
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Prepared(NamedTuple):
    """Input ``position`` of the order as its shard stores it: ``data`` with file extension ``ext``."""

    position: int
    data: bytes
    ext: str
    label: int
    path: str
    resized: bool


class Broken(NamedTuple):
    """Input ``position`` of the order, which cannot be delivered, and why."""

    position: int
    path: str
    reason: str


def _stable(reason: str) -> str:
    """A reason without the object addresses Pillow's messages hold, so the manifest is the same each run."""
    return _ADDRESS.sub("", reason)


def _name(source, index: int) -> str:
    try:
        return source.path(index)
    except Exception:  # a source that cannot even name it
        return f"input {index}"


def file_extension(data: bytes) -> str | None:
    """The extension the loader reads ``data``'s format under (by content), or None for a format it has
    no extension for."""
    if is_jpeg(data):
        return "jpg"
    head = bytes(data[:12])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[:2] in (b"P5", b"P6"):
        return "ppm" if head[:2] == b"P6" else "pgm"
    return None


def target_size(width: int, height: int, max_side: int | None) -> tuple[int, int] | None:
    """(width, height) with the longer side ``max_side``, the aspect ratio kept (the shorter side rounded
    half up, at least 1); None when the image is not larger than that."""
    if max_side is None or max(width, height) <= max_side:
        return None
    if width >= height:
        return max_side, max(1, (2 * height * max_side + width) // (2 * width))
    return max(1, (2 * width * max_side + height) // (2 * height)), max_side


def reduction(width: int, height: int, target: tuple[int, int]) -> int:
    """The largest DCT-domain reduction (1, 2, 4 or 8) that leaves at least ``REDUCING_GAP`` times the
    target's pixels along each side."""
    for r in (8, 4, 2):
        if -(-width // r) >= REDUCING_GAP * target[0] and -(-height // r) >= REDUCING_GAP * target[1]:
            return r
    return 1


class Preparer:
    """Inputs of a source to ``Prepared`` or ``Broken`` records (see the module docstring)."""

    def __init__(self, *, max_side: int | None, quality: int, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_bytes: int | None = None) -> None:
        self.max_side, self.quality, self.max_bytes = max_side, quality, max_bytes
        self.decoder = CpuDecoder(max_pixels=max_pixels)

    def __call__(self, source, index: int, position: int) -> Prepared | Broken:
        """One input's record: whatever goes wrong with it (its read, its label, its decode, memory) is that
        input's failure, named with its path; only an interrupt stops the conversion here."""
        try:
            data = read_capped(source, index, self.max_bytes)
            label = source.label(index)
        except (OSError, ValueError) as e:  # the sources' errors for an unreadable file or a missing label
            return Broken(position, _name(source, index), _stable(str(e)))
        except Exception as e:  # anything else about this input alone
            return Broken(position, _name(source, index), _stable(f"{type(e).__name__}: {e}"))
        path = source.path(index)  # after the read: a remote shard's member names are known then
        try:
            data, ext, resized = self.convert(data, path)
        except DecodeError as e:
            return Broken(position, path, _stable(e.reason))
        except Exception as e:  # a decoder's or encoder's fault on this input (MemoryError, ...)
            return Broken(position, path, _stable(f"{type(e).__name__}: {e}"))
        return Prepared(position, data, ext, label, path, resized)

    def convert(self, data: bytes, path: str) -> tuple[bytes, str, bool]:
        """(bytes to store, their extension, whether re-encoded); DecodeError when the loader could not
        decode ``data``."""
        width, height, fast = self.decoder.header(data, path)
        target = target_size(width, height, self.max_side)
        ext = file_extension(data)
        if target is None and ext is not None:
            self.decoder.decode(data, path, fast=fast)  # only to check it decodes
            return data, ext, False
        reduce = reduction(width, height, target) if fast and target is not None else 1
        pixels = self.decoder.decode(data, path, fast=fast, reduce=reduce)
        return encode_jpeg(pixels, target or (width, height), self.quality, read_orientation(data)), "jpg", True


def encode_jpeg(pixels: np.ndarray, size: tuple[int, int], quality: int, orientation: int = 1) -> bytes:
    """(h, w, 3) uint8 RGB resized to ``size`` (w, h) with Lanczos, as a baseline 4:2:0 JPEG at ``quality``
    with the EXIF ``orientation`` (none when 1)."""
    img = Image.fromarray(pixels)
    if img.size != size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    extra = {}
    if orientation != 1:
        exif = Image.Exif()
        exif[ORIENTATION_TAG] = orientation
        extra["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, subsampling=2, **extra)  # 2: 4:2:0, what the GPU engines decode
    return buf.getvalue()
