"""A structural check of a JPEG before it goes to a GPU decoder.

GPU decoders are lenient: given a truncated file or corrupt entropy-coded data,
the hardware engine returns an image with the damage filled in instead of an
error. So only files that pass this check go to the GPU; the rest take the
strict CPU decoder, which decodes them if they are sound and names them if not.

A file passes when it is a single-scan 8-bit baseline/extended JPEG whose marker
segments parse, whose entropy-coded data holds only stuffed bytes and restart
markers, and which ends with EOI (trailing zero padding allowed). Progressive
and multi-scan files do not pass (the CPU path decodes them).
"""

from __future__ import annotations

import numpy as np

try:  # the optional C extension (built with the cropped decoder): the same test, about 6x faster
    from ._turbo_crop import entropy_ok as _entropy_ok_c
except ImportError:
    _entropy_ok_c = None

_SOF_SEQUENTIAL = {0xC0, 0xC1}
_STANDALONE = set(range(0xD0, 0xD8)) | {0x01}


def gpu_safe_jpeg(data: bytes) -> bool:
    n = len(data)
    if n < 4 or data[:2] != b"\xff\xd8":
        return False
    end = n
    while end > 2 and data[end - 1] == 0:
        end -= 1
    if data[end - 2 : end] != b"\xff\xd9":
        return False  # truncated, or something after EOI
    i, seen_sof = 2, False
    while i + 4 <= end:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return False
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if marker not in _SOF_SEQUENTIAL or data[i + 4] != 8:
                return False  # progressive, lossless, arithmetic or not 8-bit: the CPU decides
            seen_sof = True
        if marker == 0xDA:
            if not seen_sof:
                return False
            return entropy_ok(data, i + 2 + length, end - 2)
        i += 2 + length
    return False


def entropy_ok(data: bytes, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` (a scan's entropy-coded bytes) holds 0xFF only as a stuffed byte (FF 00),
    a restart marker (FF D0-D7) or fill (FF FF), and does not end on 0xFF."""
    if start > end:
        return False  # the scan header runs past the end of the data
    if _entropy_ok_c is not None:
        return _entropy_ok_c(data, start, end)
    return entropy_ok_numpy(data, start, end)


def entropy_ok_numpy(data: bytes, start: int, end: int) -> bool:
    scan = np.frombuffer(data, np.uint8, max(0, end - start), start)
    ff = np.flatnonzero(scan[:-1] == 0xFF)
    follow = scan[ff + 1]
    ok = (follow == 0x00) | ((follow >= 0xD0) & (follow <= 0xD7)) | (follow == 0xFF)
    return bool(ok.all()) and (len(scan) == 0 or scan[-1] != 0xFF)
