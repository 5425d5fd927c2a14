"""What `gpufeed bench` says while it runs, where standard error is no terminal: each epoch a child process
reports, and a line whenever a step goes quiet for longer than the bench allows."""

import os
import subprocess
import sys
import time

from gpufeed.bench.progress import EpochBar, Progress, follow
from gpufeed.synth import create_synthetic_dataset

# A child that reports its epochs as the bench's child process does, one second apart.
CHILD = """
import sys, time
from gpufeed.bench.progress import EpochPipe
pipe = EpochPipe(int(sys.argv[1]))
pipe.ended(1.5, 100.0)
time.sleep(1.0)
pipe.ended(0.5, 200.0)
pipe.close()
"""


def _child(code: str, *args: str, pass_fds=()) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, pass_fds=pass_fds)


def test_follow_shows_each_epoch_a_child_reports_and_that_it_is_at_work_in_between(capsys):
    read_end, write_end = os.pipe()
    try:
        child = _child(CHILD, str(write_end), pass_fds=(write_end,))
        os.close(write_end)
        bar = EpochBar("gpufeed", ["warm-up", "plain"], Progress())
        assert follow(child, read_end, bar, time.monotonic() + 120, quiet_s=0.2)
        assert child.returncode == 0
    finally:
        os.close(read_end)
    lines = capsys.readouterr().err.splitlines()
    first = lines.index("  gpufeed epoch 1/2 (warm-up): 1.5 s, 100 images/s")
    last = lines.index("  gpufeed epoch 2/2 (plain): 0.5 s, 200 images/s")
    between = lines[first + 1:last]
    assert between and all(line.startswith("  gpufeed: epoch 2/2 (plain) running, ") for line in between)
    assert all(line.startswith("  gpufeed: all epochs done; ending") for line in lines[last + 1:])


def test_follow_gives_up_at_its_deadline_on_a_child_that_reports_nothing(capsys):
    read_end, write_end = os.pipe()
    child = _child("import time; time.sleep(60)", pass_fds=(write_end,))
    os.close(write_end)
    try:
        bar = EpochBar("model alone", [], Progress())
        assert not follow(child, read_end, bar, time.monotonic() + 1.0, quiet_s=0.2)
        assert child.poll() is None  # still running: the caller stops it
    finally:
        child.kill()
        child.wait()
        os.close(read_end)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("  model alone: running, ") and line.endswith(" s so far") for line in lines)


def test_the_synthetic_data_being_made_is_counted_aloud(tmp_path, capsys):
    progress = Progress()
    with progress.making(tmp_path / "synth", 24, quiet_s=0.05) as count:
        create_synthetic_dataset(tmp_path / "synth", n=24, num_classes=3, seed=2, workers=1)
    assert count.written() == 24
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("  synthetic data: ") and line.endswith(" of 24 JPEGs written")
                         for line in lines)
    with progress.making(tmp_path / "synth", 24) as again:  # cached: nothing written
        create_synthetic_dataset(tmp_path / "synth", n=24, num_classes=3, seed=2, workers=1)
    assert again.written() == 0
