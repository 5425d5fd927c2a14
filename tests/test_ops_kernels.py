"""The auto-augment family's Triton kernels (augment.ops.kernels) against the PyTorch passes they replace on
CUDA: run here on the CPU through Triton's interpreter, every colour and point operation at several
magnitudes, on images of one tile and of two, and on images too small to sharpen; the normalising and MixUp
kernels bit for bit; a loader's batches with an auto-augment recipe; and the fallbacks.

Everything goes through ``augment.ops``' public functions, ``SampleOps``, ``BatchMix``, ``ImageLoader`` and the
environment the kernels read (``GPUFEED_OPS_KERNELS``, ``TRITON_INTERPRET``) but the sm_90 compilations, which
need the @triton.jit functions themselves (``_jitted``)."""

import contextlib
import importlib
import json
import os
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch

from gpufeed.augment.fused import normalize_constants
from gpufeed.augment.ops import apply_operations, apply_passes, kernels

triton = pytest.importorskip("triton")

FAILED = "PyTorch passes (the Triton kernels failed: "


def _jitted() -> dict:
    """The kernels as Triton compiles them, and the options their launches pass: the one place this file names
    private parts of ``kernels`` (a @triton.jit function has no public name, and without a GPU no launch
    compiles one)."""
    return {"stats": kernels._stats, "apply": kernels._apply, "normalize": kernels._normalize,
            "mixup": kernels._mixup, "unfused": kernels._UNFUSED}


@pytest.fixture
def load_kernels():
    """``load()`` imports ``kernels`` again as a fresh process would (no launch failed yet): with
    ``cpu_reaches``, under ``TRITON_INTERPRET=1`` (the kernels then take CPU tensors) while Triton's own
    interpreter stays off, so a CPU tensor reaches the compiled kernels and their launch fails as on a GPU
    without a compiler or driver; with ``triton_installed=False``, where Triton cannot be imported. After the
    test, imported again as this process has it. (Ask for it before ``monkeypatch``, so that what a test
    patches is put back before.)"""
    saved = os.environ.get("TRITON_INTERPRET")

    def load(*, cpu_reaches: bool = False, triton_installed: bool = True) -> None:
        del triton.knobs.runtime.interpret
        os.environ.pop("TRITON_INTERPRET", None)
        if cpu_reaches:
            triton.knobs.runtime.interpret = False  # Triton compiles (this also sets TRITON_INTERPRET=0) ...
            os.environ["TRITON_INTERPRET"] = "1"  # ... while the kernels, reading it at import, take CPU tensors
        hidden = {"triton": None, "triton.language": None}  # as for a package not installed
        with contextlib.nullcontext() if triton_installed else mock.patch.dict(sys.modules, hidden):
            importlib.reload(kernels)

    yield load
    del triton.knobs.runtime.interpret
    os.environ.pop("TRITON_INTERPRET", None)
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    importlib.reload(kernels)


@contextlib.contextmanager
def _triton_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    caught[:] = [str(w.message) for w in caught if "Triton" in str(w.message)]


def _constants(mean, std):
    """(scale, shift), each (1, 3, 1, 1) float32: uint8 v normalises to v x scale + shift."""
    return tuple(torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) for v in normalize_constants(mean, std))


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


