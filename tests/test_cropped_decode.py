"""The cropped decoder (optional C extension) gives the same pixels as a full decode, and stays strict."""

import numpy as np
import pytest

import gpufeed.decode.cpu as cpu_mod
from gpufeed.augment.params import AugmentSpec
from gpufeed.decode import CpuDecoder, DecodeError
from gpufeed.sources import folder_source
from gpufeed.workers import PipelineSpec
from gpufeed.workers.chunks import load_sample_into
from tests.corpus import DECODABLE, UNDECODABLE

pytestmark = pytest.mark.skipif(not cpu_mod.cropped_decode_available(),
                                reason="the _turbo_crop extension is not built here (no libjpeg headers)")


def test_same_output_as_the_full_decode(synth_root, monkeypatch):
    spec = PipelineSpec(folder_source(synth_root), AugmentSpec(), 10**8)
    dec = CpuDecoder()

    def run():
        out = np.empty((40, 224, 224, 3), np.uint8)
        for i in range(40):
            load_sample_into(spec, dec, 1, 0, i, out[i])
        return out

    cropped = run()
    monkeypatch.setattr(cpu_mod, "_decode_crop", None)
    full = run()
    np.testing.assert_array_equal(cropped, full)


@pytest.mark.parametrize("reduce", [1, 2, 4])
def test_region_equals_the_slice_of_a_full_decode(reduce):
    data = DECODABLE["subsampling_422"]() if reduce == 1 else __import__("tests.corpus").corpus.jpeg(640, 480, 3)
    dec = CpuDecoder()
    full = dec.decode(data, "x", fast=True, reduce=reduce)
    h, w = full.shape[:2]
    bounds = (w // 5, h // 4, w - w // 7, h - h // 6)
    region = dec.decode_region(data, "x", bounds, reduce)
    np.testing.assert_array_equal(region, full[bounds[1] : bounds[3], bounds[0] : bounds[2]])


@pytest.mark.parametrize("kind", ["truncated_scan", "corrupt_marker"])
def test_damaged_files_still_refused(kind):
    data = UNDECODABLE[kind]()
    dec = CpuDecoder()
    assert dec.decode_region(data, "bad.jpg", (0, 0, 8, 8), 1) is None  # structural check: full strict decode
    with pytest.raises(DecodeError, match="bad.jpg"):
        dec.decode(data, "bad.jpg", fast=True)


def test_entropy_check_in_c_equals_the_numpy_form():
    from gpufeed.decode import jpeg_check

    assert jpeg_check._entropy_ok_c is not None
    rng = np.random.default_rng(0)
    alphabet = np.array([0x00, 0x12, 0xD0, 0xD7, 0xD8, 0xD9, 0xC4, 0xFF, 0xFF, 0xFF], np.uint8)
    cases = [b"", b"\xff", b"\x00\xff", b"\xff\x00", b"\xff\xff\x00", b"\xff\xd3\x01", b"\xff\xd9", b"\x01\xff\xc4\x00"]
    cases += [alphabet[rng.integers(0, len(alphabet), int(rng.integers(1, 12)))].tobytes() for _ in range(3000)]
    for data in cases:
        for start, end in ((0, len(data)), (1, len(data)), (0, max(0, len(data) - 1))):
            if start <= end:
                assert jpeg_check._entropy_ok_c(data, start, end) == jpeg_check.entropy_ok_numpy(data, start, end), \
                    (data.hex(), start, end)
    assert jpeg_check.entropy_ok(b"\x00\x00", 2, 1) is False
    with pytest.raises(ValueError, match="outside"):
        jpeg_check._entropy_ok_c(b"\x00", 0, 5)


@pytest.mark.parametrize("reduce", [1, 2])
def test_region_into_a_buffer_packs_the_same_rows(reduce):
    data = __import__("tests.corpus").corpus.jpeg(640, 480, 3)
    dec = CpuDecoder()
    full = dec.decode(data, "x", fast=True, reduce=reduce)
    h, w = full.shape[:2]
    bounds = (w // 5, h // 4, w - w // 7, h - h // 6)
    out = np.full(w * h * 3, 7, np.uint8)
    width, height, x = dec.decode_region_into(data, "x", bounds, reduce, out)
    rows = out[: width * height * 3].reshape(height, width, 3)
    assert height == bounds[3] - bounds[1] and width >= bounds[2] - bounds[0] + 16  # widened for the upsampling
    np.testing.assert_array_equal(rows[:, x : x + bounds[2] - bounds[0]], full[bounds[1] : bounds[3], bounds[0] : bounds[2]])
    assert (out[width * height * 3 :] == 7).all()  # nothing written past the rows


def test_region_into_a_buffer_too_small_writes_nothing():
    data = __import__("tests.corpus").corpus.jpeg(200, 100, 3)
    out = np.full(50 * 50 * 3, 7, np.uint8)
    assert CpuDecoder().decode_region_into(data, "x", (0, 0, 100, 50), 1, out) is None
    assert (out == 7).all()
    with pytest.raises(DecodeError, match="bad.jpg"):  # a damaged file still fails, naming the file
        CpuDecoder().decode_region_into(UNDECODABLE["truncated_scan"](), "bad.jpg", (0, 0, 96, 72), 1,
                                        np.empty(1 << 20, np.uint8))


def _odd_sized_jpegs(root, count, orientations=(1,)):
    """``count`` textured JPEGs in class folder ``root/c``, widths and heights not multiples of 8 (a reduced
    decode's size is rounded up), each with the next of ``orientations`` in its EXIF."""
    from PIL import Image

    from tests.helpers import textured

    (root / "c").mkdir(parents=True)
    for i in range(count):
        exif = Image.Exif()
        exif[0x0112] = orientations[i % len(orientations)]
        textured(301 + 34 * i, 203 + 21 * i, i).save(root / "c" / f"{i:02d}.jpg", quality=92, exif=exif.tobytes())
    return folder_source(root)


def _full_decode_reference(dec, spec, source, index, seed, epoch):
    """Sample ``index`` as the whole-image path makes it: the full decode (at the DCT reduction the crop
    allows), EXIF orientation applied where the spec asks, then ``crop_resize_into`` of the drawn box."""
    from gpufeed.decode.crop import crop_resize_into, reduction_for
    from gpufeed.decode.exif import apply_orientation, read_orientation

    data = source.read(index)
    orientation = read_orientation(data) if spec.exif_orientation else 1
    w, h, _ = dec.header(data, "x")
    if orientation in (5, 6, 7, 8):
        w, h = h, w
    box = spec.augment.draw(w, h, seed=seed, epoch=epoch, index=index)
    s = spec.augment.image_size
    image = apply_orientation(dec.decode(data, "x", fast=True, reduce=reduction_for(box, s)), orientation)
    out = np.empty((s, s, 3), np.uint8)
    crop_resize_into(image, box, (w, h), out)
    return out, reduction_for(box, s)


def test_reduced_region_decode_of_an_image_not_a_multiple_of_the_reduction_equals_the_full_decode(tmp_path):
    """At a small output size most crops decode at 1/4 or 1/8, and the reduced image is ceil(W / k) wide:
    the region read for a box lands on the same pixels as cropping the full reduced decode."""
    source = _odd_sized_jpegs(tmp_path, 12)
    spec = PipelineSpec(source, AugmentSpec(image_size=32), 10**8)
    dec = CpuDecoder()
    reductions = set()
    for epoch in range(2):
        for i in range(len(source)):
            got = np.empty((32, 32, 3), np.uint8)
            load_sample_into(spec, dec, 5, epoch, i, got)
            want, k = _full_decode_reference(dec, spec, source, i, 5, epoch)
            reductions.add(k)
            np.testing.assert_array_equal(got, want, err_msg=f"sample {i}, epoch {epoch}, 1/{k} decode")
    assert reductions & {4, 8}


def test_an_exif_rotated_jpeg_is_cropped_as_displayed_when_orientation_is_applied(tmp_path):
    """With exif_orientation a training crop box is in the displayed image's coordinates, so a rotated or
    mirrored JPEG must not take the cropped decoder (it reads the stored pixels): every sample equals the
    full decode, oriented, then cropped (224 output: no crop of these images is decoded reduced)."""
    source = _odd_sized_jpegs(tmp_path, 14, orientations=range(1, 9))
    spec = PipelineSpec(source, AugmentSpec(image_size=224), 10**8, exif_orientation=True)
    dec = CpuDecoder()
    for i in range(len(source)):
        got = np.empty((224, 224, 3), np.uint8)
        load_sample_into(spec, dec, 2, 0, i, got)
        want, k = _full_decode_reference(dec, spec, source, i, 2, 0)
        assert k == 1  # crops too small for a reduced decode: both paths decode at full size
        np.testing.assert_array_equal(got, want, err_msg=f"sample {i}, orientation {i % 8 + 1}")
