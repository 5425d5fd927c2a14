"""nvJPEG's batched hardware decode called directly: library discovery, and the decoder's address
arithmetic and fallbacks run on the CPU against a stand-in libnvjpeg that decodes with libjpeg-turbo
and writes the pixels at the addresses it is given (host memory here, device memory on a GPU)."""

import contextlib
import ctypes

import numpy as np
import pytest
import torch

from gpufeed.augment.params import AugmentSpec
from gpufeed.decode.base import DecodeJob
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.stage.gpu import GpuDecodeAugment
from gpufeed.decode import nvjpeg_hw
from gpufeed.decode.nvjpeg_hw import NvJpegHwDecoder, load_nvjpeg
from gpufeed.placement import create_gpu_decoders
from gpufeed.ring import KIND_BYTES, SlotView
from gpufeed.records import HostBatch
from tests.corpus import jpeg

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class FakeNvjpeg:
    """The libnvjpeg calls the decoder makes, on the CPU. A batched call containing a refused bitstream
    fails as a whole (as the hardware backend does); the per-image support check then names it."""

    def __init__(self, refuse=()):
        self.refuse, self.cpu, self.n, self.parsed = set(refuse), CpuDecoder(), 0, b""
        self.batches: list[int] = []

    def nvjpegDecodeBatchedInitialize(self, handle, state, n, threads, fmt):
        assert fmt == 5 and threads == 1  # NVJPEG_OUTPUT_RGBI
        self.n = n
        return 0

    def nvjpegDecodeBatched(self, handle, state, src, lengths, images, stream):
        n = self.n
        src = np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(src))
        lengths = np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(lengths))
        table = np.ctypeslib.as_array((ctypes.c_uint64 * (8 * n)).from_address(images)).reshape(n, 8)
        datas = [ctypes.string_at(int(s), int(ln)) for s, ln in zip(src, lengths)]
        self.batches.append(n)
        ORDER.append("decode")
        if any(d in self.refuse for d in datas):
            return 4  # NVJPEG_STATUS_JPEG_NOT_SUPPORTED
        for d, row in zip(datas, table):
            img = self.cpu.decode(d, "x", fast=True)
            assert int(row[4]) == img.shape[1] * 3 and not row[1:4].any() and not row[5:].any()
            ctypes.memmove(int(row[0]), img.tobytes(), img.nbytes)
        return 0

    def nvjpegJpegStreamParseHeader(self, handle, src, length, jstream):
        self.parsed = ctypes.string_at(src, length)
        return 0

    def nvjpegJpegStreamGetFrameDimensions(self, jstream, w, h):
        w._obj.value, h._obj.value, _ = self.cpu.header(self.parsed, "x")
        return 0

    def nvjpegDecodeBatchedSupported(self, handle, jstream, supported):
        supported._obj.value = 1 if self.parsed in self.refuse else 0
        return 0


class _Event:
    def synchronize(self):
        pass

    def record(self, stream):
        pass


class _Stream:
    cuda_stream = 0


def _decoder(lib):
    d = NvJpegHwDecoder.__new__(NvJpegHwDecoder)  # no CUDA here: the state the constructor would make
    d._lib, d._handle, d._jstream, d.device = lib, ctypes.c_void_p(1), ctypes.c_void_p(2), torch.device("cpu")
    d._states, d._turn = [(ctypes.c_void_p(3 + k), _Event()) for k in range(2)], 0
    return d


def _decode(lib, datas, outs):
    return _decoder(lib).decode(DecodeJob.of([np.frombuffer(d, np.uint8) for d in datas], outs), _Stream()).tolist()


ORDER: list[str] = []  # "wait" (the host waited for the stream's queued work), "decode" (the engines wrote)


@pytest.fixture(autouse=True)
def _no_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(nvjpeg_hw, "engines_after", lambda stream: ORDER.append("wait"))
    ORDER.clear()


def _case(n=5):
    datas = [jpeg(w=40 + 8 * i, h=24 + 4 * i, seed=i) for i in range(n)]
    refs = [CpuDecoder().decode(d, "x", fast=True) for d in datas]
    return datas, refs


def test_a_good_batch_is_one_call_with_every_pixel_in_place():
    datas, refs = _case()
    lib = FakeNvjpeg()
    outs = [torch.full(r.shape, 7, dtype=torch.uint8) for r in refs]
    ok = _decode(lib, datas, outs)
    assert ok == [True] * 5 and lib.batches == [5]
    assert ORDER == ["wait", "decode"]  # the engines write at the call: the stream's queued work ran first
    for out, ref in zip(outs, refs):
        assert np.array_equal(out.numpy(), ref)


def test_a_refused_image_fails_alone_and_its_place_is_left_alone():
    datas, refs = _case()
    lib = FakeNvjpeg(refuse={datas[2]})
    outs = [torch.full(r.shape, 7, dtype=torch.uint8) for r in refs]
    ok = _decode(lib, datas, outs)
    assert ok == [True, True, False, True, True]
    assert lib.batches == [5, 4]  # the whole batch, then the four supported ones again
    assert (outs[2] == 7).all()
    for j in (0, 1, 3, 4):
        assert np.array_equal(outs[j].numpy(), refs[j])


