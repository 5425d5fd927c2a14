"""Per-image cost of the workers' steps with P processes at once: file read, read+check, shm write."""
import multiprocessing as mp, os, sys, time, statistics
import numpy as np
sys.path.insert(0, os.environ.get("SRC", "src"))
from gpufeed.sources import folder_source
from gpufeed.sources.base import read_file
from gpufeed.decode.jpeg_check import gpu_safe_jpeg
from multiprocessing import shared_memory

def job(args):
    data, step, n, i, P, shm_name = args
    src = folder_source(data)
    paths = [src.path(j) for j in range(len(src))][: n]
    shm = shared_memory.SharedMemory(name=shm_name) if shm_name else None
    buf = np.ndarray((P, 2 << 20), np.uint8, shm.buf) if shm else None
    def once():
        for p in paths:
            b = read_file(p)
            if step >= 1: gpu_safe_jpeg(b)
            if step >= 2: buf[i, : len(b)] = np.frombuffer(b, np.uint8)
    once()
    t0 = time.perf_counter(); c0 = time.process_time()
    for _ in range(3): once()
    r = ((time.perf_counter() - t0) / (3 * len(paths)), (time.process_time() - c0) / (3 * len(paths)))
    del buf
    if shm: shm.close()
    return r

if __name__ == "__main__":
    data = sys.argv[1]
    shm = shared_memory.SharedMemory(create=True, size=16 * (2 << 20))
    print(os.uname().release, open("/proc/version").read()[:120])
    for step, name in ((0, "read_file"), (1, "+ gpu_safe_jpeg"), (2, "+ copy into shm")):
        for P in (1, 4, 13):
            with mp.get_context("spawn").Pool(P) as pool:
                res = pool.map(job, [(data, step, 600, i, P, shm.name) for i in range(P)])
            w = statistics.median(r[0] for r in res); c = statistics.median(r[1] for r in res)
            print(f"| {name} | {P} | wall {1e6*w:.0f} us | cpu {1e6*c:.0f} us |", flush=True)
    shm.close(); shm.unlink()
