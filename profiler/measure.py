"""Measuring a step: marks at every begin and end of the model's modules and of the spans, read
after the step, and each interval given to the innermost row open during it (see the package's
docstring); one extra step records every op and kernel launch against the row that ran it."""
import collections
import contextlib
import dataclasses
import functools
import inspect
import time

import numpy as np

import kernels.cpu
from kernels import cupy_module
from nn import hooks
from parallel import ddp
from .costs import shape_of

PHASES = ("forward", "backward", "other")
UNTRACKED = ("(between spans)", "untracked")    # the step's own key: Python between the spans
# From the model's backward end to the next mark: backward() returning, which drops the tape and
# with it the step's activations (NumPy hands large arrays back to the OS right there)
TAPE_RELEASE = (("release of the tape", "autograd"), "backward")
CONTRACT = tuple(name for name, fn in vars(kernels.cpu).items()
                 if inspect.isfunction(fn) and not name.startswith("_"))

_active = None


def current():
    """The Profiler recording now, or None."""
    return _active


def label(name):
    """A row's name as reports show it: the module's dotted name, '(model)' for the model itself."""
    return name or "(model)"


def span(name, category="other", phase="other", concurrent=False, stream=None):
    """A span of the running profile (see Profiler.span); nothing when no profile runs."""
    return contextlib.nullcontext() if _active is None else _active.span(name, category, phase, concurrent, stream)



# ---- clocks and NVTX ---------------------------------------------------------------------------

# EventClock's hold before a step: the first, then HOLD_FACTOR times the host's time to queue the step before
# (the hold's own launch included) plus HOLD_MIN_US, at most HOLD_MAX_US (a host slower than that to queue a
# step leaves the GPU waiting, and the report says in how many steps)
HOLD_FIRST_US, HOLD_MIN_US, HOLD_FACTOR, HOLD_MAX_US = 20_000, 1_000, 1.5, 200_000


@dataclasses.dataclass
class Queued:
    """A step run ahead() of the GPU: whether the GPU had all of it queued before it started on it."""
    fed: bool = True


class WallClock:
    """The CPU backend's clock: NumPy returns when its work is done, so a mark is the time now."""
    name = "wall clock"

    @contextlib.contextmanager
    def ahead(self):
        """Nothing to hold: the CPU runs each op as it is called (EventClock.ahead)."""
        yield Queued()

    def mark(self, stream=None):
        return time.perf_counter()

    def resolve(self, marks, origin=None):
        """Milliseconds of every mark since `origin`, a mark taken before them (default: the first)."""
        origin = marks[0] if origin is None else origin
        return [(m - origin) * 1e3 for m in marks]


class EventClock:
    """The GPU's: a CUDA event recorded at each mark, on the current stream or the one given;
    read after the step, once the device has finished it.

    Marks measure the GPU's time only where the GPU never waits for the host between them, and an
    eager step of small kernels is queued more slowly than the GPU runs it (at batch 256 in bf16 on
    one H200, about 23 ms to queue 11 ms of kernels). So a step runs ``ahead()``: behind a kernel that
    holds the stream (Backend.hold) until the host has queued all of it, for longer than the host
    took to queue the step before; the step's kernels then run back to back, as in a CUDA graph."""
    name = "CUDA events"

    def __init__(self, cupy, hold):
        self.cupy, self.hold = cupy, hold
        self.hold_us = HOLD_FIRST_US

    @contextlib.contextmanager
    def ahead(self):
        """The work queued inside runs behind a hold; yields a Queued, whose ``fed`` says, once the block
        has ended, whether the GPU was still holding when the host had queued it all (if not, the GPU
        waited for the host somewhere in it, and marks inside include that wait)."""
        began, queued = time.perf_counter(), Queued()
        self.hold(self.hold_us)
        held = self.mark()
        yield queued
        queued.fed = not held.done   # a query, not a wait: before anything reads the marks
        self.hold_us = min(HOLD_MAX_US, HOLD_MIN_US + int(HOLD_FACTOR * (time.perf_counter() - began) * 1e6))

    def mark(self, stream=None):
        event = self.cupy.cuda.Event()
        event.record(stream)
        return event

    def resolve(self, marks, origin=None):
        """As WallClock.resolve; an origin of an earlier step works too (events of one device)."""
        self.cupy.cuda.Device().synchronize()    # every stream: concurrent spans end on theirs
        origin = marks[0] if origin is None else origin
        return [self.cupy.cuda.get_elapsed_time(origin, m) for m in marks]


def clock_for(xp, backend):
    """The clock of steps on `xp`'s arrays run by `backend` (whose hold an EventClock uses)."""
    return WallClock() if xp is np else EventClock(xp, backend.hold)