def test_a_size_other_than_the_buffers_is_never_decoded():
    """If nvJPEG's header parse disagreed with the workers' about a size, the engines would write outside
    the image's place: such an image is refused before any decode."""
    datas, refs = _case(3)
    lib = FakeNvjpeg(refuse={datas[0]})  # force the checked path
    shapes = [refs[0].shape, (refs[1].shape[0], refs[1].shape[1] - 8, 3), refs[2].shape]
    outs = [torch.full(s, 7, dtype=torch.uint8) for s in shapes]
    ok = _decode(lib, datas, outs)
    assert ok == [False, False, True] and lib.batches == [3, 1]
    assert (outs[1] == 7).all() and np.array_equal(outs[2].numpy(), refs[2])


def test_gpu_stage_hands_ring_rows_and_buffer_places_by_address():
    """The stage gives the decoders addresses: sources are rows of the arena, destinations places in the
    decode buffer; with one refusal the output equals the clean result but for that sample, which the CPU
    finishes from the same box."""
    datas, refs = _case(6)
    cap = max(map(len, datas)) + 5
    meta = np.zeros((6, 9), np.int64)
    arena = np.zeros((6, cap), np.uint8)
    spec = AugmentSpec(image_size=16)
    for i, d in enumerate(datas):
        h, w, _ = refs[i].shape
        box = spec.draw(w, h, seed=0, epoch=0, index=i)
        meta[i] = (KIND_BYTES, len(d), w, h, box.x, box.y, box.width, box.height, int(box.flip))
        arena[i, : len(d)] = np.frombuffer(d, np.uint8)
    slot = SlotView(np.zeros((6, 16, 16, 3), np.uint8), np.arange(6), meta, arena)
    batch = HostBatch(torch.arange(6), slot, indices=list(range(6)), consumed=6, release=lambda: None,
                      path=lambda i: f"f{i}")

    class OnAStream:  # the stage on the CPU passes no stream; the decoder under test wants one
        def __init__(self, inner):
            self.inner, self.name, self.job_images = inner, inner.name, inner.job_images

        def decode(self, job, stream):
            return self.inner.decode(job, _Stream())

    def stage(lib, decoders=2):
        s = GpuDecodeAugment([OnAStream(_decoder(lib)) for _ in range(decoders)], device=torch.device("cpu"),
                             image_size=16, mean=MEAN, std=STD, dtype=torch.float32, channels_last=False,
                             max_pixels=10**8, buffer_bytes=1 << 20)
        assert s.job_images == NvJpegHwDecoder.job_images
        return s

    clean = stage(FakeNvjpeg())
    want, labels = clean(batch)
    assert clean.decoded_by == {"gpu:nvjpeg-hw": 6, "cpu": 0}
    refused = stage(FakeNvjpeg(refuse={datas[4]}))
    got, _ = refused(batch)
    assert refused.decoded_by == {"gpu:nvjpeg-hw": 5, "cpu": 1}
    assert torch.equal(labels, torch.arange(6))
    # sample 4 came from the CPU path's cropped decode instead of the decoder's full one: close, not equal
    torch.testing.assert_close(got[[0, 1, 2, 3, 5]], want[[0, 1, 2, 3, 5]], rtol=0, atol=0)
    assert (got[4] - want[4]).abs().mean() < 0.05


def test_library_discovery_reports_what_it_found():
    lib, where = load_nvjpeg()
    if lib is None:
        assert "libnvjpeg not found" in where
    else:  # torchvision's CUDA wheels bundle one; the nvidia-nvjpeg wheels carry another
        v = ctypes.c_int()
        assert lib.nvjpegGetProperty(0, ctypes.byref(v)) == 0 and v.value >= 11, where


def test_nvjpeg_choice_needs_a_cuda_device():
    with pytest.raises(ValueError, match="decode='nvjpeg' needs a CUDA device"):
        create_gpu_decoders("nvjpeg", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_no_gpu_gives_a_clear_error_not_a_crash():
    lib, _ = load_nvjpeg()
    if lib is None:
        pytest.skip("no libnvjpeg here")
    with pytest.raises(RuntimeError, match="nvjpegCreateEx returned NVJPEG_STATUS_"):
        NvJpegHwDecoder(torch.device("cuda", 0), max_side=1024)


def test_a_gpu_without_engines_is_refused_at_construction(monkeypatch):
    """nvJPEG may create a hardware handle on a GPU that reports 0 engines: that decoder is refused (the
    placement then tries nvImageCodec) instead of sending every image to the CPU batch after batch."""
    import gpufeed.decode.nvjpeg_hw as hw

    class NoEngines:
        destroyed = 0

        def nvjpegGetProperty(self, which, value):
            value._obj.value = (13, 3, 2)[which]
            return 0

        def nvjpegCreateEx(self, backend, dev, pinned, flags, handle):
            assert backend == 3 and flags == 1 << 5  # hardware backend, libjpeg-turbo's chroma upsampling
            handle._obj.value = 42
            return 0

        def nvjpegGetHardwareDecoderInfo(self, handle, engines, cores):
            engines._obj.value, cores._obj.value = 0, 0
            return 0

        def nvjpegDestroy(self, handle):
            NoEngines.destroyed += 1
            return 0

    monkeypatch.setattr(hw, "load_nvjpeg", lambda: (NoEngines(), "fake"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    with pytest.raises(RuntimeError, match="Some GPU reports no hardware JPEG engines"):
        NvJpegHwDecoder(torch.device("cuda", 0), max_side=1024)
    import gc

    gc.collect()
    assert NoEngines.destroyed == 1  # once, not again when the half-built decoder is collected
