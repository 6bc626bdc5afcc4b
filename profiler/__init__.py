"""Per-layer cost of training: where each step's time goes, layer by layer.

    python -m profiler --batch-size 256 --steps 20              # on the GPU where there is one
    python -m profiler --batch-size 256 --precision bf16        # the GPU's mixed precision
    python -m profiler --device cpu --batch-size 32 --steps 10 --warmup 3 --out runs/profile

The command trains ResNet-18 (nn.resnet18, --width channels in the first stage; SGD with lr 0.1,
momentum 0.9, weight decay 5e-4) on random Fashion-MNIST-shaped images: warm-up steps first, then
--steps profiled steps, each beside one plain step. It prints a table sorted by cost and writes
profile.json, profile.csv, profile.png (time per layer, forward and backward stacked) and
profile.trace.json (the timeline of the profiled steps) to --out.

From Python, on any model and SGD optimizer (train_resnet.py --profile):

    report = profile(model, optimizer, images, labels, batch_size, steps, warmup=3, log=print, title=None)
    print(report.table())
    report.write(out_dir)          # -> {'json': path, 'csv': path, 'png': path, 'trace': path}

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
device mid-step (a layer's time is then the GPU time between its events). The host queues an eager
step of small kernels more slowly than a GPU runs it, and events would then time the GPU waiting for
the host; so on the GPU every step (profiled or plain) is queued behind a kernel that holds the
stream for longer than the host took to queue the step before (Backend.hold), and its kernels run
back to back, as in a CUDA graph. A step the host still had not queued whole when the hold ended
is counted, and the report warns of it (gpu_waited_for_the_host in profile.json).
Each interval between two marks belongs to the innermost module or span open during it, so in
each step the rows add up to the step: a leaf module (conv, batch norm, relu, pool, linear) is a
row, and so are the own ops of a container, if it runs any (a Residual's relu joins run inside its
batch norms, which carry them). Rows are medians over the profiled steps.

Per row, from one extra step in which every op of the kernel contract and every CUDA kernel
launch is recorded against the row that ran it: the kernels by name, FLOPs and the fewest bytes
they must move (profiler/costs.py), the achieved TFLOP/s and GB/s, and which roof bounds it: its
arithmetic intensity against the device's ridge point (PEAKS; the CPU's is measured at start),
with the fraction of that roof reached; a row whose kernels multiply on the tensor cores sits under
their compute roof: TF32's for the convolutions under the tf32 precision (but for the stem, which
runs in FP32), BF16's, twice as high, for those under bf16; the rest under FP32's. The precision is
in the report's config. Grouped by stage and residual block by module name.

Its own overhead: each profiled step runs beside a plain one timed by one pair of marks, and the
report states both medians and their difference.

Spans from other code: ``with profiler.span(name, category):`` around work records it as a row
while a profile runs and does nothing otherwise (``current()`` is the running Profiler or None).
Work that runs beside the step is a concurrent span (``concurrent=True``, with its ``stream``): it
is no row, and is reported apart with how much of it overlapped the model's backward. Data
parallelism does not import the profiler: a running profile subscribes to its all-reduce hook
(parallel.ddp.register_all_reduce_hook), and each gradient bucket's all-reduce becomes a span,
concurrent on a GPU (on its own stream), nested in the backward on the CPU, where it blocks.

The timeline, profile.trace.json: Chrome's trace-event format; drag it into https://ui.perfetto.dev
or load it in chrome://tracing. Each rank is a process ('rank 0 (cuda:0)'); on its first track each
profiled step is a span 'step N' holding every module's forward and backward and every span above,
nested, at the times of their marks (CUDA events on the GPU), from an origin taken before the first
profiled step; concurrent spans (a bucket's all-reduce on a GPU) lie on a track of their stream's,
where their overlap with the backward shows. With several ranks, every rank takes that origin right
after a barrier and rank 0's file holds all of them, on one timeline.

Layout: measure.py (clocks, marks, the Profiler), steps.py (the training step and profile()),
report.py (rows, table, JSON, CSV, chart), trace.py (the timeline), roofs.py (the devices' roofs),
costs.py (FLOPs and bytes of each op), cli.py (``python -m profiler``).

NVTX ranges (CuPy with NVTX) name every profiled step, module phase and nested span, for Nsight
Systems or ``ncu --nvtx``; on the CPU there are none.
"""
from .measure import UNTRACKED, EventClock, Nvtx, Profiler, WallClock, current, span
from .report import Report
from .roofs import PEAKS, Peak, device_peak, gpu_peak, measured_cpu_peak
from .steps import profile, training_step

__all__ = ["profile", "training_step", "span", "current", "Profiler", "Report", "WallClock", "EventClock", "Nvtx",
           "UNTRACKED", "Peak", "PEAKS", "gpu_peak", "measured_cpu_peak", "device_peak"]
