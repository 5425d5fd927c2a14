"""What `gpufeed bench` says while it runs, where standard error is no terminal: each epoch a child process
reports, and a line whenever a step goes quiet for longer than the bench allows."""

import os
import subprocess
import sys
import time

import pytest

from gpufeed.bench.progress import EpochBar, Progress, follow

# A child that reports its epochs as the bench's child process does, one second apart.
CHILD = """
import sys, time
from gpufeed.bench.progress import EpochPipe
pipe = EpochPipe(int(sys.argv[1]))
time.sleep(0.6)
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
    # before the first epoch's end the clock counts the child's start too, and says so
    assert lines[:first] and all(line.startswith("  gpufeed: starting, then epoch 1/2 (warm-up) running, ")
                                 for line in lines[:first])
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
    """Made by a process of its own, its files counted here meanwhile; made again, nothing is written."""
    from gpufeed.bench.run import make_synthetic

    assert make_synthetic(tmp_path / "synth", 24, Progress(), quiet_s=0.05) == 24
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("  synthetic data: ") and line.endswith(" of 24 JPEGs written")
                         for line in lines)
    assert len(list((tmp_path / "synth").rglob("*.jpg"))) == 24
    assert make_synthetic(tmp_path / "synth", 24, Progress(), quiet_s=0.05) == 0  # cached: nothing written


def test_synthetic_data_that_cannot_be_made_names_its_folder_after_the_makers_own_error(tmp_path, capfd):
    from gpufeed.bench.run import SyntheticDataError, make_synthetic

    (tmp_path / "taken").write_text("a file where the folder would go")
    with pytest.raises(SyntheticDataError, match=f"making the synthetic data set under {tmp_path / 'taken'} failed"):
        make_synthetic(tmp_path / "taken", 8, Progress())
    assert "Error" in capfd.readouterr().err  # the making process's own error, on standard error
