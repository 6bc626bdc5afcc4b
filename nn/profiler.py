"""Per-layer cost of training: where each step's time goes, layer by layer.

    python -m nn.profiler --batch-size 256 --steps 20              # on the GPU where there is one
    python -m nn.profiler --device cpu --batch-size 32 --steps 10 --warmup 3 --out runs/profile

The command trains ResNet-18 (nn.resnet18, --width channels in the first stage; SGD with lr 0.1,
momentum 0.9, weight decay 5e-4) on random Fashion-MNIST-shaped images: warm-up steps first, then
--steps profiled steps, each beside one plain step. It prints a table sorted by cost and writes
profile.json, profile.csv and profile.png (time per layer, forward and backward stacked) to --out.

From Python, on any model and SGD optimizer (train_resnet.py --profile):

    report = profile(model, optimizer, images, labels, batch_size, steps, warmup=3, log=print, title=None)
    print(report.table())
    report.write(out_dir)          # -> {'json': path, 'csv': path, 'png': path}

``images`` are uint8 (N, H, W) and ``labels`` int32 (N,), on the model's device, N >= batch_size;
``title`` names the model in the report (default: its class and parameter count);
a step is the trainer's: gather a batch and convert it (images_to_float), zero_grad, forward,
cross-entropy, backward, optimizer step. profile() trains for warmup + 1 + 2 * steps steps and
then puts back the model's state, the optimizer's velocity and the train/eval mode it found.

What it measures. Every module's forward and backward, through the module hook of nn/hooks.py
(the backward events come from the tape), and the explicit spans of the step: the batch gather,
zero_grad, the loss (its forward, and its backward: the part of loss.backward() before the
model's, which is the loss gradient and the tape's sort), the release of the tape as backward()
returns (it frees the step's activations), the optimizer step. A mark is taken at every begin
and end: on the CPU backend the wall clock (NumPy returns when its work is done); on CuPy a CUDA
event recorded on the current stream, all read after the step, so that timing never stalls the
device mid-step (a layer's time is then the GPU time between its events, launch gaps included).
Each interval between two marks belongs to the innermost module or span open during it, so in
each step the rows add up to the step: a leaf module (conv, batch norm, relu, pool, linear) is a
row, and so are the own ops of a container (the relu and the add+relu that a Residual calls
itself). Rows are medians over the profiled steps.

Per row, from one extra step in which every op of the kernel contract and every CUDA kernel
launch is recorded against the row that ran it: the kernels by name, FLOPs and the fewest bytes
they must move (nn/costs.py), the achieved TFLOP/s and GB/s, and which roof bounds it: its
arithmetic intensity against the device's ridge point (PEAKS; the CPU's is measured at start),
with the fraction of that roof reached. Grouped by stage and residual block by module name.

Its own overhead: each profiled step runs beside a plain one timed by one pair of marks, and the
report states both medians and their difference.

Spans from other code: ``with profiler.span(name, category):`` around work records it as a row
while a profile runs and does nothing otherwise (``current()`` is the running Profiler or None).
Work that runs beside the step, such as a gradient bucket's all-reduce on its own stream, is a
concurrent span (``concurrent=True``, with its ``stream``): it is no row, and is reported apart
with how much of it overlapped the model's backward. (On the CPU nothing runs beside: the row a
blocking call ran inside counts its time as well.)

NVTX ranges (CuPy with NVTX) name every profiled step, module phase and nested span, for Nsight
Systems or ``ncu --nvtx``; on the CPU there are none.
"""
import argparse
import collections
import contextlib
import csv
import dataclasses
import functools
import inspect
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import kernels
import kernels.cpu
from kernels import backend_of, cupy_module, get_array_module
from . import checkpoint, costs, data, hooks
from .functional import cross_entropy
from .init import manual_seed
from .optim import SGD
from .resnet import resnet18
from .tensor import Tensor

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


def span(name, category="other", phase="other", concurrent=False, stream=None):
    """A span of the running profile (see Profiler.span); nothing when no profile runs."""
    return contextlib.nullcontext() if _active is None else _active.span(name, category, phase, concurrent, stream)


