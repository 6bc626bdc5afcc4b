"""The one timing helper of the benchmarks: median milliseconds per call of a function.

On the GPU a clock is a pair of CUDA events on the current stream (CuPy's for our kernels,
PyTorch's for PyTorch, each on the stream its own work goes to); on the CPU (the dry run) it is
the wall clock. ``median_ms`` warms up, picks how many calls one repetition makes so that a
repetition lasts at least ``min_repeat_ms`` (a lone short kernel would be timed mostly by the
launch), and gives the median over the repetitions.
"""
import math
import statistics
import time


class WallClock:
    def mark(self):
        return time.perf_counter()

    def elapsed_ms(self, start, end):
        return (end - start) * 1e3


class CupyEvents:
    def __init__(self):
        from kernels import cupy_module
        self.cupy = cupy_module()

    def mark(self):
        event = self.cupy.cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start, end):
        end.synchronize()
        return self.cupy.cuda.get_elapsed_time(start, end)


class TorchEvents:
    def __init__(self, torch):
        self.torch = torch

    def mark(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end):
        end.synchronize()
        return start.elapsed_time(end)


def clock(framework, device, torch=None):
    """The clock for work of `framework` ('ours' or 'torch') on `device` ('cuda' or 'cpu')."""
    if device == "cpu":
        return WallClock()
    return CupyEvents() if framework == "ours" else TorchEvents(torch)


def time_ms(fn, clock, calls=1):
    """Milliseconds that `calls` back-to-back calls of fn take, on `clock`."""
    start = clock.mark()
    for _ in range(calls):
        fn()
    return clock.elapsed_ms(start, clock.mark())


def median_ms(fn, clock, warmup=3, repeats=10, min_repeat_ms=2.0, max_calls=200):
    """{'ms': median per call, 'min_ms', 'calls': per repetition, 'repeats'}."""
    for _ in range(warmup):
        fn()
    once = max(time_ms(fn, clock), 1e-3)
    calls = max(1, min(max_calls, math.ceil(min_repeat_ms / once)))
    per_call = [time_ms(fn, clock, calls) / calls for _ in range(repeats)]
    return {"ms": statistics.median(per_call), "min_ms": min(per_call), "calls": calls, "repeats": repeats}
