"""examples/train.py on the CPU: a few steps, a mid-epoch checkpoint, and a resume that finishes the epoch."""

import importlib.util
from pathlib import Path

import torch

from gpufeed.synth import create_synthetic_dataset

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_checkpoint_and_resume(tmp_path, capsys):
    create_synthetic_dataset(tmp_path / "data" / "train", n=24, num_classes=3, seed=0, workers=1)
    create_synthetic_dataset(tmp_path / "data" / "val", n=6, num_classes=3, seed=1, workers=1)
    ckpt = tmp_path / "ckpt.pt"
    common = ["--data", str(tmp_path / "data"), "--model", "resnet18", "--batch-size", "4", "--image-size", "32",
              "--workers", "1", "--device", "cpu", "--epochs", "2", "--checkpoint", str(ckpt)]
    train = _load()
    assert train.main(common + ["--max-steps", "3", "--checkpoint-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "6 steps/epoch" in out and "stopping at step 3" in out
    state = torch.load(ckpt, weights_only=False)
    assert state["step"] == 2 and state["epoch"] == 0 and state["loader"]["sampler"]["offset"] == 8

    assert train.main(common + ["--resume", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "epoch 0, step 2, 8 samples of the epoch done" in out
    assert "epoch 1:" in out and "epoch 2:" in out and "val top-1" in out
    final = torch.load(ckpt, weights_only=False)
    assert final["step"] == 12 and final["epoch"] == 2  # 4 steps to finish epoch 1, then 6


def test_train_under_torchrun_two_processes(tmp_path):
    """DDP through torchrun (gloo on the CPU): ranks shard the data and train in step."""
    import subprocess
    import sys

    create_synthetic_dataset(tmp_path / "data" / "train", n=16, num_classes=2, seed=0, workers=1)
    create_synthetic_dataset(tmp_path / "data" / "val", n=4, num_classes=2, seed=1, workers=1)
    import socket

    with socket.socket() as sock:  # a free port, so parallel or repeated runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "--master_addr=127.0.0.1", str(EXAMPLE),
           "--data", str(tmp_path / "data"), "--model", "resnet18", "--batch-size", "2", "--image-size", "32",
           "--workers", "1", "--device", "cpu", "--epochs", "1", "--checkpoint", str(tmp_path / "c.pt")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 process(es) on cpu" in res.stdout and "4 steps/epoch" in res.stdout and "epoch 1:" in res.stdout
