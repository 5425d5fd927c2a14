"""The auto-augment family's Triton kernels (augment.ops.kernels) against the PyTorch passes they replace on
CUDA: run here on the CPU through Triton's interpreter, every colour and point operation at several
magnitudes, on images of one tile and of two, and on images too small to sharpen; and the fallbacks."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from gpufeed.augment.ops import apply_operations, apply_passes, kernels

triton = pytest.importorskip("triton")

def compare(device: str, sizes) -> dict:
    """Every colour and point operation at several magnitudes (and a few the kernels leave to the geometry
    passes), through the kernels and through the PyTorch passes, on random (h, w) images of each of
    ``sizes`` with narrow, flat and nearly flat channels: per operation, samples, samples the operation
    changed, values compared, values that differ, and the largest difference; and the number of rows each
    call of the kernels took."""
    from gpufeed.augment.ops.auto import AUGMIX, STANDARD, WIDE

    calls = []
    launch = kernels.apply
    kernels.apply = lambda images, rows: calls.append(len(rows)) or launch(images, rows)
    try:
        g = torch.Generator().manual_seed(0)
        report = {}
        for h, w in sizes:
            steps = []
            for name in kernels.CODES:
                for space, bins in ((WIDE, 31), (STANDARD, 31), (AUGMIX, 10)):
                    fn, signed = space.get(name, (None, False))
                    picks = [0, 5, 17, 20, 22, 30] if bins == 31 else [1, 3, 6, 9]  # 20: 0.66 in WIDE
                    mags = [0.0] if fn is None else [float(m) for m in fn(bins, w)[picks]]
                    steps += [(name, s * m) for m in mags for s in ((1, -1) if signed else (1,))]
            steps += [("Posterize", float(b)) for b in range(9)]
            steps += [("Identity", 0.0), ("Rotate", 30.0), ("TranslateX", 3.0)]
            images = torch.randint(0, 256, (len(steps), 3, h, w), dtype=torch.uint8, generator=g)
            images[::3] = images[::3] // 8 + 90  # a narrow range
            images[1::7, 1] = 42  # a channel of one value
            images[2::11, 2] = 250
            images[2::11, 2, 0, 0] = 3  # all but one pixel at the brightest: equalize's step of 0
            images = images.to(device)
            ours, reference = apply_operations(images, steps), apply_passes(images, steps)
            for i, (name, _) in enumerate(steps):
                d = (ours[i].int() - reference[i].int()).abs()
                r = report.setdefault(name, {"samples": 0, "changed": 0, "values": 0, "differ": 0, "max": 0})
                r["samples"] += 1
                r["changed"] += int(not torch.equal(reference[i], images[i]))
                r["values"] += d.numel()
                r["differ"] += int((d > 0).sum())
                r["max"] = max(r["max"], int(d.max()))
        return {"calls": calls, "report": report}
    finally:
        kernels.apply = launch


def check(result: dict, sizes) -> None:
    """The kernels ran once per size on every sample, every operation was compared on changed images, and
    the pixels are the PyTorch passes', exactly."""
    report = result["report"]
    assert len(result["calls"]) == len(sizes) and all(n > 50 for n in result["calls"]), result["calls"]
    assert set(report) == set(kernels.CODES) | {"Identity", "Rotate", "TranslateX"}
    for name, r in report.items():
        assert r["samples"] >= len(sizes), name
        assert r["differ"] == 0, (name, r)
    assert sum(r["changed"] for r in report.values()) > 0.7 * sum(r["samples"] for r in report.values())
    assert report["Equalize"]["changed"] >= len(sizes) - 1  # a real lookup table (3 x 3 has none)


SIZES = ((2, 2), (3, 3), (6, 9), (17, 17), (33, 31), (40, 40))  # 33 x 31, 40 x 40: two tiles, padded lanes


