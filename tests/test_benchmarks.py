"""Each script in benchmarks/ run tiny on this machine, so none can rot: it runs, measures what it says
and prints its table."""

import re
import runpy
import sys
from pathlib import Path

import pytest
import torch


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script, args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    except SystemExit as e:  # a script's sys.exit(main()): only a failure is one
        if e.code not in (0, None):
            raise
    return capsys.readouterr().out


def _rows(out):
    """A printed table's body rows (no header, no separator)."""
    lines = out.splitlines()
    return [line for line, after in zip(lines, lines[1:] + [""]) if line.startswith("| ") and not after.startswith("|-")]


def test_decode_only(synth_root, capsys, monkeypatch):
    out = _run("decode_only.py", [str(synth_root), "--batch", "8", "--rounds", "1", "--n", "16"], capsys, monkeypatch)
    rows = _rows(out)
    cpu = [r for r in rows if r.startswith("| cpu (libjpeg-turbo)")]
    assert len(cpu) == 1 and float(cpu[0].split("|")[2].replace(",", "")) > 0
    assert "16 files in memory, batch 8" in out
    if not __import__("torch").cuda.is_available():  # each GPU decoder: a row saying why it is not here
        assert [r.split("|")[1].strip() for r in rows[1:]] == ["nvjpeg", "nvimgcodec", "torchvision"]
        assert all("unavailable: " in r for r in rows[1:])


def test_worker_cost_measures_each_path(tmp_path, capsys, monkeypatch):
    from gpufeed.synth import create_synthetic_dataset

    root = create_synthetic_dataset(tmp_path, n=256, num_classes=2, seed=3, workers=2)
    out = _run("worker_cost.py", [str(root), "--share", "0,0.5", "--cpu", "--epochs", "1", "--batches", "1",
                                  "--workers", "2"], capsys, monkeypatch)
    rows = _rows(out)
    assert [r.split("|")[1].strip() for r in rows] == ["GPU path, CPU share 0, 1 in flight",
                                                         "GPU path, CPU share 0.5, 1 in flight", "CPU path, 1 in flight"]
    cpu_us = [float(r.split("|")[3].split("(")[0].replace(",", "")) for r in rows]
    # decoding more costs more (from /proc, in clock ticks: 10 ms over 256 images, about 40 us a tick)
    assert 0 <= cpu_us[0] < cpu_us[1] < cpu_us[2]


def test_sweep(synth_root, capsys, monkeypatch):
    out = _run("sweep.py", [str(synth_root), "--device", "cpu", "--epochs", "2", "--batch-size", "8", "2,1,cpu"],
               capsys, monkeypatch)
    (row,) = _rows(out)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "2,1,cpu" and cells[1] == "cpu"
    assert re.fullmatch(r"[\d,]+ \([\d,]+, [\d,]+\)", cells[2]), cells[2]


def test_overlap(capsys, monkeypatch):
    import torch

    out = _run("overlap.py", ["--batches", "2", "--mb", "4"], capsys, monkeypatch)
    if torch.cuda.is_available():
        (row,) = _rows(out)
        copy_ms, work_ms, both_ms, hidden = (float(c) for c in row.strip("|").split("|"))
        assert min(copy_ms, work_ms, both_ms) > 0
    else:
        assert out.strip().endswith("needs CUDA (none here); nothing measured")