def interpreted(call: str) -> dict:
    """``call`` (a function of this module, returning JSON) run in a child process under Triton's interpreter:
    Triton reads TRITON_INTERPRET when its kernels are defined."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("GPUFEED_OPS_KERNELS", None)
    code = f"import json; import tests.test_ops_kernels as t; print(json.dumps(t.{call}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_kernels_give_the_pytorch_passes_pixels_in_triton_s_interpreter():
    """In a child process (there the fused multiply-add goes through float64, rounded once as CUDA's is)."""
    check(interpreted(f"compare('cpu', {SIZES!r})"), SIZES)


NORMS = {"imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), "other": ((0.5, 0.3, 0.1), (0.21, 0.7, 0.05))}
SHAPES = ((3, 3, 5, 7), (2, 3, 33, 31), (1, 3, 40, 40), (2, 3, 1, 9), (2, 3, 9, 1))  # 40 x 40 x 3: padded tiles
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AS_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Values compared, values whose bits differ (as integers: -0.0 and NaN counted), and whether the shapes,
    dtypes and strides agree."""
    same_kind = a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    differ = int((a.view(_AS_INT[a.dtype]) != b.view(_AS_INT[b.dtype])).sum()) if same_kind else -1
    return {"values": a.numel() if same_kind else 0, "differ": differ, "same_kind": same_kind}


def normalized() -> dict:
    """Per normalisation, shape, dtype and layout, ``SampleOps.from_pixels`` (no pixel ops: the normalising
    alone) on random pixels (the first 256 every level) through the kernel against the same call with
    ``GPUFEED_OPS_KERNELS=0`` (the PyTorch passes), and against the expression those passes compute;
    and the number of the kernel's launches."""
    from gpufeed.augment.ops import SampleOps

    calls = []
    launch = kernels.normalize
    kernels.normalize = lambda *args: calls.append(1) or launch(*args)
    report = {}
    try:
        g = torch.Generator().manual_seed(0)
        for norm, (mean, std) in NORMS.items():
            ops = SampleOps(mean=mean, std=std)
            scale, shift = _constants(mean, std)
            for shape in SHAPES:
                pixels = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
                pixels.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[:pixels.numel()]
                for name, dtype in DTYPES.items():
                    for layout in ("channels_last", "contiguous"):
                        kw = dict(dtype=dtype, channels_last=layout == "channels_last")
                        ours = ops.from_pixels(pixels, range(shape[0]), 0, 0, **kw)
                        os.environ["GPUFEED_OPS_KERNELS"] = "0"
                        passes = ops.from_pixels(pixels, range(shape[0]), 0, 0, **kw)
                        del os.environ["GPUFEED_OPS_KERNELS"]
                        fmt = torch.channels_last if kw["channels_last"] else torch.contiguous_format
                        expression = (pixels * scale).add_(shift).to(dtype=dtype, memory_format=fmt)
                        key = f"{norm} {shape} {name} {layout}"
                        report[key] = {"passes": same_bits(ours, passes), "expression": same_bits(ours, expression),
                                       "fresh": ours.data_ptr() != passes.data_ptr() != pixels.data_ptr()}
    finally:
        kernels.normalize = launch
    return {"calls": len(calls), "report": report}


def test_the_normalising_kernel_gives_the_pytorch_passes_bits_in_triton_s_interpreter():
    """float32, bfloat16 and float16, channels_last and contiguous, ImageNet's and other constants, odd sizes:
    the same bits and strides as ``(pixels * scale).add_(shift).to(dtype, memory_format)``."""
    result = interpreted("normalized()")
    report = result["report"]
    assert len(report) == len(NORMS) * len(SHAPES) * len(DTYPES) * 2
    assert result["calls"] == len(report)  # the kernel made each batch (the passes: none)
    for key, r in report.items():
        for against in ("passes", "expression"):
            assert r[against]["same_kind"] and r[against]["differ"] == 0, (key, against, r)
            assert r[against]["values"] >= 54, (key, r)  # every value of the smallest batch
        assert r["fresh"], key


def rounded_at_ties() -> dict:
    """The kernel's float32 -> bfloat16 and float16 rounding against PyTorch's ``.to``, with constants that
    put many v x scale exactly halfway between two values of the dtype (either of them even), and some
    negative; and how many of those values rounding down (truncation) or half away from zero would get wrong."""
    report = {}
    pixels = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(4, 3, 16, 16).contiguous()
    for name, dtype, bits in (("bfloat16", torch.bfloat16, 7), ("float16", torch.float16, 10)):
        ulp = 2.0 ** -bits  # of the values in [1, 2)
        scale = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + 3 * ulp / 2)]).view(1, 3, 1, 1)
        shift = torch.zeros(1, 3, 1, 1)
        exact = (pixels * scale).add_(shift)  # float32, exact: at most 19 bits (and 0 * -s + 0 is +0.0)
        reference = exact.to(dtype)
        lower = exact.abs().to(torch.float64)  # each value's two neighbours in ``dtype``, from the exact value
        exponent = torch.floor(torch.log2(lower.clamp(min=1)))
        step = 2.0 ** (exponent - bits)
        down = torch.floor(lower / step) * step
        ties = (lower - down == step / 2) & (lower >= 1)
        truncated = (down * exact.sign()).to(dtype)
        away = ((down + step) * exact.sign()).to(dtype)
        for layout in (False, True):
            ours = kernels.normalize(pixels, scale, shift, dtype, layout)
            report[f"{name} {layout}"] = {
                **same_bits(ours, reference.contiguous(memory_format=torch.channels_last if layout else
                                                        torch.contiguous_format)),
                "ties": int(ties.sum()), "truncation_wrong": int((ties & (truncated != reference)).sum()),
                "away_wrong": int((ties & (away != reference)).sum())}
    return report


