"""examples/train.py on the CPU: a few steps, a mid-epoch checkpoint, and a resume that finishes the epoch."""

import torch

from gpufeed.synth import create_synthetic_dataset

from .examples import EXAMPLES, load_example

EXAMPLE = EXAMPLES / "train.py"


def test_train_checkpoint_and_resume(tmp_path, capsys):
    create_synthetic_dataset(tmp_path / "data" / "train", n=24, num_classes=3, seed=0, workers=1)
    create_synthetic_dataset(tmp_path / "data" / "val", n=6, num_classes=3, seed=1, workers=1)
    ckpt = tmp_path / "ckpt.pt"
    common = ["--data", str(tmp_path / "data"), "--model", "resnet18", "--batch-size", "4", "--image-size", "32",
              "--workers", "1", "--device", "cpu", "--epochs", "2", "--checkpoint", str(ckpt)]
    train = load_example("train")
    assert train.main(common + ["--max-steps", "3", "--checkpoint-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "6 steps/epoch" in out and "stopping at step 3 (--max-steps); checkpoint" in out
    state = torch.load(ckpt, weights_only=False)  # saved at the stop, not only at the last periodic save
    assert state["step"] == 3 and state["epoch"] == 0 and state["loader"]["sampler"]["offset"] == 12

    assert train.main(common + ["--resume", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "epoch 0, step 3, 12 samples of the epoch done" in out
    assert "epoch 1:" in out and "epoch 2:" in out and "val top-1" in out and "data wait" in out
    final = torch.load(ckpt, weights_only=False)
    assert final["step"] == 12 and final["epoch"] == 2  # 3 steps to finish epoch 1, then 6


def _torchrun(args, **kw):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a free port, so parallel or repeated runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "--master_addr=127.0.0.1", str(EXAMPLE), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _epoch_samples(log, epoch=0):
    """Sample indices trained on in ``epoch``, by rank, from ``--sample-log`` files."""
    out = {}
    for rank in (0, 1):
        lines = [line.split() for line in open(f"{log}.rank{rank}")]
        out[rank] = [int(i) for fields in lines if int(fields[0]) == epoch for i in fields[2:]]
    return out


def test_sigterm_under_torchrun_saves_and_the_resumed_run_trains_on_the_rest(tmp_path):
    """Two CPU ranks under torchrun; SIGTERM mid-epoch (as a scheduler preempts): both ranks stop at the same
    step, rank 0 saves, the job exits cleanly; resumed, the two runs together trained on every sample of the
    epoch exactly once (checked by the sample indices each rank logged)."""
    import signal
    import time

    create_synthetic_dataset(tmp_path / "data" / "train", n=96, num_classes=2, seed=0, workers=1)
    create_synthetic_dataset(tmp_path / "data" / "val", n=4, num_classes=2, seed=1, workers=1)
    log, ckpt = tmp_path / "samples", tmp_path / "c.pt"
    args = ["--data", str(tmp_path / "data"), "--model", "resnet18", "--batch-size", "2", "--image-size", "32",
            "--workers", "1", "--device", "cpu", "--epochs", "1", "--checkpoint", str(ckpt),
            "--sample-log", str(log), "--stop-check-every", "1"]
    job = _torchrun(args)
    rank0 = tmp_path / "samples.rank0"
    deadline = time.monotonic() + 180
    while not (rank0.exists() and len(rank0.read_text().splitlines()) >= 3):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # to torchrun, which passes it to the ranks
    out, err = job.communicate(timeout=120)
    assert "stop requested); checkpoint" in out, out + err[-3000:]
    first = _epoch_samples(log)
    state = torch.load(ckpt, weights_only=False)
    steps = state["step"]
    assert 3 <= steps < 24 and len(first[0]) == len(first[1]) == 2 * steps  # both ranks stopped at one step
    assert state["loader"]["sampler"]["offset"] == 4 * steps

    resumed = _torchrun(args + ["--resume", str(ckpt)])
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-3000:]
    assert f"epoch 0, step {steps}, {4 * steps} samples of the epoch done" in out and "epoch 1:" in out
    both = _epoch_samples(log)
    assert sorted(both[0] + both[1]) == list(range(96))  # every sample once over the two runs and two ranks
    assert torch.load(ckpt, weights_only=False)["step"] == 24


def test_ctrl_c_saves_and_exits_with_the_signals_status(tmp_path):
    """Ctrl-C (SIGINT) asks the run to stop after its step: the checkpoint is saved, and the exit status is the
    shell's 130, not 0, so a wrapper that runs the script until it succeeds does not take it as finished."""
    import os
    import signal
    import subprocess
    import sys
    import time

    create_synthetic_dataset(tmp_path / "data" / "train", n=96, num_classes=2, seed=0, workers=1)
    create_synthetic_dataset(tmp_path / "data" / "val", n=4, num_classes=2, seed=1, workers=1)
    log, ckpt = tmp_path / "samples", tmp_path / "c.pt"
    cmd = [sys.executable, str(EXAMPLE), "--data", str(tmp_path / "data"), "--model", "resnet18", "--batch-size", "2",
           "--image-size", "32", "--workers", "1", "--device", "cpu", "--epochs", "1", "--checkpoint", str(ckpt),
           "--sample-log", str(log)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rank0 = tmp_path / "samples.rank0"
    deadline = time.monotonic() + 180
    while not (rank0.exists() and len(rank0.read_text().splitlines()) >= 2):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=120)
    assert "stop requested); checkpoint" in out, out + err[-3000:]
    assert job.returncode == 130, (job.returncode, err[-3000:])
    assert torch.load(ckpt, weights_only=False)["step"] >= 2