def test_gpu_memory_says_it_needs_cuda_without_one(synth_root, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu-marked test below runs it")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        _run("gpu_memory.py", [str(synth_root), "--epochs", "2"], capsys, monkeypatch)


@pytest.mark.gpu
def test_gpu_memory_reports_every_epoch(synth_root, capsys, monkeypatch):
    out = _run("gpu_memory.py", [str(synth_root), "--epochs", "3", "--batch-size", "8", "--workers", "2"], capsys,
               monkeypatch)
    epochs = [int(r.split("|")[1]) for r in _rows(out)]
    assert epochs == [1, 2, 3], out
    assert "growth after epoch 1" in out


def test_cpu_device(synth_root, capsys, monkeypatch):
    out = _run("cpu_device.py", [str(synth_root), "--workers", "2", "--batch-size", "8", "--epochs", "2"], capsys,
               monkeypatch)
    (row,) = _rows(out)
    rate, per, norm, rest, arrays = (c.strip() for c in row.strip("|").split("|"))
    assert float(rate.replace(",", "")) > 0 and float(norm) > 0 and abs(float(per) - float(norm) - float(rest)) < 0.2
    used, batches = arrays.split(" of ")
    assert 1 <= int(used) <= int(batches.split()[0])


def test_remote_shards(synth_root, capsys, monkeypatch):
    out = _run("remote_shards.py", [str(synth_root), "--per-shard", "10", "--epochs", "2", "--workers", "1",
                                    "--batch-size", "8", "--startup-shards", "20"], capsys, monkeypatch)
    rows = _rows(out)
    assert [r.split("|")[1].strip() for r in rows[:2]] == ["local disk", "S3 server"]
    assert all(float(r.split("|")[3].replace(",", "")) > 0 for r in rows[:2])
    assert "First batch from 20 shards of 2" in out
    assert [r.split("|")[1].strip() for r in rows[2:4]] == ["s3fs get_file (fsspec)",
                                                            "presigned URL, standard library GET"]
    assert [r.split("|")[1].strip() for r in rows[4:]] == [
        "declared (samples_per_shard)", "from the index cache of an earlier run",
        "folder URL: one listing, then the index cache", "neither: every shard fetched and indexed first"]


def test_formats_reads_the_same_images_three_ways(synth_root, capsys, monkeypatch):
    pytest.importorskip("pyarrow")
    out = _run("formats.py", [str(synth_root), "--per-shard", "16", "--rows-per-group", "8", "--rounds", "1",
                              "--epochs", "2", "--device", "cpu", "--batch-size", "8", "--workers", "1"],
               capsys, monkeypatch)
    rows = _rows(out)
    assert [r.split("|")[1].strip() for r in rows] == ["ImageFolder", "tar shards", "Parquet"]
    for r in rows:
        assert float(r.split("|")[3].replace(",", "")) > 0


def test_formats_read_only_reads_the_same_images_three_ways(synth_root, capsys, monkeypatch):
    pytest.importorskip("pyarrow")
    out = _run("formats.py", [str(synth_root), "--per-shard", "16", "--rows-per-group", "8", "--rounds", "1",
                              "--epochs", "1", "--batch-size", "8", "--workers", "2", "--read-only"],
               capsys, monkeypatch)
    rows = _rows(out)
    assert [r.split("|")[1].strip() for r in rows] == ["ImageFolder", "tar shards", "Parquet"]
    for r in rows:
        assert float(r.split("|")[3].replace(",", "")) > 0 and "read only" in r


def test_paced_says_it_needs_a_gpu(synth_root, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("measures on the GPU machine (benchmarks/gpu_machine.sh STEPS=paced)")
    out = _run("paced.py", [str(synth_root)], capsys, monkeypatch)
    assert "needs a CUDA GPU" in out


def test_runahead_reads_its_variants_and_says_it_needs_a_gpu(synth_root, capsys, monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import runahead
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert runahead.variant("base") == {"lag": 0, "switch": 5.0, "depth": 2, "share": "auto", "prio": 0,
                                        "blocking": 0, "loopcopies": 0, "sidestream": 0}
    v = runahead.variant("depth=4,share=0.65,prio=-1,loopcopies=1,sidestream=1")
    assert (v["depth"], v["share"], v["prio"], v["loopcopies"], v["lag"], v["sidestream"]) == (4, 0.65, -1, 1, 0, 1)
    if torch.cuda.is_available():
        pytest.skip("measures on the GPU machine (benchmarks/gpu_machine.sh STEPS=runahead)")
    out = _run("runahead.py", [str(synth_root)], capsys, monkeypatch)
    assert "needs a CUDA GPU" in out


def test_stage_cost_draws_random_resized_crop_boxes_and_says_it_needs_a_gpu(synth_root, capsys, monkeypatch):
    import random

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import stage_cost
    finally:
        sys.path.remove(str(BENCHMARKS))
    rng, areas = random.Random(1), []
    for _ in range(500):
        x, y, w, h = stage_cost._box(500, 375, rng)
        assert 0 <= x and 0 <= y and 0 < w and 0 < h and x + w <= 500 and y + h <= 375
        areas.append(w * h / (500 * 375))
    # the mean crop area as torchvision's RandomResizedCrop draws it for the same image (boxes that do not fit
    # are drawn again, so large areas are rarer than the uniform scale alone gives)
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    tv = [h * w / (500 * 375) for _, _, h, w in (RandomResizedCrop.get_params(torch.empty(3, 375, 500),
                                                                              (0.08, 1.0), (3 / 4, 4 / 3))
                                                 for _ in range(2000))]
    assert min(areas) >= 0.075 and max(areas) <= 1.0
    assert abs(sum(areas) / len(areas) - sum(tv) / len(tv)) < 0.04, (sum(areas) / len(areas), sum(tv) / len(tv))
    assert stage_cost._box(10, 10, random.Random(0))[2] <= 10
    if torch.cuda.is_available():
        pytest.skip("measures on the GPU machine (benchmarks/gpu_machine.sh STEPS=stages)")
    assert "needs a CUDA GPU" in _run("stage_cost.py", [str(synth_root)], capsys, monkeypatch)


def test_engine_order_says_it_needs_a_gpu(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("measures on the GPU machine (benchmarks/gpu_machine.sh STEPS=order)")
    assert "needs a CUDA GPU" in _run("engine_order.py", [], capsys, monkeypatch)


def test_sample_ops_times_each_op_both_ways(capsys, monkeypatch):
    out = _run("sample_ops.py", ["--device", "cpu", "--batch", "4", "--size", "24", "--rounds", "1", "--tv-images", "2"],
               capsys, monkeypatch)
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in _rows(out)]
    assert [r[0] for r in rows] == ["RandomVerticalFlip", "ColorJitter", "RandomGrayscale", "GaussianBlur (10% kernel)",
                                    "RandomAdjustSharpness", "TrivialAugmentWide", "RandAugment", "AutoAugment", "AugMix",
                                    "all of the above, in order"]
    assert all(float(r[1].replace(",", "")) > 0 and float(r[5]) > 0 for r in rows)
    assert all(0 < float(r[3]) <= float(r[2]) for r in rows)  # the draws, within the host time
    assert "batch 4 x 3 x 24 x 24" in out and "colour and point operations on CUDA: " in out


def test_progressive(synth_root, capsys, monkeypatch):
    out = _run("progressive.py", [str(synth_root), "--sizes", "24,32,40", "--device", "cpu", "--workers", "2",
                                  "--batch-size", "8", "--warmup", "1"], capsys, monkeypatch)
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in _rows(out)]
    assert [(r[0], r[1]) for r in rows] == [("1", "24"), ("2", "32"), ("3", "40")]
    assert all(float(r[2].replace(",", "")) > 0 and float(r[3]) > 0 for r in rows)
    pids = re.search(r"worker PIDs before the sizes changed: \[([\d, ]+)\]; after: \[([\d, ]+)\] \((.*)\)", out)
    assert pids and pids[1] == pids[2] and pids[3] == "the same processes" and len(pids[1].split(",")) == 2
    assert "made at 40" in out and "benchmarks/progressive.py" in out