# ---- the devices' roofs ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Peak:
    device: str
    tflops: float       # float32 without tensor cores: every kernel of this project is SIMT
    gbs: float
    source: str

    @property
    def ridge(self):
        """FLOPs per byte at which the two roofs meet."""
        return self.tflops * 1e3 / self.gbs


# (name as CUDA reports it contains, fp32 TFLOP/s, GB/s): first match wins, so a specific name
# comes before the family's. From NVIDIA's datasheets: H200 (SXM 67 TFLOP/s, NVL 60; HBM3e
# 4.8 TB/s both), H100 (SXM 67 TFLOP/s with HBM3 3.35 TB/s, NVL 60 with 3.9, PCIe 51 with 2.0),
# A100 (19.5 TFLOP/s; 40 GB 1,555 GB/s, 80 GB PCIe 1,935, 80 GB SXM 2,039).
PEAKS = (
    ("H200 NVL", 60.0, 4800.0), ("H200", 67.0, 4800.0),
    ("H100 NVL", 60.0, 3900.0), ("H100 PCIe", 51.0, 2000.0), ("H100", 67.0, 3350.0),
    ("A100 80GB PCIe", 19.5, 1935.0), ("A100-SXM4-80GB", 19.5, 2039.0), ("A100", 19.5, 1555.0),
)
MATMUL_SIZE, COPY_BYTES = 2048, 1 << 26


def gpu_peak(name):
    """The datasheet roofs of the GPU called `name`, or None for one not in PEAKS."""
    for pattern, tflops, gbs in PEAKS:
        if pattern in name:
            return Peak(name, tflops, gbs, f"NVIDIA datasheet figures for '{pattern}' (nn/profiler.py PEAKS)")
    return None


@functools.cache
def measured_cpu_peak():
    """The CPU's roofs, measured once per process: the best of a few float32 matrix products
    (NumPy's BLAS on all the cores it uses) and of a few 64 MB copies (read + write). What the
    NumPy backend can reach is what its BLAS and memory copies reach, not a datasheet figure."""
    rng = np.random.default_rng(0)
    a, b = (rng.random((MATMUL_SIZE, MATMUL_SIZE), dtype=np.float32) for _ in range(2))
    source = np.ones(COPY_BYTES // 4, np.float32)
    target = np.empty_like(source)
    product = _best_seconds(lambda: a @ b)
    copy = _best_seconds(lambda: np.copyto(target, source))
    return Peak(f"CPU {platform.machine()}, {os.cpu_count()} cores", 2 * MATMUL_SIZE**3 / product / 1e12,
                2 * COPY_BYTES / copy / 1e9,
                f"measured: float32 {MATMUL_SIZE}x{MATMUL_SIZE} matrix product and {COPY_BYTES >> 20} MB copy, "
                f"best of 3")


def _best_seconds(fn, repeats=3):
    fn()    # first touch of the memory, BLAS start-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def device_peak(xp):
    """The roofs of the device that arrays of `xp` live on; None for a GPU not in PEAKS."""
    if xp is np:
        return measured_cpu_peak()
    properties = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    name = properties["name"]
    return gpu_peak(name.decode() if isinstance(name, bytes) else name)


# ---- clocks and NVTX ---------------------------------------------------------------------------

class WallClock:
    """The CPU backend's clock: NumPy returns when its work is done, so a mark is the time now."""
    name = "wall clock"

    def mark(self, stream=None):
        return time.perf_counter()

    def resolve(self, marks):
        """Milliseconds of every mark since the first."""
        return [(m - marks[0]) * 1e3 for m in marks]


class EventClock:
    """The GPU's: a CUDA event recorded at each mark, on the current stream or the one given;
    read after the step, once the device has finished it."""
    name = "CUDA events"

    def __init__(self, cupy):
        self.cupy = cupy

    def mark(self, stream=None):
        event = self.cupy.cuda.Event()
        event.record(stream)
        return event

    def resolve(self, marks):
        self.cupy.cuda.Device().synchronize()    # every stream: concurrent spans end on theirs
        return [self.cupy.cuda.get_elapsed_time(marks[0], m) for m in marks]


def clock_for(xp):
    return WallClock() if xp is np else EventClock(xp)


class Nvtx:
    """NVTX ranges where CuPy has NVTX (on the GPU), so that Nsight shows the rows' names."""

    def __init__(self, enabled):
        nvtx = cupy_module().cuda.nvtx if enabled else None
        usable = nvtx is not None and nvtx.available
        self.push = nvtx.RangePush if usable else lambda message: None
        self.pop = nvtx.RangePop if usable else lambda: None


# ---- the profiler --------------------------------------------------------------------------------

@dataclasses.dataclass
class StepTimes:
    """One profiled step: milliseconds by (row key, phase), its total, and its concurrent spans
    as (key, ms, ms overlapping the model's backward)."""
    exclusive: dict
    total_ms: float
    concurrent: list

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

    @contextlib.contextmanager
    def active(self):
        """While inside: the module hook is on and current() is this profiler."""
        global _active
        if _active is not None:
            raise RuntimeError("a profile is running already")
        handle = hooks.register_module_hook(self._on_module)
        _active = self
        try:
            yield self
        finally:
            _active = None
            handle.remove()

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
            self.concurrent.append((key, begin, self._mark(stream)))
            return
        self._edge("begin", key, phase)
        yield
        self._edge("end", key, phase)

    def step(self, fn, *args):
        """Run fn(*args) as one profiled step; its StepTimes."""
        self.marks, self.timeline, self.concurrent, self.open = [], [], [], []
        with self.active(), self.span(*UNTRACKED):
            fn(*args)
        times = self.clock.resolve(self.marks)
        backward = self._window(times, self.root, "backward")
        concurrent = [(key, times[end] - times[begin], _overlap((times[begin], times[end]), backward))
                      for key, begin, end in self.concurrent]
        step = times[self.timeline[-1][0]] - times[self.timeline[0][0]]
        return StepTimes(self._exclusive(times), step, concurrent)

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
        phase): [(op, argument shapes)], kernels by (key, phase): Counter of names, output shape
        by key, keys in the order they first ran with the step's own key last)."""
        ops, launches, shapes = collections.defaultdict(list), collections.defaultdict(collections.Counter), {}
        names_kernels = hasattr(backend, "function")    # the CUDA launchers name their kernels

        def on_op(op, args):
            ops[self.open[-1]].append((op, tuple(_shape(a) for a in args)))
            if not names_kernels:
                launches[self.open[-1]][op] += 1

        def on_launch(name):
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


