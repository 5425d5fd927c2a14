"""[Resize +] RandomCrop as the training crop: the recipe read as torchvision holds it, each sample's draw as
torchvision's RandomCrop draws, and each delivered image exactly torchvision's pixels for that draw."""

import os

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from gpufeed import ImageLoader
from gpufeed.augment.params import AugmentSpec, RandomCrop
from gpufeed.augment.recipe import read_transform
from gpufeed.workers.records import WorkerError

from .stats import assert_same_frequencies

TO_FLOAT = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]


def _crop_of(t) -> RandomCrop:
    return read_transform(t).crop


def test_the_recipe_is_read_as_each_torchvision_api_holds_it():
    """v2 keeps the padding as (left, right, top, bottom), the older API as given; both mean the same crop."""
    for make in (v2, T):
        crop = _crop_of(make.Compose([make.RandomCrop(32, padding=[1, 2, 3, 4], fill=(10, 20, 30))]))
        assert crop == RandomCrop(padding=(1, 2, 3, 4), fill=(10, 20, 30), two_steps=make is T)
        crop = _crop_of(make.Compose([make.RandomCrop(32, padding=[5, 6], padding_mode="reflect")]))
        assert crop == RandomCrop(padding=(5, 6, 5, 6), padding_mode="reflect", two_steps=make is T)
    r = read_transform(v2.Compose([v2.Resize(256), v2.RandomCrop(224, pad_if_needed=True, fill=7),
                                   v2.RandomHorizontalFlip(0.3), *TO_FLOAT]))
    assert (r.train, r.image_size, r.resize_size, r.hflip) == (True, 224, 256, 0.3)
    assert r.crop == RandomCrop(pad_if_needed=True, fill=(7, 7, 7), resize=True)
    assert read_transform(v2.Compose([v2.RandomResizedCrop(32)])).crop is None
    assert _crop_of(T.RandomCrop(32, padding=2)).two_steps and not _crop_of(v2.RandomCrop(32, padding=2)).two_steps


def test_a_subclass_of_v2s_random_crop_is_read_as_v2():
    """A class of the same name (ops of other names run in the CPU workers as they are) that v2 made."""
    mine = type("RandomCrop", (v2.RandomCrop,), {"__module__": "my_transforms"})
    assert _crop_of(mine(32, padding=[1, 2, 3, 4])) == RandomCrop(padding=(1, 2, 3, 4))


def test_the_fill_is_the_one_torchvision_looks_up_for_the_input_there():
    """v2 keeps a fill per input type: a PIL image gets its own, else "others", else 0; after ToImage, the
    tv_tensors.Image one. A fill the padding never uses is not read."""
    from torchvision import tv_tensors

    assert _crop_of(v2.RandomCrop(32, padding=2, fill={tv_tensors.Image: 127})).fill == (0, 0, 0)
    assert _crop_of(v2.RandomCrop(32, padding=2, fill={"others": 9, tv_tensors.Mask: 0})).fill == (9, 9, 9)
    assert _crop_of(v2.RandomCrop(32, padding=2, fill={Image.Image: (1, 2, 3)})).fill == (1, 2, 3)
    after = v2.Compose([v2.ToImage(), v2.RandomCrop(32, padding=2, fill={tv_tensors.Image: 127, tv_tensors.Mask: 0}),
                        v2.ToDtype(torch.float32, scale=True)])
    assert _crop_of(after).fill == (127, 127, 127)
    assert _crop_of(v2.RandomCrop(32, fill=300)).fill == _crop_of(v2.RandomCrop(32, padding=1, fill=0.5,
                                                                               padding_mode="reflect")).fill


