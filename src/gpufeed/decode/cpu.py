"""CPU decode: bytes to (H, W, 3) uint8 RGB numpy arrays.

Why simplejpeg for JPEG: measured on the 2-core development machine over 300
synthetic ImageNet-like JPEGs (~100 KB, ~470x390), one thread, full decode to
RGB: simplejpeg 0.85 ms, cv2.imdecode 0.88 ms, torchvision.io.decode_jpeg
0.88 ms, Pillow open+convert 0.96 ms. All four are libjpeg-turbo; simplejpeg
has the least overhead, decodes into a caller's buffer and exposes
libjpeg-turbo's DCT-domain scaling. Only the power-of-two factors are used:
in the same measurement the M/8 factors (7/8, 3/4, ...) were no faster than a
full decode, since libjpeg-turbo has SIMD code only for the plain IDCT.

Cropped decode: when the optional ``_turbo_crop`` extension is built (setup.py,
against libjpeg-turbo's headers), ``decode_region`` decodes only the rows and
columns of the crop box: 1.27 -> 1.03 ms per RandomResizedCrop sample on the
same machine and data, identical pixels (800 random regions compared).

Everything that is not a JPEG, or a JPEG that libjpeg-turbo's TurboJPEG API
cannot turn into RGB (CMYK, YCCK), goes through Pillow, asked for the formats of ``pillow.FORMATS`` alone.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import simplejpeg
from PIL import Image

from .base import DEFAULT_MAX_PIXELS, DecodeError, check_pixels, is_jpeg
from .jpeg_check import gpu_safe_jpeg
from .pillow import open_image, reason

try:  # optional C extension (setup.py): decodes only a crop's rows and columns
    from ._turbo_crop import decode_crop as _decode_crop
except ImportError:
    _decode_crop = None

__all__ = ["CpuDecoder", "cropped_decode_available"]

_log = logging.getLogger("gpufeed")
# what gpufeed info and the warning say when the extension is missing: why, and how to build it
CROPPED_DECODE_MISSING = ("the cropped-decode extension is not built (libjpeg-turbo's headers were missing at "
                          "install): each JPEG is decoded whole, then cropped. To build it, install the headers "
                          "(Debian/Ubuntu: apt install libjpeg-dev; Fedora: dnf install libjpeg-turbo-devel) and "
                          "reinstall gpufeed (pip install -e . again)")
_warned = False  # the warning is said once per process


def cropped_decode_available() -> bool:
    return _decode_crop is not None


def say_if_whole_image_decode() -> None:
    """Where a loader is made, not in its workers (each would say it again): the cropped decoder's absence, once
    a process."""
    global _warned
    if _decode_crop is None and not _warned:
        _warned = True
        _log.warning("gpufeed: %s", CROPPED_DECODE_MISSING)


def own_pixel_cap_only() -> None:
    """In gpufeed's worker processes only (never where the user's code runs): Pillow's own bomb check off,
    since ``max_pixels`` is checked from the header first and would otherwise be second-guessed at Pillow's
    limit (a warning above 89 MP, an error above 179 MP). ``import gpufeed`` leaves Pillow's setting as the
    user's process has it."""
    Image.MAX_IMAGE_PIXELS = None


_TURBO_RGB_SOURCES = {"Gray", "YCbCr", "RGB"}


