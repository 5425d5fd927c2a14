"""GPU decode on the NVJPG hardware engines through nvJPEG's batched API, called directly (ctypes).

nvImageCodec drives the same engines, but per call it parses every header again,
checks each image's support, creates per-image parameter objects, and waits for
the previous call's decode to finish before it submits the next one. Here a
call is one ``nvjpegDecodeBatchedInitialize`` + one ``nvjpegDecodeBatched`` for
the whole list, with the pointer arrays built by numpy (no Python per image),
and several decode states are used in turn, so a call waits only for the state
it reuses, not for the call just before it: about twice nvImageCodec's rate on
the H200's engines (BENCHMARKS.md#gpu-decode-backends).

What goes in: JPEGs the workers already checked (``jpeg_check.gpu_safe_jpeg``:
one SOF, baseline/extended 8-bit, single scan, sound markers) with the sizes
their header gave, so every output extent is known before the call. When a
batched call fails (an image the engines do not take, e.g. 4:1:1 chroma), each
image is checked with nvJPEG's own parser (size, ``nvjpegDecodeBatchedSupported``),
the supported ones are decoded again, and the rest are reported as not decoded
(the CPU decoder takes them). ``NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION``
gives libjpeg-turbo's chroma upsampling (the CPU path's).

The bitstreams are read from the caller's memory (the loader's shared ring): the caller keeps them until
the stream has run. The engines write when called, not in the stream's order, so a call first waits on the
host for the stream's queued work (``base.engines_after``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import numpy as np
import torch

from .base import DecodeJob, engines_after

_BACKEND_HARDWARE = 3
_OUTPUT_RGBI = 5
_CSS_444 = 0
_FLAG_UPSAMPLING_WITH_INTERPOLATION = 1 << 5
_STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 2: "INVALID_PARAMETER", 3: "BAD_JPEG", 4: "JPEG_NOT_SUPPORTED",
           5: "ALLOCATOR_FAILURE", 6: "EXECUTION_FAILED", 7: "ARCH_MISMATCH", 8: "INTERNAL_ERROR",
           9: "IMPLEMENTATION_NOT_SUPPORTED", 10: "INCOMPLETE_BITSTREAM"}

_P, _I, _U, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
_SIGNATURES = {
    "nvjpegGetProperty": (_I, ctypes.POINTER(_I)),
    "nvjpegCreateEx": (_I, _P, _P, _U, ctypes.POINTER(_P)),
    "nvjpegDestroy": (_P,),
    "nvjpegGetHardwareDecoderInfo": (_P, ctypes.POINTER(_U), ctypes.POINTER(_U)),
    "nvjpegJpegStateCreate": (_P, ctypes.POINTER(_P)),
    "nvjpegJpegStateDestroy": (_P,),
    "nvjpegDecodeBatchedPreAllocate": (_P, _P, _I, _I, _I, _I, _I),
    "nvjpegDecodeBatchedInitialize": (_P, _P, _I, _I, _I),
    "nvjpegDecodeBatched": (_P, _P, _P, _P, _P, _P),
    "nvjpegJpegStreamCreate": (_P, ctypes.POINTER(_P)),
    "nvjpegJpegStreamDestroy": (_P,),
    "nvjpegJpegStreamParseHeader": (_P, _P, _S, _P),
    "nvjpegJpegStreamGetFrameDimensions": (_P, ctypes.POINTER(_U), ctypes.POINTER(_U)),
    "nvjpegDecodeBatchedSupported": (_P, _P, ctypes.POINTER(_I)),
}


def _candidates() -> list[str]:
    """Where libnvjpeg may be: the nvidia-nvjpeg wheels (CUDA 13 and 12 layouts), torchvision's bundled copy,
    then the system's loader path. The CUDA major of the running torch first."""
    major = (torch.version.cuda or "13").split(".")[0]
    majors = [major] + [m for m in ("13", "12") if m != major]
    out = []
    try:
        import nvidia

        for root in nvidia.__path__:
            for m in majors:
                out += [os.path.join(root, f"cu{m}", "lib", f"libnvjpeg.so.{m}"),
                        os.path.join(root, "nvjpeg", "lib", f"libnvjpeg.so.{m}")]
    except ImportError:
        pass
    try:
        import torchvision

        libs = os.path.join(os.path.dirname(os.path.dirname(torchvision.__file__)), "torchvision.libs")
        for m in majors:
            out += sorted(glob.glob(os.path.join(libs, f"libnvjpeg*.so.{m}")))
    except ImportError:
        pass
    return [p for p in out if os.path.exists(p)] + [f"libnvjpeg.so.{m}" for m in majors]


def load_nvjpeg() -> tuple[ctypes.CDLL | None, str]:
    """(libnvjpeg with the functions used here typed, where it was found) or (None, why not)."""
    tried = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = list(args), _I
        except (OSError, AttributeError) as e:
            tried.append(f"{path}: {e}")
            continue
        return lib, path
    return None, "libnvjpeg not found (pip install nvidia-nvjpeg); tried " + "; ".join(tried)


class NvJpegError(RuntimeError):
    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} returned NVJPEG_STATUS_{_STATUS.get(status, status)}")
        self.status = status