@pytest.mark.parametrize("transform, message", [
    (v2.RandomCrop((32, 30)), "square output"),
    (v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(32)]), "geometric ops must be"),
    (v2.Compose([v2.Resize(32), v2.CenterCrop(24), v2.RandomCrop(16)]), "geometric ops must be"),
    (v2.RandomCrop(32, padding=2, fill=0.5), "fill must be 3 whole numbers"),
    (T.RandomCrop(32, padding=[1, 2, 3]), "padding takes 1, 2 or 4 numbers"),
    (v2.Compose([v2.Resize((256, 300)), v2.RandomCrop(224)]), r"^transform: Resize must take one size"),
])
def test_a_crop_gpufeed_would_not_make_as_torchvision_does_is_refused(transform, message):
    with pytest.raises(ValueError, match=message):
        read_transform(transform)


def test_a_resize_that_leaves_every_image_smaller_than_the_crop_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Resize\(100\) and RandomCrop's padding \(0, 8, 0, 8\) leave every image"):
        ImageLoader(tmp_path, transform=v2.Compose([v2.Resize(100), v2.RandomCrop(120, padding=(0, 8))]))
    # padding that makes up the shortfall on one axis: some images fit, so it is each image's to fail
    AugmentSpec(image_size=120, resize_size=100, crop=RandomCrop(padding=(10, 0, 10, 0), resize=True))


@pytest.mark.parametrize("size, padding, pad_if_needed", [((40, 30), 4, False), ((20, 18), None, True),
                                                          ((32, 32), None, False), ((50, 24), [0, 3], True)])
def test_each_samples_draw_follows_torchvisions(size, padding, pad_if_needed):
    """The crop's place (top, left, counted as each pair) and the flip over 4,000 samples, against
    torchvision's own RandomCrop.make_params on an image of the same size."""
    n, (w, h) = 4000, size
    t = v2.RandomCrop(24, padding=padding, pad_if_needed=pad_if_needed)
    spec = AugmentSpec(**read_transform(v2.Compose([t, v2.RandomHorizontalFlip(0.25)])).augment_kwargs())
    ours = [spec.random_crop(w, h, seed=1, epoch=2, index=i) for i in range(n)]
    torch.manual_seed(0)
    theirs = [t.make_params([torch.empty(3, h, w)]) for _ in range(n)]
    padding = [(p[0], p[1], p[2], p[3]) for p in (o.padding for o in ours)]
    assert set(padding) == {tuple(p["padding"]) for p in theirs} and len(set(padding)) == 1  # one padding
    compared = assert_same_frequencies([(o.top, o.left) for o in ours], [(p["top"], p["left"]) for p in theirs],
                                       "place")
    compared += assert_same_frequencies([o.flip for o in ours], [bool(b) for b in torch.rand(n) < 0.25], "flip")
    assert compared == 2 * n
    assert all((o.width, o.height) == (w, h) for o in ours)


def _pngs(root, sizes):
    """One PNG per size (width, height) under ``root``/c, noise with a gradient: lossless, so the pixels
    torchvision reads are the pixels the workers decode."""
    rng = np.random.default_rng(3)
    (root / "c").mkdir(parents=True)
    for i, (w, h) in enumerate(sizes):
        ramp = np.linspace(0, 120, w, dtype=np.uint8)[None, :, None]
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8) // 2 + ramp
        Image.fromarray(pixels).save(root / "c" / f"{i:02d}.png")
    return root


