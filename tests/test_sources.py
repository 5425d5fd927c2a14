import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from gpufeed.sources import create_source, filelist_source, folder_source


def test_folder_matches_torchvision_imagefolder(synth_root):
    src = folder_source(synth_root)
    ref = ImageFolder(str(synth_root))
    assert len(src) == len(ref) == 40
    assert [src.path(i) for i in range(len(src))] == [p for p, _ in ref.samples]
    assert [src.label(i) for i in range(len(src))] == [t for _, t in ref.samples]
    assert list(src.classes) == ref.classes


def test_folder_ignores_other_extensions_like_imagefolder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "x.PNG")
    Image.new("RGB", (8, 8)).save(tmp_path / "b" / "y.jpeg")
    (tmp_path / "b" / "notes.txt").write_text("not an image")
    src = folder_source(tmp_path)
    assert len(src) == 2
    assert [src.label(0), src.label(1)] == [0, 1]


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "no class sub-folders"),
    (lambda p: (p / "cls").mkdir(parents=True), "holds no image"),
])
def test_folder_errors_name_the_folder(tmp_path, setup, message):
    root = tmp_path / "data"
    setup(root)
    with pytest.raises((FileNotFoundError, ValueError), match=message) as info:
        folder_source(root)
    assert "data" in str(info.value)


def test_filelist_reads_paths_and_labels(tmp_path, synth_root):
    src = folder_source(synth_root)
    lines = ["path,label"] + [f"{src.path(i)},{src.label(i) + 10}" for i in range(5)]
    (tmp_path / "list.csv").write_text("\n".join(lines))
    fl = filelist_source(tmp_path / "list.csv")
    assert len(fl) == 5 and fl.label(0) == src.label(0) + 10
    assert fl.read(2) == src.read(2)


def test_filelist_relative_paths_and_spaces(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "img.jpg")
    (tmp_path / "list.txt").write_text("# a comment\nimg.jpg 3\n")
    fl = filelist_source(tmp_path / "list.txt")
    assert fl.path(0) == str(tmp_path / "img.jpg") and fl.label(0) == 3


def test_filelist_missing_file_named(tmp_path):
    (tmp_path / "list.csv").write_text("gone.jpg,0\n")
    with pytest.raises(FileNotFoundError, match="gone.jpg"):
        filelist_source(tmp_path / "list.csv")


def test_filelist_bad_label_named(tmp_path):
    (tmp_path / "list.csv").write_text("a.jpg,cat\n")
    with pytest.raises(ValueError, match=r"list.csv:1: label must be an integer, got 'cat'"):
        filelist_source(tmp_path / "list.csv")


def test_create_source_dispatch(tmp_path, synth_root):
    assert len(create_source(synth_root)) == 40
    with pytest.raises(TypeError, match="int"):
        create_source(3)


def test_read_file_returns_whole_files_and_names_a_missing_one(tmp_path):
    from gpufeed.sources.base import read_file

    big = bytes(range(256)) * 9000  # 2.3 MB
    for name, data in (("empty", b""), ("small", b"\xff\xd8x"), ("big", big)):
        (tmp_path / name).write_bytes(data)
        assert read_file(str(tmp_path / name)) == data
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        read_file(str(tmp_path / "missing.jpg"))
    with open("/proc/version", "rb") as f:  # stat gives 0 bytes: read until the end all the same
        assert read_file("/proc/version") == f.read() != b""


@pytest.mark.parametrize("content, message", [
    (None, r"is a JPEG image, not a data set: give a folder of class folders"),
    (b"img.jpg,1\n\xff\xfe,2\n", r"is not a text file list \(byte 10 is not UTF-8\): give a folder of class folders"),
])
def test_a_file_that_is_no_list_is_named_with_what_is_taken(tmp_path, content, message):
    """An image's path, or a binary, given where a data set goes: a ValueError naming it, not a decode error."""
    path = tmp_path / "given.jpg"
    if content is None:
        Image.new("RGB", (8, 8), (200, 10, 10)).save(path)
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as e:
        create_source(str(path))
    assert str(path) in str(e.value)


def test_a_data_sets_parent_folder_is_said_to_hold_splits_not_classes(tmp_path, caplog):
    for split in ("train", "val"):
        (tmp_path / split / "cat").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / split / "cat" / "0.jpg")
    with caplog.at_level("WARNING", logger="gpufeed"):
        assert folder_source(tmp_path).classes == ["train", "val"]  # still ImageFolder's reading
    assert f"give the split's folder, e.g. {str(tmp_path / 'train')!r}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpufeed"):
        folder_source(tmp_path / "train")
    assert "splits" not in caplog.text
