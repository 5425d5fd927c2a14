import json
import os
import re

import pytest
from PIL import Image

from gpufeed.cli import main
from gpufeed.synth import create_synthetic_dataset


def test_synth_is_deterministic_imagenet_like_and_cached(tmp_path):
    a = create_synthetic_dataset(tmp_path / "a", n=12, num_classes=3, seed=4, workers=1)
    b = create_synthetic_dataset(tmp_path / "b", n=12, num_classes=3, seed=4, workers=1)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(files_a) == 12 and len({p.parent for p in files_a}) == 3
    assert all((a / p).read_bytes() == (b / p).read_bytes() for p in files_a)
    with Image.open(a / files_a[0]) as im:
        assert im.format == "JPEG" and im.mode == "RGB" and 160 <= im.size[0] <= 900
        assert [l[1:3] for l in im.layer] == [(2, 2), (1, 1), (1, 1)]  # 4:2:0
    mtime = (a / files_a[0]).stat().st_mtime_ns
    create_synthetic_dataset(tmp_path / "a", n=12, num_classes=3, seed=4, workers=1)
    assert (a / files_a[0]).stat().st_mtime_ns == mtime  # cached, not rewritten


def test_synth_command(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "d"), "--n", "6", "--classes", "2"]) == 0
    assert "6 JPEGs in 2 classes" in capsys.readouterr().out


def test_info_command_reports_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and re.search(r"decode: cpu \(simplejpeg \+ Pillow\)\s+works", out)
    assert re.search(r"decode: cpu cropped \(libjpeg-turbo ext\)\s+(built|not built)", out)


