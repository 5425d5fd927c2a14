"""The first code a worker process runs: native thread pools limited before numpy and OpenCV load.

numpy and OpenCV each bring an OpenBLAS that starts a thread per core when it loads, in every process
that imports them. Workers never call BLAS (and OpenCV's own pool is set to one thread), so on a
16-core machine each worker would carry 30 idle threads, and 16 workers per rank times 8 ranks on a
128-core node some 32,000: enough to hit a container's process limit (OpenBLAS's "pthread_create
failed" at worker start). PyTorch's DataLoader sets ``torch.set_num_threads(1)`` in its workers for
the same reason. The thread counts are read when the libraries load, so they are set here, before the
worker's code is imported: this module imports nothing heavy, and the pipeline spec (whose classes
pull in numpy) arrives pickled and is unpickled only after.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "VECLIB_MAXIMUM_THREADS": "1"}


def boot(worker_id: int, spec_pickle: bytes, *args: Any) -> None:
    """Set ``SINGLE_THREADED`` in this process's environment, then run ``workers._worker_main`` with the
    unpickled spec and ``args``."""
    os.environ.update(SINGLE_THREADED)
    from . import workers

    workers._worker_main(worker_id, pickle.loads(spec_pickle), *args)
