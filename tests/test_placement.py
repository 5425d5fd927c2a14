"""The placement policy: which decoder, the cost model, which samples the CPU takes, the CPU share, the
cores kept from the workers."""

import pytest
import torch

import gpufeed.placement as placement
from gpufeed import cores
from gpufeed.augment.params import CropBox
from gpufeed.placement import Candidate, ShareControl, cheapest_on_cpu, cpu_cost, create_gpu_decoders, engine_cost


def test_decoder_placement_on_the_cpu(monkeypatch):
    assert create_gpu_decoders("auto", torch.device("cpu"))[0] is None
    import gpufeed.augment.fused as fused

    with monkeypatch.context() as m:
        m.setattr(fused, "triton", None)
        assert create_gpu_decoders("auto", torch.device("cuda", 0)) == (
            None, "decode='auto': Triton is not installed (the fused GPU kernel needs it); CPU workers")
    decoders, why = create_gpu_decoders("auto", torch.device("cuda", 0))
    if decoders is None:  # no GPU here: the CPU workers, and the reason says why for each GPU decoder
        assert why.startswith("decode='auto': nvjpeg unavailable") and "nvimgcodec unavailable" in why
        assert "CPU workers" in why
    else:
        assert decoders[0].name in ("nvjpeg-hw", "nvimgcodec")  # never torchvision's decoder
    assert create_gpu_decoders("cpu", torch.device("cpu"))[0] is None
    from gpufeed.augment.params import AugmentSpec

    from gpufeed.augment.params import RandomCrop

    decoders, why = create_gpu_decoders("nvjpeg", torch.device("cuda", 0),
                                        recipe=placement.cpu_crops(AugmentSpec(crop=RandomCrop())))
    assert decoders is None and why.startswith("RandomCrop: CPU workers")  # made for nothing otherwise
    assert placement.cpu_crops(AugmentSpec()) is None  # RandomResizedCrop: the GPU path's
    assert placement.cpu_crops(AugmentSpec(train=False)) is None  # Resize + CenterCrop: augment.center_crop
    with pytest.raises(ValueError, match="decode='nvimgcodec' needs a CUDA device"):
        create_gpu_decoders("nvimgcodec", torch.device("cpu"))
    with pytest.raises(ValueError, match="decode must be one of"):
        create_gpu_decoders("dali", torch.device("cpu"))