SIZES = [(24, 24), (30, 26), (40, 33), (26, 41), (57, 24), (24, 31), (33, 33), (45, 29)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("resize", [None, 30])
@pytest.mark.parametrize("padding_mode, fill", [("constant", (250, 5, 128)), ("edge", 0), ("reflect", 0),
                                                ("symmetric", 0)])
def test_each_delivered_image_is_torchvisions_for_its_draw(tmp_path, padding_mode, fill, resize, device):
    """Every sample of two epochs through the loader against torchvision's functional ops on the PIL image
    with that sample's draw: [Resize], pad, crop, flip, exactly. On CUDA too the CPU workers crop, and say so."""
    root = _pngs(tmp_path, SIZES)
    crop = [v2.RandomCrop(24, padding=[3, 1, 2, 5], fill=fill, padding_mode=padding_mode)]
    pipeline = v2.Compose(([v2.Resize(resize)] if resize else []) + crop + [v2.RandomHorizontalFlip(), *TO_FLOAT])
    loader = ImageLoader(root, transform=pipeline, batch_size=4, num_workers=2, device=device, seed=9)
    assert loader.decode_backend == "cpu"
    assert device == "cpu" or loader.decode_reason.startswith("RandomCrop: CPU workers")
    paths = sorted(os.path.join(root, "c", f) for f in os.listdir(root / "c"))
    compared, padded, flipped = 0, 0, 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for images, _ in loader:
            for image, index in zip(images, loader.batch_indices, strict=True):
                pil = Image.open(paths[index]).convert("RGB")
                at = loader.augment.random_crop(*pil.size, seed=9, epoch=epoch, index=index)
                if resize:
                    pil = F.resize(pil, [resize])
                assert pil.size == (at.width, at.height)
                left, top, right, bottom = at.padding
                pil = F.pad(pil, [left, top, right, bottom], fill=fill, padding_mode=padding_mode)
                pil = F.crop(pil, at.top, at.left, 24, 24)
                expected = F.pil_to_tensor(F.hflip(pil) if at.flip else pil)
                assert torch.equal(image.cpu().mul(255).round().to(torch.uint8), expected), (paths[index], at)
                compared += 1
                padded += not (left <= at.left <= at.left + 24 <= left + at.width
                               and top <= at.top <= at.top + 24 <= top + at.height)
                flipped += at.flip
    loader.close()
    assert compared == 2 * len(SIZES) and padded >= 3 and 3 <= flipped <= 2 * len(SIZES) - 3


def test_an_image_smaller_than_the_crop_is_that_files_failure(tmp_path):
    root = _pngs(tmp_path, [(30, 30), (30, 30), (20, 30), (30, 30)])
    kw = dict(transform=v2.Compose([v2.RandomCrop(24), *TO_FLOAT]), batch_size=4, num_workers=1, device="cpu")
    with pytest.raises(WorkerError, match=r"02\.png.*RandomCrop\(24\) is larger than the image \(20 x 30\)"):
        list(ImageLoader(root, **kw))
    loader = ImageLoader(root, on_error="skip", **kw)
    assert sum(len(labels) for _, labels in loader) == 4
    assert [os.path.basename(p) for p, _ in loader.stats["skipped"]] == ["02.png"]
    loader.close()


@pytest.mark.parametrize("padding_mode", ["reflect", "symmetric", "edge", "constant"])
def test_the_older_api_pads_what_pad_if_needed_adds_after_the_padding(tmp_path, padding_mode):
    """torchvision.transforms.RandomCrop pads its padding, then the width, then the height pad_if_needed
    lacks, each with the mode: on images smaller than the crop, exactly those pixels."""
    root = _pngs(tmp_path, [(14, 12), (16, 16), (20, 11), (13, 19)])
    pipeline = T.Compose([T.RandomCrop(24, padding=2, pad_if_needed=True, fill=40, padding_mode=padding_mode),
                          T.ToTensor()])
    loader = ImageLoader(root, transform=pipeline, batch_size=4, num_workers=1, device="cpu", seed=3)
    paths = sorted(os.path.join(root, "c", f) for f in os.listdir(root / "c"))
    (images, _), = list(loader)
    compared = 0
    for image, index in zip(images, loader.batch_indices, strict=True):
        pil = Image.open(paths[index]).convert("RGB")
        at = loader.augment.random_crop(*pil.size, seed=3, epoch=0, index=index)
        pil = F.pad(pil, [2], fill=40, padding_mode=padding_mode)
        if pil.size[0] < 24:
            pil = F.pad(pil, [24 - pil.size[0], 0], fill=40, padding_mode=padding_mode)
        if pil.size[1] < 24:
            pil = F.pad(pil, [0, 24 - pil.size[1]], fill=40, padding_mode=padding_mode)
        expected = F.pil_to_tensor(F.crop(pil, at.top, at.left, 24, 24))
        assert torch.equal(image.mul(255).round().to(torch.uint8), expected), (paths[index], at)
        compared += 1
    loader.close()
    assert compared == 4
