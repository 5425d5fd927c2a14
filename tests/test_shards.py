"""`gpufeed shards`: every decodable input delivered once with its label through ImageLoader on the output,
every broken one named; the same bytes on every run; a killed conversion resumed to the same shards."""

from __future__ import annotations

import collections
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gpufeed
from gpufeed import ImageLoader
from gpufeed.cli import main
from gpufeed.decode.exif import read_orientation
from gpufeed.shards import BrokenInput, ShardOptions, ShardSize, write_shards
from gpufeed.shards.prepare import target_size
from gpufeed.sources import create_source

from .corpus import DECODABLE, UNDECODABLE

pytestmark = pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # the corpus's malformed EXIF, read by Pillow
MAX_SIDE = 100
LOADER = dict(batch_size=5, image_size=16, device="cpu", num_workers=2, train=False, drop_last=False)


def smooth(width: int, height: int, seed: int) -> Image.Image:
    """Photograph-like smooth content (a random field upsampled), so a resize is a fair comparison."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)


def encode(img: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 92} if fmt == "JPEG" else {}) | kw)
    return buf.getvalue()


def _odd_folder(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """An ImageFolder of large images (to be resized; every one of a distinct resized shape), the test
    corpus's odd but decodable files (small: copied), its undecodable ones and a dangling link, and two
    plain small JPEGs. Returns {path: (bytes or None when unreadable, label)}."""
    exif = Image.Exif()
    exif[0x0112] = 6
    big = {f"wide_{k}.jpg": encode(smooth(200, 60 + 17 * k, k)) for k in range(6)}
    big |= {"tall.jpg": encode(smooth(90, 210, 10)), "rotated.jpg": encode(smooth(240, 124, 11), exif=exif.tobytes()),
            "progressive.jpg": encode(smooth(220, 172, 12), progressive=True),
            "cmyk.jpg": encode(smooth(160, 132, 13).convert("CMYK")), "large_png.jpg": encode(smooth(181, 104, 14), "PNG")}
    shapes = [target_size(*Image.open(io.BytesIO(d)).size, MAX_SIDE) for d in big.values()]
    assert None not in shapes and len(set(shapes)) == len(shapes)
    groups = {"a_big": big, "b_odd": {f"{k}.jpg": make() for k, make in DECODABLE.items()},
              "c_broken": {f"{k}.jpg": make() for k, make in UNDECODABLE.items()}
              | {"fine_1.jpg": encode(smooth(40, 30, 20)), "fine_2.jpg": encode(smooth(30, 44, 21))}}
    inputs = {}
    for label, (name, files) in enumerate(sorted(groups.items())):
        (root / name).mkdir(parents=True)
        for fname, data in files.items():
            (root / name / fname).write_bytes(data)
            inputs[str(root / name / fname)] = (data, label)
    os.symlink(root / "nowhere.jpg", root / "c_broken" / "dangling.jpg")
    inputs[str(root / "c_broken" / "dangling.jpg")] = (None, 2)
    return inputs


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    return root, _odd_folder(root)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255**2 / max(mse, 1e-10))


def _match(out_data: bytes, inputs: dict, by_bytes: dict) -> str:
    """The input a stored sample came from: the one with the same bytes (copied), else the one whose resized
    shape it has, checked against a Lanczos resize of that input."""
    if out_data in by_bytes:
        return by_bytes[out_data]
    with Image.open(io.BytesIO(out_data)) as im:
        assert im.format == "JPEG"
        size, pixels = im.size, np.asarray(im.convert("RGB"))
    (path,) = [p for p, (d, _) in inputs.items() if d is not None and
               target_size(*Image.open(io.BytesIO(d)).size, MAX_SIDE) == size]
    with Image.open(io.BytesIO(inputs[path][0])) as im:
        reference = np.asarray(im.convert("RGB").resize(size, Image.Resampling.LANCZOS))
    assert _psnr(pixels, reference) > 30, path
    return path


def _check_delivered(dest: Path, inputs: dict) -> dict:
    """Every decodable input once, with its label, through ImageLoader on ``dest``; every other one named
    in the manifest. Returns the manifest."""
    manifest = json.loads((dest / "manifest.json").read_text())
    broken = {b["path"] for b in manifest["broken"]}
    assert broken == {str(p) for p in inputs if Path(p).parent.name == "c_broken" and "fine" not in p}
    assert all(b["reason"] and b["shard"].startswith("shard-") for b in manifest["broken"])
    decodable = {p: v for p, v in inputs.items() if p not in broken}
    by_bytes = {d: p for p, (d, _) in decodable.items()}
    out = create_source(dest)
    came_from = [_match(out.read(i), decodable, by_bytes) for i in range(len(out))]
    assert sorted(came_from) == sorted(decodable)  # each decodable input exactly once
    assert [out.label(i) for i in range(len(out))] == [decodable[p][1] for p in came_from]
    with ImageLoader(dest, on_error="raise", **LOADER) as loader:
        seen = []
        for _, labels in loader:
            assert labels.tolist() == [decodable[came_from[i]][1] for i in loader.batch_indices]
            seen += loader.batch_indices
    assert sorted(seen) == list(range(len(decodable)))
    assert manifest["samples"] == len(decodable) and manifest["inputs"] == len(inputs)
    assert manifest["resized"] == sum(1 for p in decodable if Path(p).parent.name == "a_big")
    per_label = collections.Counter(str(label) for _, label in decodable.values())
    assert manifest["labels"] == dict(sorted(per_label.items(), key=lambda kv: int(kv[0])))
    return manifest


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_every_decodable_input_once_with_its_label_and_every_broken_one_named(odd, tmp_path, fmt, capsys):
    pytest.importorskip("pyarrow") if fmt == "parquet" else None
    root, inputs = odd
    assert main(["shards", str(root), str(tmp_path / "out"), "--format", fmt, "--max-side", str(MAX_SIDE),
                 "--shard-size", "7", "--workers", "2"]) == 0
    assert f"{len(UNDECODABLE) + 1} input(s) left out (listed in manifest.json)" in capsys.readouterr().out
    manifest = _check_delivered(tmp_path / "out", inputs)
    assert manifest["classes"] == ["a_big", "b_odd", "c_broken"]
    assert manifest["options"] == {"format": fmt, "max_side": MAX_SIDE, "quality": 90, "resample": "lanczos",
                                   "shard_size": "7", "shuffle": 0, "on_error": "skip",
                                   "max_bytes": 256 << 20}
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted([s["name"] for s in manifest["shards"]] + ["manifest.json"])  # no leftovers


def test_a_resized_image_keeps_its_exif_orientation(odd, tmp_path):
    root, _ = odd
    write_shards(root, tmp_path / "out", ShardOptions(max_side=MAX_SIDE, shard_size=ShardSize(1000), workers=1))
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tf:
        images = [tf.extractfile(m).read() for m in tf if m.name.endswith(".jpg")]
    turned = [Image.open(io.BytesIO(d)).size for d in images if d[:3] == b"\xff\xd8\xff" and read_orientation(d) == 6]
    assert sorted(turned) == sorted([target_size(240, 124, MAX_SIDE), (80, 40)])  # resized, and the corpus's copied


def test_tar_headers_are_fixed_and_reruns_give_the_same_bytes(odd, tmp_path):
    root, _ = odd
    opts = dict(max_side=MAX_SIDE, shard_size=ShardSize.parse("20KB"))
    write_shards(root, tmp_path / "a", ShardOptions(**opts, workers=2))
    write_shards(root, tmp_path / "b", ShardOptions(**opts, workers=1))
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    with tarfile.open(tmp_path / "a" / "shard-000000.tar") as tf:
        members = tf.getmembers()
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    keys = [m.name.split(".")[0] for m in members]
    assert keys[::2] == keys[1::2] and [m.name.split(".")[1] for m in members][1::2] == ["cls"] * (len(keys) // 2)
    before = {n: (tmp_path / "a" / n).stat().st_mtime_ns for n in files}
    write_shards(root, tmp_path / "a", ShardOptions(**opts, workers=2))  # finished: nothing written again
    assert {n: (tmp_path / "a" / n).stat().st_mtime_ns for n in files} == before


def test_parquet_reruns_give_the_same_bytes_and_row_groups_the_manifest_lists(synth_root, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    opts = ShardOptions(format="parquet", max_side=48, shard_size=ShardSize(1500), workers=2)
    from gpufeed.shards import writers

    writers.ROWS_PER_GROUP, saved = 16, writers.ROWS_PER_GROUP  # several row groups from 40 images
    try:
        m = write_shards(synth_root, tmp_path / "a", opts)
        write_shards(synth_root, tmp_path / "b", opts)
    finally:
        writers.ROWS_PER_GROUP = saved
    (shard,) = m["shards"]
    assert shard["row_groups"] == [16, 16, 8]
    f = pq.ParquetFile(tmp_path / "a" / shard["name"])
    assert [f.metadata.row_group(r).num_rows for r in range(3)] == [16, 16, 8]
    assert f.schema_arrow.field("image").type.names == ["bytes", "path"]
    assert json.loads(f.schema_arrow.metadata[b"huggingface"])["info"]["features"]["image"] == {"_type": "Image"}
    paths = f.read(columns=["image"]).column("image").combine_chunks().field("path").to_pylist()
    assert sorted(paths) == sorted(os.path.relpath(p, synth_root) for p in create_source(synth_root).paths)
    for name in ("manifest.json", shard["name"]):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with ImageLoader(tmp_path / "a", **LOADER) as loader:  # row groups from the manifest, no footer read
        assert loader.source.groups == (16, 16, 8) and loader.stats["shards"]["max_side"] == 48
        assert sum(len(y) for _, y in loader) == 40


def test_shuffle_seed_orders_the_samples_and_none_keeps_the_source_order(synth_root, tmp_path):
    src = create_source(synth_root)
    orders = {}
    for seed in (None, 0, 1):
        write_shards(synth_root, tmp_path / str(seed), ShardOptions(shard_size=ShardSize(16), shuffle=seed, workers=1))
        out = create_source(tmp_path / str(seed))
        orders[seed] = [src.paths.index(next(p for p in src.paths if Path(p).read_bytes() == out.read(i)))
                        for i in range(len(out))]
    assert orders[None] == list(range(40))  # copied byte for byte, in the folder's order
    assert sorted(orders[0]) == list(range(40)) and orders[0] != orders[None] and orders[0] != orders[1]
    assert orders[0] == np.random.default_rng(0).permutation(40).tolist()


def test_shard_size_in_bytes_gives_shards_of_about_that_size(tmp_path):
    root = tmp_path / "src"
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(60):
            (root / f"c{c}" / f"{i}.jpg").write_bytes(encode(smooth(64 + i % 7, 48, 100 * c + i)))
    m = write_shards(root, tmp_path / "out", ShardOptions(shard_size=ShardSize.parse("40kB"), workers=2))
    sizes = [s["size"] for s in m["shards"]]
    assert len(sizes) >= 4 and all(0.7 * 40_000 < s < 1.3 * 40_000 for s in sizes[:-1]), sizes


def test_on_error_raise_names_the_first_broken_input(odd, tmp_path, capsys):
    root, _ = odd
    with pytest.raises(BrokenInput, match="c_broken"):
        write_shards(root, tmp_path / "lib", ShardOptions(on_error="raise", shuffle=None, workers=1))
    assert main(["shards", str(root), str(tmp_path / "cli"), "--on-error", "raise", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "gpufeed shards: error: cannot convert" in err and "c_broken" in err
    assert not (tmp_path / "cli" / "manifest.json").exists()


def test_a_destination_of_other_files_or_another_conversion_is_refused(synth_root, tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["shards", str(synth_root), str(tmp_path / "busy"), "--workers", "1"]) == 2
    assert "is not empty (it holds 'notes.txt')" in capsys.readouterr().err
    (tmp_path / "folders" / "cat").mkdir(parents=True)  # an ImageFolder's class, say
    assert main(["shards", str(synth_root), str(tmp_path / "folders"), "--workers", "1"]) == 2
    assert "is not empty (it holds 'cat/')" in capsys.readouterr().err
    assert main(["shards", str(synth_root), str(tmp_path / "out"), "--workers", "1"]) == 0
    assert main(["shards", str(synth_root), str(tmp_path / "out"), "--workers", "2"]) == 0  # the same: done
    assert main(["shards", str(synth_root), str(tmp_path / "out"), "--workers", "1", "--max-side", "30"]) == 2
    assert "holds the shards of another conversion (what differs: max_side (None there, 30 here)," in \
        capsys.readouterr().err


def test_a_conversion_is_the_same_one_whatever_the_library_versions(synth_root, tmp_path, capsys):
    """Library versions are recorded, not part of what a conversion is: after an upgrade the same command
    finds its conversion done (or resumes it), and a refusal says which setting differs."""
    out = tmp_path / "out"
    assert main(["shards", str(synth_root), str(out), "--workers", "1", "--shard-size", "40"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["written_with"] = {"gpufeed": "0.0.1", "pillow": "1.0"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(["shards", str(synth_root), str(out), "--workers", "1", "--shard-size", "40"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing written again
    assert main(["shards", str(synth_root), str(out), "--workers", "1", "--shard-size", "50", "--quality", "80"]) == 2
    err = capsys.readouterr().err
    assert "quality (" in err and "80 here" in err and "shard_size ('40' there, '50' here)" in err


def test_options_are_checked_and_name_the_bad_value():
    assert ShardSize.parse("1000") == ShardSize(samples=1000)
    assert ShardSize.parse("256MB") == ShardSize(bytes=256 * 10**6)
    assert ShardSize.parse("1.5GiB") == ShardSize(bytes=3 * 2**29)
    for bad in ("", "12XB", "-3", "0", "2.5"):
        with pytest.raises(ValueError, match=repr(bad) if bad not in ("0",) else "got 0"):
            ShardSize.parse(bad)
    with pytest.raises(ValueError, match="max_side must be an integer >= 1 or None, got 0"):
        ShardOptions(max_side=0)
    with pytest.raises(ValueError, match="quality must be an integer from 1 to 100, got 101"):
        ShardOptions(quality=101)
    with pytest.raises(ValueError, match="format must be one of"):
        ShardOptions(format="zip")
    assert target_size(200, 100, 100) == (100, 50) and target_size(100, 301, 100) == (33, 100)
    assert target_size(3, 1000, 100) == (1, 100) and target_size(100, 80, 100) is None


def test_loader_and_bench_on_the_shards_report_their_options(synth_root, tmp_path, capsys):
    assert main(["shards", str(synth_root), str(tmp_path / "out"), "--max-side", "64", "--shard-size", "16",
                 "--workers", "1"]) == 0
    with ImageLoader(tmp_path / "out", **LOADER) as loader:
        assert loader.stats["shards"]["max_side"] == 64
        assert loader.stats["shards"]["manifest"] == str(tmp_path / "out" / "manifest.json")
        assert list(loader.source.classes) == list(create_source(synth_root).classes)  # the folder's names
    rc = main(["bench", "--data", str(tmp_path / "out"), "--batch-size", "8", "--workers", "1", "--epochs", "2",
               "--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]  # shards: gpufeed alone, no ImageFolder baseline
    assert row["loader_stats"]["shards"]["max_side"] == 64
    assert len(row["epochs"]) >= 2 and all(e["images"] == 40 for e in row["epochs"])


def test_tar_shards_and_parquet_convert_again(synth_root, tmp_path):
    pytest.importorskip("pyarrow")
    src = create_source(synth_root)
    write_shards(synth_root, tmp_path / "tar", ShardOptions(shard_size=ShardSize(16), shuffle=None, workers=1))
    write_shards(tmp_path / "tar", tmp_path / "pq", ShardOptions(format="parquet", shard_size=ShardSize(25), workers=1))
    out = create_source(tmp_path / "pq")
    assert sorted((out.read(i), out.label(i)) for i in range(len(out))) == \
        sorted((src.read(i), src.label(i)) for i in range(len(src)))


def kill_part_way(argv: list[str], shards_done, at: int = 3) -> None:
    """Run ``gpufeed argv`` in a subprocess and SIGKILL it as soon as ``shards_done()`` reaches ``at``; its
    worker processes (and the fork server, the resource tracker) must then exit by themselves."""
    psutil = pytest.importorskip("psutil")
    env = dict(os.environ, PYTHONPATH=str(Path(gpufeed.__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "gpufeed", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline, helpers = time.monotonic() + 120, []
    while time.monotonic() < deadline and proc.poll() is None:
        if shards_done() >= at:
            helpers = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the conversion ended before it was killed"
    assert helpers, "no worker processes seen"
    _, alive = psutil.wait_procs(helpers, timeout=20)
    assert not alive, f"left running after the conversion was killed: {alive}"


def test_a_killed_conversion_resumes_to_the_same_shards_keeping_the_finished_ones(tmp_path):
    root = tmp_path / "src"
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(80):
            (root / f"c{c}" / f"{i:03d}.jpg").write_bytes(encode(smooth(400, 300, 1000 * c + i)))
    args = [str(root), "--max-side", "40", "--shard-size", "8", "--workers", "1"]
    assert main(["shards", str(root), str(tmp_path / "whole"), *args[1:]]) == 0
    dest = tmp_path / "killed"
    kill_part_way(["shards", str(root), str(dest), *args[1:]], lambda: len(list(dest.glob("shard-*.tar"))))
    finished = {p.name: p.stat().st_mtime_ns for p in dest.glob("shard-*.tar")}
    assert 3 <= len(finished) < 30 and not (dest / "manifest.json").exists()
    with pytest.raises(ValueError, match=r"holds an unfinished `gpufeed shards` conversion of .*src.* Run the same "
                                         r"`gpufeed shards` command again"):
        ImageLoader(dest, **LOADER)  # a part of the data set is never read as the whole
    assert main(["shards", str(root), str(dest), *args[1:]]) == 0
    whole = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert sorted(p.name for p in dest.iterdir()) == whole  # no temporary file or progress folder left
    for name in whole:
        assert (dest / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert {n: (dest / n).stat().st_mtime_ns for n in finished} == finished  # kept, not written again
    with ImageLoader(dest, **LOADER) as loader:
        assert sum(len(labels) for _, labels in loader) == 240


def test_importing_gpufeed_and_the_local_engine_imports_neither_ray_nor_torch():
    code = ("import sys, gpufeed, gpufeed.cli, gpufeed.shards, gpufeed.shards.local; "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(Path(gpufeed.__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_shard_changed_after_its_manifest_is_counted_from_itself(synth_root, tmp_path, caplog):
    pq = pytest.importorskip("pyarrow.parquet")
    write_shards(synth_root, tmp_path / "out", ShardOptions(format="parquet", shard_size=ShardSize(16), workers=1))
    assert create_source(tmp_path / "out").groups == (16, 16, 8)
    shard = tmp_path / "out" / "shard-000001.parquet"
    pq.write_table(pq.read_table(shard).slice(0, 5), shard)  # 5 rows where the manifest says 16
    with caplog.at_level("WARNING", logger="gpufeed"):
        src = create_source(tmp_path / "out")
    assert src.groups == (16, 5, 8) and "does not list shard-000001.parquet at its size" in caplog.text


def test_hostile_inputs_are_each_their_own_failure_and_names_are_kept(tmp_path):
    """A file over --max-bytes (sparse, 3 GB: refused unread), one whose read runs out of memory, and one whose
    name is not UTF-8: the first two are broken, named, and the conversion goes on; the third converts, to
    tar and to Parquet, its name kept (its odd byte as \\xNN in Parquet's string column)."""
    pq = pytest.importorskip("pyarrow.parquet")
    from gpufeed.sources import FileSource

    from .slow_source import HungrySource

    root = tmp_path / "src"
    (root / "c").mkdir(parents=True)
    for i in range(4):
        (root / "c" / f"{i}.jpg").write_bytes(encode(smooth(60, 40, i)))
    odd = os.fsdecode(bytes(root / "c") + b"/caf\xe9.jpg")
    with open(odd, "wb") as f:
        f.write(encode(smooth(50, 50, 9)))
    with open(root / "c" / "huge.jpg", "wb") as f:
        f.truncate(3 << 30)
    (root / "c" / "hungry.jpg").write_bytes(encode(smooth(40, 40, 8)))
    out = tmp_path / "tar"
    assert main(["shards", str(root), str(out), "--workers", "1", "--max-bytes", str(1 << 20)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    broken = {Path(b["path"]).name: b["reason"] for b in manifest["broken"]}
    assert list(broken) == ["huge.jpg"] and "over max_bytes=1048576: refused unread" in broken["huge.jpg"]
    assert manifest["samples"] == 6 and manifest["options"]["max_bytes"] == 1 << 20
    with ImageLoader(out, **LOADER) as loader:
        assert sum(len(y) for _, y in loader) == 6
    src = create_source(root)
    hungry = HungrySource(src.paths, src.labels, src.classes)
    write_shards(hungry, tmp_path / "pq", ShardOptions(format="parquet", workers=1))
    manifest = json.loads((tmp_path / "pq" / "manifest.json").read_text())
    broken = {Path(b["path"]).name: b["reason"] for b in manifest["broken"]}
    assert sorted(broken) == ["huge.jpg", "hungry.jpg"] and broken["hungry.jpg"] == "MemoryError: "
    rows = pq.read_table(tmp_path / "pq" / "shard-000000.parquet").column("image").to_pylist()
    assert sorted(Path(r["path"]).name for r in rows) == ["0.jpg", "1.jpg", "2.jpg", "3.jpg", "caf\\xe9.jpg"]
    with ImageLoader(tmp_path / "pq", **LOADER) as loader:
        assert sum(len(y) for _, y in loader) == 5


FULL = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
from gpufeed.cli import main
sys.exit(main(["shards", sys.argv[1], sys.argv[2], "--workers", "1", "--shard-size", "8"]))
"""


def test_a_full_destination_is_one_line_naming_it_and_leaves_nothing_partial(tmp_path):
    """Writes past a file size limit fail as on a full disk: exit status 2, one line naming the destination
    and the way out, no temporary file left; the shards finished before are kept, and the same command, with
    room, finishes the conversion."""
    root = tmp_path / "src"
    (root / "c").mkdir(parents=True)
    for i in range(24):
        (root / "c" / f"{i:02d}.jpg").write_bytes(encode(smooth(200, 150, i), quality=95))
    dest = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(Path(gpufeed.__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", FULL, str(root), str(dest)], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in done.stderr.strip().splitlines() if not re.match(r"gpufeed shards: \d+/\d+ img ", line)]
    assert done.returncode == 2 and len(lines) == 1, done.stderr  # the progress lines apart
    assert lines[0].startswith(f"gpufeed shards: error: {dest}: File too large while writing the shards: make room")
    left = [p.name for p in dest.iterdir()]
    assert not [n for n in left if n.endswith(".gpufeed-tmp")] and "manifest.json" not in left, left
    assert main(["shards", str(root), str(dest), "--workers", "1", "--shard-size", "8"]) == 0
    with ImageLoader(dest, **LOADER) as loader:
        assert sum(len(y) for _, y in loader) == 24


def test_a_second_writer_of_one_destination_is_refused_naming_the_first(tmp_path, capsys):
    """While one conversion writes a folder, another of the same conversion is refused at once, naming the
    process that holds it, and leaves its files alone: the first finishes whole."""
    root = tmp_path / "src"
    (root / "c").mkdir(parents=True)
    for i in range(240):
        (root / "c" / f"{i:03d}.jpg").write_bytes(encode(smooth(400, 300, i)))
    dest = tmp_path / "out"
    args = ["shards", str(root), str(dest), "--max-side", "64", "--shard-size", "8", "--workers", "1"]
    env = dict(os.environ, PYTHONPATH=str(Path(gpufeed.__file__).resolve().parents[1]))
    first = subprocess.Popen([sys.executable, "-m", "gpufeed", *args], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(dest.glob("shard-*.tar")):
            time.sleep(0.01)
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"{dest} is being written by another `gpufeed shards` (process {first.pid} on " in err, err
        assert "one conversion per destination at a time" in err
        assert first.wait(120) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
    assert sorted(p.name for p in dest.iterdir()) == ["manifest.json"] + [f"shard-{k:06d}.tar" for k in range(30)]
    with ImageLoader(dest, **LOADER) as loader:
        assert sum(len(y) for _, y in loader) == 240


def test_a_shard_changed_in_place_is_found_by_verify_and_made_anew_by_a_rerun(synth_root, tmp_path, capsys):
    """A label of one shard changed in place, the size kept (bit rot, tampering): --verify names that shard
    (exit status 2), a rerun of the conversion makes it anew instead of calling the conversion done, and then
    --verify passes and the labels are the source's again."""
    args = ["shards", str(synth_root), str(tmp_path / "out"), "--shard-size", "16", "--workers", "1"]
    assert main(args) == 0
    assert main(["shards", "--verify", str(tmp_path / "out")]) == 0
    assert "every shard as its manifest lists it" in capsys.readouterr().out
    shard = tmp_path / "out" / "shard-000001.tar"
    original = shard.read_bytes()
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".cls"))
        label = tar.extractfile(member).read()
        where = original.index(label, member.offset_data)
    forged = original[:where] + (b"9" if label[:1] != b"9" else b"8") + original[where + 1:]
    shard.write_bytes(forged)
    assert main(["shards", "--verify", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "shard-000001.tar: its sha256 is not the manifest's" in err and "1 shard(s) differ" in err
    with pytest.warns(UserWarning, match=r"1 shard\(s\) of the finished conversion are not as its manifest lists "
                                         r"them, so they are made anew: shard-000001.tar: its sha256 is not"):
        assert main(args) == 0  # not "done": the changed shard is made again, the same bytes as before
    assert shard.read_bytes() == original
    assert main(["shards", "--verify", str(tmp_path / "out")]) == 0
    assert main(["shards", "--verify", str(synth_root)]) == 2
    assert "holds no manifest.json of a finished `gpufeed shards` conversion" in capsys.readouterr().err


def test_parquet_without_pyarrow_is_said_in_one_line_before_anything_is_written(synth_root, tmp_path):
    code = ("import sys; sys.modules['pyarrow'] = None; from gpufeed.cli import main; "
            "sys.exit(main(['shards', sys.argv[1], sys.argv[2], '--format', 'parquet']))")
    env = dict(os.environ, PYTHONPATH=str(Path(gpufeed.__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", code, str(synth_root), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "gpufeed shards: error: writing Parquet shards needs pyarrow: pip install 'gpufeed[parquet]'"], done.stderr
    assert not (tmp_path / "out").exists()


def test_a_plain_script_converts_without_a_main_guard(tmp_path):
    """A script that calls write_shards at module level, as one calls ImageLoader, with no ``if __name__ ==
    "__main__":``: the worker processes do not run it again (which multiprocessing refuses while they
    start), and the shards it wrote load with every image and label."""
    from gpufeed.synth import create_synthetic_dataset

    root = tmp_path / "src"
    create_synthetic_dataset(str(root), n=24, num_classes=3, seed=5)
    script = tmp_path / "convert.py"
    script.write_text(
        "import sys\n"
        "from gpufeed.shards import ShardOptions, ShardSize, write_shards\n"
        "options = ShardOptions(max_side=64, shard_size=ShardSize(10), workers=2)\n"
        "manifest = write_shards(sys.argv[1], sys.argv[2], options)\n"
        "print('converted', sum(s['samples'] for s in manifest['shards']))\n")
    here = str(Path(gpufeed.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), str(root), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["converted", "24"]
    assert done.stderr.count("Traceback") == 0
    loader = ImageLoader(str(tmp_path / "out"), batch_size=8, device="cpu", train=False, image_size=32,
                         num_workers=1)
    labels = sorted(int(v) for _, y in loader for v in y)
    assert labels == sorted(create_source(str(root)).label(i) for i in range(24))


def test_an_unfinished_conversion_is_resumed_with_its_options_and_refused_with_others(synth_root, tmp_path):
    """A conversion stopped after its first shard: the same call resumes it to the uninterrupted result;
    a call with other options is refused, naming the option and both values."""
    class Stop(Exception):
        pass

    def stop_after_first_shard(done: int, total: int) -> None:
        if done >= 40:
            raise Stop

    options = ShardOptions(shard_size=ShardSize(40), workers=1)
    with pytest.raises(Stop):
        write_shards(synth_root, tmp_path / "out", options, progress=stop_after_first_shard)
    assert not (tmp_path / "out" / "manifest.json").exists()
    with pytest.raises(ValueError, match=r"unfinished conversion of other inputs or options \(what differs: "
                                         r"quality \(90 there, 70 here\)\): resume it with those"):
        write_shards(synth_root, tmp_path / "out", ShardOptions(shard_size=ShardSize(40), workers=1, quality=70))
    resumed = write_shards(synth_root, tmp_path / "out", options)
    whole = write_shards(synth_root, tmp_path / "whole", options)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in whole["shards"]]


def test_the_main_script_s_spec_is_put_back_after_conversions_however_they_overlap(synth_root, tmp_path):
    """The workers start with ``__main__`` reporting itself as not to be re-imported; once the conversions
    are over, the script's own spec is back, also when two overlapping ones end in the order they began."""
    from gpufeed.workers.process import main_not_reimported

    main = sys.modules["__main__"]
    before = main.__dict__.get("__spec__")
    write_shards(synth_root, tmp_path / "out", ShardOptions(shard_size=ShardSize(20), workers=1))
    assert main.__dict__.get("__spec__") is before
    a, b = main_not_reimported(), main_not_reimported()
    a.__enter__()
    b.__enter__()
    assert main.__spec__.name == "__main__"
    a.__exit__(None, None, None)
    assert main.__spec__.name == "__main__"  # b still starts processes
    b.__exit__(None, None, None)
    assert main.__dict__.get("__spec__") is before