def test_decoder_placement_order_and_fallback(monkeypatch):
    """Each choice tries its decoders in order, says why each earlier one was passed over, and an explicit
    single choice that cannot work raises instead of quietly decoding elsewhere."""

    def broken(device, batch_size):
        raise RuntimeError("no engines on this GPU")

    made = lambda name: (lambda device, batch_size: ([name] * 2, f"{name} works"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(placement.decoders, "_MAKERS", {"nvjpeg": broken, "nvimgcodec": made("nvimgcodec"),
                                               "torchvision": made("torchvision")})
    decoders, why = create_gpu_decoders("gpu", cuda)
    assert decoders == ["nvimgcodec", "nvimgcodec"]
    assert why == "nvjpeg unavailable: RuntimeError: no engines on this GPU; nvimgcodec works"
    with pytest.raises(ValueError, match="nvjpeg unavailable: RuntimeError: no engines"):
        create_gpu_decoders("nvjpeg", cuda)
    monkeypatch.setitem(placement.decoders._MAKERS, "nvimgcodec", broken)
    assert create_gpu_decoders("gpu", cuda)[0][0] == "torchvision"
    decoders, why = create_gpu_decoders("auto", cuda)
    assert decoders is None and why.endswith("; CPU workers (pip install gpufeed[nvjpeg-cu13] or gpufeed[nvimgcodec-cu13])")
    monkeypatch.setitem(placement.decoders._MAKERS, "torchvision", broken)
    decoders, why = create_gpu_decoders("gpu", cuda)
    assert decoders is None and why.count("unavailable") == 3 and why.endswith("CPU decode")


def _candidate(y, h, w=100, nbytes=1000, height=100):
    return Candidate(nbytes, height, CropBox(0, y, w, h))


def test_the_cpu_takes_small_boxes_near_the_top_first():
    # costs: 1000 bytes x (y + h) / 100 rows + half the box's pixels
    chunk = {10: _candidate(50, 50), 11: _candidate(0, 20, 20), 12: _candidate(0, 100), 13: _candidate(10, 30, 30)}
    assert [round(cpu_cost(c)) for c in chunk.values()] == [3500, 400, 6000, 850]
    assert cheapest_on_cpu(chunk, 0) == cheapest_on_cpu(chunk, -1) == set()
    assert cheapest_on_cpu(chunk, 2) == {11, 13}
    assert cheapest_on_cpu(chunk, 9) == {10, 11, 12, 13}


def test_the_cpu_takes_what_saves_the_engines_most_per_unit_of_its_own_cost():
    # a: a large file with a small box at the top: CPU 100,000 x 20 / 100 + 200 = 20,200, engines 136,000
    # b: a small file cropped whole:               CPU 4,000 + 5,000 = 9,000,              engines 40,000
    chunk = {0: _candidate(0, 20, 20, nbytes=100_000), 1: _candidate(0, 100, 100, nbytes=4_000)}
    assert [round(cpu_cost(c)) for c in chunk.values()] == [20_200, 9_000]
    assert [engine_cost(c) for c in chunk.values()] == [136_000, 40_000]
    assert cheapest_on_cpu(chunk, 1) == {0}  # 0.149 < 0.225, though b costs the CPU less


class _ScriptedIdle:
    """Idle-core readings on demand: ``poll`` returns the next queued value, None when none is queued."""

    def __init__(self, cores=16):
        self.capacity, self.readings, self.window_s = float(cores), [], 0.1

    def poll(self):
        return self.readings.pop(0) if self.readings else None


def test_share_control_gives_the_workers_what_they_keep_up_with_and_leaves_cores_idle():
    idle = _ScriptedIdle(16)
    auto = ShareControl("auto", idle)
    start, step = auto.value, 1 / 32
    assert auto.reserve == 4  # a quarter of the cores
    for _ in range(5):
        auto.update(collect_wait=0.0)  # ready, but the window has not ended: no change
    assert auto.value == start
    idle.readings = [8.0, 8.0, 4.5]
    for _ in range(3):
        auto.update(0.0)  # two windows with cores to spare: more; 4.5 idle is within the margin: hold
    assert auto.value == pytest.approx(start + 2 * step)
    for wait in (0.02, 0.02):
        auto.update(wait)  # two of the window's three batches were late: less, whatever the load
    idle.readings = [8.0]
    auto.update(0.0)
    assert auto.value == pytest.approx(start + step)
    for wait in (0.02, 0.0, 0.0):
        auto.update(wait)  # one late batch of four: not most
    idle.readings = [8.0]
    auto.update(0.0)
    assert auto.value == pytest.approx(start + 2 * step)
    idle.readings = [3.7]
    auto.update(0.0)  # fewer than 4 cores idle: less, a step per core missing (at least one)
    assert auto.value == pytest.approx(start + step)
    idle.readings = [1.0, 12.0]
    auto.update(0.0)
    assert auto.value == pytest.approx(start - 2 * step)
    auto.update(0.0)  # up: one step a window however many cores idle
    assert auto.value == pytest.approx(start - step)
    idle.readings = [0.0]
    auto.update(0.0)  # 4 missing: 4 steps, the most a window
    assert auto.value == pytest.approx(start - 5 * step)
    idle.readings = [16.0] * 100
    for _ in range(100):
        auto.update(0.0)
    assert auto.value == 1.0
    idle.readings = [16.0] * 100
    for _ in range(100):
        auto.update(0.5)
    assert auto.value == 0.0
    fixed = ShareControl(0.3)
    fixed.taken(False)
    fixed.update(0.0)
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match=r"cpu_share must be 'auto' or a fraction in \[0, 1\], got -0.1"):
        ShareControl(-0.1)


def test_share_control_moves_work_to_the_cpu_while_the_training_never_waits_for_the_loader():
    """A window in which the training took every batch ready: up one step, though the workers were late and
    crowded the cores; one wait in the window and the load rules decide again."""
    idle = _ScriptedIdle(16)
    auto = ShareControl("auto", idle)
    start, step = auto.value, 1 / 32
    for window in range(3):
        for _ in range(3):
            auto.taken(False)
            auto.update(0.02)  # late
        idle.readings = [0.0]  # every core busy
        auto.taken(False)
        auto.update(0.02)
        assert auto.value == pytest.approx(start + (window + 1) * step)
    for waited in (False, True, False):
        auto.taken(waited)
        auto.update(0.02)
    idle.readings = [0.0]
    auto.update(0.02)
    assert auto.value == pytest.approx(start + 3 * step - 4 * step)  # crowded: four steps down
    idle.readings = [8.0]
    auto.update(0.0)  # nothing taken in the window: not ahead, so the load rules (cores to spare: up)
    assert auto.value == pytest.approx(start)
    idle.readings = [16.0] * 40
    for _ in range(40):
        auto.taken(False)
        auto.update(0.5)
    assert auto.value == 1.0
    # no cores kept from the workers (under 8): they share the training's cores, so the load rules decide
    idle = _ScriptedIdle(4)
    shared = ShareControl("auto", idle, training_cores_kept=False)
    for _ in range(3):
        shared.taken(False)
        idle.readings = [0.0]
        shared.update(0.02)
    assert shared.value == pytest.approx(start - 3 * step)


def test_workers_keep_off_the_kept_cores_on_the_gpu_path_only(monkeypatch):
    mask = set(range(16))
    monkeypatch.setattr(cores, "affinity", lambda: mask)
    monkeypatch.setattr(cores, "_thread_siblings", lambda c: {c})
    assert placement.worker_cpus(gpu_path=False) is None  # the CPU path: the workers are the whole pipeline
    assert placement.worker_cpus(gpu_path=True) == set(range(placement.KEPT_CORES, 16))
    # two ranks on the node: each keeps its own cores, within the quarter-of-the-mask cap
    assert placement.worker_cpus(gpu_path=True, local_world_size=2) == set(range(4, 16))


def test_default_workers_share_the_usable_cores_among_the_nodes_ranks(monkeypatch):
    monkeypatch.setattr(placement.cpus, "usable_cores", lambda: 16)
    assert [placement.default_num_workers(r) for r in (1, 2, 3, 32)] == [16, 8, 5, 1]


def test_info_names_the_workers_cpus_as_ranges():
    from gpufeed.cores import cpu_ranges as _ranges
    from gpufeed.info import collect_info

    assert _ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and _ranges({3}) == "3"
    import torch

    info = collect_info()
    line = info["GPU path: workers' CPUs"]
    kept = placement.worker_cpus(gpu_path=True)
    if not torch.cuda.is_available():  # said plainly, with nothing that reads as a fault
        assert line == "no GPU here: the workers use every usable core"
        assert info["this machine"].startswith("CPU only") and info["NVML"] in ("not used (no NVIDIA driver here)",
                                                                              "not installed (pip install "
                                                                              "'gpufeed[nvml]' to read GPU utilisation)")
    elif kept is None:
        assert line.startswith("all (under 8 cores")
    else:
        assert line.startswith(_ranges(kept) + " (")


def test_gpu_memory_budget_counts_the_allocators_segments():
    # batch 256 at 224, float32: 147 MiB an output batch, 5 in flight with prefetch depth 2; 192 MiB a buffer
    m = placement.gpu_memory(batch_size=256, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=1)
    assert (m.batch_bytes, m.batches, m.buffer_bytes) == (256 * 3 * 224 * 224 * 4, 5, 256 * 3 * 512 * 512)
    mib = 1 << 20
    # each batch a segment of 148 MiB, each buffer one of 192 MiB, a 2 MiB small segment on each of 3 streams
    assert m.total == 5 * 148 * mib + 2 * 192 * mib + 3 * 2 * mib
    cpu = placement.gpu_memory(batch_size=256, image_size=224, itemsize=2, prefetch_depth=2, gpu_decoders=0)
    assert cpu.buffer_bytes == 0 and cpu.total == 5 * 74 * mib + 2 * 2 * mib  # CPU decode: outputs only
    capped = placement.gpu_memory(batch_size=256, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=1,
                                  max_gpu_memory=1 << 30)
    assert capped.total <= 1 << 30 < capped.total + 2 * 2 * mib  # the buffers as large as the cap allows
    with pytest.raises(ValueError, match=r"max_gpu_memory=1000 is less than the 5 output batches in flight"):
        placement.gpu_memory(batch_size=256, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=0,
                             max_gpu_memory=1000)
    with pytest.raises(ValueError, match=r"max_gpu_memory=100000000 leaves no room to decode"):
        placement.gpu_memory(batch_size=256, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=1,
                             max_gpu_memory=100_000_000)


def test_reserved_bytes_follows_the_caching_allocators_segments():
    mib = 1 << 20
    assert placement.reserved_bytes(1000, 3) == 2 * mib  # small blocks share a 2 MiB segment
    assert placement.reserved_bytes(mib, 3) == 4 * mib  # two 1 MiB blocks a segment
    assert placement.reserved_bytes(4 * mib, 2) == 20 * mib and placement.reserved_bytes(4 * mib, 6) == 40 * mib
    assert placement.reserved_bytes(19_267_584, 5) == 5 * 20 * mib  # batch 32 at 224, float32: 20 MiB each
    assert placement.reserved_bytes(24 * mib, 2) == 48 * mib and placement.reserved_bytes(0, 4) == 0
    # under a cap, the decode buffers fall to the next class of segment rather than past the cap
    for cap in (110 * mib, 130 * mib, 151 * mib):
        m = placement.gpu_memory(batch_size=32, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=1,
                                 max_gpu_memory=cap)
        assert m.total <= cap and m.buffer_bytes >= 224 * 224 * 3, (cap, m)


def test_images_larger_than_a_decode_buffer_stay_on_the_cpu(tmp_path):
    from tests.corpus import jpeg

    data = jpeg(200, 100)
    room = dict(bytes_capacity=1 << 20, buffer_bytes=200 * 100 * 3)
    assert placement.gpu_may_take(data, (200, 100, True), 1, **room)
    assert not placement.gpu_may_take(data, (201, 100, True), 1, **room)
    assert not placement.gpu_may_take(data, (200, 100, False), 1, **room)  # not for libjpeg-turbo's RGB path
    assert not placement.gpu_may_take(data, (200, 100, True), 6, **room)  # EXIF-rotated
    assert not placement.gpu_may_take(data, (200, 100, True), 1, bytes_capacity=len(data) - 1,
                                      buffer_bytes=1 << 20)  # a file over the ring's room for bytes


def test_images_with_a_side_over_the_gpu_limit_stay_on_the_cpu():
    """nvJPEG's engine decoders took memory for images of up to GPU_MAX_SIDE a side: nothing longer reaches them."""
    from tests.corpus import jpeg

    side = placement.GPU_MAX_SIDE
    room = dict(bytes_capacity=1 << 20, buffer_bytes=1 << 30)
    data = jpeg(64, 48)  # the header given decides; the bytes only pass the structural check
    assert placement.gpu_may_take(data, (side, side, True), 1, **room)
    assert not placement.gpu_may_take(data, (side + 1, 16, True), 1, **room)
    assert not placement.gpu_may_take(data, (16, side + 1, True), 1, **room)


def test_decode_calls_are_never_larger_than_what_the_decoders_took_memory_for():
    assert placement.decode_call_images(256, 256) == 128  # two decoder threads share a batch
    assert placement.decode_call_images(1024, 256) == 256
    assert placement.decode_call_images(3, 256) == 2