def _shape(a):
    return tuple(a.shape) if hasattr(a, "shape") else a


@contextlib.contextmanager
def _recording_ops(backend, on_op, on_launch):
    """The backend's contract ops call on_op(op, args) first, outermost calls only; with
    `on_launch`, each kernel launch calls on_launch(name) (the CUDA backend's be.function)."""
    depth = [0]

    def recorded(op, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0] == 0:
                on_op(op, args)     # keyword arguments (add's out) change no cost
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call
    originals = {op: getattr(backend, op) for op in CONTRACT if hasattr(backend, op)}
    for op, fn in originals.items():
        setattr(backend, op, recorded(op, fn))
    if on_launch is not None:
        function = backend.function

        def launched(family, name):
            on_launch(name)
            return function(family, name)
        backend.function = launched
    try:
        yield
    finally:
        for op, fn in originals.items():
            setattr(backend, op, fn)
        if on_launch is not None:
            del backend.function        # the class's method again


@contextlib.contextmanager
def _output_shapes(model, keys, shapes):
    """Each module's forward also stores its output's shape in shapes[key]."""
    modules = model.modules()

    def recorded(module):
        forward = module.forward

        def call(*args):
            out = forward(*args)
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


# ---- the training step, its spans, and the whole profile ---------------------------------------

def training_step(model, optimizer, images, labels, index, ddp=None):
    """The trainer's step (nn/train.py) on the batch images[index], with its parts as spans;
    with ``ddp`` (parallel.ddp.DataParallel), on this rank's shard of it, the gradients summed
    over ranks in buckets (each an 'allreduce' span)."""
    K = backend_of(images)
    with span("batch gather", "data"):
        index = index if ddp is None else ddp.scatter(index)
        x, y = Tensor(K.images_to_float(images[index])), labels[index]
    with span("zero_grad", "optimizer"):
        optimizer.zero_grad()
    logits = model(x)
    with span("loss", "loss", "forward"):
        loss = cross_entropy(logits, y)
    with span("loss", "loss", "backward"):
        loss.backward() if ddp is None else ddp.backward(loss)
    with span("optimizer step", "optimizer"):
        optimizer.step()


