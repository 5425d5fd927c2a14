import io

import numpy as np
import pytest
from PIL import Image

from gpufeed.decode import CpuDecoder, DecodeError, is_jpeg
from tests.conftest import jpeg_bytes


def test_jpeg_fast_path_matches_pillow():
    data = jpeg_bytes(64, 48)
    dec = CpuDecoder()
    w, h, fast = dec.header(data, "a.jpg")
    assert (w, h, fast) == (64, 48, True)
    ours = dec.decode(data, "a.jpg", fast=True).astype(int)
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3) and np.abs(ours - ref).max() <= 2


def test_dct_reduction_halves_the_size():
    data = jpeg_bytes(640, 480)
    assert CpuDecoder().decode(data, "a.jpg", fast=True, reduce=2).shape == (240, 320, 3)


def test_png_under_a_jpg_name_is_recognised_by_content():
    buf = io.BytesIO()
    Image.new("RGBA", (10, 6), (255, 0, 0, 128)).save(buf, "PNG")
    data = buf.getvalue()
    assert not is_jpeg(data)
    dec = CpuDecoder()
    w, h, fast = dec.header(data, "fake.jpg")
    assert (w, h, fast) == (10, 6, False)
    assert dec.decode(data, "fake.jpg", fast=False)[0, 0].tolist() == [255, 0, 0]


def test_cmyk_jpeg_goes_through_pillow():
    buf = io.BytesIO()
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(buf, "JPEG")
    dec = CpuDecoder()
    _, _, fast = dec.header(buf.getvalue(), "cmyk.jpg")
    out = dec.decode(buf.getvalue(), "cmyk.jpg", fast=fast)
    assert out.shape == (16, 16, 3) and out[8, 8, 0] > 200 and out[8, 8, 1] < 60


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"this is not an image at all", "not an image of a format gpufeed reads \\(JPEG, PNG, PPM, BMP, TIFF, WEBP\\)"),
])
def test_bad_bytes_name_the_file(data, message):
    with pytest.raises(DecodeError, match=message) as info:
        CpuDecoder().header(data, "/data/bad.jpg")
    assert "/data/bad.jpg" in str(info.value)


def test_truncated_jpeg_raises_not_grey():
    data = jpeg_bytes(256, 256)[:2000]
    dec = CpuDecoder()
    _, _, fast = dec.header(data, "t.jpg")
    with pytest.raises(DecodeError, match="t.jpg"):
        dec.decode(data, "t.jpg", fast=fast)


def test_pixel_cap_is_checked_from_the_header():
    data = jpeg_bytes(100, 100)
    with pytest.raises(DecodeError, match="over max_pixels=5000"):
        CpuDecoder(max_pixels=5000).header(data, "big.jpg")
