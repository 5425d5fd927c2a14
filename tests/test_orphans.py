"""A training process that dies, however it dies, leaves no worker process and no shared memory behind; one
that is only asked to stop keeps its loader until it has."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import shared_memory_mapped

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
    proc = subprocess.Popen([sys.executable, str(script), str(synth_root), device], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "ready"
        tree = psutil.Process(proc.pid).children(recursive=True)  # workers, forkserver, resource tracker
        # what the training's processes map, not all that appears in /dev/shm: other processes make files there
        made = shared_memory_mapped(proc.pid, *(p.pid for p in tree))
        assert len(tree) >= 3 and any(n.startswith("psm_") for n in made)  # there was something to leave
        proc.send_signal(sig)
        proc.wait(10)
        deadline = time.monotonic() + 30  # left as soon as all is gone; a busy machine may take seconds
        while True:
            alive = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            left = made & set(os.listdir("/dev/shm"))
            if not alive and not left:
                break
            assert time.monotonic() < deadline, f"30 s after {sig.name}: processes {alive}, /dev/shm {sorted(left)}"
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


GROUP = """
import signal, sys
from gpufeed import ImageLoader
signal.signal(signal.SIGTERM, lambda *a: None)  # asked to stop: it finishes the epoch here, as a step and a save
loader = ImageLoader(sys.argv[1], batch_size=4, image_size=16, num_workers=2, device=sys.argv[2], drop_last=False)
it = iter(loader)
n = len(next(it)[1])
print("ready", flush=True)
sys.stdin.readline()  # the group has had SIGTERM, and the fork server is gone
n += sum(len(labels) for _, labels in it)
print("delivered", n, flush=True)
"""


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sigterm_to_the_process_group_leaves_the_loader_delivering(tmp_path, synth_root, device):
    """torchrun and batch schedulers send SIGTERM to the training process's whole group, where the
    multiprocessing fork server dies of it; the workers ignore it, and the loader must not take them for
    dead while the training finishes its step and saves."""
    script = tmp_path / "group.py"
    script.write_text(GROUP)
    proc = subprocess.Popen([sys.executable, str(script), str(synth_root), device], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.poll() is not None else ""
        server = [p for p in psutil.Process(proc.pid).children() if "forkserver" in " ".join(p.cmdline())]
        assert len(server) == 1 and len(server[0].children()) == 2  # the workers are the fork server's children
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not _gone(server[0]):  # what the loader must get through
            assert time.monotonic() < deadline, "the fork server outlived SIGTERM"
            time.sleep(0.05)
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split() == ["delivered", "40"], out + err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
