"""Progressive resizing: ``set_image_size`` between epochs gives, from the same workers and memory, exactly
the batches a loader made at that size gives."""

import pytest
import torch

from gpufeed import ImageLoader, placement
from gpufeed.workers.records import OutputSize


def make(root, **kw):
    kw = {"batch_size": 8, "image_size": 48, "num_workers": 2, "device": "cpu", "seed": 3, **kw}
    return ImageLoader(root, **kw)


def _epoch(loader):
    return [(x, y) for x, y in loader]


def _compare(got, want, size):
    """Batches equal to the bit, in shape, dtype and strides; how many were compared."""
    assert len(got) == len(want) > 0
    for (x, y), (p, q) in zip(got, want, strict=True):
        assert x.shape[-2:] == (size, size)
        assert torch.equal(x, p) and torch.equal(y, q) and x.stride() == p.stride() and x.dtype == p.dtype
    return len(got)


def _fresh_epoch(root, epoch, **kw):
    with make(root, **kw) as fresh:
        fresh.set_epoch(epoch)
        return _epoch(fresh)


@pytest.mark.parametrize("train", [True, False])
def test_a_new_size_gives_what_a_loader_made_at_it_gives_with_the_same_workers(synth_root, train):
    """Epoch 0 at 48, then 32, then 40, then 48 again: each epoch equals a fresh loader's at that size (the
    next epoch's first batches, started while the last one ended, are made again at the new size); the
    worker processes are the same ones throughout. Validation resizes to round(size x 256 / 224) first."""
    compared = 0
    with make(synth_root, train=train) as loader:
        compared += _compare(_epoch(loader), _fresh_epoch(synth_root, 0, train=train), 48)
        pids = loader.worker_pids
        assert len(pids) == 2
        for epoch, size in enumerate((32, 40, 48), start=1):
            loader.set_image_size(size)
            assert loader.augment.image_size == size and loader.max_image_size == 48
            assert loader.augment.resize_size == round(size * 256 / 224)
            got = _epoch(loader)  # the loader moved on to this epoch by itself
            compared += _compare(got, _fresh_epoch(synth_root, epoch, train=train, image_size=size), size)
            assert loader.worker_pids == pids
    assert compared == 4 * 5


@pytest.mark.parametrize("channels_last", [False, True])
def test_workers_that_normalise_write_the_smaller_size_too(synth_root, channels_last):
    """A CPU device with WORKERS_NORMALISE_FROM workers: the workers' float32 output at a smaller size is
    what a loader made at that size delivers, in its layout."""
    kw = dict(num_workers=placement.WORKERS_NORMALISE_FROM, channels_last=channels_last)
    with make(synth_root, **kw) as loader:
        assert loader.spec.normalize is not None
        loader.set_image_size(24)
        got = _epoch(loader)
        pids = loader.worker_pids
        loader.set_image_size(40)
        again = _epoch(loader)
        assert loader.worker_pids == pids
    compared = _compare(got, _fresh_epoch(synth_root, 0, image_size=24, **kw), 24)
    compared += _compare(again, _fresh_epoch(synth_root, 1, image_size=40, **kw), 40)
    assert compared == 10


def test_a_size_given_mid_epoch_applies_to_the_rest_and_travels_in_the_state(synth_root):
    """The iteration under way keeps its size; an epoch broken off goes on at the new one; ``state_dict``
    carries the size, so a resume made with the largest size continues at the one in effect."""
    with make(synth_root) as loader:
        loader.set_epoch(2)
        it = iter(loader)
        first = next(it)[0]
        loader.set_image_size(32)  # the running iteration is not changed
        second = next(it)[0]
        it.close()
        assert first.shape[-1] == second.shape[-1] == 48
        state = loader.state_dict()
        assert state["image_size"] == 32 and state["resize_size"] == round(32 * 256 / 224)
        rest = _epoch(loader)
    assert len(rest) == 3
    with make(synth_root, image_size=32) as fresh:
        fresh.load_state_dict(state)
        want = _epoch(fresh)
    with make(synth_root) as resumed:
        resumed.load_state_dict(state)
        assert resumed.augment.image_size == 32
        resumed_rest = _epoch(resumed)
    assert _compare(rest, want, 32) + _compare(resumed_rest, want, 32) == 6


