"""python -m profiler: the per-layer profile of ResNet-18 training steps on random images of
Fashion-MNIST's shape (28 x 28, 10 classes); the package's docstring is its --help."""
import argparse
import functools
import sys
import time

import numpy as np

import kernels
import profiler
from kernels import emu
from kernels.cuda.launch import ELEMENT_LIMIT
from nn.init import manual_seed
from nn.optim import SGD
from nn.resnet import largest_activation, largest_gpu_batch, memory_shortfall, resnet18
from . import report
from .steps import profile

CLASSES = 10
PROG = "python -m profiler"


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=profiler.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=256, help="images per step (default %(default)s)")
    p.add_argument("--steps", type=int, default=20,
                   help="profiled steps; each row is their median (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default %(default)s)")
    p.add_argument("--width", type=int, default=64,
                   help="channels of the first stage; 64 is ResNet-18 (default %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="where to run (default: cuda where CuPy sees a GPU, else cpu)")
    p.add_argument("--precision", choices=kernels.PRECISIONS,
                   help="of the step on the GPU, as train_resnet.py's --precision: tf32 (the convolutions on the "
                        "TF32 tensor cores), bf16 (mixed precision, the activations in bfloat16) or fp32 (default: "
                        "tf32 where the GPU has tensor cores, else fp32; the CPU computes in float32 and takes none)")
    p.add_argument("--out", metavar="DIR", help="folder for profile.json, profile.csv, profile.png and "
                                                "profile.trace.json (default runs/profile-<date>-<time>)")
    p.add_argument("--json", metavar="FILE", help="the JSON file (default DIR/profile.json)")
    p.add_argument("--csv", metavar="FILE", help="the CSV file (default DIR/profile.csv)")
    p.add_argument("--png", metavar="FILE", help="the chart (default DIR/profile.png)")
    p.add_argument("--trace", metavar="FILE", help="the timeline, for Perfetto or chrome://tracing "
                                                   "(default DIR/profile.trace.json)")
    p.add_argument("--top", type=int, default=15, help="rows in the terminal table (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the random images (default %(default)s)")
    args = p.parse_args(argv)   # argparse's own errors (an unknown flag, a malformed number) print the usage
    problem = _problem(args)
    if problem:                 # a well-formed value that is wrong here: one line, as train_resnet.py's
        p.exit(2, f"{p.prog}: error: {problem}\n")
    if args.why_fp32:
        print(args.why_fp32, flush=True)
    return args


def _problem(args):
    """What is wrong with well-formed flags, for this machine too, in one line (None when nothing is); fills
    in the device, its array module, the precision and the output folder."""
    for name in ("batch_size", "steps", "width", "top"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.warmup < 0:
        return f"--warmup must be 0 or more, got {args.warmup}"
    if args.seed < 0:
        return f"--seed must be 0 or more, got {args.seed}"
    args.device = args.device or ("cuda" if kernels.gpu_count() else "cpu")
    args.why_fp32 = None
    try:
        args.xp = kernels.array_module_for(args.device)
        if args.device != "cpu":
            args.precision, args.why_fp32 = kernels.precision_for([args.xp.cuda.runtime.getDevice()], args.precision)
    except kernels.DeviceError as e:
        return f"--device {args.device}: {e}"
    if args.device == "cpu" and args.precision is not None:
        return f"--precision {args.precision} is the GPU's: the CPU computes in float32"
    if args.device != "cpu" and args.batch_size > largest_gpu_batch(args.width):
        return (f"--batch-size {args.batch_size}: at --width {args.width} the first stage's activations would have "
                f"{args.batch_size * largest_activation(args.width):,} elements, more than the CUDA kernels index "
                f"({ELEMENT_LIMIT:,}); at most {largest_gpu_batch(args.width):,} images fit a batch")
    args.out = args.out or time.strftime("runs/profile-%Y%m%d-%H%M%S")
    return report.unwritable(report.output_paths(args.out, args.json, args.csv, args.png, args.trace), args.out) or \
        memory_shortfall(args.width, CLASSES, 1, args.xp)


def main(argv=None):
    args = parse_args(argv)
    try:
        with kernels.use_precision(args.precision or kernels.precision()):
            return _profile(args)
    except MemoryError:   # CuPy's OutOfMemoryError is one too
        print(f"{PROG}: error: out of {args.device} memory at batch size {args.batch_size}: try a smaller "
              f"--batch-size", file=sys.stderr)
        return 1
    except emu.CacheError as e:   # the emulator's (on simulated GPUs) cannot keep what it compiles
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _profile(args):
    manual_seed(args.seed)
    model = resnet18(num_classes=CLASSES, width=args.width).to(args.device)
    optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    # random images: a step's cost depends on the shapes, not on what the pixels show
    rng = np.random.default_rng(args.seed)
    count = 4 * args.batch_size
    images = args.xp.asarray(rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
    labels = args.xp.asarray(rng.integers(0, CLASSES, count).astype(np.int32))
    log = functools.partial(print, flush=True)
    result = profile(model, optimizer, images, labels, args.batch_size, args.steps, args.warmup, log=log,
                     title=f"ResNet-18 (width {args.width})")
    print(result.table(args.top))
    try:
        paths = result.write(args.out, args.json, args.csv, args.png, args.trace)
    except OSError as e:   # what the checks before profiling could not foresee (a full disk, /proc)
        print(f"{PROG}: error: cannot write the profile: {e}", file=sys.stderr)
        return 1
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0