def plain_step_ms(clock, fn, *args):
    """One step timed by one pair of marks: the baseline of the profiler's overhead."""
    marks = [clock.mark()]
    fn(*args)
    marks.append(clock.mark())
    return clock.resolve(marks)[-1]


def check_inputs(images, labels, batch_size, steps, warmup):
    if batch_size < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"batch size and steps must be at least 1 and warm-up at least 0, got batch size "
                         f"{batch_size}, {steps} steps, {warmup} warm-up steps")
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 (N, H, W), got {images.dtype} {tuple(images.shape)}")
    if labels.shape != images.shape[:1]:
        raise ValueError(f"labels must be (N,) for {len(images)} images, got {tuple(labels.shape)}")
    if len(images) < batch_size:
        raise ValueError(f"a batch of {batch_size} needs at least as many images, got {len(images)}")


@contextlib.contextmanager
def _state_kept(model, optimizer):
    """Profiling trains: the model's state, the velocity and the train/eval mode are put back, in
    place, so that the flat buffers and the optimizer's views of them stay as they are."""
    saved = {k: v.copy() for k, v in model.state_dict().items()}
    velocity = None if optimizer.velocity is None else optimizer.velocity.copy()
    training = model.training
    try:
        yield
    finally:
        for key, array in model.state_dict().items():
            array[...] = saved[key]
        if velocity is not None:
            optimizer.velocity[...] = velocity
        optimizer.zero_grad()
        model.train(training)


def profile(model, optimizer, images, labels, batch_size, steps, warmup=3, log=print, title=None, ddp=None):
    """The Report of `steps` profiled steps after `warmup` plain ones (see the module's docstring);
    with ``ddp``, of this rank's data-parallel steps on its shards of global batches."""
    check_inputs(images, labels, batch_size, steps, warmup)
    xp, backend = get_array_module(images), backend_of(images)
    order = xp.asarray(data.epoch_order(len(images), seed=0, epoch=0))
    batches = [b for b in data.batch_indices(order, batch_size) if len(b) == batch_size]
    clock = clock_for(xp)
    peak = device_peak(xp)
    profiler = Profiler(model, clock, Nvtx(enabled=xp is not np))
    step = functools.partial(training_step, model, optimizer, images, labels, ddp=ddp)
    with _state_kept(model, optimizer):
        model.train()
        log(f"profile: {warmup} warm-up steps, one step recording kernels, then {steps} profiled steps, "
            f"each beside a plain one (batch {batch_size}, {backend.name} backend, {clock.name})")
        for i in range(warmup):
            step(batches[i % len(batches)])
        inspection = profiler.inspect(backend, model, step, batches[warmup % len(batches)])
        plain, profiled = [], []
        for i in range(steps):
            batch = batches[(warmup + 1 + i) % len(batches)]
            plain.append(plain_step_ms(clock, step, batch))
            profiler.nvtx.push(f"profiled step {i}")
            profiled.append(profiler.step(step, batch))
            profiler.nvtx.pop()
    config = {"model": title or f"{type(model).__name__} of {sum(p.size for p in model.parameters()):,} parameters",
              "batch_size": batch_size, "steps": steps, "warmup": warmup, "backend": backend.name,
              "clock": clock.name, "world_size": 1 if ddp is None else ddp.world_size}
    return build_report(config, peak, profiler.kinds, inspection, profiled, plain)


