import io
import tarfile

import pytest
import torch

from gpufeed import ImageLoader
from gpufeed.sources import create_source, folder_source, tar_source


def _shards(root, out, per_shard=15, webdataset=False):
    """Pack an ImageFolder tree into tar shards (ImageFolder layout inside, or WebDataset .jpg + .cls)."""
    src = folder_source(root)
    out.mkdir()
    for s in range(0, len(src), per_shard):
        with tarfile.open(out / f"shard-{s // per_shard:03d}.tar", "w") as tf:
            for i in range(s, min(s + per_shard, len(src))):
                data = src.read(i)
                cls = src.classes[src.label(i)]
                name = f"{i:06d}.jpg" if webdataset else f"{cls}/{i:06d}.jpg"
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                if webdataset:
                    label = str(src.label(i)).encode()
                    info = tarfile.TarInfo(f"{i:06d}.cls")
                    info.size = len(label)
                    tf.addfile(info, io.BytesIO(label))
    return src


@pytest.mark.parametrize("webdataset", [False, True])
def test_tar_shards_read_the_same_samples(tmp_path, synth_root, webdataset):
    src = _shards(synth_root, tmp_path / "shards", webdataset=webdataset)
    tar = create_source(tmp_path / "shards")
    assert len(tar) == len(src) == 40
    for i in (0, 17, 39):
        assert tar.read(i) == src.read(i) and tar.label(i) == src.label(i)
        assert ".tar:" in tar.path(i)


def test_loader_over_tar_equals_loader_over_folder(tmp_path, synth_root):
    _shards(synth_root, tmp_path / "shards")
    kw = dict(batch_size=8, image_size=32, num_workers=2, device="cpu", seed=4)
    with ImageLoader(synth_root, **kw) as a, ImageLoader(tmp_path / "shards", **kw) as b:
        compared = 0
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert torch.equal(ya, yb) and torch.equal(xa, xb)
            compared += 1
        assert compared == len(a) == 5


def test_tar_errors_name_the_shard(tmp_path):
    (tmp_path / "bad.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ValueError, match="bad.tar"):
        tar_source(tmp_path / "bad.tar")
    with tarfile.open(tmp_path / "nolabel.tar", "w") as tf:
        info = tarfile.TarInfo("x.jpg")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(ValueError, match="nolabel.tar:x.jpg: no 'x.cls' member"):
        tar_source(tmp_path / "nolabel.tar")


def test_links_devices_and_fifos_named_like_images_are_left_out_and_said(tmp_path):
    """Only a tar's regular files are read: a symlink, hard link, device or FIFO member named like an image is
    left out, the warning says how many and names the first, and the loader's stats count and list each as
    left out, apart from the samples skipped under on_error="skip" (there are none)."""
    from tests.corpus import tar_with_links

    path = tmp_path / "shard.tar"
    tar_with_links(path)
    with pytest.warns(UserWarning, match=r"4 members of .*shard\.tar' with image names are left out: .* only its "
                                         r"regular files \(first: '.*shard\.tar:sym\.jpg'\); loader.stats\['left_out'\]"):
        src = tar_source(path)
    assert len(src) == 1 and src.label(0) == 3
    from gpufeed import ImageLoader

    with pytest.warns(UserWarning, match="4 members"):
        loader = ImageLoader(path, batch_size=1, image_size=16, device="cpu", num_workers=1, train=False)
    with loader:
        assert [y.tolist() for _, y in loader] == [[3]]
        stats = loader.stats
    assert stats["left_out_count"] == 4 and stats["skipped_count"] == 0 and stats["skipped"] == []
    assert [p.rsplit(":", 1)[1] for p, _ in stats["left_out"]] == ["sym.jpg", "hard.jpg", "dev.jpg", "fifo.jpg"]
    assert all("links, devices and FIFOs are never read" in why for _, why in stats["left_out"])


def test_class_folders_are_numbered_in_sorted_order_whatever_order_the_tar_holds_them(tmp_path, synth_root):
    """ImageFolder numbers classes by their sorted names: a shard written with its class folders in reverse
    order (and a second shard in another) labels each member as the folder source labels the same file."""
    src = folder_source(synth_root)
    (tmp_path / "shards").mkdir()
    order = sorted(range(len(src)), key=lambda i: (-src.label(i), i))  # the last class first
    for s, part in enumerate((order[:25], order[25:][::-1])):
        with tarfile.open(tmp_path / "shards" / f"shard-{s:03d}.tar", "w") as tf:
            for i in part:
                data = src.read(i)
                info = tarfile.TarInfo(f"{src.classes[src.label(i)]}/{i:06d}.jpg")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    tar = tar_source(tmp_path / "shards")
    assert tar.classes == src.classes == sorted(src.classes)
    by_bytes = {src.read(i): src.label(i) for i in range(len(src))}
    assert len(tar) == len(by_bytes) == 40
    assert [tar.label(i) for i in range(len(tar))] == [by_bytes[tar.read(i)] for i in range(len(tar))]
    assert len({tar.label(i) for i in range(len(tar))}) == 4
