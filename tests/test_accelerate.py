"""HF Accelerate: ``Accelerator.prepare`` wraps torch DataLoaders only, so an ImageLoader goes through it as it
is and shards itself (from torch.distributed, which Accelerate initialises under ``accelerate launch``)."""

import pytest
import torch

from gpufeed import ImageLoader

KW = dict(batch_size=4, image_size=16, num_workers=1, device="cpu", seed=3)


def test_prepare_hands_the_loader_back_untouched_and_it_delivers_its_epoch(synth_root):
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    model, opt = torch.nn.Linear(3 * 16 * 16, 4), None
    with ImageLoader(synth_root, **KW) as loader:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, prepared = acc.prepare(model, opt, loader)
        assert prepared is loader  # not re-wrapped: no second sharding, no second sampler
        seen = []
        for images, labels in prepared:
            loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            seen += loader.batch_indices
    assert sorted(seen) == list(range(40))
