"""How the batch-norm reductions (kernels/cuda/batchnorm.cu's bn_stats and bn_backward_sums) read memory,
and their grids at batch 256; no GPU needed.

  PYTHONPATH=. python -m bench.bn_plan [--rows 512] [--channels 64 128] [--batch 256] [--sms 132]

First, measured on the emulator with its traffic counter (emu.traffic(), kernels/emu/README.md): the two
reductions over channels-last x (and dy) of --rows rows of C channels, as the block-per-channel kernels
read them (forced here: the launchers ran them on every shape before, and keep them where C is not a
multiple of 32 or the memory is not rows of channels) and as the _rows kernels that the launchers now pick
read them: the warp-wide load requests, the 32-byte sectors they read, the bytes they use, sectors per
byte used (ideal 1/32) and bytes moved from L2 per byte used (ideal 1). The inputs lie at 256-byte
boundaries, as CuPy allocates them; the per-split sums that the launchers allocate lie where NumPy puts
them (at 16 bytes), which costs the _rows kernels a few sectors that a GPU would not read. The backward
runs without the relu mask, which leaves bytes of dy unused where y is 0 in either layout. The L1 cache
is not modelled: for data read once, as here, the sectors are what moves from L2 to the SMs.

Then, for each batch-norm layer of ResNet-18 at --batch, channels-last as under the default tf32
precision: the grids of both kernels (a block per channel, or per 32 channels, times the splits of the
rows), the blocks per SM, the rows a block reduces, and the bytes the two reductions use per step (x;
then dy, x and, where a relu is fused, its output y), with the L2 traffic that the ratios measured above
(at the nearest C) make of them. A model of the traffic, not a measurement of time: bench/gpu_check times
the step when a GPU is lent.
"""
import argparse
import contextlib
import sys
from unittest import mock

import numpy as np

from bench import layers
from kernels import backend_of, emu, emulate
from kernels.cuda import batchnorm
from kernels.cuda.launch import split

REDUCTIONS = ("bn_stats", "bn_backward_sums")
FLOAT = 4


def channels_last(rows, c, gen):
    """A random (1, C, rows, 1) NCHW view of channels-last memory, rows of C channels from a 256-byte boundary."""
    memory = emu.aligned_empty((1, rows, 1, c))
    memory[...] = gen.standard_normal(memory.shape)
    return memory.transpose(0, 3, 1, 2)


def measured(rows, c, old):
    """{kernel: emu.Traffic} of the two reductions over rows of C channels: by the block-per-channel kernels
    if `old`, else as the launchers choose (the _rows kernels, for C a multiple of 32)."""
    gen = np.random.default_rng(0)
    x, dy = channels_last(rows, c, gen), channels_last(rows, c, gen)
    gamma, beta = gen.standard_normal((2, c)).astype(np.float32)
    forced = mock.patch.object(batchnorm, "by_rows", lambda c, plane: False) if old else contextlib.nullcontext()
    with emulate(), forced, emu.traffic() as counted:
        be = backend_of(x)
        _, mean, invstd = be.batch_norm_forward(x, gamma, beta, 1e-5)
        be.batch_norm_backward(dy, x, gamma, mean, invstd)
    return {kernel: traffic for kernel, traffic in counted.items() if kernel.startswith(REDUCTIONS)}


def reduction_of(kernel):
    """bn_stats or bn_backward_sums, of either kernel."""
    return kernel.partition("<")[0].removesuffix("_rows")


def per_step(batch, ratios, sms):
    """The table of the batch-norm layers at `batch` and the step's totals: [(row, ...)], (bytes used,
    L2 bytes old, L2 bytes new); ratios {(reduction, old, C): L2 bytes per byte used}."""
    rows_out, used, l2 = [], 0, {True: 0.0, False: 0.0}
    for layer, count in layers.distinct(layers.resnet18_layers(batch)):
        if not layer.op.startswith("batch_norm"):
            continue
        n, c, h, w = layer.x
        rows = n * h * w
        old_splits, _ = split(rows, c)
        suffix, (groups, splits), chunk = batchnorm.reduction(rows, c, 1)
        arrays = {"bn_stats": 1, "bn_backward_sums": 3 if "relu" in layer.op else 2}
        for name, k in arrays.items():
            nbytes = count * k * rows * c * FLOAT
            used += nbytes
            for old in (True, False):
                nearest = min((m for r, o, m in ratios if r == name and o == old), key=lambda m: abs(m - c))
                l2[old] += nbytes * ratios[name, old, nearest]
        rows_out.append((layer.label, count, rows, (c, old_splits), (groups, splits), groups * splits / sms, chunk,
                         count * sum(arrays.values()) * rows * c * FLOAT))
    return rows_out, (used, l2[True], l2[False])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", type=int, default=512, help="rows (pixels) of the measured arrays (default 512)")
    p.add_argument("--channels", type=int, nargs="+", default=[64, 128],
                   help="C of the measured arrays, multiples of 32 (default 64 128)")
    p.add_argument("--batch", type=int, default=layers.BATCH)
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default 132, an H200 SXM)")
    args = p.parse_args(argv)
    if any(c <= 0 or c % batchnorm.GROUP for c in args.channels):
        p.error(f"--channels {' '.join(map(str, args.channels))}: give multiples of {batchnorm.GROUP}, where the "
                "launchers pick the _rows kernels")
    print(f"Measured on the emulator (emu.traffic()): rows of channels, {args.rows} rows\n")
    print("| kernel | C | requests | sectors read | bytes used | sectors per byte used | L2 bytes per byte used |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for c in args.channels:
        for old in (True, False):
            for kernel, t in measured(args.rows, c, old).items():
                ratios[reduction_of(kernel), old, c] = t.sectors * 32 / t.bytes
                print(f"| `{kernel}`{' (forced)' if old else ''} | {c} | {t.requests} | "
                      f"{t.sectors} | {t.bytes} | {t.sectors / t.bytes:.4f} (1/{t.bytes / t.sectors:.1f}) | "
                      f"{t.sectors * 32 / t.bytes:.3f} |")
    table, (used, l2_old, l2_new) = per_step(args.batch, ratios, args.sms)
    print(f"\n| layer (batch {args.batch}) | n | rows | block-per-channel grid | _rows grid | _rows blocks per SM "
          f"({args.sms}) | rows per _rows block | MB used per step |")
    print("|---|---|---|---|---|---|---|---|")
    for label, count, rows, old_grid, grid, per_sm, chunk, nbytes in table:
        print(f"| {label} | {count} | {rows} | {'x'.join(map(str, old_grid))} | {'x'.join(map(str, grid))} | "
              f"{per_sm:.1f} | {chunk} | {nbytes / 1e6:.0f} |")
    print(f"\nPer step, the two reductions use {used / 1e9:.2f} GB; at the L2 bytes per byte used measured above, "
          f"the block-per-channel kernels move {l2_old / 1e9:.1f} GB from L2, the _rows kernels "
          f"{l2_new / 1e9:.2f} GB (a model; time unmeasured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
