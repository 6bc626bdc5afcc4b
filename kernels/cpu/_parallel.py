"""Every core for the CPU kernels' passes: the parts of a pass on a few threads, NumPy's BLAS on one each.

A NumPy pass (a copy, a ufunc, a matrix product) releases the GIL, so threads that each take a part of
a pass run it on as many cores. The kernels cut their passes into parts of whole images (a convolution's
part is its window matrix and its product, which stay in cache together), and what makes the parts is
the shape alone, never the thread count: whatever the cores, each part is computed alike and the parts'
sums are added in one order, so results do not depend on the threads.

While the parts run, the BLAS runs on one thread (threadpoolctl's handle on it): its own threads would
take the cores the parts are on. The threads here are as many as the BLAS would use (its default: one per
core, or OPENBLAS_NUM_THREADS and its kin where they are set), read once; `threads(n)` sets another count.

The parts' ufuncs run with buffers of _UFUNC_BUFFER values (NumPy's setting is per thread; each() sets it
back after). With its default of 8192, NumPy 2.4 copies every operand that is not contiguous (a strided view of
tiles, say) into its buffers before it computes: half the time of a subtraction of two such views went to the
copies. With buffers of 1024 it reads them in place: winograd.tiles at 28 x 28 took half the time (588 -> 294
us a part) and the step at batch 32 5 % less. Below 1024, a per-channel scale broadcast over a part, and a
cast, got slower.
"""
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_UFUNC_BUFFER = 1024
_lock = threading.Lock()
_inside = threading.local()   # .part: this thread runs a part of each()'s
_state = {"threads": None, "pool": None, "blas": None, "depth": 0, "saved": None}


def _forked():
    """A forked child has none of the pool's threads (a part handed to them would never run) and may hold
    the lock as some thread of the parent left it: both made anew."""
    global _lock
    _lock = threading.Lock()
    _state.update(pool=None, depth=0)


os.register_at_fork(after_in_child=_forked)


def _blas():
    """threadpoolctl's controller of NumPy's BLAS libraries, made once (it scans the loaded libraries)."""
    if _state["blas"] is None:   # NumPy's BLAS is loaded: it is imported above
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415
        _state["blas"] = ThreadpoolController().select(user_api="blas")
    return _state["blas"]


def threads(count=None):
    """The threads the passes run on; with ``count``, first set to it (1: every pass on the calling thread)."""
    with _lock:
        if count is not None:
            if count < 1:
                raise ValueError(f"the CPU kernels need at least one thread, got {count}")
            _state["threads"], _state["pool"] = count, None
        if _state["threads"] is None:
            _state["threads"] = max([1] + [lib.num_threads for lib in _blas().lib_controllers])
        return _state["threads"]


def each(part, count):
    """part(i) for i in range(count), on up to threads() threads (the caller's among them), the BLAS on one
    thread meanwhile; returns when all are done, raising the first part's error if one failed."""
    total = threads()
    workers = min(total, count)
    if getattr(_inside, "part", False):   # a part's own passes run on its thread: the others may all be
        for i in range(count):            # waiting for theirs
            part(i)
        return
    queue = itertools.count()   # next() of it is atomic under the GIL: each part is taken once

    def work():
        _inside.part = True
        try:
            with _ufunc_buffers():
                for i in iter(queue.__next__, None):
                    if i >= count:
                        return
                    part(i)
        finally:
            _inside.part = False
    if workers <= 1:
        with _ufunc_buffers():
            for i in range(count):
                part(i)
        return
    with _single_threaded_blas():
        with _lock:
            if _state["pool"] is None:
                _state["pool"] = ThreadPoolExecutor(total - 1, thread_name_prefix="cpu-kernels")
            pool = _state["pool"]
        others = [pool.submit(work) for _ in range(workers - 1)]
        try:
            work()
        finally:
            errors = [f.exception() for f in others]   # waits for each
        for error in errors:
            if error is not None:
                raise error


class _ufunc_buffers:
    """This thread's ufuncs on buffers of _UFUNC_BUFFER values inside, as before outside."""

    def __enter__(self):
        self.saved = np.setbufsize(_UFUNC_BUFFER)

    def __exit__(self, *exc):
        np.setbufsize(self.saved)


class _single_threaded_blas:
    """The BLAS on one thread inside, as before outside; nested and concurrent uses share one setting."""

    def __enter__(self):
        with _lock:
            if _state["depth"] == 0:
                blas = _blas()
                _state["saved"] = [lib.num_threads for lib in blas.lib_controllers]
                for lib in blas.lib_controllers:
                    lib.set_num_threads(1)
            _state["depth"] += 1

    def __exit__(self, *exc):
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                for lib, count in zip(_blas().lib_controllers, _state["saved"]):
                    lib.set_num_threads(count)