def test_validation_takes_a_given_resize_size(synth_root):
    with make(synth_root, train=False) as loader:
        loader.set_image_size(32, resize_size=48)
        got = _epoch(loader)
    assert _compare(got, _fresh_epoch(synth_root, 0, train=False, image_size=32, resize_size=48), 32) == 5



def test_a_given_resize_size_travels_in_the_state(synth_root):
    """Validation set to 32 with Resize(40) (not the loader's 256/224 ratio, which gives 37): a loader resumed
    from its state resizes to 40 too, and delivers what the first one delivers."""
    with make(synth_root, train=False, drop_last=False) as loader:
        loader.set_image_size(32, resize_size=40)
        state = loader.state_dict()
        want = _epoch(loader)
    with make(synth_root, train=False, drop_last=False) as resumed:
        resumed.load_state_dict(state)
        assert (resumed.augment.image_size, resumed.augment.resize_size) == (32, 40)
        assert _compare(_epoch(resumed), want, 32) == 5

def test_sizes_over_the_allocation_or_not_sizes_are_refused_naming_them(synth_root):
    with make(synth_root) as loader:
        with pytest.raises(ValueError, match="image_size=64 is over the loader's max_image_size=48"):
            loader.set_image_size(64)
        for bad in (0, 3.5, "160"):
            with pytest.raises(ValueError, match=f"image_size must be an integer >= 1, got {bad!r}"):
                loader.set_image_size(bad)
        with pytest.raises(ValueError, match="resize_size must be >= image_size \\(32\\), got 20"):
            loader.set_image_size(32, resize_size=20)
        state = loader.state_dict()
        state["image_size"], state["sampler"]["offset"] = 96, 16  # saved by a loader made larger, mid-epoch
        with pytest.raises(ValueError, match="image_size=96 is over the loader's max_image_size=48"):
            loader.load_state_dict(state)
        state["image_size"], state["sampler"]["num_samples_total"] = 32, 41  # a state of other data
        with pytest.raises(ValueError, match="num_samples_total=41"):
            loader.load_state_dict(state)
        assert loader.augment.image_size == 48 and loader.state_dict()["sampler"]["offset"] == 0  # nothing changed


