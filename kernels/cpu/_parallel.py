"""Every core for the CPU kernels' passes: the parts of a pass on a few threads, NumPy's BLAS on one each.

A NumPy pass (a copy, a ufunc, a matrix product) releases the GIL, so threads that each take a part of
a pass run it on as many cores. The kernels cut their passes into parts of whole images (a convolution's
part is its window matrix and its product, which stay in cache together), and what makes the parts is
the shape alone, never the thread count: whatever the cores, each part is computed alike and the parts'
sums are added in one order, so results do not depend on the threads.

While the parts run, the BLAS runs on one thread (threadpoolctl's handle on it): its own threads would
take the cores the parts are on. The threads here are as many as the BLAS would use (its default: one per
core, or OPENBLAS_NUM_THREADS and its kin where they are set), read once; `threads(n)` sets another count.
"""
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

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
    if _state["blas"] is None:
        import numpy  # noqa: F401,PLC0415  (its BLAS must be loaded to be found)
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
    if workers <= 1 or getattr(_inside, "part", False):   # a part's own passes run on its thread: the others
        for i in range(count):                            # may all be waiting for theirs
            part(i)
        return
    queue = itertools.count()   # next() of it is atomic under the GIL: each part is taken once

    def work():
        _inside.part = True
        try:
            for i in iter(queue.__next__, None):
                if i >= count:
                    return
                part(i)
        finally:
            _inside.part = False
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