class NvJpegHwDecoder:
    """Batched decode on the hardware engines of one device (``decode.base.GpuDecoder``).

    ``states``: decode states used in turn (a call waits until the state it takes has finished its
    previous decode on the GPU; nvJPEG stages the bitstreams in the state's own buffers). Each state takes
    its device memory now, for a call of ``call_images`` images of up to ``max_side`` x ``max_side`` pixels;
    a call with a larger image makes nvJPEG grow it to what that image needs (``placement.ENGINE_ROOM_SIDE``).
    Calls hold at most ``call_images`` images (``placement.decode_call_images``).
    """

    name = "nvjpeg-hw"
    job_images = 256  # one call per decoder thread per batch: no Python per image left to overlap

    def __init__(self, device: torch.device, *, max_side: int, states: int = 2, call_images: int = job_images) -> None:
        lib, where = load_nvjpeg()
        if lib is None:
            raise RuntimeError(where)
        self._lib, self.library = lib, where
        self.device = device
        major, minor = self._property(0), self._property(1)
        self.version = (major, minor, self._property(2))
        flags = _FLAG_UPSAMPLING_WITH_INTERPOLATION if (major, minor) >= (12, 1) else 0
        self._handle = _P()
        self._states: list[tuple[_P, torch.cuda.Event]] = []
        self._jstream = _P()
        with torch.cuda.device(device):
            self._check("nvjpegCreateEx", lib.nvjpegCreateEx(_BACKEND_HARDWARE, None, None, flags,
                                                             ctypes.byref(self._handle)))
            engines, cores = _U(), _U()
            if lib.nvjpegGetHardwareDecoderInfo(self._handle, ctypes.byref(engines), ctypes.byref(cores)) != 0:
                engines.value = cores.value = 0  # not reported by this nvJPEG; the handle was created, so assume some
            elif engines.value == 0:
                lib.nvjpegDestroy(self._handle)
                self._handle = _P()
                raise RuntimeError(f"{torch.cuda.get_device_name(device)} reports no hardware JPEG engines")
            self.engines, self.cores_per_engine = engines.value, cores.value
            for _ in range(states):
                state = _P()
                self._check("nvjpegJpegStateCreate", lib.nvjpegJpegStateCreate(self._handle, ctypes.byref(state)))
                self._states.append((state, torch.cuda.Event(blocking=True)))  # waited for asleep, not spinning
                self._check("nvjpegDecodeBatchedPreAllocate", lib.nvjpegDecodeBatchedPreAllocate(
                    self._handle, state, call_images, max_side, max_side, _CSS_444, _OUTPUT_RGBI))
            self._check("nvjpegJpegStreamCreate", lib.nvjpegJpegStreamCreate(self._handle, ctypes.byref(self._jstream)))
        self._turn = 0

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is None or not getattr(self, "_handle", None):
            return
        try:
            for state, event in self._states:
                event.synchronize()  # no decode may still use the state
                lib.nvjpegJpegStateDestroy(state)
            if self._jstream:
                lib.nvjpegJpegStreamDestroy(self._jstream)
            lib.nvjpegDestroy(self._handle)
        except Exception:  # interpreter shutdown: CUDA may already be gone; the process frees it all
            pass

    def decode(self, job: DecodeJob, stream: torch.cuda.Stream) -> np.ndarray:
        """Decode ``job`` in ``stream``'s order; (n,) bool: which were decoded. Before a retry after a
        failed batch, each image's size is checked against nvJPEG's own parse: the engines write exactly the
        extent given, so a disagreement must never reach them."""
        n = len(job)
        ok = np.zeros(n, bool)
        if not n:
            return ok
        with torch.cuda.device(self.device):
            engines_after(stream)  # the engines write at the call, not in the stream's order
            if self._batched(job, stream):
                ok[:] = True
                return ok
            # some image the engines refuse: nvJPEG's own parser says which; decode the rest again
            good = np.array([self._supported(int(job.src[j]), int(job.lengths[j]), int(job.widths[j]),
                                             int(job.heights[j])) for j in range(n)], bool)
            idx = np.flatnonzero(good)
            if len(idx) and self._batched(job[idx], stream):
                ok[idx] = True
            else:  # still failing as a batch: one at a time
                for j in idx:
                    ok[j] = self._batched(job[j : j + 1], stream)
        return ok

    def _batched(self, job: DecodeJob, stream: torch.cuda.Stream) -> bool:
        lib, n = self._lib, len(job)
        images = np.zeros((n, 8), np.uint64)  # nvjpegImage_t: channel[4] pointers, pitch[4]
        images[:, 0] = job.dst
        images[:, 4] = job.widths * 3
        src = np.ascontiguousarray(job.src, np.uint64)
        lengths = np.ascontiguousarray(job.lengths, np.uint64)
        state, done = self._states[self._turn]
        self._turn = (self._turn + 1) % len(self._states)
        done.synchronize()  # this state's previous decode has run: its staging buffers are free
        status = lib.nvjpegDecodeBatchedInitialize(self._handle, state, n, 1, _OUTPUT_RGBI)
        if status == 0:
            status = lib.nvjpegDecodeBatched(self._handle, state, src.ctypes.data, lengths.ctypes.data,
                                             images.ctypes.data, _P(stream.cuda_stream))
        done.record(stream)
        return status == 0

    def _supported(self, src: int, length: int, width: int, height: int) -> bool:
        lib, w, h, s = self._lib, _U(), _U(), _I(-1)
        if lib.nvjpegJpegStreamParseHeader(self._handle, src, length, self._jstream) != 0:
            return False
        if lib.nvjpegJpegStreamGetFrameDimensions(self._jstream, ctypes.byref(w), ctypes.byref(h)) != 0:
            return False
        if (w.value, h.value) != (width, height):
            return False  # never let the engines write an extent other than the buffer's
        return lib.nvjpegDecodeBatchedSupported(self._handle, self._jstream, ctypes.byref(s)) == 0 and s.value == 0

    def _property(self, which: int) -> int:
        v = _I()
        self._check("nvjpegGetProperty", self._lib.nvjpegGetProperty(which, ctypes.byref(v)))
        return v.value

    @staticmethod
    def _check(call: str, status: int) -> None:
        if status != 0:
            raise NvJpegError(call, status)
