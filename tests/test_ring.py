"""The shared ring: layout, and mapping its pages ahead so that writers take no page faults."""

import sys
from multiprocessing import shared_memory

import pytest

import gpufeed.ring as ring_mod
from gpufeed.ring import Ring

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads page faults from /proc")


def _faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


@pytest.fixture
def ring():
    shape = (2, 8, 32)  # slots, batch, image size
    capacity = 256 << 10
    shm = shared_memory.SharedMemory(create=True, size=Ring.nbytes(*shape, capacity))
    r = Ring(shm, *shape, capacity)
    yield r
    r.images = r.labels = r.meta = r.arena = r.rooms = None
    shm.close()
    shm.unlink()


def test_layout_views_do_not_overlap(ring):
    ring.images[:] = 1
    ring.labels[:] = 2
    ring.meta[:] = 3
    ring.arena[:] = 4
    assert (ring.images == 1).all() and (ring.labels == 2).all() and (ring.meta == 3).all()
    assert ring.arena.shape == (2, 8, 256 << 10) and ring.arena.strides[1] % 4096 == 0


def test_on_the_gpu_path_each_image_is_the_head_of_its_pixel_room(ring):
    px = 32 * 32 * 3
    assert ring.rooms.shape == (2, 8, ring_mod.PIXEL_ROOM * px) and ring.pixels is ring.rooms
    for s in range(2):
        for k in range(8):
            ring.rooms[s, k] = 10 * s + k
    assert all((ring.images[s, k] == 10 * s + k).all() for s in range(2) for k in range(8))
    ring.images[1, 3] = 99  # writes the first S x S x 3 bytes of that room only
    assert (ring.rooms[1, 3, :px] == 99).all() and (ring.rooms[1, 3, px:] == 13).all()
    assert (ring.rooms[1, 4] == 14).all() and (ring.rooms[1, 2] == 12).all()


def test_the_cpu_path_ring_has_contiguous_images_and_no_rooms():
    shm = shared_memory.SharedMemory(create=True, size=Ring.nbytes(2, 4, 16, 0))
    try:
        r = Ring(shm, 2, 4, 16, 0)
        assert r.rooms is None and r.meta is None and r.images.flags.c_contiguous and r.pixels is r.images
        r = None
    finally:
        shm.close()
        shm.unlink()


def _write_positions(ring, lo: int, hi: int) -> int:
    """Minor faults taken writing bytes [lo, hi) of every arena position."""
    before = _faults()
    for s in range(ring.arena.shape[0]):
        for k in range(ring.arena.shape[1]):
            ring.arena[s, k, lo:hi] = 7
    return _faults() - before


@linux
@pytest.mark.parametrize("madvise", [True, False])
def test_mapped_pages_take_no_faults_when_written(ring, monkeypatch, madvise):
    if not madvise:  # the fallback: one byte read per page
        monkeypatch.setattr(ring_mod, "_populate_write", lambda addr, length: False)
    ring.arena[1, 3, :5] = 9  # written before: mapping must keep it
    ring.images[1, 2, 0, 0] = 9
    done = ring.map_pages(64 << 10)
    assert (ring.arena[1, 3, :5] == 9).all() and (ring.images[1, 2, 0, 0] == 9).all()
    assert done is madvise or (madvise and not done)  # a kernel before 5.14 takes the fallback
    positions = ring.arena.shape[0] * ring.arena.shape[1]
    assert _write_positions(ring, 0, 64 << 10) < positions  # 16 mapped pages per position: (nearly) no faults
    assert _write_positions(ring, 64 << 10, 128 << 10) >= 8 * positions  # the next 16 were not mapped
    before = _faults()
    ring.images[:] = 5
    ring.labels[:] = 6
    assert _faults() - before < 8


@linux
def test_unmapped_pages_fault_when_written(ring):  # the measurement above can tell the difference
    assert _write_positions(ring, 0, 64 << 10) >= 8 * ring.arena.shape[0] * ring.arena.shape[1]
