"""The fused crop/resize/flip/normalise kernel: reference math, Triton indexing, CPU parity."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpufeed.decode.crop import crop_resize_into
from gpufeed.augment.fused import normalize_constants, resized_crop_reference, taps_for
from gpufeed.augment.params import CropBox
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.stage.gpu import _slices
from gpufeed.synth import synthetic_jpeg
from tests.helpers import psnr

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _to_uint8(x: torch.Tensor) -> np.ndarray:
    """(3, S, S) normalised -> (S, S, 3) uint8-range float."""
    m, s = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    return ((x.float() * s + m) * 255).permute(1, 2, 0).numpy()


def pack(images):
    """(h, w, 3) uint8 images in one flat buffer, as the GPU stage lays them out; the buffer and the offsets."""
    offsets = [0]
    for im in images[:-1]:
        offsets.append(offsets[-1] + im.numel())
    return torch.cat([im.reshape(-1) for im in images]), offsets


def test_taps():
    assert taps_for(224, 224, 224) == 1 and taps_for(300, 200, 224) == 2 and taps_for(5000, 10, 224) == 4


def test_reference_matches_the_cpu_path_for_the_same_boxes():
    """Two independent implementations (OpenCV on the CPU, the kernel's math): PSNR >= 30 dB."""
    dec, scale, shift = CpuDecoder(), *normalize_constants(MEAN, STD)
    images, boxes, cpu = [], [], []
    for i in range(6):
        data, (w, h) = synthetic_jpeg(np.random.default_rng([5, i]))
        full = dec.decode(data, "x", fast=True)
        frac = (0.4, 0.75, 1.0)[i % 3]
        box = CropBox(int(w * (1 - frac) / 2), int(h * (1 - frac) / 3), int(w * frac), int(h * frac), i % 2 == 1)
        out = np.empty((224, 224, 3), np.uint8)
        crop_resize_into(full, box, (w, h), out)
        images.append(torch.from_numpy(full.copy()))
        boxes.append(box)
        cpu.append(out)
    flat, offs = pack(images)
    meta = torch.tensor([[o, im.shape[0], im.shape[1], b.x, b.y, b.width, b.height, int(b.flip)]
                         for o, im, b in zip(offs, images, boxes)])
    out = torch.full((6, 3, 224, 224), float("nan"))
    resized_crop_reference(flat, meta, 224, torch.tensor(scale), torch.tensor(shift), out)
    assert not torch.isnan(out).any()
    scores = [psnr(_to_uint8(out[i]), cpu[i]) for i in range(6)]
    assert min(scores) >= 30.0, scores


_INTERPRETER_CHECK = r"""
import torch
from gpufeed.augment.fused import resized_crop_reference, resized_crop_triton
g = torch.Generator().manual_seed(0)
imgs = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in ((50, 70), (31, 17), (90, 120), (1, 1))]
flat = torch.cat([im.reshape(-1) for im in imgs])
offs = [0, 50 * 70 * 3, 50 * 70 * 3 + 31 * 17 * 3, 50 * 70 * 3 + 31 * 17 * 3 + 90 * 120 * 3]
meta = torch.tensor([[offs[0], 50, 70, 5, 3, 60, 40, 0], [offs[1], 31, 17, 0, 0, 17, 31, 1],
                     [offs[2], 90, 120, 10, 5, 100, 80, 1], [offs[3], 1, 1, 0, 0, 1, 1, 0]])
sc, sh = [0.01, 0.02, 0.03], [-1.0, -2.0, 0.5]
ref = resized_crop_reference(flat, meta, 16, torch.tensor(sc), torch.tensor(sh), torch.empty(4, 3, 16, 16))
for fmt in (torch.contiguous_format, torch.channels_last):
    out = torch.full((4, 3, 16, 16), float("nan")).contiguous(memory_format=fmt)
    resized_crop_triton(flat, meta, 16, sc, sh, out, block=64)
    assert not torch.isnan(out).any(), "unwritten output"
    assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
# uint8 out, scale 1 and shift 0: the crop's pixels, each the nearest level (not truncated), as the reference
one, zero = [1.0] * 3, [0.0] * 3
exact = resized_crop_reference(flat, meta, 16, torch.tensor(one), torch.tensor(zero), torch.empty(4, 3, 16, 16))
ref8 = resized_crop_reference(flat, meta, 16, torch.tensor(one), torch.tensor(zero), torch.empty(4, 3, 16, 16, dtype=torch.uint8))
out8 = torch.zeros(4, 3, 16, 16, dtype=torch.uint8)
resized_crop_triton(flat, meta, 16, one, zero, out8, block=64)
assert torch.equal(out8, ref8)
assert (ref8.float() - exact).abs().max() <= 0.5 + 1e-3, (ref8.float() - exact).abs().max()
assert (exact - exact.floor() > 0.6).sum() > 50  # enough values that truncating would have missed
half = torch.tensor([10, 10, 10, 11, 11, 11], dtype=torch.uint8)  # a 1 x 2 image averaged to one pixel: 10.5
row = torch.tensor([[0, 1, 2, 0, 0, 2, 1, 0]])
one8 = torch.zeros(1, 3, 1, 1, dtype=torch.uint8)
resized_crop_triton(half, row, 1, one, zero, one8, block=64)
assert one8.flatten().tolist() == [11, 11, 11], one8  # half up (half to even would give 10)
print("ok")
"""


def test_triton_kernel_indexing_in_the_interpreter():
    """The kernel itself, run on CPU tensors by Triton's interpreter: every element written, equal to the reference."""
    pytest.importorskip("triton", minversion="3.8")  # older interpreters cannot run runtime-bounded loops
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_the_reference_rounds_a_uint8_output_half_up_and_clamps():
    """A 1 x 2 image (10, 11) averaged to one pixel is 10.5: 11 (half up); a shift past 255 clamps."""
    flat = torch.tensor([10, 10, 10, 11, 11, 11], dtype=torch.uint8)
    row = torch.tensor([[0, 1, 2, 0, 0, 2, 1, 0]])
    out = resized_crop_reference(flat, row, 1, torch.ones(3), torch.tensor([0.0, 250.0, -20.0]),
                                 torch.zeros(1, 3, 1, 1, dtype=torch.uint8))
    assert out.flatten().tolist() == [11, 255, 0]


def test_slices_respect_the_budget():
    sizes = [10_000] * 5 + [1_000_000] + [10_000] * 2
    assert _slices(sizes, 30_000) == [range(0, 3), range(3, 5), range(5, 6), range(6, 8)]
    assert _slices(sizes, 10**9) == [range(0, 8)]
