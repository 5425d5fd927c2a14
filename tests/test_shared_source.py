import pickle

from gpufeed.sources import FileSource
from gpufeed.sources.shared import SharedFileSource


def test_shared_file_source_matches_and_pickles_small(tmp_path):
    paths = [str(tmp_path / f"dir é/{i:06d}.jpg") for i in range(5000)] + [str(tmp_path / "odd\udcff.jpg")]
    labels = [i % 1000 for i in range(len(paths))]
    (tmp_path / "dir é").mkdir()
    (tmp_path / "dir é" / "000003.jpg").write_bytes(b"abc")
    src = FileSource(paths, labels)
    shared, block = SharedFileSource.create(src)
    try:
        blob = pickle.dumps(shared)
        assert len(blob) < 200  # the name of the block, not the paths
        copy = pickle.loads(blob)
        assert len(copy) == len(src)
        assert all(copy.path(i) == src.path(i) and copy.label(i) == src.label(i) for i in range(len(src)))
        assert copy.read(3) == b"abc"
    finally:
        block.unlink()