def test_the_normalising_kernel_rounds_ties_to_even_as_pytorch_does_in_triton_s_interpreter():
    """Where truncation (the interpreter's own bfloat16 cast) or rounding half away from zero would give
    another value, the kernel gives PyTorch's."""
    report = interpreted("rounded_at_ties()")
    assert len(report) == 4
    for key, r in report.items():
        assert r["same_kind"] and r["values"] == 4 * 3 * 256 and r["differ"] == 0, (key, r)
        assert r["ties"] >= 50 and r["truncation_wrong"] >= 10 and r["away_wrong"] >= 10, (key, r)


def _plain(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
    from gpufeed.augment.ops import SampleOps

    ops = SampleOps(mean=mean, std=std)
    pixels = torch.randint(0, 256, (2, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    scale, shift = _constants(mean, std)
    return ops, pixels, (pixels * scale).add_(shift)


@pytest.mark.parametrize("where", ["cpu", "switched off"])
def test_the_normalising_is_pytorch_s_on_the_cpu_or_with_the_kernels_off(load_kernels, monkeypatch, where):
    """A CPU tensor with compiled Triton, or ``GPUFEED_OPS_KERNELS=0`` where the kernel could run: the
    PyTorch passes, in the asked dtype and layout, and the kernel never called."""
    load_kernels(cpu_reaches=where == "switched off")
    if where == "switched off":
        monkeypatch.setenv("GPUFEED_OPS_KERNELS", "0")
    monkeypatch.setattr(kernels, "normalize", lambda *_: pytest.fail("the kernel ran"))
    ops, pixels, expected = _plain()
    for dtype in DTYPES.values():
        out = ops.from_pixels(pixels, [0, 1], 0, 0, dtype=dtype, channels_last=True)
        assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
        assert out.dtype == dtype and torch.equal(out, expected.to(dtype)), dtype
        contiguous = ops.from_pixels(pixels, [0, 1], 0, 0, dtype=dtype, channels_last=False)
        assert contiguous.is_contiguous() and torch.equal(contiguous, out)


def test_a_normalising_kernel_that_cannot_run_turns_the_kernels_off_with_one_warning(load_kernels):
    """Compiled Triton on a CPU tensor fails as a missing compiler or driver would: the PyTorch passes' bits,
    one warning naming the normalising kernel, and every kernel off."""
    load_kernels(cpu_reaches=True)
    ops, pixels, expected = _plain(mean=(0.5, 0.3, 0.1), std=(0.21, 0.7, 0.05))
    assert kernels.usable(pixels)
    with _triton_warnings() as caught:
        outs = [ops.from_pixels(pixels, [0, 1], 0, 0, dtype=torch.bfloat16, channels_last=True) for _ in range(2)]
    assert len(caught) == 1 and "Triton normalising kernel failed" in caught[0], caught
    assert kernels.describe().startswith(FAILED) and not kernels.usable(pixels)
    reference = expected.to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    assert all(torch.equal(out, reference) and out.stride() == reference.stride() for out in outs)


def test_a_kernel_that_cannot_run_turns_itself_off_with_one_warning(load_kernels):
    """Compiled (not interpreted) Triton on CPU tensors fails as a missing compiler or driver would: the
    PyTorch passes' pixels come back, one warning says why, and ``describe`` names the failure."""
    load_kernels(cpu_reaches=True)
    images = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    steps = [("Brightness", 0.5), ("Equalize", 0.0), ("Sharpness", -0.4)]
    assert kernels.usable(images)
    with _triton_warnings() as caught:
        out = apply_operations(images, steps)
        again = apply_operations(images, steps)
    assert len(caught) == 1 and "Triton colour kernels failed" in caught[0], caught
    reason = kernels.describe().removeprefix(FAILED)
    assert kernels.describe().startswith(FAILED) and f"({reason[:-1]})" in caught[0] and not kernels.usable(images)
    reference = apply_passes(images, steps)
    assert torch.equal(out, reference) and torch.equal(again, reference)
    assert not torch.equal(reference, images)


def test_the_kernels_are_used_only_where_they_can_run(load_kernels, monkeypatch):
    load_kernels()
    cpu = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    assert not kernels.usable(cpu)  # a CPU tensor, compiled Triton
    assert kernels.describe() == f"two Triton kernels per step (triton {triton.__version__})"
    load_kernels(cpu_reaches=True)
    assert kernels.usable(cpu)  # where they could run, the switch alone turns them off:
    monkeypatch.setenv("GPUFEED_OPS_KERNELS", "0")
    assert not kernels.usable(cpu) and kernels.describe() == "PyTorch passes (GPUFEED_OPS_KERNELS=0)"
    monkeypatch.delenv("GPUFEED_OPS_KERNELS")
    load_kernels(cpu_reaches=True, triton_installed=False)
    assert not kernels.usable(cpu) and kernels.describe() == "PyTorch passes (Triton not installed)"
    images = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    steps = [("Posterize", 3.0), ("Contrast", 0.3)]
    assert torch.equal(apply_operations(images, steps), apply_passes(images, steps))


def test_an_error_before_the_launch_is_raised_not_retried(load_kernels):
    """Only a failed launch turns the kernels off and falls back; an error before it (here a row short for
    the batch, as an error in the upload would be) reaches the caller as it is, and the kernels stay on."""
    load_kernels(cpu_reaches=True)
    images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    with _triton_warnings() as caught, pytest.raises(ValueError, match="a row per sample, got shape"):
        apply_operations(images, [("Brightness", 0.5), ("Identity", 0.0), ("Color", 0.2)])
    assert caught == [] and kernels.usable(images)
    assert kernels.describe() == f"two Triton kernels per step (triton {triton.__version__})"


@pytest.mark.parametrize("kernels_on", [True, False])
def test_an_unknown_operation_is_refused_naming_it_on_both_paths(load_kernels, kernels_on):
    load_kernels(cpu_reaches=kernels_on)
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

    jitted = _jitted()
    pointers = {"src": "*u8", "table": "*fp32", "stats": "*fp32", "luts": "*u8"}
    signatures = {jitted["stats"]: {**pointers, "hw": "i32", "inv_hw": "fp32", "BLOCK": "constexpr"},
                  jitted["apply"]: {**pointers, "out": "*u8", "h": "i32", "w": "i32", "BLOCK": "constexpr"}}
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


LAMS = (0.3, 0.123456789, 0.9990001, 1.0, 0.0)
MIX_SHAPES = ((4, 3, 5, 7), (3, 3, 33, 31), (1, 3, 4, 4), (2, 3, 40, 40))


def mixed() -> dict:
    """Per dtype, layout, shape and lam, ``BatchMix.apply``'s MixUp through the kernel against the same call
    with ``GPUFEED_OPS_KERNELS=0`` (the PyTorch passes, in place) and against torchvision's sum; whether the
    kernel's batch is a new one and the one given kept; and the number of the kernel's launches."""
    from gpufeed.augment.mix import BatchMix, Mix

    calls = []
    launch = kernels.mixup
    kernels.mixup = lambda *args: calls.append(1) or launch(*args)
    mix = BatchMix((("MixUp", 1.0),), (1.0,), num_classes=4)
    report = {}
    try:
        g = torch.Generator().manual_seed(0)
        for name, dtype in DTYPES.items():
            for layout in ("channels_last", "contiguous"):
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                for shape in MIX_SHAPES:
                    for lam in LAMS:
                        images = (torch.randn(shape, generator=g) * 3).to(dtype)
                        images.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-40, -3.0])  # signed zeros, a subnormal
                        images = images.contiguous(memory_format=fmt)
                        labels = torch.arange(shape[0]) % 4
                        given = images.clone(memory_format=torch.preserve_format)
                        ours, _ = mix.apply(images, labels, Mix("MixUp", lam), fresh=True)
                        kept = torch.equal(images.view(_AS_INT[dtype]), given.view(_AS_INT[dtype]))
                        torchvision = given.roll(1, 0).mul_(1.0 - lam).add_(given.mul(lam))
                        os.environ["GPUFEED_OPS_KERNELS"] = "0"
                        passes, _ = mix.apply(given, labels, Mix("MixUp", lam), fresh=True)
                        del os.environ["GPUFEED_OPS_KERNELS"]
                        report[f"{name} {layout} {shape} {lam}"] = {
                            "passes": same_bits(ours, passes),
                            "torchvision": same_bits(ours, torchvision.contiguous(memory_format=fmt)),
                            "kept": kept, "new": ours.data_ptr() != images.data_ptr(),
                            "in_place": passes.data_ptr() == given.data_ptr()}
    finally:
        kernels.mixup = launch
    return {"calls": len(calls), "report": report}


def test_the_mixup_kernel_gives_the_pytorch_passes_bits_in_triton_s_interpreter():
    """float32, bfloat16 and float16, channels_last and contiguous, a lone sample, lam 0 and 1: the bits and
    strides of the in-place passes and of torchvision's ``rolled * (1 - lam) + images * lam``, in a new batch
    (the batch given left as it was)."""
    result = interpreted("mixed()")
    report = result["report"]
    assert len(report) == len(DTYPES) * 2 * len(MIX_SHAPES) * len(LAMS) and result["calls"] == len(report)
    for key, r in report.items():
        for against in ("passes", "torchvision"):
            assert r[against]["same_kind"] and r[against]["differ"] == 0, (key, against, r)
            assert r[against]["values"] >= 48, (key, r)  # every value of the smallest batch
        assert r["new"] and r["kept"] and r["in_place"], (key, r)


@pytest.mark.parametrize("where", ["cpu", "switched off", "failing"])
def test_mixup_is_pytorch_s_in_place_where_the_kernel_does_not_run(load_kernels, monkeypatch, where):
    """On a CPU tensor with compiled Triton, with ``GPUFEED_OPS_KERNELS=0``, or where the launch fails (one
    warning, the kernels off): torchvision's bits, mixed in place in the batch given."""
    from gpufeed.augment.mix import BatchMix, Mix

    load_kernels(cpu_reaches=where != "cpu")  # a CPU tensor reaches the compiled kernel: its launch fails
    if where == "switched off":
        monkeypatch.setenv("GPUFEED_OPS_KERNELS", "0")
    if where != "failing":
        monkeypatch.setattr(kernels, "mixup", lambda *_: pytest.fail("the kernel ran"))
    images = torch.randn(3, 3, 6, 5, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    images = images.contiguous(memory_format=torch.channels_last)
    expected = images.roll(1, 0).mul_(0.75).add_(images.mul(0.25))
    with _triton_warnings() as caught:
        out, labels = BatchMix((("MixUp", 1.0),), (1.0,), num_classes=4).apply(images, torch.arange(3),
                                                                               Mix("MixUp", 0.25), fresh=True)
    assert out is images and torch.equal(out, expected) and out.stride() == (90, 1, 15, 3)
    assert torch.equal(labels[0], torch.tensor([0.25, 0.0, 0.75, 0.0]))
    assert len(caught) == (where == "failing") and all("Triton MixUp kernel failed" in w for w in caught), caught
    assert kernels.describe().startswith(FAILED) == (where == "failing")


def test_mixup_mixes_a_batch_it_was_not_told_is_fresh_in_place_where_the_kernel_runs(load_kernels, monkeypatch):
    """A batch from the loader's fixed GPU outputs (no per-sample ops made a new one) is mixed in place even
    where the kernel runs: a new batch per MixUp batch would take GPU memory past the loader's budget."""
    from gpufeed.augment.mix import BatchMix, Mix

    load_kernels(cpu_reaches=True)  # the kernels would take these CPU tensors
    monkeypatch.setattr(kernels, "mixup", lambda *_: pytest.fail("the kernel ran on a batch not fresh"))
    images = torch.randn(3, 3, 6, 5, generator=torch.Generator().manual_seed(3)).contiguous(
        memory_format=torch.channels_last)
    expected = images.roll(1, 0).mul_(0.75).add_(images.mul(0.25))
    mix = BatchMix((("MixUp", 1.0),), (1.0,), num_classes=4)
    out, _ = mix.apply(images, torch.arange(3), Mix("MixUp", 0.25))
    assert out is images and torch.equal(out, expected)
    taken = []
    monkeypatch.setattr(kernels, "mixup", lambda batch, lam: taken.append(lam) or batch.clone())
    out, _ = mix.apply(images, torch.arange(3), Mix("MixUp", 0.25), fresh=True)
    assert taken == [0.25] and out is not images


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_normalising_kernel_compiles_for_a_hopper_gpu_rounding_as_pytorch(dtype):
    """Compiled for sm_90 without a GPU, in both layouts: with the options its launch passes, a product and a
    sum each rounded (``mul.rn``, ``add.rn``; with Triton's default options, one fused multiply-add rounding
    once), then the dtype's round-to-nearest-even conversion, the one PyTorch's CUDA cast uses."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jitted = _jitted()
    fn = jitted["normalize"]
    types = {"src": "*u8", "out": f"*{dtype}", "scale": "*fp32", "shift": "*fp32"}
    signature = {name: types.get(name, "constexpr" if name.isupper() else "i32") for name in fn.arg_names}
    for channels_last in (True, False):
        source = ASTSource(fn=fn, signature=signature, constexprs={"CHANNELS_LAST": channels_last, "BLOCK": 1024})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=jitted["unfused"]).asm["ptx"]
        fused = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx and "fma" not in ptx and ".f64" not in ptx
        assert ".ftz" not in ptx and "fma.rn.f32" in fused
        if dtype != "fp32":
            assert f"cvt.rn.{dtype.replace('fp', 'f')}.f32" in ptx


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_mixup_kernel_compiles_for_a_hopper_gpu_rounding_as_pytorch(dtype):
    """As the normalising kernel: two products and a sum each rounded (with Triton's default options, in
    float32, a fused multiply-add), each rounded into the dtype with its round-to-nearest-even conversion. The
    compiler may add two bfloat16 or float16 values in their own precision: the same sum, as float32's 24
    bits are at least twice theirs plus two (rounding twice gives the value rounding once does)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jitted = _jitted()
    fn = jitted["mixup"]
    types = {"src": f"*{dtype}", "out": f"*{dtype}", "w0": "fp32", "w1": "fp32", "BLOCK": "constexpr"}
    source = ASTSource(fn=fn, signature={name: types.get(name, "i32") for name in fn.arg_names},
                       constexprs={"BLOCK": 1024})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=jitted["unfused"]).asm["ptx"]
    fused = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    added = ("add.rn.f32",) if dtype == "fp32" else ("add.rn.f32", f"add.rn.{dtype.replace('fp', 'f')}")
    assert ptx.count("mul.rn.f32") >= 2 and any(a in ptx for a in added)
    assert "fma" not in ptx and ".f64" not in ptx and ".ftz" not in ptx  # subnormals kept, as PyTorch's are
    if dtype == "fp32":  # (in the others each product is rounded into the dtype before the sum: nothing to fuse)
        assert "fma.rn.f32" in fused
    else:
        assert ptx.count(f"cvt.rn.{dtype.replace('fp', 'f')}.f32") >= 3


def test_a_loader_says_what_runs_its_auto_augment_ops(load_kernels):
    """``SampleOps.auto_augment_runner`` (``ImageLoader.stats["auto_augment_ops"]``, the bench's row): the
    kernels' own account on a CUDA device where the recipe has an auto-augment op, None otherwise; after a
    failed launch, the failure."""
    from torchvision.transforms import v2

    from gpufeed.augment.ops import SampleOps
    from gpufeed.augment.recipe import read_transform

    load_kernels()
    mean, std = (0.5,) * 3, (0.25,) * 3
    with_auto = SampleOps(pixel=read_transform(v2.Compose([v2.RandomResizedCrop(8), v2.RandAugment()])).pixel,
                          mean=mean, std=std)
    without = SampleOps(pixel=read_transform(v2.Compose([v2.RandomResizedCrop(8), v2.ColorJitter(0.2)])).pixel,
                        mean=mean, std=std)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert with_auto.auto_augment_runner(cuda) == f"two Triton kernels per step (triton {triton.__version__})"
    assert with_auto.auto_augment_runner(cpu) is None and without.auto_augment_runner(cuda) is None
    load_kernels(cpu_reaches=True)
    with _triton_warnings() as caught:
        apply_operations(torch.zeros(1, 3, 4, 4, dtype=torch.uint8), [("Brightness", 0.5)])
    assert len(caught) == 1
    runner = with_auto.auto_augment_runner(cuda)
    assert runner.startswith(FAILED) and f"({runner.removeprefix(FAILED)[:-1]})" in caught[0], (runner, caught)


def loaded(root: str) -> dict:
    """Batches of an ImageLoader on the CPU with an auto-augment recipe as ``transform=``: through the kernels
    (here, Triton's interpreter), with ``GPUFEED_OPS_KERNELS=0`` (the PyTorch passes), and without the
    auto-augment ops; per batch, whether the first two have the same bits and whether they differ from the
    third; and how many times the kernels were launched."""
    from torchvision.transforms import v2

    from gpufeed import ImageLoader

    calls = []
    launch = kernels.apply
    kernels.apply = lambda images, rows: calls.append(len(rows)) or launch(images, rows)
    head = [v2.RandomResizedCrop(24), v2.RandomHorizontalFlip()]
    tail = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
    kw = dict(batch_size=8, device="cpu", num_workers=1, seed=5)

    def batches(transform):
        with ImageLoader(root, transform=v2.Compose(transform), **kw) as loader:
            return [x for x, _ in loader]

    try:
        ours = batches(head + [v2.TrivialAugmentWide(), v2.RandAugment(num_ops=2)] + tail)
        used = len(calls)
        os.environ["GPUFEED_OPS_KERNELS"] = "0"
        passes = batches(head + [v2.TrivialAugmentWide(), v2.RandAugment(num_ops=2)] + tail)
        del os.environ["GPUFEED_OPS_KERNELS"]
        plain = batches(head + tail)
    finally:
        kernels.apply = launch
    return {"calls": used, "after_off": len(calls) - used, "batches": len(ours),
            "same": [bool(torch.equal(a, b)) for a, b in zip(ours, passes, strict=True)],
            "changed": [not torch.equal(a, b) for a, b in zip(ours, plain, strict=True)]}


def test_a_loader_s_auto_augment_batches_are_the_pytorch_passes_bits_in_triton_s_interpreter(synth_root):
    """``ImageLoader(transform=...)`` with TrivialAugmentWide and RandAugment on the CPU, in a child process
    under Triton's interpreter: the kernels make the batches' ops (a launch a batch at least), and the batches
    are those of the PyTorch passes, bit for bit, and not the batches without the ops."""
    result = interpreted(f"loaded({str(synth_root)!r})")
    assert result["batches"] == 5 and result["calls"] >= result["batches"] and result["after_off"] == 0, result
    assert all(result["same"]) and any(result["changed"]), result