def test_bench_smoke_writes_table_json_and_chart(tmp_path, synth_root, capsys):
    """Every pipeline of the benchmark, tiny, so the benchmark cannot rot."""
    rc = main(["bench", "--data", str(synth_root), "--batch-size", "8", "--workers", "1", "--epochs", "2",
               "--device", "cpu", "--pipelines", "baseline,baseline+prefetch,gpufeed",
               "--json", str(tmp_path / "r.json"), "--chart", str(tmp_path / "r.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| baseline " in out and "| gpufeed " in out and "PSS added GB" in out
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["pipeline"]: r for r in result["rows"]}
    assert set(rows) == {"baseline", "baseline+prefetch", "gpufeed (cpu decode)"}
    assert rows["gpufeed (cpu decode)"]["loader_stats"]["decode_backend"] == "cpu"
    for r in rows.values():
        assert [e["images"] for e in r["epochs"]] == [40, 40] and all(e["cpu_share"] is None for e in r["epochs"])
        assert r["images_per_s"] > 0 and r["peak_rss_bytes"] > 0
        # PSS: shared pages split among the processes that map them, never above RSS
        assert all(0 < e["peak_pss_bytes"] <= e["peak_rss_bytes"] for e in r["epochs"])
        assert 0.05 < r["cpu_cores_busy"] < 2 * os.cpu_count() + 1  # decoding took CPU; a core count, not %
    assert rows["baseline"]["vs_baseline"] == 1.0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_monitor_reads_pss_of_child_processes_that_exit_before_the_epoch_ends():
    """PSS is read when asked (halfway through an epoch), not at ``stop()``: a child process holding
    memory then, gone by the end (as the usual DataLoader's workers are), still counts."""
    import subprocess
    import sys

    from gpufeed.bench.monitor import Monitor

    psutil = pytest.importorskip("psutil")
    if getattr(psutil.Process().memory_full_info(), "pss", None) is None:
        pytest.skip("no PSS on this platform")
    monitor = Monitor(None)
    monitor.start()
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(80 << 20); b[::4096] = b'x' * len(b[::4096]); "
                              "print(1, flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"  # its 80 MB are touched
        monitor.read_pss()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    monitor.stop()
    assert monitor.peak_pss - monitor.start_pss >= 60 << 20
    assert monitor.peak_rss > 0


def test_monitor_counts_cores_busy_over_the_whole_phase_without_a_pss_read():
    """``stop()`` measures the cores kept busy from ``start()`` on, whether or not PSS was read between."""
    import time

    from gpufeed.bench.monitor import Monitor

    pytest.importorskip("psutil")
    monitor = Monitor(None)
    monitor.start()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # this process busy for the whole phase
        pass
    monitor.stop()
    assert monitor.cores_busy is not None and 0.5 < monitor.cores_busy < 2.5


def test_bench_rejects_model_on_cpu(capsys):
    assert main(["bench", "--device", "cpu", "--model", "resnet18", "--n", "10"]) == 2
    assert "--model needs a CUDA device" in capsys.readouterr().err


def test_bench_rejects_compile_without_a_model(capsys):
    assert main(["bench", "--device", "cpu", "--model", "none", "--compile", "--n", "10"]) == 2
    assert "--compile needs --model" in capsys.readouterr().err


def test_bench_row_names_the_gpu_decoder_share_and_worker_cpus(monkeypatch):
    """The row label says what ran: the decoder, the CPU share and the CPUs the workers were kept to."""
    import torch

    import gpufeed.bench.run as run
    from gpufeed.bench.monitor import Monitor

    class FakeGpuLoader:  # what ImageLoader(decode="gpu") reports, without a GPU; the share moves each epoch
        epochs = 0

        @property
        def stats(self):
            return {"decode_backend": "nvjpeg-hw", "cpu_share": 0.25 * self.epochs, "worker_cpus": [3, 4, 5, 6, 7, 9]}

        def __len__(self):
            return 2

        def __iter__(self):
            self.epochs += 1
            return iter([(torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.int64))] * 2)

    class Bar:
        update = close = lambda *a: None

    monkeypatch.setattr(run, "_make_loader", lambda *a: FakeGpuLoader())
    row = run.run_pipeline("gpufeed-gpu", "unused", run.BenchConfig(epochs=2), torch.device("cpu"), None,
                           Monitor(None), lambda *a: Bar())
    assert row["pipeline"] == "gpufeed-gpu (nvjpeg-hw decode, CPU share 0.50, workers on CPUs 3-7,9)"
    assert row["loader_stats"]["worker_cpus"] == [3, 4, 5, 6, 7, 9]
    assert [e["cpu_share"] for e in row["epochs"]] == [0.25, 0.5]  # each epoch's, as it ended


def test_bench_under_torchrun_sums_the_ranks(tmp_path, synth_root):
    """`torchrun -m gpufeed bench`: every rank loads its shard, rank 0 alone prints the table, whose images
    are those of both ranks."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "--master_addr=127.0.0.1", "-m", "gpufeed", "bench", "--data", str(synth_root), "--batch-size", "4",
           "--epochs", "2", "--device", "cpu", "--pipelines", "baseline,gpufeed", "--json", str(tmp_path / "r.json")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("gpufeed bench:") == 1  # one table, from rank 0
    result = json.loads((tmp_path / "r.json").read_text())
    from gpufeed.cores import usable_cores

    assert result["machine"]["ranks"] == 2 and result["config"]["workers"] == max(1, usable_cores() // 2)
    for r in result["rows"]:  # each rank 20 of the 40 samples (5 batches of 4), summed over the ranks
        assert [e["images"] for e in r["epochs"]] == [40, 40] and r["images_per_s"] > 0


def test_bench_times_a_recipe_both_ways(tmp_path, synth_root, capsys):
    """``--recipe``: the DataLoader runs the recipe's torchvision transforms per image, gpufeed gets the same
    Compose, and a batch transform (MixUp/CutMix) runs on both pipelines' batches; a recipe file works too."""
    rc = main(["bench", "--data", str(synth_root), "--batch-size", "8", "--workers", "1", "--epochs", "2",
               "--device", "cpu", "--recipe", "trivialaugment-mix", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    assert "recipe trivialaugment-mix" in capsys.readouterr().out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["pipeline"] for r in rows] == ["baseline", "gpufeed (cpu decode)"]
    assert all([e["images"] for e in r["epochs"]] == [40, 40] and r["images_per_s"] > 0 for r in rows)
    recipe = tmp_path / "mine.py"
    recipe.write_text("import torch\nfrom torchvision.transforms import v2\n"
                      "transform = v2.Compose([v2.RandomResizedCrop(64), v2.ToImage(), "
                      "v2.ToDtype(torch.float32, scale=True)])\n")
    assert main(["bench", "--data", str(synth_root), "--batch-size", "8", "--workers", "1", "--epochs", "2",
                 "--device", "cpu", "--pipelines", "gpufeed", "--recipe", str(recipe)]) == 0
    assert main(["bench", "--n", "10", "--device", "cpu", "--recipe", "randaugment"]) == 2
    assert "--recipe must be one of" in capsys.readouterr().err


def test_every_built_in_recipe_is_one_gpufeed_reads():
    from gpufeed.augment.recipe import read_transform
    from gpufeed.bench.recipes import BUILT_IN, load_recipe

    read = {name: read_transform(load_recipe(name, image_size=64).transform) for name in BUILT_IN}
    assert len(read) == 4 and all(r.train and r.image_size == 64 for r in read.values())
    assert read["resize-randomcrop"].crop is not None and read["resize-randomcrop"].resize_size == 73
    assert read["standard"].crop is None and len(read["trivialaugment"].pixel) == 1