class Nvtx:
    """NVTX ranges where CuPy has NVTX (on the GPU), so that Nsight shows the rows' names."""

    def __init__(self, enabled):
        nvtx = cupy_module().cuda.nvtx if enabled else None
        usable = nvtx is not None and nvtx.available
        self.push = nvtx.RangePush if usable else lambda message: None
        self.pop = nvtx.RangePop if usable else lambda: None


# ---- the profiler --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Span:
    """A row's phase in one step, from begin to end in ms since the origin of the profile's
    timeline (Profiler.start_timeline). The step's own spans nest; a concurrent one ran beside
    them, on the stream of handle `stream` (None where it was given none)."""
    key: tuple
    phase: str
    begin_ms: float
    end_ms: float
    concurrent: bool = False
    stream: int = None


@dataclasses.dataclass
class StepTimes:
    """One profiled step: milliseconds by (row key, phase), its total, its concurrent spans as
    (key, ms, ms overlapping the model's backward), all its spans on the timeline (Span), and whether
    the GPU had the whole step queued before it started on it (Queued.fed; always on the CPU)."""
    exclusive: dict
    total_ms: float
    concurrent: list
    spans: list
    fed: bool = True

    @property
    def covered_ms(self):
        """The part of the step inside its layers and spans: all but the Python between the spans."""
        return self.total_ms - self.exclusive.get((UNTRACKED, "other"), 0.0)


class Profiler:
    """The timeline of a step: a mark at every begin and end of the model's modules and of the
    spans, resolved after the step into each row's own time per phase."""

    def __init__(self, model, clock, nvtx):
        self.clock, self.nvtx = clock, nvtx
        self.keys = {id(m): (name, "layer" if not m.children() else "block") for name, m in model.named_modules()}
        self.kinds = {self.keys[id(m)]: type(m).__name__ for m in model.modules()}
        self.root = self.keys[id(model)]
        self.marks, self.timeline, self.concurrent, self.open = [], [], [], []
        self.origin = None      # until start_timeline(), a step's spans are timed from its own start

    def start_timeline(self):
        """Take the origin mark of the profile's timeline: the spans of every later step are timed
        from it, so that the steps lie one after the other."""
        self.origin = self.clock.mark()

    @contextlib.contextmanager
    def active(self):
        """While inside: the module hook and the all-reduce hook are on, and current() is this profiler."""
        global _active
        if _active is not None:
            raise RuntimeError("a profile is running already")
        handles = [hooks.register_module_hook(self._on_module), ddp.register_all_reduce_hook(self._all_reduce)]
        _active = self
        try:
            yield self
        finally:
            _active = None
            for handle in handles:
                handle.remove()

    def _all_reduce(self, name, stream):
        """A bucket's all-reduce: beside the step when it runs on a stream of its own, else a row of
        the backward, which it blocks."""
        return self.span(name, "allreduce", "backward", concurrent=stream is not None, stream=stream)

    def _on_module(self, module, event):
        key = self.keys.get(id(module))
        if key is None:     # modules of another model are not ours to time
            return
        phase, edge = event.split("_")
        self._edge(edge, key, phase)
        if key == self.root and event == "backward_end":
            self._edge("begin", *TAPE_RELEASE)

    def _mark(self, stream=None):
        self.marks.append(self.clock.mark(stream))
        return len(self.marks) - 1

    def _edge(self, edge, key, phase):
        if self.open and self.open[-1] == TAPE_RELEASE and (key, phase) != TAPE_RELEASE:
            self._edge("end", *TAPE_RELEASE)    # the tape's release lasts until the next mark
        if edge == "begin":
            self.nvtx.push(f"{key[0] or 'model'} {phase}")
            self.timeline.append((self._mark(), edge, key, phase))
            self.open.append((key, phase))
            return
        if not self.open or self.open[-1] != (key, phase):
            raise RuntimeError(f"{key[0]} {phase} ended while {self.open[-1:]} was open: spans must nest")
        self.timeline.append((self._mark(), edge, key, phase))
        self.open.pop()
        self.nvtx.pop()

    @contextlib.contextmanager
    def span(self, name, category="other", phase="other", concurrent=False, stream=None):
        """A row `name` of `category` (data, loss, optimizer, allreduce, ...) timed in `phase`.

        A nested span (the default) takes its time from the module or span around it. A
        concurrent one is work that runs beside the step (on `stream`, for CUDA): it takes no
        time from the rows and is reported apart, with its overlap with the model's backward."""
        key = (name, category)
        # no `finally`: an exception inside leaves the timeline unfinished, and it is not read
        if concurrent:
            begin = self._mark(stream)
            yield
            self.concurrent.append((key, phase, begin, self._mark(stream), None if stream is None else stream.ptr))
            return
        self._edge("begin", key, phase)
        yield
        self._edge("end", key, phase)

    def step(self, fn, *args):
        """Run fn(*args) as one profiled step; its StepTimes."""
        self.marks, self.timeline, self.concurrent, self.open = [], [], [], []
        with self.clock.ahead() as queued, self.active(), self.span(*UNTRACKED):
            fn(*args)
        times = self.clock.resolve(self.marks)
        backward = self._window(times, self.root, "backward")
        concurrent = [(key, times[end] - times[begin], _overlap((times[begin], times[end]), backward))
                      for key, _, begin, end, _ in self.concurrent]
        step = times[self.timeline[-1][0]] - times[self.timeline[0][0]]
        # the step's times stay its own (from its first mark); shifted by its start, on the timeline
        start = self.clock.resolve(self.marks[:1], self.origin)[0]
        return StepTimes(self._exclusive(times), step, concurrent, self._spans([start + t for t in times]),
                         queued.fed)

    def _spans(self, times):
        """The step's Spans: each begin paired with its end (they nest), then the concurrent ones."""
        spans, begins = [], []
        for index, edge, key, phase in self.timeline:
            if edge == "begin":
                begins.append(times[index])
            else:
                spans.append(Span(key, phase, begins.pop(), times[index]))
        return spans + [Span(key, phase, times[begin], times[end], concurrent=True, stream=stream)
                        for key, phase, begin, end, stream in self.concurrent]

    def _exclusive(self, times):
        """Each interval between two marks goes to the innermost row open during it."""
        owned, open_rows = collections.defaultdict(float), []
        for (index, edge, key, phase), (following, *_) in zip(self.timeline, self.timeline[1:]):
            if edge == "begin":
                open_rows.append((key, phase))
            else:
                open_rows.pop()
            owned[open_rows[-1]] += times[following] - times[index]
        return dict(owned)

    def _window(self, times, key, phase):
        """(first begin, last end) of a row's phase in this step, or None."""
        marks = [times[index] for index, _, k, p in self.timeline if (k, p) == (key, phase)]
        return (marks[0], marks[-1]) if marks else None

    def inspect(self, backend, model, fn, *args):
        """Run fn(*args) once with every op of the contract and every CUDA kernel launch recorded
        against the row and phase that ran it, and every module's output shape: (ops by (key,
        phase): [(op, argument shapes, keyword argument shapes)], kernels by (key, phase): Counter
        of names, output shape by key, keys in the order they first ran with the step's own key
        last)."""
        ops, launches, shapes = collections.defaultdict(list), collections.defaultdict(collections.Counter), {}
        names_kernels = hasattr(backend, "function")    # the CUDA launchers name their kernels

        def on_op(op, args, kwargs):
            ops[self.open[-1]].append((op, tuple(shape_of(a) for a in args),
                                       {k: shape_of(v) for k, v in kwargs.items()}))
            if not names_kernels:
                launches[self.open[-1]][op] += 1

        def on_launch(name):
            if self.open:    # else the profiler's own hold (EventClock.ahead), before the step's first span
                launches[self.open[-1]][name] += 1
        recording = _recording_ops(backend, on_op, on_launch if names_kernels else None)
        with recording, _output_shapes(model, self.keys, shapes):
            self.step(fn, *args)
        order = [key for key in dict.fromkeys(key for _, _, key, _ in self.timeline) if key != UNTRACKED]
        return ops, launches, shapes, order + [UNTRACKED]


