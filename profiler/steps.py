"""The training step with its parts as spans, and ``profile()``: warm-up steps, the inspection
step, then each profiled step beside a plain one, into a Report."""
import contextlib
import functools

import numpy as np

from kernels import backend_of, get_array_module, precision
from nn import data
from nn.functional import cross_entropy
from nn.tensor import Tensor
from . import trace
from .measure import Nvtx, Profiler, clock_for, span
from .report import build_report
from .roofs import device_peak


def training_step(model, optimizer, images, labels, index, ddp=None):
    """The trainer's step (training/loop.py) on the batch images[index], with its parts as spans;
    with ``ddp`` (parallel.ddp.DataParallel), on this rank's shard of it, the gradients summed
    over ranks in buckets (each an 'allreduce' span)."""
    K = backend_of(images)
    with span("batch gather", "data"):
        index = index if ddp is None else ddp.scatter(index)
        x, y = Tensor(K.images_to_float(images, index)), K.take(labels, index)
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
    """One step timed by one pair of marks, run ahead of the GPU as a profiled one is: the baseline of
    the profiler's overhead."""
    with clock.ahead():
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
    with ``ddp``, of this rank's data-parallel steps on its shards of global batches, and with the
    timeline of every rank."""
    check_inputs(images, labels, batch_size, steps, warmup)
    xp, backend = get_array_module(images), backend_of(images)
    order = xp.asarray(data.epoch_order(len(images), seed=0, epoch=0))
    batches = [b for b in data.batch_indices(order, batch_size) if len(b) == batch_size]
    clock = clock_for(xp, backend)
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
        if ddp is not None:
            ddp.comm.barrier()     # every rank's origin at once: one timeline for all ranks
        profiler.start_timeline()
        plain, profiled = [], []
        for i in range(steps):
            batch = batches[(warmup + 1 + i) % len(batches)]
            plain.append(plain_step_ms(clock, step, batch))
            profiler.nvtx.push(f"profiled step {i}")
            profiled.append(profiler.step(step, batch))
            profiler.nvtx.pop()
    device = "cpu" if xp is np else f"cuda:{images.device.id}"
    timeline = trace.rank_events(profiled, profiler.kinds, 0 if ddp is None else ddp.rank, device)
    if ddp is not None:
        timeline = trace.gathered(timeline, ddp.comm)
    config = {"model": title or f"{type(model).__name__} of {sum(p.size for p in model.parameters()):,} parameters",
              "batch_size": batch_size, "steps": steps, "warmup": warmup, "backend": backend.name,
              "precision": "fp32" if backend.name == "cpu" else precision(), "clock": clock.name,
              "world_size": 1 if ddp is None else ddp.world_size}
    return build_report(config, peak, profiler.kinds, inspection, profiled, plain, timeline)
