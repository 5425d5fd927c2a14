"""Validation's Resize + CenterCrop on the GPU path (augment.center_crop), run here on the CPU: the Triton
kernels through Triton's interpreter against the numpy reference (the same integers), both against
torchvision's Resize(256) + CenterCrop(224) on PIL images of varied sizes and aspect ratios; and the GPU stage
fed by a real worker pool (a stand-in decoder in the GPU's place), its CPU share, its refusals and its
dropped samples."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision.transforms as T

from gpufeed.augment import center_crop
from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.base import DecodeError, SkipLog
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.records import KernelRow
from gpufeed.ring import KIND_BYTES, KIND_PIXELS, Meta
from gpufeed.stage.refused import settle_dropped
from tests.helpers import psnr, textured, tinted_classes
from gpufeed.sources import folder_source
from gpufeed.stage.gpu import GpuDecodeAugment
from gpufeed.workers import PipelineSpec, WorkerPool
from tests.test_gpu_stage import CpuStandIn, host_batch

triton = pytest.importorskip("triton")

S, RESIZE = 224, 256
VAL = AugmentSpec(train=False, image_size=S, resize_size=RESIZE)
# landscape, portrait and square, larger and smaller than the crop, long strips, odd sizes
SHAPES = [(500, 375), (375, 500), (333, 500), (640, 427), (256, 256), (1024, 683), (150, 100), (257, 300),
          (999, 998), (300, 1000), (2000, 90), (50, 60)]


def interpreted(call: str):
    """``call`` (an expression over this module, giving JSON) run in a child process under Triton's interpreter:
    Triton reads TRITON_INTERPRET when its kernels are defined."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"import json; import tests.test_center_crop as t; print(json.dumps(t.{call}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _torchvision(img):
    return np.asarray(T.CenterCrop(S)(T.Resize(RESIZE)(img)))


def _table(images):
    """The images packed as the GPU stage packs them, and their kernel rows."""
    flat = torch.cat([torch.from_numpy(im.copy()).reshape(-1) for im in images])
    offsets = np.cumsum([0] + [im.size for im in images[:-1]])
    rows = []
    for off, im in zip(offsets, images):
        g = VAL.resize_crop(im.shape[1], im.shape[0])
        rows.append([off, im.shape[0], im.shape[1], g.left, g.top, g.width, g.height, 0])
    return flat, torch.tensor(rows, dtype=torch.int64)


def test_the_reference_gives_torchvisions_pixels():
    """Pillow's arithmetic on the crop's pixels alone, its passes in the installed Pillow's order: torchvision's
    result bit for bit, for wide, tall, square, small and strip-like images."""
    for i, (w, h) in enumerate(SHAPES):
        img = textured(w, h, i)
        g = VAL.resize_crop(w, h)
        got = center_crop.center_crop_pixels(np.asarray(img), g.width, g.height, g.left, g.top, S)
        assert np.array_equal(got, _torchvision(img)), (w, h)


def test_the_order_of_the_passes_is_the_installed_pillows():
    """Pillow 13 takes the vertical pass first where the height shrinks by more than twice the pixels the width
    does (Resample.c before it: always the horizontal first); the order learnt is the one that gives
    torchvision's pixels, and the other is a level off in places."""
    rule = center_crop.pillow_order()
    img = textured(300, 1000, 3)  # to 256 x 853: 147 rows fewer, 44 columns
    g = VAL.resize_crop(300, 1000)
    assert center_crop.vertical_first(300, 1000, g.width, g.height, 1)
    assert not center_crop.vertical_first(500, 375, 341, 256, 1)
    assert not center_crop.vertical_first(300, 1000, 256, 853, 0)
    other = center_crop.center_crop_pixels(np.asarray(img), g.width, g.height, g.left, g.top, S, 1 - rule)
    assert 50 <= psnr(other, _torchvision(img)) < 100


def _pillow_ordering_by(vertical):
    """Pillow's resize with its passes in the order ``vertical(w, h, new_w, new_h)`` says: each pass a resize
    along one axis alone (Pillow's own pass, rounded to uint8 as between its two)."""
    from PIL import Image

    resize = Image.Image.resize

    def ordered(self, size, resample=Image.BILINEAR, box=None, reducing_gap=None):
        (w, h), (new_w, new_h) = self.size, size
        middle = (w, new_h) if vertical(w, h, new_w, new_h) else (new_w, h)
        return resize(resize(self, middle, resample), size, resample)

    return ordered


@pytest.mark.parametrize("pillow, rule", [("always horizontal first (Pillow 12)", 0),
                                          ("vertical first by the rule of Pillow 13", 1)])
def test_the_order_is_learnt_from_pillows_resizes(monkeypatch, pillow, rule):
    from PIL import Image

    vertical = {0: lambda *shape: False, 1: lambda *shape: center_crop.vertical_first(*shape, 1)}[rule]
    monkeypatch.setattr(Image.Image, "resize", _pillow_ordering_by(vertical))
    center_crop.pillow_order.cache_clear()
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert center_crop.pillow_order() == rule, pillow
    finally:
        center_crop.pillow_order.cache_clear()


def test_a_pillow_ordering_its_passes_by_another_rule_is_named_with_the_way_out(monkeypatch):
    """A Pillow that goes vertically first wherever the height loses more pixels than the width (not twice as
    many): the probes near the threshold tell it from Pillow 13's rule; the warning names the version and what
    to do."""
    import PIL
    from PIL import Image

    monkeypatch.setattr(Image.Image, "resize", _pillow_ordering_by(lambda w, h, nw, nh: h - nh > w - nw))
    center_crop.pillow_order.cache_clear()
    try:
        with pytest.warns(UserWarning, match=f"Pillow {PIL.__version__} orders") as caught:
            assert center_crop.pillow_order() == 0
        said = str(caught[0].message)
        assert 'decode="cpu"' in said and "pip install" in said
    finally:
        center_crop.pillow_order.cache_clear()


def kernel_checks() -> dict:
    """Under the interpreter: the kernels against the reference on textured images of varied shapes, in uint8
    and normalised float32 through channels_last strides; and an S x S image with the geometry (0, 0, S, S)."""
    images = [np.asarray(textured(w, h, 40 + i)) for i, (w, h) in enumerate(SHAPES[:2] + SHAPES[6:7] + SHAPES[-3:])]
    flat, table = _table(images)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    checks = {}
    for dtype, channels_last in ((torch.uint8, False), (torch.float32, True)):
        scale, shift = ([1.0] * 3, [0.0] * 3) if dtype == torch.uint8 else (
            [1 / (255 * s) for s in std], [-m / s for m, s in zip(mean, std)])
        out = torch.full((len(images), S, S, 3), 7, dtype=dtype).permute(0, 3, 1, 2)
        out = out if channels_last else out.contiguous()
        taps = center_crop.max_taps(table.numpy())
        center_crop.center_crop_triton(flat, table, S, scale, shift, out, taps_at_most=taps)
        ref = torch.empty((len(images), 3, S, S), dtype=dtype)
        center_crop.center_crop_reference(flat, table, S, scale, shift, ref)
        checks[str(dtype)] = [int((out[b] != ref[b]).sum()) for b in range(len(images))]
        if dtype == torch.uint8:  # and those are the pixels the reference gives on its own
            checks["pixels"] = []
            for b, im in enumerate(images):
                g = VAL.resize_crop(im.shape[1], im.shape[0])
                want = center_crop.center_crop_pixels(im, g.width, g.height, g.left, g.top, S)
                checks["pixels"].append(int((out[b].permute(1, 2, 0).numpy() != want).sum()))
    im = np.asarray(textured(S, S, 5))
    out = torch.empty((1, 3, S, S), dtype=torch.uint8)
    center_crop.center_crop_triton(torch.from_numpy(im.copy()).reshape(-1), torch.tensor([[0, S, S, 0, 0, S, S, 0]]), S,
                                   [1.0] * 3, [0.0] * 3, out, taps_at_most=3)
    checks["copy"] = int((out[0].permute(1, 2, 0).numpy() != im).sum())
    return checks


def test_the_triton_kernels_compute_the_references_integers():
    """Pre-cropped pixels (the workers' share, a refused file) enter the kernel as (0, 0, S, S): copied."""
    checks = interpreted("kernel_checks()")
    assert checks == {"torch.uint8": [0] * 6, "torch.float32": [0] * 6, "pixels": [0] * 6, "copy": 0}


def test_max_taps_covers_every_sample():
    table = np.array([[0, 375, 500, 58, 16, 341, 256, 0], [0, 1000, 300, 16, 314, 256, 853, 0],
                      [0, 683, 4096, 0, 0, 1536, 256, 0]])
    assert center_crop.max_taps(table) == 2 * 3 + 1 == center_crop.taps(4096, 1536)
    assert center_crop.max_taps(table[:2]) == 5


@pytest.fixture()
def shapes(tmp_path):
    """Two classes, each a colour over texture, JPEGs of varied sizes and aspect ratios."""
    sizes = [(300, 200), (200, 300), (260, 260), (520, 390), (150, 120), (700, 240)]
    return tinted_classes(tmp_path, [(220, 40, 40), (40, 40, 220)], sizes, 10, 95)


def _reference_crops(root):
    from PIL import Image

    paths = sorted(root.glob("c*/*.jpg"))
    return [_torchvision(Image.open(p).convert("RGB")) for p in paths]


def _stage_output(root, decoder, cpu_rows, skips=None, cpu=None):
    """A validation batch of every sample under ``root`` from GPU-path workers, through the stage (uint8):
    (images, labels, the stage, each sample's kind, the batch's source indices); ``skips``, ``cpu``: the
    stage's skip log and its CPU decoder for what the GPU refuses."""
    src = folder_source(root)
    spec = PipelineSpec(src, VAL, 10**8, gpu_bytes_capacity=1 << 20, gpu_buffer_bytes=1 << 22)
    pool = WorkerPool(spec, num_workers=2, num_slots=2, batch_size=len(src))
    try:
        pool.submit(0, 0, 0, 0, list(range(len(src))), cpu_rows=cpu_rows)
        view, failures = pool.collect(0)
        assert failures == []
        stage = GpuDecodeAugment([decoder], device=torch.device("cpu"), image_size=S, mean=(0.0,) * 3,
                                 std=(1.0,) * 3, dtype=torch.uint8, channels_last=False, max_pixels=10**8,
                                 buffer_bytes=1 << 22, crop="center", skips=skips, cpu=cpu)
        batch = host_batch(view, src.path)
        images, labels = stage(batch)
        return images, labels, stage, view.meta[:, Meta.KIND].copy(), batch.indices
    finally:
        pool.close()


@pytest.mark.parametrize("cpu_rows", [0, 5])
def test_the_stage_gives_torchvisions_validation_crops_with_their_labels(shapes, cpu_rows):
    """GPU-path workers leave validation's JPEGs encoded with their geometry (or, for the CPU's share,
    resize and crop them themselves); the stage decodes, resizes and crops the rest: torchvision's pixels,
    level for level, whichever path each image took (the device's kernel, the workers' share, one refused
    JPEG finished on the CPU), each with its label."""
    refuse = {(shapes / "c1" / "03.jpg").read_bytes()}
    images, labels, stage, kinds, _ = _stage_output(shapes, CpuStandIn(refuse), cpu_rows)
    assert set(kinds.tolist()) == ({KIND_BYTES, KIND_PIXELS} if cpu_rows else {KIND_BYTES})
    assert stage.decoded_by["cpu"] == cpu_rows + 1 and stage.decoded_by["gpu:standin"] == 11 - cpu_rows
    assert labels.tolist() == [0] * 6 + [1] * 6
    want = _reference_crops(shapes)
    unequal = [i for i in range(12) if not np.array_equal(images[i].permute(1, 2, 0).numpy(), want[i])]
    assert not unequal, [(i, kinds[i]) for i in unequal]


def test_a_sample_dropped_from_a_validation_batch_leaves_it_in_order():
    out = torch.arange(5, dtype=torch.float32).view(5, 1, 1, 1).expand(5, 3, 2, 2).contiguous()
    labels = torch.tensor([10, 11, 12, 13, 14])

    class Batch:
        def __init__(self):
            self.indices = [100, 101, 102, 103, 104]

        @staticmethod
        def path(i):
            return f"{i}.jpg"

    batch, skips = Batch(), SkipLog()
    kept, kept_labels = settle_dropped(out, labels, batch, [1, 3], "center", skips)
    assert kept_labels.tolist() == [10, 12, 14] and batch.indices == [100, 102, 104]
    assert kept[:, 0, 0, 0].tolist() == [0.0, 2.0, 4.0] and skips.repeated == 0
    out2, labels2 = settle_dropped(out.clone(), torch.tensor([10, 11, 12, 13, 14]), Batch(), [1], "box", skips)
    assert out2.shape[0] == 5 and labels2.tolist() == [10, 10, 12, 13, 14] and skips.repeated == 1
    assert KernelRow.BOX_W == 5 and Meta.BOX_W == 6  # the geometry's columns, as the workers write them


def test_samples_leaving_a_gpu_path_batch_take_their_bytes_along(tmp_path):
    """Validation on the GPU path under on_error="skip": the good samples move up over the bad ones with
    their encoded bytes, meta rows and labels, so each position's JPEG is its index's file."""
    import functools

    from gpufeed.placement import ShareControl
    from gpufeed.sampling import ShardedSampler
    from gpufeed.schedule import Scheduler

    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(6):
            textured(60 + 9 * i, 50 + 5 * c, 10 * c + i).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=90)
    src = folder_source(tmp_path)
    bad = {1, 2, 7}
    for i in bad:
        with open(src.path(i), "wb") as f:
            f.write(b"\xff\xd8\xff\xe0 not a jpeg")
    spec = PipelineSpec(src, VAL, 10**8, gpu_bytes_capacity=1 << 20, gpu_buffer_bytes=1 << 22, on_error="skip")
    scheduler = Scheduler(start_pool=functools.partial(WorkerPool, spec, num_workers=2, num_slots=3, batch_size=6),
                          num_slots=3, batch_size=6, drop_last=False, share=ShareControl(0.0), skips=SkipLog(),
                          path=src.path, cuda=False, stand_ins=False)
    delivered = []
    try:
        for batch in scheduler.batches(ShardedSampler(len(src), shuffle=False)):
            meta = batch.slot.meta
            for k, index in enumerate(batch.indices):
                data = open(src.path(index), "rb").read()
                assert meta[k, Meta.KIND] == KIND_BYTES and meta[k, Meta.LENGTH] == len(data)
                assert batch.slot.arena[k, : len(data)].tobytes() == data, (k, index)
                assert batch.labels[k].item() == src.label(index)
            delivered += batch.indices
            batch.release()
    finally:
        scheduler.close()
    assert delivered == [i for i in range(12) if i not in bad]


def test_the_center_box_is_the_part_of_the_image_the_crop_is_made_from():
    """What the CPU share's cost model weighs: the crop's rows and columns mapped back through the resize,
    inside the image, within the filter's reach of the pixels Pillow's coefficients read."""
    for w, h in SHAPES:
        box = VAL.center_box(w, h)
        g = VAL.resize_crop(w, h)
        assert 0 <= box.x and 0 <= box.y and box.x + box.width <= w and box.y + box.height <= h
        for first, size, lo, n, full in ((g.left, g.width, box.x, box.width, w),
                                         (g.top, g.height, box.y, box.height, h)):
            start, weights = center_crop.axis_coefficients(full, size, first, S)
            reach = weights.shape[1]
            assert start.min() <= lo + reach and (start + reach).max() >= lo + n - reach, (w, h)


class _FailingCpu(CpuDecoder):
    """libjpeg-turbo, but for one file, which fails as a damaged file the GPU also refused would."""

    def __init__(self, bad: bytes):
        super().__init__(max_pixels=10**8)
        self.bad = bad

    def decode(self, data, path, **kw):
        if data == self.bad:
            raise DecodeError(path, "corrupt JPEG data")
        return super().decode(data, path, **kw)


def test_a_file_neither_the_gpu_nor_the_cpu_decodes_leaves_its_validation_batch(shapes):
    bad = (shapes / "c0" / "02.jpg").read_bytes()
    skips = SkipLog()
    images, labels, _, _, indices = _stage_output(shapes, CpuStandIn({bad}), 0, skips=skips, cpu=_FailingCpu(bad))
    assert images.shape == (11, 3, S, S) and labels.tolist() == [0] * 5 + [1] * 6
    assert indices == [i for i in range(12) if i != 2] and skips.repeated == 0
    assert [p for p, _ in skips.listed] == [str(shapes / "c0" / "02.jpg")]
    want = _reference_crops(shapes)
    kept = [w for i, w in enumerate(want) if i != 2]
    assert all(np.array_equal(images[i].permute(1, 2, 0).numpy(), kept[i]) for i in range(11))


def test_the_kernels_compile_for_a_hopper_gpu_without_one():
    """Compiled (not interpreted) for sm_90 as a GPU builds them, with the options their launches pass: what the
    interpreter does not check (types across branches). The coefficients in float64 as Pillow computes them,
    each step rounded (``div.rn.f64``, no fused multiply-add), so the integers are Pillow's."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    coefficients, crop = center_crop._coefficients_kernel, center_crop._center_crop_kernel  # @triton.jit: no public name
    signature = {"table_ptr": "*i64", "coef_ptr": "*i32", "S": "i32", "K": "i32", "BLOCK_S": "constexpr"}
    ptx = triton.compile(ASTSource(fn=coefficients, signature=signature, constexprs={"BLOCK_S": 256}), target=target,
                         options=center_crop._UNFUSED).asm["ptx"]
    assert "div.rn.f64" in ptx and "fma.rn.f64" not in ptx
    pointers = {"src_ptr": "*u8", "table_ptr": "*i64", "coef_ptr": "*i32"}
    for out in ("*u8", "*fp32", "*bf16"):
        signature = {name: {**pointers, "out_ptr": out}.get(name, "fp32" if name[:5] in ("scale", "shift") else "i32")
                     for name in crop.arg_names if name not in ("BY", "BX", "ROUND")}
        signature.update(BY="constexpr", BX="constexpr", ROUND="constexpr")
        compiled = triton.compile(ASTSource(fn=crop, signature=signature,
                                            constexprs={"BY": 16, "BX": 32, "ROUND": out == "*u8"}),
                                  target=target, options=center_crop._UNFUSED)
        assert compiled.asm["cubin"]
