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
    # CPU time from /proc, not wall time: the CPU path decodes 256 images, the GPU path at share 0 none (some
    # tenfold apart; how the shares compare is the benchmark's finding, not this test's)
    assert 0 <= cpu_us[0] < cpu_us[2] and cpu_us[1] >= 0


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


@pytest.mark.parametrize("script", ["engine_cost.py", "anatomy.py"])
def test_scripts_of_the_gpu_machine_say_they_need_a_gpu(script, synth_root, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("measures on the GPU machine")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as run from there: its sibling scripts import
    out = _run(script, [str(synth_root)], capsys, monkeypatch)
    assert "needs a CUDA GPU" in out


def test_progressive(synth_root, capsys, monkeypatch):
    out = _run("progressive.py", [str(synth_root), "--sizes", "24,32,40", "--device", "cpu", "--workers", "2",
                                  "--batch-size", "8", "--warmup", "1"], capsys, monkeypatch)
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in _rows(out)]
    assert [(r[0], r[1]) for r in rows] == [("1", "24"), ("2", "32"), ("3", "40")]
    assert all(float(r[2].replace(",", "")) > 0 and float(r[3]) > 0 for r in rows)
    pids = re.search(r"worker PIDs before the sizes changed: \[([\d, ]+)\]; after: \[([\d, ]+)\] \((.*)\)", out)
    assert pids and pids[1] == pids[2] and pids[3] == "the same processes" and len(pids[1].split(",")) == 2
    assert "made at 40" in out and "benchmarks/progressive.py" in out


def _script(name, args, tmp_path, **env):
    """``benchmarks/NAME`` in a process of its own (the harnesses start fresh processes themselves)."""
    import os
    import subprocess

    res = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_plain_loop_times_every_epoch(synth_root, tmp_path):
    import json
    import statistics

    _script("plain_loop.py", [str(synth_root), "--device", "cpu", "--epochs", "3", "--batch-size", "8",
                              "--workers", "1", "--json", str(tmp_path / "r.json")], tmp_path)
    r = json.loads((tmp_path / "r.json").read_text())
    assert len(r["epochs"]) == 3 and all(x > 0 for x in r["epochs"])
    assert r["images_per_s"] == statistics.median(r["epochs"][1:])  # the epochs after the first
    assert r["ceiling"] is None and r["decode_backend"] == "cpu"


def test_plain_loop_times_whole_validation_passes(synth_root, tmp_path):
    """``--validation``: each epoch a train=False pass over every image, the short last batch too."""
    import json

    _script("plain_loop.py", [str(synth_root), "--device", "cpu", "--epochs", "2", "--batch-size", "16",
                              "--workers", "1", "--validation", "--json", str(tmp_path / "v.json")], tmp_path)
    r = json.loads((tmp_path / "v.json").read_text())
    assert r["validation"] and len(r["epochs"]) == 2 and all(x > 0 for x in r["epochs"])
    assert r["decode_backend"] == "cpu" and r["ceiling"] is None


def test_ab_harness_runs_a_commit_against_the_working_tree(synth_root, tmp_path):
    """The reference a/b harness, tiny: HEAD exported with git archive, both trees alternating in fresh
    processes, a row per tree with its median, spread and verdict."""
    import json

    out = _script("ab.py", [str(synth_root), "--ref", "HEAD", "--rows", "none", "--rounds", "2", "--epochs", "2",
                            "--batch-size", "8", "--workers", "1", "--device", "cpu", "--json",
                            str(tmp_path / "ab.json")], tmp_path, HOME=str(tmp_path))
    (row,) = _rows(out)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "none (images/s)" and cells[5] in ("faster", "slower", "within noise")
    assert re.fullmatch(r"[+-]\d+\.\d% \([+-]\d+\.\d to [+-]\d+\.\d%\)", cells[4])  # paired, 2 rounds
    assert re.fullmatch(r"[\d,]+ \([\d,]+-[\d,]+\)", cells[1]) and re.fullmatch(r"[\d,]+ \([\d,]+-[\d,]+\)", cells[2])
    result = json.loads((tmp_path / "ab.json").read_text())
    ref, cur = result["runs"]["none/HEAD"], result["runs"]["none/current"]
    assert len(ref) == len(cur) == 2 and all(len(r["epochs"]) == 2 for r in ref + cur)
    exported = next((tmp_path / ".cache" / "gpufeed" / "ab").iterdir())
    assert all(r["tree"].startswith(str(exported)) for r in ref)  # each tree ran its own code
    assert all(r["tree"].startswith(str(BENCHMARKS.parent / "src")) for r in cur)
    assert all(r["cropped_decode"] for r in ref + cur)  # the reference's extension built too
    assert all(r["wall_s"] > 0 for r in ref + cur)


