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
            scan = np.frombuffer(data, np.uint8, end - 2 - (i + 2 + length), i + 2 + length)
            ff = np.flatnonzero(scan[:-1] == 0xFF)
            follow = scan[ff + 1]
            ok = (follow == 0x00) | ((follow >= 0xD0) & (follow <= 0xD7)) | (follow == 0xFF)
            return bool(ok.all()) and (len(scan) == 0 or scan[-1] != 0xFF)
        i += 2 + length
    return False