def test_the_gpu_stage_makes_a_smaller_size_from_the_largest_sizes_memory(tmp_path):
    """The GPU path's logic, run on the CPU with a stand-in decoder: a pool and stage made for 48 and given
    batches at 32 (engines' share, CPU rows, pixels resized by the workers) give what a pool and stage made
    for 32 give, reusing the output batch allocated at 48."""
    import numpy as np
    from PIL import Image

    from tests.test_gpu_stage import CpuStandIn, host_batch

    from gpufeed.augment.params import AugmentSpec
    from gpufeed.stage.gpu import GpuDecodeAugment
    from gpufeed.ring import KIND_BYTES, KIND_PIXELS, KIND_ROWS, Meta
    from gpufeed.sources import folder_source
    from gpufeed.workers import PipelineSpec, WorkerPool

    rng = np.random.default_rng(0)
    (tmp_path / "c0").mkdir()
    for i in range(12):
        h, w = 60 + 7 * i, 90 - 5 * i
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / "c0" / f"{i}.jpg")
    src = folder_source(tmp_path)
    n = len(src)

    def pool_and_stage(size):
        spec = PipelineSpec(src, AugmentSpec(image_size=size), 10**8, gpu_bytes_capacity=1 << 20,
                            gpu_buffer_bytes=1 << 20)
        stage = GpuDecodeAugment([CpuStandIn()], device=torch.device("cpu"), image_size=size, mean=(0.5,) * 3,
                                 std=(0.25,) * 3, dtype=torch.float32, channels_last=True, max_pixels=10**8,
                                 buffer_bytes=1 << 20, output_batches=(n, 1))
        return WorkerPool(spec, num_workers=2, num_slots=2, batch_size=n), stage

    def run(pool, stage, batch_id, size):
        pool.submit(batch_id, batch_id % 2, 0, 1, list(range(n)), cpu_rows=n * 3 // 4, size=size)
        view, failures = pool.collect(batch_id)
        assert failures == []
        images, _ = stage(host_batch(view, src.path))
        return images, view.meta[:, Meta.KIND].copy()

    small = OutputSize(32, 37)
    pool, stage = pool_and_stage(48)
    big, _ = run(pool, stage, 0, None)
    storage = big.untyped_storage().data_ptr()
    del big  # its output batch is free for the next batch
    got, kinds = run(pool, stage, 1, small)
    assert got.untyped_storage().data_ptr() == storage  # the 48 batch's memory, no new one
    with pytest.raises(ValueError, match="image size 64 is over the 48 this ring was made for"):
        pool.submit(2, 0, 0, 1, [0], size=OutputSize(64, 73))
    pool.close()
    pool, stage = pool_and_stage(32)
    want, want_kinds = run(pool, stage, 0, small)
    pool.close()
    assert set(kinds.tolist()) == {KIND_BYTES, KIND_ROWS, KIND_PIXELS} and (kinds == want_kinds).all()
    assert got.shape == (n, 3, 32, 32) and got.stride() == want.stride() and torch.equal(got, want)


def test_a_cpu_devices_batch_arrays_of_a_larger_size_serve_a_smaller_one():
    """The main process's float32 batches (a CPU device) are reused at a smaller size: the head of the
    larger batch's array, laid out as a new array of that shape, values as a fresh normalisation gives."""
    from gpufeed import Normalize

    big = torch.randint(0, 255, (1, 1001, 1001, 3), dtype=torch.uint8)
    small = big[:, :1000, :1000].contiguous()
    n = Normalize(channels_last=True)
    first = n.images(big)
    ptr = first.data_ptr()
    del first  # nothing refers to its array now
    again = n.images(small)
    assert again.data_ptr() == ptr and again.shape == (1, 3, 1000, 1000)
    assert again.is_contiguous(memory_format=torch.channels_last)
    want = (small.permute(0, 3, 1, 2).float() / 255 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) \
        / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)
    held = again
    assert n.images(small).data_ptr() != held.data_ptr()  # a batch still referred to is never handed out


def test_validation_keeps_its_resize_ratio_at_every_size(synth_root):
    with make(synth_root, train=False, resize_size=54) as loader:  # 54 / 48, not 256 / 224
        loader.set_image_size(48)
        assert loader.augment.resize_size == 54
        loader.set_image_size(32)
        assert loader.augment.resize_size == 36  # round(32 * 54 / 48)
        got = _epoch(loader)
    assert _compare(got, _fresh_epoch(synth_root, 0, train=False, image_size=32, resize_size=36), 32) == 5


def test_a_size_a_blur_cannot_take_is_refused_naming_both(synth_root):
    from torchvision.transforms import v2

    recipe = v2.Compose([v2.RandomResizedCrop(48), v2.GaussianBlur(9), v2.ToImage(),
                         v2.ToDtype(torch.float32, scale=True)])
    with ImageLoader(synth_root, transform=recipe, batch_size=8, num_workers=1, device="cpu") as loader:
        with pytest.raises(ValueError, match=r"GaussianBlur\(kernel_size=\(9, 9\)\) .* under the image size 4"):
            loader.set_image_size(4)
        assert loader.augment.image_size == 48  # unchanged
        loader.set_image_size(5)
        images, _ = next(iter(loader))
    assert images.shape == (8, 3, 5, 5)
