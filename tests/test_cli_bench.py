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
    """Every pipeline of the benchmark, tiny, so the benchmark cannot rot: each in a process of its own, its
    epochs a warm-up, plain ones (the rate) and the memory epoch (PSS), the bench's overhead in the JSON."""
    rc = main(["bench", "--data", str(synth_root), "--batch-size", "8", "--workers", "1", "--epochs", "3",
               "--device", "cpu", "--pipelines", "baseline,baseline+prefetch,gpufeed",
               "--json", str(tmp_path / "r.json"), "--chart", str(tmp_path / "r.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| baseline " in out and "| baseline+prefetch " in out and "| gpufeed " in out and "PSS added GB" in out
    assert "5 batches an epoch" in out  # too few for a steady figure: said
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["pipeline"]: r for r in result["rows"]}
    assert set(rows) == {"baseline", "baseline+prefetch", "gpufeed (cpu decode)"}
    assert rows["gpufeed (cpu decode)"]["loader_stats"]["decode_backend"] == "cpu"
    assert result["isolated"] and len({r["process"] for r in rows.values()} | {os.getpid()}) == 4
    for r in rows.values():
        assert [e["kind"] for e in r["epochs"]] == ["warm-up", "plain", "monitored", "memory"]
        assert [e["images"] for e in r["epochs"]] == [40] * 4 and all(e["cpu_share"] is None for e in r["epochs"])
        plain, watched, memory = r["epochs"][1:]
        assert r["images_per_s"] == plain["images_per_s"] and r["monitored_images_per_s"] == watched["images_per_s"]
        assert r["bench_overhead"] == pytest.approx(plain["images_per_s"] / watched["images_per_s"] - 1)
        assert plain["rss_peak"] is None and plain["cores_busy"] is None  # nothing read in a plain epoch
        # PSS: read in the memory epoch alone; shared pages split among the processes, never above RSS
        assert watched["pss_peak"] is None and 0 < memory["pss_peak"] <= memory["rss_peak"]
        assert r["peak_rss_bytes"] > 0 and r["added_pss_bytes"] is not None
        assert 0.05 < r["cpu_cores_busy"] < 2 * os.cpu_count() + 1  # decoding took CPU; a core count, not %
    assert rows["baseline"]["vs_baseline"] == 1.0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def _busy_child(mb: int):
    """A child process holding ``mb`` MB it has touched, until its standard input closes."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", f"import sys; b = bytearray({mb} << 20); "
                              "b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"1"
    return child


def test_monitor_reads_pss_of_child_processes_that_exit_before_the_phase_ends():
    """PSS is read when asked (halfway through the memory epoch), not at ``stop()``: a child process holding
    memory then, gone by the end (as the usual DataLoader's workers are), still counts."""
    from gpufeed.bench.monitor import Monitor

    psutil = pytest.importorskip("psutil")
    if getattr(psutil.Process().memory_full_info(), "pss", None) is None:
        pytest.skip("no PSS on this platform")
    with Monitor(None) as monitor:
        before = monitor.now(pss=True)
        monitor.start()
        child = _busy_child(80)
        try:
            monitor.read_pss()
            monitor.now()  # answered after the PSS read: the sampler takes its commands in order
        finally:
            child.stdin.close()
            child.wait(timeout=30)
        reading = monitor.stop().get()
    assert reading.pss_peak - before["pss"] >= 60 << 20
    assert reading.rss_peak >= reading.rss_start > 0


def test_monitor_phases_do_not_wait_for_the_sampler_and_their_readings_come_in_order():
    """``start`` and ``stop`` only write their line (an epoch never begins late); each phase's ``Reading``
    comes from its ``Pending``, in order, also when a later ``now()`` is read first."""
    import time

    from gpufeed.bench.monitor import Monitor, Reading

    pytest.importorskip("psutil")
    with Monitor(None) as monitor:
        monitor.start()
        time.sleep(0.05)
        one = monitor.stop()
        monitor.start()
        child = _busy_child(80)
        try:
            time.sleep(0.3)
            two = monitor.stop()
        finally:
            child.stdin.close()
            child.wait(timeout=30)
        now = monitor.now()  # read past both pending answers
        second, first = two.get(), one.get()
    assert isinstance(first, Reading) and isinstance(second, Reading) and set(now) >= {"rss", "cpu_seconds"}
    assert second.rss_peak - first.rss_peak >= 60 << 20  # the child came in the second phase alone


def test_a_late_sampler_does_not_count_a_process_started_after_the_phase_ended():
    """The sampler, running late on a loaded machine, reads the tree after the measured process has ended the
    phase and started a child: ``stop T`` keeps that child out of the phase's peak, and in the next one."""
    import subprocess
    import sys
    import time

    pytest.importorskip("psutil")
    sampler = subprocess.Popen([sys.executable, "-m", "gpufeed.bench.sampler", str(os.getpid()), "-1", "0.01", "rss"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(sampler.stdout.readline())["psutil"] is True
        sampler.stdin.write("start\n")
        sampler.stdin.flush()
        time.sleep(0.2)
        ended = time.monotonic()  # the phase ends here; the "stop" line goes only after the child came
        child = _busy_child(80)
        try:
            time.sleep(0.2)  # the sampler lists the child several times, still within the first phase
            sampler.stdin.write(f"stop {ended!r}\nstart\n")
            sampler.stdin.flush()
            first = json.loads(sampler.stdout.readline())
            time.sleep(0.2)
            sampler.stdin.write(f"stop {time.monotonic()!r}\n")
            sampler.stdin.flush()
            second = json.loads(sampler.stdout.readline())
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    finally:
        sampler.stdin.close()
        sampler.wait(timeout=30)
    assert first["rss_peak"] - first["rss_start"] < 40 << 20
    assert second["rss_start"] - first["rss_peak"] >= 60 << 20 and second["rss_peak"] >= second["rss_start"]


def test_monitor_samples_from_a_process_of_its_own_and_counts_cores_busy_over_the_phase():
    """No thread is added to the measured process; ``stop()`` gives the cores kept busy since ``start()``,
    and RSS sampled meanwhile catches a child that came and went."""
    import threading
    import time

    from gpufeed.bench.monitor import Monitor

    pytest.importorskip("psutil")
    with Monitor(None, interval=0.01) as monitor:
        threads = threading.active_count()
        t0 = time.perf_counter()
        monitor.start()
        monitor.now()  # answered once the sampler has begun the phase: it takes its commands in order
        assert threading.active_count() == threads
        child = _busy_child(120)
        time.sleep(0.3)  # sampled meanwhile (RSS every fourth interval)
        child.stdin.close()
        child.wait(timeout=30)
        end = time.process_time() + 0.3
        while time.process_time() < end:  # this process busy for 0.3 s of CPU, however loaded the machine
            pass
        reading = monitor.stop().get()
        wall = time.perf_counter() - t0
    # CPU seconds over the phase's wall time: at least the 0.3 s this process spent within it, over at most the
    # wall time measured around it (here, not by the sampler: a machine's load scales both alike)
    assert reading.cores_busy is not None and 0.28 / wall <= reading.cores_busy <= os.cpu_count()
    assert reading.rss_peak - reading.rss_start >= 100 << 20
    assert reading.gpu_busy is None and reading.gpu_mem_peak is None  # no GPU asked for


def test_the_rate_comes_from_plain_epochs_and_the_overhead_and_unsteady_epochs_are_said():
    """``summarise``: images/s is the plain epochs' median whatever the monitored ones ran at; monitors that
    cost more than 1% beyond the plain epochs' spread, an unsteady rate and short epochs are warned about."""
    from gpufeed.bench.pipeline import summarise

    def epoch(kind, rate):
        return {"kind": kind, "seconds": 1000 / rate, "images": 1000, "images_per_s": rate, "cpu_share": None,
                "gpu_busy": None, "gpu_samples": 0, "gpu_mem_start": None, "gpu_mem_peak": None, "rss_start": 10,
                "rss_peak": None if kind == "plain" else 20, "pss_peak": 15 if kind == "memory" else None,
                "cores_busy": None if kind == "plain" else 3.0}

    before = {"rss": 5, "pss": 4, "gpu_used": None}
    steady = [epoch("warm-up", 50), epoch("plain", 100), epoch("monitored", 90), epoch("plain", 101),
              epoch("memory", 80)]
    row = summarise("gpufeed", steady, None, 100, before, workers=2, synthetic=True)
    assert row["images_per_s"] == 100.5 and row["monitored_images_per_s"] == 90
    assert row["bench_overhead"] == pytest.approx(100.5 / 90 - 1)
    assert row["added_rss_bytes"] == 15 and row["added_pss_bytes"] == 11 and row["cpu_cores_busy"] == 3.0
    assert row["warnings"] == ["the bench's monitors cost 11.7% (monitored epochs against plain ones, beyond the "
                               "plain epochs' own spread of 1.0%)"]
    quiet = summarise("gpufeed", [*steady[:2], epoch("monitored", 100.2), *steady[3:]], None, 100, before,
                      workers=2, synthetic=True)
    assert quiet["warnings"] == []
    rising = summarise("gpufeed", [epoch("warm-up", 50), epoch("plain", 80), epoch("monitored", 90),
                                   epoch("plain", 100), epoch("memory", 80)], None, 5, before, workers=2, synthetic=True)
    assert rising["warnings"][0].startswith("5 batches an epoch") and "more images (--n)" in rising["warnings"][0]
    assert rising["warnings"][1] == "plain epochs not steady: 80-100 images/s (min-max, 25% apart)"
    theirs = summarise("gpufeed", steady, None, 5, before, workers=2, synthetic=False)  # the user's --data
    assert "more images in --data" in theirs["warnings"][0] and "--n" not in theirs["warnings"][0]


def test_bench_rejects_model_on_cpu(capsys):
    assert main(["bench", "--device", "cpu", "--model", "resnet18", "--n", "10"]) == 2
    assert "--model needs a CUDA device" in capsys.readouterr().err


def test_bench_rejects_compile_without_a_model(capsys):
    assert main(["bench", "--device", "cpu", "--model", "none", "--compile", "--n", "10"]) == 2
    assert "--compile needs --model" in capsys.readouterr().err


def test_bench_row_names_the_gpu_decoder_share_and_worker_cpus(monkeypatch):
    """The row label says what ran: the decoder, the CPU share and the CPUs the workers were kept to."""
    import torch

    import gpufeed.bench.pipeline as pipeline
    from gpufeed.bench.monitor import Monitor
    from gpufeed.bench.run import BenchConfig

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

    monkeypatch.setattr(pipeline, "make_loader", lambda *a: FakeGpuLoader())
    with Monitor(None) as monitor:
        row = pipeline.run_pipeline("gpufeed-gpu", "unused", BenchConfig(epochs=2), torch.device("cpu"), None, monitor)
    assert row["pipeline"] == "gpufeed-gpu (nvjpeg-hw decode, CPU share 0.75, workers on CPUs 3-7,9)"
    assert row["loader_stats"]["worker_cpus"] == [3, 4, 5, 6, 7, 9]
    assert [e["cpu_share"] for e in row["epochs"]] == [0.25, 0.5, 0.75]  # each epoch's, as it ended


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
    assert res.stdout.count("gpufeed bench,") == 1  # one table, from rank 0
    assert res.stderr.count("gpufeed bench:") == 1 and res.stderr.count("[1/2] baseline: ") == 2  # said by rank 0
    result = json.loads((tmp_path / "r.json").read_text())
    from gpufeed.cores import usable_cores

    assert result["machine"]["ranks"] == 2 and result["config"]["workers"] == max(1, usable_cores() // 2)
    assert not result["isolated"]  # the ranks' own processes run the pipelines
    for r in result["rows"]:  # each rank 20 of the 40 samples (5 batches of 4), summed over the ranks
        assert [e["images"] for e in r["epochs"]] == [40, 40, 40] and r["images_per_s"] > 0


def test_bench_times_a_recipe_both_ways(tmp_path, synth_root, capsys):
    """``--recipe``: the DataLoader runs the recipe's torchvision transforms per image, gpufeed gets the same
    Compose, and a batch transform (MixUp/CutMix) runs on both pipelines' batches; a recipe file works too."""
    rc = main(["bench", "--data", str(synth_root), "--batch-size", "8", "--workers", "1", "--epochs", "2",
               "--device", "cpu", "--recipe", "trivialaugment-mix", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    assert "recipe trivialaugment-mix" in capsys.readouterr().out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["pipeline"] for r in rows] == ["baseline", "gpufeed (cpu decode)"]
    assert all([e["images"] for e in r["epochs"]] == [40, 40, 40] and r["images_per_s"] > 0 for r in rows)
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


def test_past_three_timed_epochs_two_plain_ones_come_for_each_monitored_one():
    """The rate is the plain epochs' median: from four timed epochs on, three or more plain ones, so that the first
    epoch after the warm-up (often the slowest) does not weigh half."""
    from gpufeed.bench.pipeline import epoch_kinds

    assert epoch_kinds(4) == ["warm-up", "plain", "monitored", "plain", "memory"]
    assert epoch_kinds(5) == ["warm-up", "plain", "monitored", "plain", "plain", "memory"]
    kinds = epoch_kinds(9)
    assert kinds.count("plain") == 5 and kinds.count("monitored") == 3 and kinds[0] == "warm-up"


def test_other_processes_busy_while_the_bench_ran_are_said():
    """The machine's busy cores (``/proc/stat``) beyond the pipeline's own, while its monitored epochs ran: past
    a tenth of the cores (and a whole core) the table says the figures are a shared machine's."""
    import os
    import time

    from gpufeed.bench.pipeline import summarise
    from gpufeed.bench.sampler import machine_cpu_seconds

    t0, c0 = time.monotonic(), machine_cpu_seconds()
    while time.monotonic() - t0 < 0.3:  # this process busy: the machine's CPU seconds go up with it
        pass
    assert machine_cpu_seconds() - c0 >= 0.1

    cores = os.cpu_count() or 1
    others = max(1.0, 0.1 * cores) + 0.5

    def epoch(kind, machine):
        return {"kind": kind, "seconds": 1.0, "images": 100, "images_per_s": 100.0, "cpu_share": None,
                "gpu_busy": None, "gpu_samples": 0, "gpu_mem_start": None, "gpu_mem_peak": None, "rss_start": 10,
                "rss_peak": None, "pss_peak": None, "cores_busy": None if kind == "plain" else 2.0,
                "machine_cores_busy": None if kind == "plain" else 2.0 + machine}

    before = {"rss": 5, "pss": 4, "gpu_used": None}
    shared = summarise("gpufeed", [epoch("warm-up", 0), epoch("plain", 0), epoch("monitored", others),
                                   epoch("plain", 0), epoch("memory", others)], None, 100, before, workers=2,
                       synthetic=True)
    assert shared["warnings"] == [f"other processes kept about {others:.1f} of the machine's {cores} cores busy while "
                                  "it ran: these figures are what a shared machine gave; run again on a quiet one to "
                                  "compare"]
    quiet = summarise("gpufeed", [epoch("warm-up", 0), epoch("plain", 0), epoch("monitored", 0.3),
                                  epoch("plain", 0), epoch("memory", 0.3)], None, 100, before, workers=2,
                      synthetic=True)
    assert quiet["warnings"] == []
