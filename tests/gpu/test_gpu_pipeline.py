"""GPU path: parity with the CPU path, odd images inside a GPU batch, poisoning, memory. Marked gpu."""

import os
import time

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed import ImageLoader, placement
from gpufeed.augment.fused import normalize_constants, resized_crop_reference, resized_crop_triton
from gpufeed.decode.base import DecodeJob
from gpufeed.synth import create_synthetic_dataset
from tests.helpers import denormalised_uint8, psnr

pytestmark = pytest.mark.gpu
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ENGINE_PATHS = ["nvimgcodec", "nvjpeg"]  # nvJPEG's batched hardware decode called directly ("gpu" picks it)


def _uint8(x):
    return denormalised_uint8(x, MEAN, STD)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return create_synthetic_dataset(tmp_path_factory.mktemp("g"), n=96, num_classes=4, seed=2, workers=4)


def _gpu_loader(root, decode, **kw):
    return ImageLoader(root, device="cuda", decode=decode, **kw)


@pytest.mark.parametrize("decode, job_images", [("gpu", None), ("nvimgcodec", None), ("nvimgcodec", 3), ("nvjpeg", 5),
                                                ("torchvision", None)])
def test_gpu_matches_cpu_for_the_same_crops(synth, decode, job_images):
    kw = dict(batch_size=32, num_workers=2, seed=7)
    gpu = ImageLoader(synth, device="cuda", decode=decode, cpu_share=0.0, **kw)  # every image on the GPU
    if job_images:  # many small decode calls, dealt in turn to the decoder threads
        gpu._gpu_stage.job_images = job_images
    cpu = ImageLoader(synth, device="cpu", **kw)
    assert gpu.decode_backend != "cpu"
    scores = []
    for (xg, yg), (xc, yc) in zip(gpu, cpu, strict=True):
        assert xg.is_cuda and yg.is_cuda and xg.dtype == torch.float32
        assert torch.equal(yg.cpu(), yc)
        a, b = _uint8(xg), _uint8(xc)
        assert (a.reshape(len(a), -1).max(axis=1) > 0).all()  # no image all-zero
        scores += [psnr(a[i], b[i]) for i in range(len(a))]
    assert len(scores) == 96 and min(scores) >= 30.0, sorted(scores)[:5]
    assert gpu.stats["decoded_by"].get(f"gpu:{gpu.decode_backend}", 0) == 96
    gpu.close(), cpu.close()


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_cpu_decode_path_normalises_on_cuda_as_on_the_cpu(synth, channels_last):
    """The CPU workers' crops normalised on the device (torch's passes) equal the same crops normalised on a
    CPU device (NumPy), in either memory format: a scale and shift swapped on one path shows here."""
    kw = dict(batch_size=16, num_workers=2, seed=3, decode="cpu", channels_last=channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with ImageLoader(synth, device="cuda", **kw) as gpu, ImageLoader(synth, device="cpu", **kw) as cpu:
        for (xg, yg), (xc, yc) in zip(gpu, cpu, strict=True):
            assert xg.is_cuda and xg.is_contiguous(memory_format=fmt) and xc.is_contiguous(memory_format=fmt)
            assert torch.equal(yg.cpu(), yc) and xc.std() > 0.3  # textured: a wrong constant cannot hide
            torch.testing.assert_close(xg.cpu(), xc, rtol=0, atol=1e-5)


def test_kernel_writes_every_element_and_matches_reference():
    g = torch.Generator().manual_seed(1)
    imgs = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in ((375, 500), (17, 900), (1, 1))]
    flat = torch.cat([i.reshape(-1) for i in imgs]).cuda()
    offs = [0, 375 * 500 * 3, 375 * 500 * 3 + 17 * 900 * 3]
    meta = torch.tensor([[offs[0], 375, 500, 10, 20, 400, 300, 1], [offs[1], 17, 900, 0, 0, 900, 17, 0],
                         [offs[2], 1, 1, 0, 0, 1, 1, 0]], device="cuda")
    sc, sh = normalize_constants(MEAN, STD)
    for fmt, dtype in ((torch.contiguous_format, torch.float32), (torch.channels_last, torch.bfloat16)):
        out = torch.full((3, 3, 224, 224), float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=fmt)
        resized_crop_triton(flat, meta, 224, sc, sh, out)
        assert not torch.isnan(out).any()
        ref = resized_crop_reference(flat, meta, 224, torch.tensor(sc, device="cuda"), torch.tensor(sh, device="cuda"),
                                     torch.empty(3, 3, 224, 224, device="cuda"))
        torch.testing.assert_close(out.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)


