"""benchmarks/shards.py run tiny on the CPU, so it cannot rot: it converts, runs every loop in fresh processes,
measures the crops' PSNR and prints its tables."""

import re
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "shards.py"


def test_shards_benchmark_runs_tiny_on_the_cpu(tmp_path, capfd, monkeypatch):
    argv = ["--device", "cpu", "--n", "48", "--epochs", "2", "--rounds", "1", "--batch-size", "8", "--image-size", "48",
            "--workers", "2", "--ceiling-seconds", "0.2", "--psnr-images", "6", "--psnr-sizes", "96,160",
            "--work", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capfd.readouterr().out  # the loops print from their own processes
    assert re.search(r"conversion: 48 images \(\d+ resized to max side 320\) into 1 shards .* [\d,]+ images/s", out)
    for variant in ("original", "shards"):
        for mode in ("loader", "train  "):
            assert len(re.findall(rf"{variant} +{mode.strip()} +epoch \d: 48 images", out)) == 2, (variant, mode)
    lines = out.rstrip().splitlines()
    assert lines[-5].startswith("| data | loader only")
    original, shards, ratio = (line.split("|")[1:-1] for line in lines[-3:])
    assert original[0].strip() == "original" and shards[0].strip() == "shards"
    for row in (original, shards):
        assert all(float(c.strip().rstrip("%").replace(",", "")) > 0 for c in row[1:])
    assert ratio[0].strip() == "shards / original" and float(ratio[1].strip().rstrip("x")) > 0
    psnr = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^\| (\d+) \| ([\d.]+) \|", out, re.M)}
    assert set(psnr) == {96, 160} and all(15 < v < 60 for v in psnr.values())
    assert re.search(r"stats\['shards'\] \{'format': 'tar', [^}]*'max_side': 320", out), out