def _overlap(interval, window):
    if window is None:
        return 0.0
    return max(0.0, min(interval[1], window[1]) - max(interval[0], window[0]))


@contextlib.contextmanager
def _recording_ops(backend, on_op, on_launch):
    """The backend's contract ops call on_op(op, args, kwargs) first, outermost calls only; with
    `on_launch`, each kernel launch calls on_launch(name) (the CUDA backend's observing_launches)."""
    depth = [0]

    def recorded(op, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0] == 0:
                on_op(op, args, kwargs)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call
    originals = {op: getattr(backend, op) for op in CONTRACT if hasattr(backend, op)}
    for op, fn in originals.items():
        setattr(backend, op, recorded(op, fn))
    try:
        with backend.observing_launches(lambda family, name: on_launch(name)) if on_launch is not None else \
                contextlib.nullcontext():
            yield
    finally:
        for op, fn in originals.items():
            setattr(backend, op, fn)


@contextlib.contextmanager
def _output_shapes(model, keys, shapes):
    """Each module's forward also stores its output's shape in shapes[key]."""
    modules = model.modules()

    def recorded(module):
        forward = module.forward

        def call(*args, **kwargs):
            out = forward(*args, **kwargs)
            shapes[keys[id(module)]] = getattr(out, "shape", None)
            return out
        return call
    for m in modules:
        object.__setattr__(m, "forward", recorded(m))     # an instance attribute hides the method
    try:
        yield
    finally:
        for m in modules:
            del m.__dict__["forward"]
