"""decode.crop: a sample's box (or RandomCrop window) decoded, cropped, resized and flipped on the CPU, by each
of its paths (the cropped decoder's rows, a DCT-reduced decode, a full decode), compared on textured JPEGs with
torchvision's own crop of the same box, so a box read on the wrong axis or off by a row shows."""

import io

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as F
from PIL import Image

import gpufeed.decode.cpu as cpu_mod
from gpufeed.augment.params import CropBox, RandomCrop, RandomCropAt
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.decode.crop import (crop_bounds, decode_box_into, decode_box_rows_into, decode_random_crop_into,
                                 reduction_for)
from tests.helpers import psnr, textured

W, H = 320, 240
# wide, tall, off-centre and flipped boxes; the last two small enough for a DCT reduction at 32
BOXES = [CropBox(40, 30, 200, 90), CropBox(150, 10, 70, 220, True), CropBox(7, 101, 31, 17),
         CropBox(0, 0, W, H, True), CropBox(60, 20, 250, 200)]


def _jpeg(seed: int = 0) -> tuple[bytes, np.ndarray]:
    buf = io.BytesIO()
    textured(W, H, seed).save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    return data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _reference(full: np.ndarray, box: CropBox, size: int) -> np.ndarray:
    ref = F.resized_crop(torch.from_numpy(full.copy()).permute(2, 0, 1), box.y, box.x, box.height, box.width,
                         [size, size], antialias=True)
    return (F.horizontal_flip(ref) if box.flip else ref).permute(1, 2, 0).numpy()


@pytest.mark.parametrize("fast, cropped", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("box", BOXES, ids=lambda b: f"{b.x}-{b.y}-{b.width}x{b.height}{'-flip' if b.flip else ''}")
def test_a_box_decodes_to_torchvisions_resized_crop_by_every_path(box, fast, cropped, monkeypatch):
    """The cropped decoder's region, a DCT-reduced whole decode and a plain one (``fast=False``) all give
    torchvision's ``resized_crop`` of the box, within what the resize filters differ by."""
    if not cropped:
        monkeypatch.setattr(cpu_mod, "_decode_crop", None)
    data, full = _jpeg()
    out = np.empty((32, 32, 3), np.uint8)
    decode_box_into(CpuDecoder(), data, "x.jpg", box, (W, H), fast, out)
    ref = _reference(full, box, 32)
    assert psnr(out, ref) >= 28.0
    # the box's own place: the same box shifted by a tenth of its size scores clearly worse
    moved = CropBox(min(W - box.width, box.x + box.width // 10 + 2), box.y, box.width, box.height, box.flip)
    if moved != box:
        assert psnr(out, ref) > psnr(out, _reference(full, moved, 32)) + 1.0


@pytest.mark.parametrize("box", BOXES[:3] + BOXES[4:], ids=lambda b: f"{b.x}-{b.y}-{b.width}x{b.height}")
def test_rows_for_the_gpu_hold_the_crop_with_a_row_above_and_below(box):
    """``decode_box_rows_into``: the rows hold the box at (x, y) of them, exactly the pixels of the reduced
    decode there, with the row above and the row below where the image has them (the GPU filter reads them)."""
    data, _ = _jpeg(1)
    dec = CpuDecoder()
    room = np.empty(W * H * 3, np.uint8)
    done = decode_box_rows_into(dec, data, "x.jpg", box, (W, H), 32, room)
    assert done is not None, "the cropped decoder is not built: python setup.py build_ext --inplace"
    width, height, x, y, bw, bh = done
    rows = room[: width * height * 3].reshape(height, width, 3)
    reduce = reduction_for(box, 32)
    whole = dec.decode(data, "x.jpg", fast=True, reduce=reduce)
    x0, y0, x1, y1 = crop_bounds(box, (W, H), (whole.shape[1], whole.shape[0]))
    assert (bw, bh) == (x1 - x0, y1 - y0)
    assert y == (1 if y0 > 0 else 0) and height == bh + y + (1 if y1 < whole.shape[0] else 0)
    np.testing.assert_array_equal(rows[y : y + bh, x : x + bw], whole[y0:y1, x0:x1])
    np.testing.assert_array_equal(rows[:, x : x + bw], whole[y0 - y : y0 - y + height, x0:x1])


@pytest.mark.parametrize("padding, at", [((0, 0, 0, 0), (37, 5)), ((6, 2, 0, 0), (3, 9)), ((0, 0, 5, 9), (300, 230))])
def test_a_random_crop_window_is_the_padded_images_own(padding, at):
    """``decode_random_crop_into`` for a given draw: the window at (left, top) of the image padded by
    ``padding`` (left, top, right, bottom), on the unpadded image's own pixels where it lies inside."""
    data, full = _jpeg(2)
    s = 24
    crop = RandomCrop(padding=padding, fill=(1, 2, 3))
    left, top, right, bottom = padding
    draw = RandomCropAt(W, H, padding, min(at[0], W + left + right - s), min(at[1], H + top + bottom - s), False)
    padded = np.empty((H + top + bottom, W + left + right, 3), np.uint8)
    padded[:] = (1, 2, 3)
    padded[top : top + H, left : left + W] = full
    out = np.empty((s, s, 3), np.uint8)
    decode_random_crop_into(CpuDecoder(), data, "x.jpg", crop, draw, (W, H), False, out)
    np.testing.assert_array_equal(out, padded[draw.top : draw.top + s, draw.left : draw.left + s])
    decode_random_crop_into(CpuDecoder(), data, "x.jpg", crop, draw._replace(flip=True), (W, H), False, out)
    np.testing.assert_array_equal(out, padded[draw.top : draw.top + s, draw.left : draw.left + s][:, ::-1])
