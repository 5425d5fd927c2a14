"""Progressive resizing on CUDA: a smaller size from the same workers, ring and GPU output batches gives
exactly what a loader made at that size gives."""

import pytest
import torch

from gpufeed import ImageLoader
from gpufeed.synth import create_synthetic_dataset

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return create_synthetic_dataset(tmp_path_factory.mktemp("p"), n=96, num_classes=4, seed=2, workers=4)


@pytest.mark.parametrize("decode, extra", [("gpu", {"cpu_share": 0.25}), ("cpu", {}),
                                           ("gpu", {"cpu_share": 0.0, "channels_last": True,
                                                    "dtype": torch.bfloat16})])
def test_set_image_size_on_cuda_equals_a_loader_made_at_that_size(synth, decode, extra):
    """Epoch 0 at 224, then epoch 1 at 160: bit for bit a fresh 160 loader's epoch 1 (a fixed CPU share,
    so both decode the same samples on the same decoder), the same worker processes, no GPU memory added."""
    kw = dict(batch_size=32, num_workers=2, seed=7, device="cuda", decode=decode, **extra)
    with ImageLoader(synth, image_size=224, **kw) as loader:
        for images, _ in loader:
            assert images.shape[-1] == 224
        pids, allocated = loader.worker_pids, torch.cuda.memory_allocated()
        loader.set_image_size(160)
        got = [(x.cpu(), y.cpu(), x.stride()) for x, y in loader]  # batches not kept on the GPU: reused
        torch.cuda.synchronize()
        assert loader.worker_pids == pids and torch.cuda.memory_allocated() <= allocated
    compared = 0
    with ImageLoader(synth, image_size=160, **kw) as fresh:
        fresh.set_epoch(1)
        for (x, y, stride), (p, q) in zip(got, fresh, strict=True):
            assert x.shape == (32, 3, 160, 160) and stride == p.stride()
            assert torch.equal(x, p.cpu()) and torch.equal(y, q.cpu())
            compared += 1
    assert compared == 3