@pytest.mark.parametrize("decode", ENGINE_PATHS)
def test_odd_images_in_a_gpu_batch_fall_back_to_the_cpu(tmp_path, decode):
    colours = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]
    for c, colour in enumerate(colours):
        d = tmp_path / f"c{c}"
        d.mkdir()
        for i in range(5):
            Image.new("RGB", (64 + 8 * i, 48), colour).save(d / f"{i}.jpg", quality=95)
    Image.new("RGB", (40, 40), colours[0]).save(tmp_path / "c0" / "png_named.jpg", "PNG")
    Image.new("RGB", (40, 40), colours[1]).convert("CMYK").save(tmp_path / "c1" / "cmyk.jpg", "JPEG")
    Image.new("RGB", (64, 64), colours[2]).save(tmp_path / "c2" / "prog.jpg", "JPEG", progressive=True)
    Image.new("L", (50, 50), 200).save(tmp_path / "c2" / "gray.jpg", "JPEG")
    # training crops: validation samples are all the CPU workers' (placement.gpu_may_take)
    loader = _gpu_loader(tmp_path, decode, batch_size=19, num_workers=2, drop_last=False, image_size=32,
                         cpu_share=0.0)
    (images, labels), = list(loader)
    rgb = _uint8(images).mean(axis=(2, 3))
    for i, label in enumerate(labels.tolist()):
        if abs(rgb[i] - 200).max() < 8:  # the grey one
            assert label == 2
            continue
        assert int(np.argmax(rgb[i])) == label, (i, rgb[i], label)
    assert loader.stats["decoded_by"]["cpu"] >= 2  # the PNG and the CMYK JPEG at least
    loader.close()