def test_the_kernels_give_the_pytorch_passes_pixels_in_triton_s_interpreter():
    """In a child process: Triton reads TRITON_INTERPRET when its kernels are defined (there its fused
    multiply-add goes through float64, rounded once as CUDA's is)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("GPUFEED_OPS_KERNELS", None)
    code = ("import json; from tests.test_ops_kernels import compare; "
            f"print(json.dumps(compare('cpu', {SIZES!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    check(json.loads(out.stdout.strip().splitlines()[-1]), SIZES)


def test_a_kernel_that_cannot_run_turns_itself_off_with_one_warning(monkeypatch):
    """Compiled (not interpreted) Triton on CPU tensors fails as a missing compiler or driver would: the
    PyTorch passes' pixels come back, one warning says why, and ``describe`` names the failure."""
    monkeypatch.setattr(kernels, "_INTERPRET", True)  # let a CPU tensor reach the compiled kernel
    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.delenv("GPUFEED_OPS_KERNELS", raising=False)
    images = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    steps = [("Brightness", 0.5), ("Equalize", 0.0), ("Sharpness", -0.4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = apply_operations(images, steps)
        again = apply_operations(images, steps)
    assert [str(w.message) for w in caught if "Triton colour kernels failed" in str(w.message)] != []
    assert len([w for w in caught if "Triton" in str(w.message)]) == 1
    assert kernels._failed is not None and kernels.describe().startswith("PyTorch passes (the Triton kernels failed")
    monkeypatch.setenv("GPUFEED_OPS_KERNELS", "0")
    monkeypatch.setattr(kernels, "_failed", None)
    reference = apply_operations(images, steps)
    assert torch.equal(out, reference) and torch.equal(again, reference)
    assert not torch.equal(reference, images)


def test_the_kernels_are_used_only_where_they_can_run(monkeypatch):
    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.delenv("GPUFEED_OPS_KERNELS", raising=False)
    cpu = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    assert not kernels.usable(cpu)  # a CPU tensor, compiled Triton
    assert kernels.describe() == f"two Triton kernels per step (triton {triton.__version__})"
    monkeypatch.setenv("GPUFEED_OPS_KERNELS", "0")
    monkeypatch.setattr(kernels, "_INTERPRET", True)
    assert not kernels.usable(cpu) and kernels.describe() == "PyTorch passes (GPUFEED_OPS_KERNELS=0)"
    monkeypatch.setattr(kernels, "triton", None)
    assert kernels.describe() == "PyTorch passes (Triton not installed)"


def test_an_error_before_the_launch_is_raised_not_retried(monkeypatch):
    """Only a failed launch turns the kernels off and falls back; an error before it (here the upload, as
    out of memory would) reaches the caller once, and the kernels stay on."""
    monkeypatch.setattr(kernels, "_INTERPRET", True)
    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.delenv("GPUFEED_OPS_KERNELS", raising=False)
    attempts = []

    def upload(*_):
        attempts.append(1)
        raise torch.OutOfMemoryError("no memory for the table")

    monkeypatch.setattr(kernels, "on", upload)
    images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    with pytest.raises(torch.OutOfMemoryError, match="no memory for the table"):
        apply_operations(images, [("Brightness", 0.5), ("Identity", 0.0)])
    assert attempts == [1] and kernels._failed is None


@pytest.mark.parametrize("kernels_on", [True, False])
def test_an_unknown_operation_is_refused_naming_it_on_both_paths(monkeypatch, kernels_on):
    monkeypatch.setattr(kernels, "_INTERPRET", kernels_on)
    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.delenv("GPUFEED_OPS_KERNELS", raising=False)
    images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    assert kernels.usable(images) is kernels_on
    with pytest.raises(ValueError, match="no auto-augment operation 'Brightnes'; the operations are Identity, "):
        apply_operations(images, [("Brightness", 0.5), ("Brightnes", 0.5)])


def test_the_kernels_compile_for_a_hopper_gpu_without_one():
    """Compiled (not interpreted) for sm_90 with Triton's own compiler, as a GPU would build them: what the
    interpreter does not check (types across branches, constants). The arithmetic the pixels rest on is
    there: fused multiply-adds and correctly rounded divisions, and nothing in float64 (the interpreter's
    stand-in for the multiply-add)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = {"src": "*u8", "table": "*fp32", "stats": "*fp32", "luts": "*u8"}
    signatures = {kernels._stats: {**pointers, "hw": "i32", "inv_hw": "fp32", "BLOCK": "constexpr"},
                  kernels._apply: {**pointers, "out": "*u8", "h": "i32", "w": "i32", "BLOCK": "constexpr"}}
    ptx = {}
    for fn, signature in signatures.items():
        signature = {name: signature[name] for name in fn.arg_names}  # in the kernel's order
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs={"BLOCK": 1024}),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"]
        ptx[fn.__name__] = compiled.asm["ptx"]
    assert ".f64" not in ptx["_stats"] + ptx["_apply"]
    assert ptx["_stats"].count("fma.rn.f32") >= 2  # the grey image's two fused adds
    assert ptx["_apply"].count("fma.rn.f32") >= 10 and ptx["_apply"].count("div.rn.f32") >= 3


def test_a_loader_says_what_runs_its_auto_augment_ops(monkeypatch):
    """``SampleOps.auto_augment_runner`` (``ImageLoader.stats["auto_augment_ops"]``, the bench's row): the
    kernels' own account on a CUDA device where the recipe has an auto-augment op, None otherwise."""
    from torchvision.transforms import v2

    from gpufeed.augment.ops import SampleOps
    from gpufeed.augment.recipe import read_transform

    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.delenv("GPUFEED_OPS_KERNELS", raising=False)
    mean, std = (0.5,) * 3, (0.25,) * 3
    with_auto = SampleOps(pixel=read_transform(v2.Compose([v2.RandomResizedCrop(8), v2.RandAugment()])).pixel,
                          mean=mean, std=std)
    without = SampleOps(pixel=read_transform(v2.Compose([v2.RandomResizedCrop(8), v2.ColorJitter(0.2)])).pixel,
                        mean=mean, std=std)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert with_auto.auto_augment_runner(cuda) == f"two Triton kernels per step (triton {triton.__version__})"
    assert with_auto.auto_augment_runner(cpu) is None and without.auto_augment_runner(cuda) is None
    monkeypatch.setattr(kernels, "_failed", "RuntimeError: no ptxas")
    assert with_auto.auto_augment_runner(cuda) == "PyTorch passes (the Triton kernels failed: RuntimeError: no ptxas)"
