"""What `gpufeed synth` and `gpufeed info` say while they work, with stderr a pipe (a log, CI): what is
made and where, progress lines, the reuse of a cached dataset, a line before each slow probe."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _gpufeed(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "gpufeed", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=300)


def test_synth_says_what_it_makes_then_how_far_it_got_then_that_it_reuses_it(tmp_path):
    root = tmp_path / "d"
    made = _gpufeed("synth", str(root), "--n", "30", "--classes", "3")
    assert made.returncode == 0, made.stderr
    lines = made.stderr.splitlines()
    assert re.fullmatch(rf"gpufeed synth: writing 30 ImageNet-like JPEGs in 3 classes under {re.escape(str(root))} "
                        r"\(seed 0, \d+ process(es)?\)", lines[0]), lines[0]
    counts = [int(m.group(1)) for line in lines[1:] if (m := re.fullmatch(r"gpufeed synth: (\d+)/30 img \(\d+%.*\)", line))]
    assert len(counts) == len(lines) - 1, lines  # nothing else on stderr: no bar's control characters
    assert len(counts) >= 2 and counts == sorted(counts) and counts[-1] == 30, lines
    files = sorted(root.glob("class_*/img_*.jpg"))
    assert len(files) == 30
    pixels = np.asarray(Image.open(files[0]))
    assert pixels.std() > 10  # textured content, as the loader tests need

    written = {p: p.stat().st_mtime_ns for p in files}
    again = _gpufeed("synth", str(root), "--n", "30", "--classes", "3")
    assert again.returncode == 0, again.stderr
    assert again.stderr.splitlines() == [f"gpufeed synth: {root} already holds these 30 JPEGs in 3 classes (seed 0): reused"]
    assert {p: p.stat().st_mtime_ns for p in files} == written  # reused, not written again


def test_synth_refuses_a_folder_holding_another_data_set_and_finishes_its_own_unfinished_run(tmp_path):
    """Written into a folder a loader would read whole, another data set's images would join this one's."""
    root = tmp_path / "d"
    assert _gpufeed("synth", str(root), "--n", "12", "--classes", "3").returncode == 0
    other = _gpufeed("synth", str(root), "--n", "6", "--classes", "3")
    assert other.returncode != 0
    assert (f"{str(root)!r} holds another synthetic data set (n=12, classes=3, seed=0), which a loader would read "
            "with this one: give another folder, or delete it first") in other.stderr
    marker = next(p for p in root.iterdir() if p.is_file())
    marker.unlink()  # as a run killed before its end leaves it
    smaller = _gpufeed("synth", str(root), "--n", "6", "--classes", "3")
    assert smaller.returncode != 0 and f"{str(root)!r} holds 'class_000/img_000006.jpg', which this data set does not " \
        "hold" in smaller.stderr, smaller.stderr
    finished = _gpufeed("synth", str(root), "--n", "12", "--classes", "3")  # the same data set: written over
    assert finished.returncode == 0, finished.stderr
    assert len(list(root.glob("class_*/img_*.jpg"))) == 12
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    foreign = _gpufeed("synth", str(tmp_path / "mine"), "--n", "3")
    assert foreign.returncode != 0 and "holds 'notes.txt'" in foreign.stderr


def test_a_library_caller_that_asks_for_quiet_gets_no_output(tmp_path, capfd):
    from gpufeed.synth import create_synthetic_dataset

    create_synthetic_dataset(tmp_path / "q", n=3, num_classes=2, workers=1, progress=False)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert len(list((tmp_path / "q").glob("class_*/img_*.jpg"))) == 3


def test_plain_progress_lines_each_tenth_and_the_last(tmp_path):
    import io

    from gpufeed.progress import Progress

    stream = io.StringIO()
    with Progress("job", 50, stream=stream) as bar:
        for done in range(1, 51):
            bar.update(done)
    counts = [int(re.match(r"job: (\d+)/50 img", line).group(1)) for line in stream.getvalue().splitlines()]
    assert counts == [5, 10, 15, 20, 25, 30, 35, 40, 45, 50]

    stream = io.StringIO()
    with Progress("job", 7, stream=stream) as bar:
        bar.update(3)
    assert stream.getvalue().splitlines()[-1].startswith("job: 3/7 img (42%")  # closed part-way: where it stopped


def test_info_says_what_it_probes_before_it_probes_it():
    run = _gpufeed("info")
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if line.startswith("gpufeed info: ")]
    assert said[:2] == ["gpufeed info: importing torch ...", "gpufeed info: probing the CPU decoder ..."]
    assert re.search(r"^decode: cpu \(simplejpeg \+ Pillow\) +works$", run.stdout, re.M), run.stdout


def test_ctrl_c_stops_synth_at_once_in_one_line(tmp_path):
    """Ctrl-C reaches the whole process group: the pool's processes leave it to the parent, which stops them
    and says so in one line, with the shell's status for it."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = subprocess.Popen([sys.executable, "-m", "gpufeed", "synth", str(tmp_path / "d"), "--n", "5000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "d").glob("class_*/img_*.jpg")):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    sent = time.monotonic()
    os.killpg(job.pid, signal.SIGINT)
    out, err = job.communicate(timeout=60)
    assert time.monotonic() - sent < 10 and job.returncode == 130, (job.returncode, err)
    assert err.rstrip().splitlines()[-1] == "gpufeed synth: interrupted" and "Traceback" not in err, err
    assert len(list((tmp_path / "d").glob("class_*/img_*.jpg"))) < 5000