# ---- the report ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    name: str               # dotted module name ('' for the model itself), or the span's name
    category: str           # layer, block (a container's own ops), data, loss, optimizer, ...
    kind: str               # the module's class, or the span's category
    output: tuple           # the module's output shape, or None
    ms: dict                # phase -> median ms per step
    cost: dict              # phase -> costs.Cost of the ops it ran
    kernels: dict           # phase -> {kernel name: launches per step}
    uncosted: list          # ops that nn/costs.py has no formula for
    stage: str              # the model's top-level module it is in (resnet_block2), or a span's category
    block: str              # the second-level container it is in (resnet_block2.0), or its stage

    @property
    def total_ms(self):
        return sum(self.ms.values())

    @property
    def label(self):
        return self.name or "(model)"

    def metrics(self, peak, step_ms):
        """The row's figures: times, share, FLOPs, bytes, rates, and its place under the roofs."""
        flops = sum(c.flops for c in self.cost.values())
        nbytes = sum(c.bytes for c in self.cost.values())
        ms = self.total_ms
        out = {"name": self.label, "category": self.category, "kind": self.kind, "stage": self.stage,
               "block": self.block, "output_shape": list(self.output) if self.output else None,
               **{f"{p}_ms": self.ms[p] for p in PHASES}, "total_ms": ms,
               "share": ms / step_ms if step_ms > 0 else None, "flops": flops, "bytes": nbytes,
               "tflops": flops / ms / 1e9 if ms > 0 else None, "gbs": nbytes / ms / 1e6 if ms > 0 else None,
               "intensity": flops / nbytes if nbytes else None, "bound": None, "peak_fraction": None,
               "flops_fraction": None, "bandwidth_fraction": None, "roofline_ms": None,
               "kernels": {p: dict(k) for p, k in self.kernels.items() if k}, "uncosted": self.uncosted}
        if peak is not None and nbytes and ms > 0:
            roof_ms = max(flops / (peak.tflops * 1e9), nbytes / (peak.gbs * 1e6))
            out.update(bound="compute" if flops / nbytes > peak.ridge else "memory", roofline_ms=roof_ms,
                       peak_fraction=roof_ms / ms, flops_fraction=out["tflops"] / peak.tflops,
                       bandwidth_fraction=out["gbs"] / peak.gbs)
        return out


def build_report(config, peak, kinds, inspection, profiled, plain):
    """The Report from the inspection step, the profiled steps' StepTimes and the plain steps' ms."""
    ops, launches, shapes, order = inspection
    keys = order + [k for s in profiled for k, _ in s.exclusive if k not in order]
    rows = [_row(key, kinds, shapes, ops, launches, profiled) for key in dict.fromkeys(keys)]
    concurrent = collections.defaultdict(list)
    for s in profiled:
        for key, ms, overlap in s.concurrent:
            concurrent[key].append((ms, overlap))
    steps = [{"profiled_ms": s.total_ms, "covered_ms": s.covered_ms, "plain_ms": ms} for s, ms in zip(profiled, plain)]
    return Report(config, peak, rows, steps,
                  {key: tuple(statistics.median(v) for v in zip(*times)) for key, times in concurrent.items()})


def _row(key, kinds, shapes, ops, launches, profiled):
    name, category = key
    stage = block = category
    if key in kinds:     # a module: grouped by the containers its dotted name passes through
        stage = name.split(".")[0] or "(model)"
        second = ".".join(name.split(".")[:2])
        block = second if name and (second, "block") in kinds and second != stage else stage
    kind = kinds.get(key, category) + (" own ops" if category == "block" else "")
    ms = {p: statistics.median(s.exclusive.get((key, p), 0.0) for s in profiled) for p in PHASES}
    cost, uncosted = {}, []
    for p in PHASES:
        known = [(op, args) for op, args in ops.get((key, p), []) if hasattr(costs, op)]
        uncosted += [op for op, _ in ops.get((key, p), []) if not hasattr(costs, op)]
        cost[p] = sum((costs.cost_of(op, *args) for op, args in known), costs.ZERO)
    output = tuple(shapes[key]) if shapes.get(key) is not None else None
    return Row(name, category, kind, output, ms, cost, {p: launches.get((key, p), {}) for p in PHASES},
               sorted(set(uncosted)), stage, block)