@pytest.mark.parametrize("decode, share", [("gpu", "auto"), ("nvimgcodec", 0.0), ("nvjpeg", 0.0)])
def test_gpu_memory_is_fixed_from_the_first_epoch(synth, decode, share):
    """20 epochs: what the loader holds on the GPU after epoch 1 is what it holds at the end (within 16 MB),
    and within the budget it reports."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    loader = _gpu_loader(synth, decode, batch_size=32, num_workers=2, cpu_share=share)
    reserved = []
    for _ in range(20):
        for x, y in loader:
            pass
        del x, y
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved() - before)
    assert max(reserved) - min(reserved) <= 16 << 20, reserved
    assert max(reserved) <= loader.stats["gpu_memory_budget"], (reserved, loader.stats["gpu_memory_budget"])
    loader.close()


def test_a_small_gpu_memory_budget_slices_batches_and_changes_nothing_else(synth):
    kw = dict(batch_size=32, num_workers=2, seed=4, cpu_share=0.0)
    roomy = _gpu_loader(synth, "gpu", **kw)
    # room for 20 MiB of decode buffers: two of 10 MiB, each batch in slices
    cap = roomy.gpu_memory.total - placement.reserved_bytes(roomy.gpu_memory.buffer_bytes, 2) + (20 << 20)
    tight = _gpu_loader(synth, "gpu", max_gpu_memory=cap, **kw)
    assert tight.gpu_memory.buffer_bytes == 10 << 20 < roomy.gpu_memory.buffer_bytes
    assert tight.stats["gpu_memory_budget"] <= cap < roomy.stats["gpu_memory_budget"]
    compared = 0
    for (xa, ya), (xb, yb) in zip(roomy, tight, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
        compared += 1
    assert compared == 3
    roomy.close(), tight.close()


@pytest.mark.parametrize("decode", ENGINE_PATHS)
def test_gpu_batch_of_255_good_and_1_broken_under_skip(tmp_path, decode):
    """A full batch of 256: 255 correct outputs, each with its own label, and a good one standing in for the
    broken file, which is counted, not delivered."""
    from tests.corpus import UNDECODABLE

    colours = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]
    for c, colour in enumerate(colours):
        (tmp_path / f"c{c}").mkdir()
        for i in range(85):
            Image.new("RGB", (48 + (i % 7) * 8, 40 + (i % 5) * 8), colour).save(tmp_path / f"c{c}" / f"{i}.jpg")
    (tmp_path / "c1" / "broken.jpg").write_bytes(UNDECODABLE["truncated_scan"]())
    loader = _gpu_loader(tmp_path, decode, batch_size=256, num_workers=4, drop_last=False, image_size=32,
                         on_error="skip")
    (images, labels), = list(loader)
    assert images.shape[0] == 256 and labels.shape[0] == 256
    rgb = _uint8(images).mean(axis=(2, 3))
    assert (np.argmax(rgb, axis=1) == labels.cpu().numpy()).all()
    assert loader.stats["skipped_count"] == loader.stats["repeated"] == 1
    assert loader.stats["skipped"][0][0].endswith("broken.jpg")
    assert len(set(loader.batch_indices)) == 255 and "broken" not in str([loader.source.path(i) for i in
                                                                          loader.batch_indices])
    loader.close()


@pytest.mark.parametrize("kind", ["cmyk", "ycck", "grayscale", "progressive", "subsampling_444", "subsampling_422",
                                  "subsampling_440", "subsampling_411", "restart_markers", "tiny_1x1", "tiny_7x3",
                                  "odd_45x29", "png_palette_named_jpg", "webp_named_jpg"])
@pytest.mark.parametrize("decode", ENGINE_PATHS)
def test_odd_kinds_on_the_gpu_path_match_the_cpu_path(tmp_path, kind, decode):
    from tests.corpus import DECODABLE

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.jpg").write_bytes(DECODABLE[kind]())
    kw = dict(batch_size=1, num_workers=1, drop_last=False, train=False, image_size=32)
    gpu = _gpu_loader(tmp_path, decode, **kw)
    cpu = ImageLoader(tmp_path, device="cpu", **kw)
    (xg, _), = list(gpu)
    (xc, _), = list(cpu)
    assert psnr(_uint8(xg)[0], _uint8(xc)[0]) >= 30.0, kind
    gpu.close(), cpu.close()


def test_cpu_decode_to_cuda_from_the_page_locked_ring_is_exact(synth):
    """Slots are page-locked and copied to the GPU directly, then reused: every batch of two epochs must
    equal the CPU device's (same pipeline), with the GPU kept busy so copies lag behind."""
    kw = dict(batch_size=8, num_workers=2, seed=3, decode="cpu")
    gpu, cpu = ImageLoader(synth, device="cuda", **kw), ImageLoader(synth, device="cpu", **kw)
    compared = 0
    for epoch in range(2):
        for (xg, yg), (xc, yc) in zip(gpu, cpu, strict=True):
            torch.cuda._sleep(2_000_000)  # the consumer's stream lags; the next copies run meanwhile
            torch.testing.assert_close(xg.cpu(), xc, atol=1e-5, rtol=0)  # same pixels; normalised on each device
            assert torch.equal(yg.cpu(), yc)
            compared += 1
    assert compared == 2 * len(cpu) == 24
    assert gpu.stats["ring_page_locked"] is True  # copied to the GPU without a staging copy
    gpu.close(), cpu.close()


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_gpu_decode_with_a_cpu_share_matches_the_cpu_path(synth, share):
    """The CPU's share decodes its crops' rows and the kernel resizes them: they come out as the engines'
    decode of the same boxes does (the two decoders agree to ~87 dB), within 30 dB of the CPU path."""
    kw = dict(batch_size=32, num_workers=2, seed=7)
    gpu = ImageLoader(synth, device="cuda", decode="gpu", cpu_share=share, **kw)
    engines = ImageLoader(synth, device="cuda", decode="gpu", cpu_share=0.0, **kw)
    cpu = ImageLoader(synth, device="cpu", **kw)
    scores = []
    for (xg, yg), (xe, ye), (xc, yc) in zip(gpu, engines, cpu, strict=True):
        assert torch.equal(yg.cpu(), yc) and torch.equal(ye.cpu(), yc)
        a, e, b = _uint8(xg), _uint8(xe), _uint8(xc)
        scores += [psnr(a[i], b[i]) for i in range(len(a))]
        assert min(psnr(a[i], e[i]) for i in range(len(a))) >= 45.0
    assert len(scores) == 96 and min(scores) >= 30.0
    assert gpu.stats["decoded_by"]["cpu"] == round(share * 32) * 3 and gpu.stats["cpu_share"] == share
    from gpufeed.batched_copy import BatchedCopy
    # where the driver has the batched copy, these rows went through it and it was never refused
    assert gpu._gpu_stage._device._batched.available == BatchedCopy().available
    gpu.close(), engines.close(), cpu.close()