class CpuDecoder:
    """Decode on the CPU; ``header`` first, then ``decode`` at a power-of-two reduction."""

    def __init__(self, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        if max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
        self.max_pixels = max_pixels

    def header(self, data: bytes, path: str) -> tuple[int, int, bool]:
        """(width, height, fast) from the header alone; ``fast``: libjpeg-turbo can decode it to RGB."""
        if not data:
            raise DecodeError(path, "the file is empty (0 bytes)")
        if is_jpeg(data):
            try:
                h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            except ValueError:
                pass  # unusual JPEG: let Pillow read the header
            else:
                check_pixels(w, h, self.max_pixels, path)
                return w, h, colorspace in _TURBO_RGB_SOURCES
        with open_image(data, path) as im:
            w, h = im.size
        check_pixels(w, h, self.max_pixels, path)
        return w, h, False

    def decode_region(self, data: bytes, path: str, bounds: tuple[int, int, int, int], reduce: int) -> np.ndarray | None:
        """Only the pixels of ``bounds`` = (x0, y0, x1, y1) in the image decoded at 1/``reduce``, as an
        (y1 - y0, x1 - x0, 3) uint8 view; None when the cropped decoder is not built here or the file
        is not a plain sequential JPEG (then ``decode`` the whole image).

        Rows below the crop are never decoded and columns outside it skip the IDCT, so the cost
        follows the crop. The pixels equal the same region of a full decode. Files that fail the
        structural check (truncated, corrupt markers, progressive) take the strict full decode, so a
        damaged file is refused whatever its crop. The request is widened by 16 columns on each side:
        fancy chroma upsampling at a crop edge needs its neighbour (measured: without it the first or
        last column differed by up to 25 levels).
        """
        if _decode_crop is None:
            return None
        if not gpu_safe_jpeg(data):
            return None
        x0, _, x1, _ = bounds
        pixels, width, height, left, _ = self._crop(data, path, bounds, reduce)
        rows = np.frombuffer(pixels, np.uint8).reshape(height, width, 3)
        return rows[:, x0 - left : x1 - left]

    def decode_region_into(self, data: bytes, path: str, bounds: tuple[int, int, int, int], reduce: int,
                           out: np.ndarray) -> tuple[int, int, int] | None:
        """``decode_region`` written into ``out`` (1-D uint8, C-contiguous) as packed (height, width, 3)
        rows that hold the crop from column ``x`` on, for a consumer that crops and resizes them itself
        (the GPU kernel); returns (width, height, x), or None when the rows need more than ``out`` holds
        or the cropped decoder is not built here (nothing written then). For a file already known to be
        a plain sequential JPEG (``gpu_safe_jpeg`` passed): the structural check is not repeated."""
        if _decode_crop is None:
            return None
        done = self._crop(data, path, bounds, reduce, out)
        if done is None:
            return None
        _, width, height, left, _ = done
        return width, height, bounds[0] - left

    @staticmethod
    def _crop(data: bytes, path: str, bounds: tuple[int, int, int, int], reduce: int, out=None):
        x0, y0, x1, y1 = bounds
        try:
            return _decode_crop(data, max(0, x0 - 16), y0, x1 + 16, y1, reduce, out)
        except ValueError as e:
            raise DecodeError(path, f"corrupt or truncated JPEG ({e})") from None

    def decode(self, data: bytes, path: str, *, fast: bool, reduce: int = 1) -> np.ndarray:
        """(h, w, 3) uint8 RGB. ``reduce`` in {1, 2, 4, 8} shrinks JPEGs in the DCT domain
        (the result is ceil(H / reduce) x ceil(W / reduce)); other formats ignore it.

        JPEGs on the fast path are decoded strictly: any libjpeg-turbo warning (truncated
        data, corrupt entropy data, bad markers) raises ``DecodeError`` rather than
        delivering grey-filled or partly garbage pixels. Pillow is not asked to try again,
        since it would accept the same file with the damage filled in.
        """
        if fast:
            try:
                if reduce > 1:
                    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
                    return simplejpeg.decode_jpeg(
                        data, "RGB", min_height=math.ceil(h / reduce), min_width=math.ceil(w / reduce)
                    )
                return simplejpeg.decode_jpeg(data, "RGB")
            except ValueError as e:
                raise DecodeError(path, f"corrupt or truncated JPEG (libjpeg-turbo: {e})") from None
        with open_image(data, path) as im:
            try:
                im.load()
                return np.asarray(im.convert("RGB"))
            except Exception as e:  # Pillow raises many types for bad input
                raise DecodeError(path, reason(e)) from None