def test_ab_verdict_needs_every_run_of_one_tree_past_every_run_of_the_other_and_two_of_each(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from harness import verdict

    assert verdict([100, 104], [105, 106]) == "faster" and verdict([100, 104], [90, 99]) == "slower"
    assert verdict([100, 104], [103, 110]) == "within noise"
    assert verdict([1000], [1000.5]) == "too few runs (1 and 1)"  # one run has no spread to judge by
    assert verdict([1000, 1100, 1050], [1101]) == "too few runs (3 and 1)"


def test_ab_paired_change_is_the_median_of_each_rounds_ratio(monkeypatch):
    """Drift between rounds cancels: each round's current run against that round's reference run."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from harness import paired

    ref = [{"images_per_s": 100.0}, {"images_per_s": 200.0}, {"images_per_s": 150.0}]
    cur = [{"images_per_s": 102.0}, {"images_per_s": 202.0}, {"error": "exit status 1"}]
    assert paired(ref, cur) == "+1.5% (+1.0 to +2.0%)"  # the failed round left out, not paired with another
    shares = [{"of_ceiling": 0.80, "images_per_s": 8000.0}], [{"of_ceiling": 0.84, "images_per_s": 8400.0}]
    assert paired(*shares) == "+5.0% (1 round)" and paired([], []) == "-"


def test_ab_harness_prints_its_tables_when_stopped(synth_root, tmp_path):
    """A ``timeout`` (SIGTERM) ending the harness mid-way still gets the tables of the runs made."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "ab.py"), str(synth_root), "--bench", "--rows", "none",
                             "--rounds", "50", "--epochs", "2", "--batch-size", "8", "--workers", "1", "--device",
                             "cpu"], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    lines = []
    for line in proc.stdout:  # the first run's line, then stop it within the next
        lines.append(line)
        if line.startswith("round 1 none"):
            break
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    assert "stopped (SIGTERM) in round" in out
    (row,) = _rows(out)
    assert row.startswith("| none (images/s) |")


def test_ab_harness_builds_a_reference_folders_extension(synth_root, tmp_path):
    """A reference given as a folder (an exported tree, as carried to a GPU machine) decodes as the working
    tree does: its cropped-decode extension is built before it runs."""
    import json
    import subprocess

    tree = tmp_path / "ref"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(BENCHMARKS.parent), "archive", "HEAD"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    _script("ab.py", [str(synth_root), "--ref", str(tree), "--rows", "none", "--rounds", "1", "--epochs", "2",
                      "--batch-size", "8", "--workers", "1", "--device", "cpu", "--json", str(tmp_path / "ab.json")],
            tmp_path)
    runs = json.loads((tmp_path / "ab.json").read_text())["runs"][f"none/{tree}"]
    assert runs[0]["tree"].startswith(str(tree)) and runs[0]["cropped_decode"]


def test_ab_harness_checks_the_bench_against_a_plain_loop(synth_root, tmp_path):
    """``--bench``: gpufeed bench of the working tree in every round beside its plain loop, and the gap;
    ``--budget``: no round is begun that would end past it (a round here takes seconds)."""
    out = _script("ab.py", [str(synth_root), "--bench", "--rows", "none", "--rounds", "3", "--epochs", "2",
                            "--batch-size", "8", "--workers", "1", "--device", "cpu", "--budget", "1"], tmp_path)
    (row,) = _rows(out)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "none (images/s)" and re.fullmatch(r"[+-]\d+\.\d%", cells[3])
    assert "round 1 none bench:" in out and "round 1 none current:" in out
    assert "round 2 not begun" in out and "round 2 none" not in out and "1 rounds" in out
    assert "WARNING" not in out  # the bench runs the working tree: no extension mismatch to report


def test_monitor_cost_times_every_monitor(synth_root, tmp_path):
    out = _script("monitor_cost.py", [str(synth_root), "--models", "none", "--rounds", "1", "--batch-size", "8",
                                      "--workers", "1", "--device", "cpu"], tmp_path)
    names = [r.split("|")[1].strip() for r in _rows(out)]
    assert names == ["plain", "sampler", "sampler-nvml", "sampler-rss", "pss", "thread", "bar", "sum"]


def test_steady_times_every_epoch_of_each_scenario_in_a_process_of_its_own(synth_root, tmp_path):
    """benchmarks/steady.py, tiny: each scenario's epochs, the marked ones (validation before, the hog during)
    starred and left out of the steady rate, the validation passes timed, the hog's curve read."""
    import json
    import statistics

    out = _script("steady.py", [str(synth_root), "--device", "cpu", "--epochs", "6", "--batch-size", "8",
                                "--workers", "1", "--hog-cores", "1", "--json", str(tmp_path / "s.json")], tmp_path)
    results = {r["scenario"]: r for r in json.loads((tmp_path / "s.json").read_text())}
    assert set(results) == {"fresh", "after-loaders", "after-validation", "hog"}
    assert all(len(r["epochs"]) == 6 and all(x > 0 for x in r["epochs"]) for r in results.values())
    assert len({r["pid"] for r in results.values()}) == 4  # each in a fresh process
    val, hog = results["after-validation"], results["hog"]
    assert val["marked"] == [3, 5] and len(val["validation"]) == 2 and hog["marked"] == [2, 3]
    assert val["steady"] == statistics.median([val["epochs"][i] for i in (2, 4)])
    assert results["fresh"]["marked"] == [] and results["fresh"]["steady"] == statistics.median(
        results["fresh"]["epochs"][2:])
    rows = {r.split("|")[1].strip(): r for r in _rows(out) if r.split("|")[1].strip() in results}
    assert set(rows) == set(results) and "*" in rows["hog"] and "*" not in rows["fresh"]


def test_verify_cost_times_the_check_and_without(synth_root, tmp_path):
    from gpufeed.shards import ShardOptions, ShardSize, write_shards

    write_shards(synth_root, tmp_path / "shards", ShardOptions(shard_size=ShardSize(16), workers=1))
    out = _script("verify_cost.py", [str(tmp_path / "shards"), "--rounds", "1", "--batch-size", "8", "--image-size",
                                     "16", "--workers", "1"], tmp_path)
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| True") or line.startswith("| False")]
    assert [r[0].strip() for r in rows] == ["False", "True"] and all(float(r[1]) > 0 for r in rows)
    assert "3 shards" in out and "40 samples" in out and "the check's cost:" in out