def test_nvjpeg_direct_decodes_a_mixed_batch_and_names_what_the_engines_refuse():
    """One batched call with images the engines refuse (4:1:1 chroma) among good ones: the good ones
    decode (and match the CPU decode), the refused ones come back False with their places untouched."""
    from gpufeed.decode.cpu import CpuDecoder
    from gpufeed.decode.nvjpeg_hw import NvJpegHwDecoder
    from tests.corpus import DECODABLE, jpeg

    datas = [jpeg(w=96 + 16 * i, h=72 + 8 * i, seed=i) for i in range(6)]
    datas[2], datas[4] = DECODABLE["subsampling_411"](), DECODABLE["grayscale"]()
    refs = [CpuDecoder().decode(d, "x", fast=True) for d in datas]
    outs = [torch.full(r.shape, 7, dtype=torch.uint8, device="cuda") for r in refs]
    dec = NvJpegHwDecoder(torch.device("cuda", 0), max_side=1024)
    ok = dec.decode(DecodeJob.of([np.frombuffer(d, np.uint8) for d in datas], outs), torch.cuda.current_stream())
    torch.cuda.synchronize()
    for j, (good, out, ref) in enumerate(zip(ok, outs, refs)):
        if good:
            assert psnr(out.cpu().numpy(), ref) >= 40.0, j
        else:
            assert (out == 7).all(), j
    assert ok[0] and ok[1] and ok[3] and ok[5], ok


def test_two_nvjpeg_decoders_called_at_once_from_two_threads_decode_every_image():
    """A loader's decoder threads call their decoders at the same time, each decoder with room for
    512 x 512 images (``placement.ENGINE_ROOM_SIDE``) and given larger ones too: every image decodes."""
    import threading

    from gpufeed.decode import nvjpeg_hw
    from gpufeed.decode.cpu import CpuDecoder
    from tests.corpus import jpeg

    try:
        decoders = [nvjpeg_hw.NvJpegHwDecoder(torch.device("cuda", 0), max_side=placement.ENGINE_ROOM_SIDE)
                    for _ in range(2)]
    except RuntimeError as e:  # no engines, or the library is missing
        pytest.skip(str(e))
    # sides from 200 to over 900: the later calls hold images larger than the room taken
    datas = [[jpeg(w=200 + 30 * i + 4 * t, h=150 + 20 * i, seed=100 * t + i) for i in range(24)] for t in range(2)]
    refs = [[CpuDecoder().decode(d, "x", fast=True) for d in ds] for ds in datas]
    outs = [[torch.full(r.shape, 7, dtype=torch.uint8, device="cuda") for r in rs] for rs in refs]
    results: dict = {}

    def run(t: int) -> None:
        stream = torch.cuda.Stream()
        job = DecodeJob.of([np.frombuffer(d, np.uint8) for d in datas[t]], outs[t])
        ok = [decoders[t].decode(job, stream) for _ in range(20)]  # calls overlap the other thread's
        stream.synchronize()
        results[t] = ok

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(2):
        assert all(ok.all() for ok in results[t]), t
        for out, ref in zip(outs[t], refs[t]):
            assert psnr(out.cpu().numpy(), ref) >= 40.0, t


