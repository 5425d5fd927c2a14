"""Validation on CUDA: augment.center_crop's kernels against their CPU reference, a whole train=False epoch
with its labels, a bad file mid-batch under on_error="skip", and a training loader beside a validation
loader in one process. Marked gpu."""

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from gpufeed import ImageLoader
from gpufeed.augment.center_crop import center_crop_reference, center_crop_triton, max_taps
from gpufeed.augment.params import AugmentSpec
from tests.helpers import denormalised_uint8, psnr, textured, tinted_classes

pytestmark = pytest.mark.gpu
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZES = [(500, 375), (375, 500), (333, 500), (640, 427), (256, 256), (1000, 683), (150, 100), (257, 300),
         (300, 1000), (800, 90), (50, 60), (224, 224)]


def _uint8(x):
    return denormalised_uint8(x, MEAN, STD)


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    """Three classes, each a colour over texture (the mean colour names the class), in varied sizes."""
    colours = [(220, 40, 40), (40, 220, 40), (40, 40, 220)]
    return tinted_classes(tmp_path_factory.mktemp("val"), colours, SIZES, 100, 92)


def _torchvision(paths):
    t = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    return torch.stack([t(Image.open(p).convert("RGB")) for p in paths])


def test_the_cuda_kernels_give_the_cpu_references_integers():
    spec = AugmentSpec(train=False)
    images = [np.asarray(textured(w, h, i)) for i, (w, h) in enumerate(SIZES)]
    flat = torch.cat([torch.from_numpy(im.copy()).reshape(-1) for im in images])
    offsets = np.cumsum([0] + [im.size for im in images[:-1]])
    rows = [[o, im.shape[0], im.shape[1], *(lambda g: (g.left, g.top, g.width, g.height))(
        spec.resize_crop(im.shape[1], im.shape[0])), 0] for o, im in zip(offsets, images)]
    table = torch.tensor(rows, dtype=torch.int64)
    for dtype, scale, shift in ((torch.uint8, [1.0] * 3, [0.0] * 3),
                                (torch.float32, [1 / (255 * s) for s in STD], [-m / s for m, s in zip(MEAN, STD)])):
        out = torch.empty((len(images), 3, 224, 224), dtype=dtype, device="cuda")
        center_crop_triton(flat.cuda(), table.cuda(), 224, scale, shift, out, taps_at_most=max_taps(table.numpy()))
        ref = center_crop_reference(flat, table, 224, scale, shift, torch.empty(out.shape, dtype=dtype))
        if dtype == torch.uint8:
            assert torch.equal(out.cpu(), ref)
        else:
            torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("decode", ["auto", "nvimgcodec"])
def test_a_validation_epoch_on_cuda_keeps_labels_with_their_images(classes, decode):
    paths = sorted(classes.glob("c*/*.jpg"))
    ref = _torchvision(paths)
    with ImageLoader(classes, train=False, batch_size=10, device="cuda", decode=decode, num_workers=3,
                     cpu_share=0.3) as loader:
        assert loader.decode_backend != "cpu", loader.decode_reason
        got, labels, indices = [], [], []
        for images, y in loader:
            assert images.is_cuda and images.dtype == torch.float32 and y.is_cuda
            got.append(images)
            labels.append(y)
            indices += loader.batch_indices
        by = loader.stats["decoded_by"]
    images, labels = torch.cat(got), torch.cat(labels).cpu()
    assert indices == list(range(len(paths))) and len(images) == len(paths) == 36  # every image, in order, once
    assert labels.tolist() == [i // len(SIZES) for i in range(36)]
    assert by.get("cpu", 0) > 0 and sum(by.values()) == 36, by
    a, b = _uint8(images), _uint8(ref)
    scores = [psnr(a[i], b[i]) for i in range(36)]
    print(f"validation on cuda ({decode}): min {min(scores):.2f} median {np.median(scores):.2f} dB")
    assert min(scores) >= 40 and np.median(scores) >= 50, sorted(scores)[:4]


def test_a_bad_file_mid_batch_leaves_its_validation_batch_under_skip(classes, tmp_path):
    root = tmp_path / "data"
    for p in sorted(classes.glob("c*/*.jpg")):
        (root / p.parent.name).mkdir(parents=True, exist_ok=True)
        (root / p.parent.name / p.name).write_bytes(p.read_bytes())
    bad = root / "c1" / "05.jpg"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 3])  # truncated: no decoder may take it
    paths = sorted(root.glob("c*/*.jpg"))
    with ImageLoader(root, train=False, batch_size=8, device="cuda", num_workers=2, on_error="skip") as loader:
        batches = [(x, y.cpu(), list(loader.batch_indices)) for x, y in loader]
        stats = loader.stats
    sizes = [len(y) for _, y, _ in batches]
    assert sizes == [8, 8, 7, 8, 4] and stats["skipped_count"] == 1, sizes  # c1/05.jpg is sample 17
    assert stats["skipped"][0][0].endswith("c1/05.jpg") and stats["repeated"] == 0
    indices = [i for _, _, idx in batches for i in idx]
    assert indices == [i for i in range(36) if paths[i] != bad]
    ref = _torchvision([paths[i] for i in indices])
    images = torch.cat([x for x, _, _ in batches])
    labels = torch.cat([y for _, y, _ in batches])
    assert labels.tolist() == [i // len(SIZES) for i in indices]
    a, b = _uint8(images), _uint8(ref)
    assert min(psnr(a[i], b[i]) for i in range(35)) >= 40


def test_a_training_and_a_validation_loader_in_one_process(classes):
    train = ImageLoader(classes, batch_size=12, device="cuda", num_workers=2, seed=3)
    val = ImageLoader(classes, train=False, batch_size=12, device="cuda", num_workers=2)
    try:
        for epoch in range(2):
            seen = 0
            for x, y in train:
                assert x.shape == (12, 3, 224, 224) and y.is_cuda
                seen += len(y)
            assert seen == 36
            labels = torch.cat([y for _, y in val]).cpu()
            assert labels.tolist() == [i // len(SIZES) for i in range(36)]
        assert train.decode_backend != "cpu" and val.decode_backend != "cpu"
    finally:
        train.close(), val.close()


def test_a_validation_batch_of_bad_files_is_not_yielded_on_cuda(classes, tmp_path):
    """on_error="skip" on the GPU path: a batch none of whose files decode (truncated, and not JPEGs at all)
    never reaches the loop; the others come whole, their files counted once each."""
    root = tmp_path / "data"
    for p in sorted(classes.glob("c*/*.jpg")):
        (root / p.parent.name).mkdir(parents=True, exist_ok=True)
        (root / p.parent.name / p.name).write_bytes(p.read_bytes())
    paths = sorted(root.glob("c*/*.jpg"))
    bad = paths[8:16]  # the second batch of eight
    for k, p in enumerate(bad):
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 3] if k % 2 else b"\xff\xd8\xff\xe0 not a jpeg")
    with ImageLoader(root, train=False, batch_size=8, device="cuda", num_workers=2, on_error="skip") as loader:
        batches = [(y.cpu(), list(loader.batch_indices)) for _, y in loader]
        stats = loader.stats
    assert [len(y) for y, _ in batches] == [8, 8, 8, 4]
    assert [i for _, idx in batches for i in idx] == list(range(8)) + list(range(16, 36))
    assert stats["skipped_count"] == 8 and sorted(p for p, _ in stats["skipped"]) == sorted(map(str, bad))
