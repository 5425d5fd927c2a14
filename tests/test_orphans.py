"""A training process that dies, however it dies, leaves no worker process and no shared memory behind."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

SCRIPT = """
import os, sys, time
from gpufeed import ImageLoader
loader = ImageLoader(sys.argv[1], batch_size=4, image_size=16, num_workers=2, device=sys.argv[2])
it = iter(loader)
next(it)  # mid-epoch: workers busy with the next batches, slots in use
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists POSIX shared memory in /dev/shm")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_training_process_leaves_nothing_behind(tmp_path, synth_root, sig, device):
    """On the GPU path the ring's page-locked pixel rooms are in /dev/shm too, and decoder threads run."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, str(script), str(synth_root), device], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "ready"
        tree = psutil.Process(proc.pid).children(recursive=True)  # workers, forkserver, resource tracker
        made = set(os.listdir("/dev/shm")) - before
        assert len(tree) >= 3 and any(n.startswith("psm_") for n in made)  # there was something to leave
        proc.send_signal(sig)
        proc.wait(10)
        deadline = time.monotonic() + 5
        while True:
            alive = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            left = made & set(os.listdir("/dev/shm"))
            if not alive and not left:
                break
            assert time.monotonic() < deadline, f"5 s after {sig.name}: processes {alive}, /dev/shm {sorted(left)}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


SPAWNED = """
import multiprocessing as mp, sys

def train(root):
    from gpufeed import ImageLoader
    loader = ImageLoader(root, batch_size=4, image_size=16, num_workers=2, device="cpu")
    for _ in loader:
        raise RuntimeError("loss is NaN")  # any training error, with the loader still alive in the traceback

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=train, args=(sys.argv[1],))
    p.start()
    p.join(60)
    print("exited" if not p.is_alive() else "still alive", p.exitcode, flush=True)
    if p.is_alive():
        p.kill()
"""


def test_a_spawned_training_process_that_fails_exits(tmp_path, synth_root):
    """As under torch.multiprocessing.spawn: the process exits with its error, its workers first (they ignore
    SIGTERM, so multiprocessing's own exit, which terminates and joins daemon children, must find them gone)."""
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    res = subprocess.run([sys.executable, str(script), str(synth_root)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.stdout.split() == ["exited", "1"], res.stdout + res.stderr[-2000:]
    assert "loss is NaN" in res.stderr