def _engine_decoder(decode):
    try:
        if decode == "torchvision":
            from gpufeed.decode.torchvision_gpu import TorchvisionGpuDecoder

            return TorchvisionGpuDecoder(torch.device("cuda", 0))
        if decode == "nvjpeg":
            from gpufeed.decode.nvjpeg_hw import NvJpegHwDecoder

            return NvJpegHwDecoder(torch.device("cuda", 0), max_side=1024)
        from gpufeed.decode.nvimgcodec import NvImageCodecDecoder

        return NvImageCodecDecoder(torch.device("cuda", 0))
    except RuntimeError as e:  # no engines, or the library is missing
        pytest.skip(str(e))


@pytest.mark.parametrize("decode", ENGINE_PATHS)
def test_engine_decoders_write_only_after_the_streams_queued_work(decode):
    """The engines write when called, not in the stream's order: a decode into memory that work queued
    earlier on the stream still reads must wait for that work. Here the stream sleeps about 0.25 s, then
    snapshots the places; the snapshots must hold what was there before the decode, and the places the
    decoded images."""
    from gpufeed.decode.cpu import CpuDecoder
    from tests.corpus import jpeg

    datas = [jpeg(w=320, h=240, seed=i) for i in range(8)]
    refs = [CpuDecoder().decode(d, "x", fast=True) for d in datas]
    outs = [torch.full(r.shape, 7, dtype=torch.uint8, device="cuda") for r in refs]
    dec = _engine_decoder(decode)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)  # cycles: about 0.25 s at the H200's clock
        snaps = [o.clone() for o in outs]
    ok = dec.decode(DecodeJob.of([np.frombuffer(d, np.uint8) for d in datas], outs), stream)
    stream.synchronize()
    assert ok.all(), ok
    assert [bool((s == 7).all()) for s in snaps] == [True] * 8
    assert min(psnr(o.cpu().numpy(), r) for o, r in zip(outs, refs)) >= 40.0


@pytest.mark.parametrize("decode", ["torchvision", *ENGINE_PATHS])
def test_two_calls_on_one_busy_stream_each_decode_their_own_images(decode):
    """Two calls back to back on a stream whose queued work has not run yet (it sleeps about 0.25 s first):
    each call's places hold its own images. A decoder whose engines write into memory the first call's queued
    copies still read (torchvision's outputs, from the caching allocator) would put the second call's pixels
    in the first call's places."""
    from gpufeed.decode.cpu import CpuDecoder
    from tests.corpus import jpeg

    datas = [[jpeg(w=320, h=240, seed=10 * k + i) for i in range(8)] for k in range(2)]
    refs = [[CpuDecoder().decode(d, "x", fast=True) for d in ds] for ds in datas]
    outs = [[torch.full(r.shape, 7, dtype=torch.uint8, device="cuda") for r in rs] for rs in refs]
    dec = _engine_decoder(decode)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)  # cycles: about 0.25 s at the H200's clock
    oks = [dec.decode(DecodeJob.of([np.frombuffer(d, np.uint8) for d in datas[k]], outs[k]), stream) for k in range(2)]
    stream.synchronize()
    assert all(ok.all() for ok in oks), oks
    for k in range(2):
        assert min(psnr(o.cpu().numpy(), r) for o, r in zip(outs[k], refs[k])) >= 40.0, k