@dataclasses.dataclass
class Report:
    config: dict
    peak: Peak              # None for a GPU without figures in PEAKS
    rows: list              # in the order they first ran
    steps: list             # per profiled step: {profiled_ms, covered_ms, plain_ms} (its plain neighbour)
    concurrent: dict        # (name, category) -> (median ms, median ms overlapping backward)

    @property
    def step_ms(self):
        """The median profiled step."""
        return statistics.median(s["profiled_ms"] for s in self.steps)

    @property
    def plain_step_ms(self):
        """The median step timed by one pair of marks."""
        return statistics.median(s["plain_ms"] for s in self.steps)

    @property
    def overhead_ms(self):
        return self.step_ms - self.plain_step_ms

    def covered_fraction(self):
        """How much of a step its layers and spans account for (the median over the steps)."""
        return statistics.median(s["covered_ms"] / s["profiled_ms"] for s in self.steps)

    def rows_ms(self):
        """The layers' and spans' medians added up. Below the median step when other processes
        take the CPU at random places of each step: every step keeps its interruptions, while each
        row's median leaves them out."""
        return sum(r.total_ms for r in self.rows if r.category != UNTRACKED[1])

    def by_cost(self):
        return sorted(self.rows, key=lambda r: -r.total_ms)

    def to_json(self):
        metrics = [r.metrics(self.peak, self.step_ms) for r in self.rows]
        return {"config": self.config,
                "device": {"peak": dataclasses.asdict(self.peak) if self.peak else None,
                           "ridge_flops_per_byte": self.peak.ridge if self.peak else None},
                "step": {"profiled_ms": self.step_ms, "plain_ms": self.plain_step_ms,
                         "overhead_ms": self.overhead_ms, "overhead_fraction": self.overhead_ms / self.plain_step_ms,
                         "covered_fraction": self.covered_fraction(), "rows_median_sum_ms": self.rows_ms(),
                         "each": self.steps},
                "rows": metrics, "groups": self.groups(),
                "concurrent": [{"name": n, "category": c, "ms": ms, "overlap_backward_ms": overlap,
                                "overlap_fraction": overlap / ms if ms > 0 else None}
                               for (n, c), (ms, overlap) in self.concurrent.items()]}

    def groups(self):
        """Medians added up by stage and by residual block: [{group, level, forward_ms, ...}]."""
        totals = {}
        for r in self.rows:
            for level, group in (("stage", r.stage), ("block", r.block)):
                if level == "block" and group == r.stage:
                    continue
                entry = totals.setdefault(group, {"group": group, "level": level, **{f"{p}_ms": 0.0 for p in PHASES}})
                for p, ms in r.ms.items():
                    entry[f"{p}_ms"] += ms
        return list(totals.values())

    def table(self, top=15):
        """The terminal report: the costliest rows, the totals, the overhead, the groups."""
        c, peak = self.config, self.peak
        roof = (f"{peak.device}: {peak.tflops:.3g} TFLOP/s, {peak.gbs:.4g} GB/s, ridge {peak.ridge:.1f} FLOP/B "
                f"({peak.source})") if peak else "roofs unknown for this GPU: add it to PEAKS in nn/profiler.py"
        rows = self.by_cost()
        lines = [f"{c['model']}, batch {c['batch_size']}, {c['backend']} backend ({c['clock']}): medians of "
                 f"{c['steps']} steps after {c['warmup']} warm-up", roof, "", TABLE_HEADER]
        lines += [_table_line(r.metrics(peak, self.step_ms), self.step_ms) for r in rows[:top]]
        if rows[top:]:
            lines.append(_times_line(f"... {len(rows[top:])} more rows", rows[top:], self.step_ms))
        lines += [_times_line(f"total of all {len(rows)} rows", rows, self.step_ms),
                  f"step: {self.step_ms:.2f} ms (median of the profiled steps), {100 * self.covered_fraction():.1f} % "
                  f"of it inside its layers and spans; the rows' medians add up to {self.rows_ms():.2f} ms",
                  f"profiler overhead: {self.step_ms:.2f} ms per step with per-layer marks against "
                  f"{self.plain_step_ms:.2f} ms with one pair of marks per step: {self.overhead_ms:+.2f} ms "
                  f"({100 * self.overhead_ms / self.plain_step_ms:+.1f} %)", "",
                  f"{'by stage and residual block':{LABEL_WIDTH}s} " + " ".join(f"{h:>8s}" for h in PHASE_HEADS)
                  + f" {'share':>6s}"]
        for g in self.groups():
            indent = "  " if g["level"] == "block" else ""
            lines.append(f"{indent + g['group']:{LABEL_WIDTH}s} " + " ".join(_ms(g[f'{p}_ms']) for p in PHASES)
                         + f" {_share(sum(g[f'{p}_ms'] for p in PHASES), self.step_ms)}")
        if self.concurrent:
            lines += ["", "beside the step (concurrent spans): median ms, and how much of it overlapped the backward"]
            lines += [f"  {n} ({c}): {ms:.3f} ms, {overlap:.3f} ms overlapped ({100 * overlap / ms if ms else 0:.0f} %)"
                      for (n, c), (ms, overlap) in self.concurrent.items()]
        return "\n".join(lines)

    def write(self, out_dir=None, json_path=None, csv_path=None, png_path=None):
        """profile.json, profile.csv and profile.png in `out_dir` (or at the paths given), each
        replaced atomically; {'json': path, 'csv': path, 'png': path}."""
        paths = {kind: Path(given) if given else Path(out_dir) / f"profile.{kind}"
                 for kind, given in (("json", json_path), ("csv", csv_path), ("png", png_path))}
        if any(not given for given in (json_path, csv_path, png_path)) and out_dir is None:
            raise ValueError("write() needs an output folder for the files without a path")
        for path in paths.values():
            path.parent.mkdir(parents=True, exist_ok=True)
        document = self.to_json()
        with checkpoint.atomic_write(paths["json"], "w") as f:
            json.dump(document, f, indent=1)
        with checkpoint.atomic_write(paths["csv"], "w") as f:
            write_csv(f, document["rows"])
        with checkpoint.atomic_write(paths["png"]) as f:
            f.write(self.chart())
        return paths

    def chart(self):
        """PNG bytes: each row's median ms per step, forward, backward and other stacked, in the
        order the step runs them (containers without ops of their own left out)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = [r for r in self.rows if r.category not in ("block", UNTRACKED[1]) or any(r.kernels.values())]
        fig, ax = plt.subplots(figsize=(9, 1.5 + 0.19 * len(rows)))
        y = np.arange(len(rows))
        left = np.zeros(len(rows))
        for phase, color in zip(PHASES, ("tab:blue", "tab:orange", "tab:gray")):
            widths = np.array([r.ms.get(phase, 0.0) for r in rows])
            ax.barh(y, widths, left=left, color=color, label=phase)
            left += widths
        ax.set_yticks(y, [r.label if r.kind == r.category else f"{r.label} ({r.kind})" for r in rows], fontsize=7)
        ax.set_ylim(len(rows) - 0.5, -0.5)     # the first row on top, no margins
        c = self.config
        ax.set_xlabel(f"ms per step, median of {c['steps']} steps")
        ax.set_title(f"{c['model']}, batch {c['batch_size']}, {c['backend']}: step {self.step_ms:.1f} ms", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        return buf.getvalue()


PHASE_HEADS = ("fwd ms", "bwd ms", "other ms")
LABEL_WIDTH = 34 + 1 + 14 + 1 + 10     # the layer, type and output columns
TABLE_HEADER = (f"{'layer':34s} {'type':14s} {'output':>10s} " + " ".join(f"{h:>8s}" for h in PHASE_HEADS)
                + f" {'share':>6s} {'GFLOP':>7s} {'MB':>7s} {'TFLOP/s':>8s} {'GB/s':>7s} {'bound':>7s} {'%peak':>6s}"
                + "  kernels")
CSV_FIELDS = ("name", "category", "kind", "stage", "block", "output_shape", "forward_ms", "backward_ms", "other_ms",
              "total_ms", "share", "flops", "bytes", "tflops", "gbs", "intensity", "bound", "peak_fraction",
              "flops_fraction", "bandwidth_fraction", "roofline_ms", "kernels")


def _ms(v):
    return f"{v:8.3f}" if v else f"{'-':>8s}"


def _share(ms, step_ms):
    return f"{100 * ms / step_ms:5.1f}%" if step_ms > 0 else f"{'-':>6s}"


def _number(v, fmt, width, scale=1):
    """v / scale in `width` columns; '-' where there is no figure (None, or no FLOPs or bytes)."""
    return f"{v / scale:{width}{fmt}}" if v else f"{'-':>{width}s}"


def _kernel_list(kernels_by_phase):
    """'conv2d_forward x1, add x2' over the phases, in the order they ran."""
    merged = collections.Counter()
    for counts in kernels_by_phase.values():
        merged.update(counts)
    return ", ".join(f"{name} x{n}" for name, n in merged.items())


def _table_line(m, step_ms):
    output = "x".join(map(str, m["output_shape"][1:])) if m["output_shape"] else "-"   # without the batch
    peak = 100 * m["peak_fraction"] if m["peak_fraction"] is not None else None
    return (f"{m['name'][:34]:34s} {m['kind'][:14]:14s} {output[:10]:>10s} "
            + " ".join(_ms(m[f"{p}_ms"]) for p in PHASES) + f" {_share(m['total_ms'], step_ms)}"
            f" {_number(m['flops'], '.3f', 7, 1e9)} {_number(m['bytes'], '.1f', 7, 1e6)}"
            f" {_number(m['tflops'], '.3f', 8)} {_number(m['gbs'], '.1f', 7)} {m['bound'] or '-':>7s}"
            f" {_number(peak, '.1f', 6)}  {_kernel_list(m['kernels'])}")


def _times_line(label, rows, step_ms):
    """A line of the table's time columns, added up over `rows`."""
    return (f"{label:{LABEL_WIDTH}s} " + " ".join(_ms(sum(r.ms[p] for r in rows)) for p in PHASES)
            + f" {_share(sum(r.total_ms for r in rows), step_ms)}")