def test_gpu_path_workers_stay_off_the_kept_cores(synth):
    from gpufeed import cores, placement

    loader = ImageLoader(synth, device="cuda", decode="gpu", batch_size=32, num_workers=2)
    want = placement.worker_cpus(gpu_path=True)
    assert loader.worker_cpus == want and loader.stats["worker_cpus"] == (sorted(want) if want else None)
    next(iter(loader))
    deadline = time.monotonic() + 30  # a worker that took no chunk yet may still be starting
    mask = want or cores.affinity()
    while (got := [os.sched_getaffinity(pid) for pid in loader.worker_pids]) != [mask, mask]:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    loader.close()


@pytest.mark.parametrize("on_error", ["raise", "skip"])  # "skip": the GPU stage records skips for the loader
def test_a_dropped_gpu_loader_is_freed_without_a_garbage_collection(synth, on_error):
    """A loader dropped after a ``break`` goes at once, its GPU stage (decoders, decode buffers, threads)
    and workers with it, not at some later collection (which would stall another loader's epoch)."""
    import gc
    import weakref

    gc.disable()
    try:
        loader = ImageLoader(synth, device="cuda", decode="gpu", batch_size=16, num_workers=2, on_error=on_error)
        for i, _ in enumerate(loader):
            if i == 1:
                break
        stage, pids = weakref.ref(loader._gpu_stage), loader.worker_pids
        ref = weakref.ref(loader)
        del loader, _
        assert ref() is None and stage() is None
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                  for pid in pids):
            assert time.monotonic() < deadline, pids
            time.sleep(0.05)
    finally:
        gc.enable()


def test_batched_copy_queues_every_copy_on_the_stream():
    """The CPU-decoded rows' copies as one driver call: each source (taken out of order) lands whole at its
    offset, and nothing else is written."""
    from gpufeed.batched_copy import BatchedCopy

    copier = BatchedCopy()
    if not copier.available:
        pytest.skip("the driver has no cuMemcpyBatchAsync (CUDA 12.8 or later): rows are copied one by one")
    rng = np.random.default_rng(0)
    host = torch.from_numpy(rng.integers(1, 256, (64, 5000), dtype=np.uint8)).pin_memory()
    sizes = rng.integers(1, 5000, 64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = rng.permutation(64)
    dev = torch.zeros(int(sizes.sum()) + 100, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert copier.copy(dev.data_ptr() + offsets.astype(np.uint64),
                           host.data_ptr() + order.astype(np.uint64) * np.uint64(5000), sizes, stream)
    stream.synchronize()
    got = dev.cpu()
    for k in range(64):
        assert torch.equal(got[offsets[k] : offsets[k] + sizes[k]], host[order[k], : sizes[k]]), k
    assert int(got[int(sizes.sum()):].sum()) == 0


def test_mixup_and_cutmix_on_cuda_keep_channels_last_and_give_torchvisions_batches(synth):
    """MixUp/CutMix in the loader's thread on CUDA: each batch is torchvision's mix (for the loader's draw) of
    the batch the same loader gives without it, in place, channels_last kept."""
    from torchvision.transforms import v2

    from gpufeed.augment.params import SampleRandom
    from tests.test_loader import _torchvision_with

    mixing = v2.RandomChoice([v2.MixUp(num_classes=4), v2.CutMix(num_classes=4)])
    kw = dict(batch_size=32, num_workers=2, seed=7, decode="gpu", cpu_share=0.0, channels_last=True)
    plain, mixed = _gpu_loader(synth, **kw), _gpu_loader(synth, batch_transform=mixing, **kw)
    kinds, compared = set(), 0
    for (x, y), (xm, ym) in zip(plain, mixed, strict=True):
        mix = mixed.batch_mix
        drawn = mix.draw(SampleRandom(7 ^ mix.salt, 0, plain.batch_indices[0]), x.shape[-2], x.shape[-1])
        expected_x, expected_y = _torchvision_with(mixing, drawn)(x, y)
        assert xm.is_cuda and xm.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xm, expected_x) and torch.equal(ym, expected_y) and ym.shape == (32, 4)
        kinds.add(drawn.kind)
        compared += 1
    assert compared == 3 and kinds  # 96 images in batches of 32
    plain.close(), mixed.close()