def write_csv(f, metrics):
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for m in metrics:
        writer.writerow({**m, "output_shape": "x".join(map(str, m["output_shape"] or [])),
                         "kernels": "; ".join(f"{p}: {_kernel_list({p: k})}" for p, k in m["kernels"].items())})


# ---- the command ---------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m nn.profiler", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=256, help="images per step (default %(default)s)")
    p.add_argument("--steps", type=int, default=20,
                   help="profiled steps; each row is their median (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default %(default)s)")
    p.add_argument("--width", type=int, default=64,
                   help="channels of the first stage; 64 is ResNet-18 (default %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="where to run (default: cuda where CuPy sees a GPU, else cpu)")
    p.add_argument("--out", metavar="DIR", help="folder for profile.json, profile.csv and profile.png "
                                                "(default runs/profile-<date>-<time>)")
    p.add_argument("--json", metavar="FILE", help="the JSON file (default DIR/profile.json)")
    p.add_argument("--csv", metavar="FILE", help="the CSV file (default DIR/profile.csv)")
    p.add_argument("--png", metavar="FILE", help="the chart (default DIR/profile.png)")
    p.add_argument("--top", type=int, default=15, help="rows in the terminal table (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the random images (default %(default)s)")
    args = p.parse_args(argv)
    for name in ("batch_size", "steps", "width", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {args.warmup}")
    args.device = args.device or ("cuda" if kernels.gpu_count() else "cpu")
    try:
        args.xp = kernels.array_module_for(args.device)
    except kernels.DeviceError as e:
        p.error(f"--device {args.device}: {e}")
    args.out = args.out or time.strftime("runs/profile-%Y%m%d-%H%M%S")
    return args


def main(argv=None):
    args = parse_args(argv)
    manual_seed(args.seed)
    model = resnet18(width=args.width).to(args.device)
    optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    # random images: a step's cost depends on the shapes, not on what the pixels show
    rng = np.random.default_rng(args.seed)
    count = 4 * args.batch_size
    images = args.xp.asarray(rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
    labels = args.xp.asarray(rng.integers(0, data.NUM_CLASSES, count).astype(np.int32))
    log = functools.partial(print, flush=True)
    report = profile(model, optimizer, images, labels, args.batch_size, args.steps, args.warmup, log=log,
                     title=f"ResNet-18 (width {args.width})")
    print(report.table(args.top))
    paths = report.write(args.out, args.json, args.csv, args.png)
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
