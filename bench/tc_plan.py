"""What the tensor-core kernels launch for every convolution of ResNet-18 at batch 256, and how that
fills an H200, for both tensor-core precisions side by side: conv_tc.cu's TF32 GEMMs (--precision
tf32) and conv_bf16.cu's BF16 ones (bf16), and on sm_90 the forwards of conv_sm90.cu (Hopper's warpgroup MMA
fed by TMA); no GPU needed.

  PYTHONPATH=. python -m bench.tc_plan [--batch 256] [--arch sm_90] [--sms 132] [--precision tf32 bf16]

Each tensor-core kernel's registers, shared memory and resident blocks, and its main loops in the
SASS NVRTC makes (the loops with the most HMMA of the GEMM): their instructions, their HMMA and the
instructions per HMMA, the issue slots a loop spends for each tensor-core instruction of the
product. A backward-weight has more than one: the first row of tiles also sums the bias gradient,
in a loop of its own (the "bias loop", listed after the lean loop): BF16's from the B fragments (a
float32 add per value); TF32's from dy's TF32 values as they land, or, for a raw
dy, from its values before it rounds them. Then for each GEMM (forward, backward-data,
backward-weight) of each distinct convolution that the tensor cores take: the kernel the launchers
choose (kernels/cuda/conv_tc.py's plan; TF32's projection backward, one launch for backward-data and
backward-weight, on both rows), its grid in blocks, its split-K parts (and their groups),
the waves of blocks over the SMs at the occupancy that the kernel's registers and shared memory
allow (from ptxas through NVRTC, as
kernels.cuda.ptxas_report gives them), and the FLOPs per L2 byte of its tile: the FLOPs of a k step,
2 BM BN k, over the operand bytes a block loads for it, (BM + BN) k times the element's bytes (a tile
wider than the GEMM loads and multiplies its real rows and columns only). The occupancy rules are
--arch's (SM_LIMITS): 65,536 registers per SM, allocated per warp in units of 256; 228 KB of shared
memory per SM on sm_90, 164 on sm_80, 100 on sm_86 and sm_89, 1 KB of it reserved per block; at most
32 blocks (sm_86: 16, sm_89: 24) and 64 warps (sm_86, sm_89: 48) per SM. An A100's figures:
--arch sm_80 --sms 108. A model of the launch, not a measurement: the speed is measured by
bench/gpu_check (tier c) when a GPU is lent.
"""
import argparse
import math
import re
import statistics
import sys

import numpy as np

from bench import layers
from kernels import bfloat16
from kernels.cuda import conv_sm90, conv_tc
from kernels.cuda.launch import tile_of
from kernels.cuda.ptxas_report import compile_family, report

REGISTERS, REGISTER_UNIT, SHARED_RESERVED = 65536, 256, 1024
# an SM's shared memory, blocks and warps, by architecture (CUDA's occupancy tables): an A100's, an RTX 3090's or an
# A10's, an RTX 4090's or an L4's, an H100's or H200's
SM_LIMITS = {"sm_80": (167936, 32, 64), "sm_86": (102400, 16, 48), "sm_89": (102400, 24, 48), "sm_90": (233472, 32, 64)}
KINDS = {"tf32": conv_tc.TF32, "bf16": conv_tc.BF16}
# the halo backward-weights (with the norm applied too): their family's conv_tc.WGRAD_HALO
WGRAD_HALOS = {kernel: halo for halo in conv_tc.WGRAD_HALO.values() for kernel in (halo.kernel,
                                                                                   halo.kernel[:-1] + ", true>")}
ELEMENT_BYTES = {"tf32": 4, "bf16": 2}
# the FLOPs per L2 byte a GEMM should read (issue 28's 32 for TF32; the 128 x 128 tile's 64 for BF16)
FLOPS_PER_BYTE_GOAL = {"tf32": 32, "bf16": 64}
RAW_DY_LOOP = "conv_tc_wgrad<"   # the TF32 backward-weights with a raw dy's bias loop, their third (a name's start)


def blocks_per_sm(resources, threads, arch, dynamic=0):
    """Resident blocks per SM of `arch` of a kernel of `threads` threads with ptxas' `resources` and `dynamic` bytes
    of dynamic shared memory a block, and what limits them."""
    shared, max_blocks, max_warps = SM_LIMITS[arch]
    warps = threads // 32
    per_warp = math.ceil(resources.registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    limits = {"registers": REGISTERS // (per_warp * warps), "shared memory": shared // (resources.shared_bytes +
                                                                                       dynamic + SHARED_RESERVED),
              "blocks": max_blocks, "warps": max_warps // warps}
    limit = min(limits, key=limits.get)
    return limits[limit], limit


_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+0x([0-9a-f]+)")
_HMMA = re.compile(r"(@!?U?P\w+\s+)?HMMA\b")   # predicated or not


def _loops(instructions):
    """[(start, end, HMMA)] of the loops of a kernel's SASS: a backward branch and the instructions from its
    target to it (each SASS instruction is 16 bytes), the HMMA among them."""
    hmma = [bool(_HMMA.match(i)) for i in instructions]
    found = []
    for end, instruction in enumerate(instructions):
        branch = _BRANCH.search(instruction)
        start = int(branch.group(1), 16) // 16 if branch else end + 1
        if start <= end:
            found.append((start, end, sum(hmma[start:end + 1])))
    return found


def main_loops(instructions):
    """[(instructions, HMMA)] of a kernel's main loops, from its SASS (_loops): the innermost of the loops
    with HMMA (a loop around another, the ring's wrap, holds all of it) that hold at least as many HMMA as
    the one with the fewest of those that hold the most of them: a loop that also sums the bias holds as
    many. Shortest first; [] for a kernel without one."""
    found = [(start, end, count) for start, end, count in _loops(instructions) if count]
    inner = {(end - start + 1, count) for start, end, count in found
             if not any(start <= a and b <= end and (a, b) != (start, end) for a, b, _ in found)}
    if not inner:
        return []
    most = max(count for _, count in inner)
    product = min(count for _, count in inner if count * 5 >= most * 4)   # the GEMM's own, without the bias
    return sorted(loop for loop in inner if loop[1] >= product)


def window_loops(instructions):
    """The instructions of the loops without HMMA inside a kernel's lean main loop (main_loops' first),
    the innermost of them: a halo kernel's, which copy and land its window a row at a time (inside the
    loops over a thread's columns, one at the widths the plan gives them), and which the main loop's count
    holds once where they run once per row of the window."""
    size, hmma = main_loop(instructions)
    if not size:
        return 0
    found = _loops(instructions)
    first, last = next((start, end) for start, end, count in found if (end - start + 1, count) == (size, hmma))
    inner = [(a, b) for a, b, count in found if not count and first < a and b < last]
    innermost = [(a, b) for a, b in inner if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in inner)]
    return sum(b - a + 1 for a, b in innermost)


def phase_loops(instructions):
    """[(instructions, HMMA)] of each innermost loop with HMMA of a kernel's SASS, shortest first: the stride-2
    backward-data from windows (conv_tc.PHASE_KERNEL) has one for each count of a phase's taps (1, 2, 4), each
    its own GEMM (main_loops would keep the one with the most HMMA alone)."""
    found = [(start, end, count) for start, end, count in _loops(instructions) if count]
    return sorted((end - start + 1, count) for start, end, count in found
                  if not any(start <= a and b <= end and (a, b) != (start, end) for a, b, _ in found))


def window_rows(geometry, step=conv_tc.HALO_ROWS):
    """The mean rows of the windows a halo forward's or backward-data's blocks (`step` output pixels each), or a
    halo backward-weight's stages (conv_tc.WGRAD_HALO's pixels), load for the convolution (N, C, H, W, ...): the
    kernel's count, from the first pixel's padded row to the last's, and one above and below."""
    n, _, h, w = geometry[:4]
    pixels = n * h * w
    padded = lambda m: m // (h * w) * (h + 2) + m % (h * w) // w   # noqa: E731
    return statistics.mean(padded(min(m0 + step, pixels) - 1) - padded(m0) + 3 for m0 in range(0, pixels, step))


def main_loop(instructions):
    """(instructions, HMMA) of a kernel's lean main loop: main_loops' first; (0, 0) without one."""
    loops_ = main_loops(instructions)
    return loops_[0] if loops_ else (0, 0)


def loops(arch, family="conv_tc"):
    """{name expression: [(loop instructions, HMMA per loop)]} of a family's kernels for `arch`."""
    compiled = compile_family(family, arch)
    sass = compiled.sass()
    return {name: main_loops(sass[mangled]) for name, mangled in compiled.lowered_names.items()}


def window_loop_sizes(arch, family):
    """{name expression: window_loops} of a family's kernels for `arch`."""
    compiled = compile_family(family, arch)
    sass = compiled.sass()
    return {name: window_loops(sass[mangled]) for name, mangled in compiled.lowered_names.items()}


def geometry(layer):
    """conv.py's geometry tuple of a conv2d Layer."""
    n, c, h, w = layer.x
    o, _, kh, kw = layer.w
    return (n, c, h, w, o, kh, kw, layer.stride, layer.stride, layer.padding, layer.padding, *layer.y[2:])


def flops_per_byte(kind, precision, p, rows, columns, geometry):
    """The FLOPs per L2 byte of a Plan's tile: 2 BM' BN' k over (BM' + BN') k element bytes, BM' and
    BN' the tile's rows and columns that the GEMM has (a tile wider than the GEMM loads and multiplies
    those alone). A halo kernel's block loads, per chunk of channels (32 bfloat16, 16 floats), its window
    once for the nine taps: the image's pixels in it (padding is zero-filled, not read), averaged over the
    blocks, and each tap's channels of B. The halo backward-weight's, per stage of its pixels, the window
    of their x (32 channels) and their dy, for the nine taps of 32 channels by its columns. The projection
    backward's, both GEMMs' FLOPs of a block's cells over their dy and x and the weights."""
    if p.kernel == conv_tc.PHASE_KERNEL:   # the four phases' blocks: each its window of dy and its taps' weights
        n, c, h, w, o, *_, oh, ow = geometry
        bn, cells = min(64, columns), n * oh * ow
        window = statistics.mean(_window_pixels(m0, min(m0 + conv_tc.PHASE_ROWS, cells), oh, ow)
                                 for m0 in range(0, cells, conv_tc.PHASE_ROWS))
        rows = min(conv_tc.PHASE_ROWS, cells)
        taps = (4, 2, 2, 1)   # of the phases of a 3x3, stride-2 convolution; the 1-tap one reads its cells' rows
        return 2 * rows * bn * sum(taps) / (
            sum((window if t > 1 else rows) + t * bn for t in taps) * ELEMENT_BYTES[precision])
    if p.kernel in conv_tc.PROJECTION_KERNELS:   # both GEMMs of a block's cells: dy, x and w read once
        n, c, o, oh, ow = geometry[0], geometry[1], geometry[4], geometry[11], geometry[12]
        cells = min(conv_tc.PROJECTION_CELLS, n * oh * ow)
        return 4 * cells * c * o / ((cells * o + cells * c + o * c) * ELEMENT_BYTES[precision])
    if p.kernel in WGRAD_HALOS:
        bn, step = min(64, columns), WGRAD_HALOS[p.kernel].pixels
        n, _, h, w = geometry[:4]
        pixels = n * h * w
        window = statistics.mean(_window_pixels(k0, min(k0 + step, pixels), h, w) for k0 in range(0, pixels, step))
        channels = conv_tc.WGRAD_HALO_CHANNELS
        return 2 * step * 9 * channels * bn / ((window * channels + step * bn) * ELEMENT_BYTES[precision])
    if "_halo<" in p.kernel:   # per chunk of the window's channels (kind.halo_channels): they cancel
        bn = min(64, columns)
        n, _, h, w = geometry[:4]
        pixels = n * h * w
        window = statistics.mean(_window_pixels(m0, min(m0 + conv_tc.HALO_ROWS, pixels), h, w)
                                 for m0 in range(0, pixels, conv_tc.HALO_ROWS))
        flops = 2 * min(conv_tc.HALO_ROWS, rows) * bn * 9 * kind.halo_channels
        return flops / ((window + 9 * bn) * kind.halo_channels * ELEMENT_BYTES[precision])
    bm, bn, _ = kind.tile(tile_of(p.kernel))
    bm, bn = min(bm, rows), min(bn, columns)
    return 2 * bm * bn / ((bm + bn) * ELEMENT_BYTES[precision])


def _window_pixels(first, end, h, w):
    """The image's pixels in the window of the output pixels [first, end) of a 3x3, stride-1 convolution:
    the rows they lie in and the rows above and below, within each image."""
    rows = {(m // (h * w), m % (h * w) // w + d) for m in range(first, end) for d in (-1, 0, 1)}
    return w * sum(0 <= r < h for _, r in rows)


def rows(batch, arch, sms, precision):
    """(the launches of the tensor-core GEMMs of `precision` at `batch`, one dict per GEMM of each
    distinct convolution that they take; the ptxas Resources of each kernel; the labels of the
    products that run the FP32 kernels instead: the stem, the linear layer)."""
    kind = KINDS[precision]
    resources = {kernel: r for _, _, kernel, r in report([kind.family], [arch])}
    out, fp32 = [], []
    # a residual block's conv2 reads bn1's input and applies bn1 and its relu as it loads it, under TF32
    # (F.batch_norm's fold): its forward and backward-weight run the kernels that do (conv_tc.folds)
    folded = lambda layer: precision == "tf32" and layer.name.endswith(".conv2")   # noqa: E731
    for layer, count in layers.distinct(layers.resnet18_layers(batch), key=lambda layer: (layer.key, folded(layer))):
        fold = folded(layer)
        if layer.op not in ("conv2d", "linear"):
            continue
        if layer.op == "linear" or not conv_tc.supports(layer.x[1], layer.w[0], kind):
            fp32.append(layer.label)
            continue
        n, c, h, w = layer.x
        o, _, kh, kw = layer.w
        outputs = {"forward": math.prod(layer.y), "dgrad": n * c * h * w, "wgrad": o * c * kh * kw}
        shapes = {"forward": (math.prod(layer.y) // o, o), "dgrad": (n * h * w, c), "wgrad": (c * kh * kw, o)}
        # a projection's backward-data and backward-weight are one launch (conv_tc.projection_backward: the step's
        # projections read no norm's sums, and their dy holds TF32 values), listed on both rows
        projection = precision == "tf32" and conv_tc.projection(geometry(layer))
        for gemm in ("forward", "dgrad", "wgrad"):
            applies = fold and gemm != "dgrad" and conv_tc.folds(gemm, geometry(layer))
            p = conv_tc.projection_plan(geometry(layer)) if projection and gemm != "forward" else \
                conv_tc.plan(gemm, geometry(layer), kind, fold=applies)
            p = p._replace(kernel=conv_tc.for_shared_memory(p.kernel, SM_LIMITS[arch][0]))   # as a GPU runs it
            resident, limit = blocks_per_sm(resources[p.kernel], conv_tc.threads(p.kernel), arch,
                                            dynamic=conv_tc.dynamic_shared(p.kernel))
            blocks = math.prod(p.grid)
            out.append({"layer": layer.label + (" (bn1 applied)" if fold else ""), "count": count, "gemm": gemm,
                        "kernel": p.kernel, "geometry": geometry(layer), "grid": p.grid, "blocks": blocks,
                        "resident": resident, "limit": limit, "splits": p.splits, "group": p.group,
                        "waves": blocks / (resident * sms),
                        "flops_per_byte": flops_per_byte(kind, precision, p, *shapes[gemm], geometry(layer)),
                        "partial_bytes": 4 * conv_tc.partial_slots(p) * (0 if p.kernel in conv_tc.PROJECTION_KERNELS
                                                                         and gemm == "dgrad" else outputs[gemm])})
    return out, resources, fp32


def hopper_rows(batch, sms):
    """The GEMMs that conv_sm90.cu (Hopper's warpgroup MMA fed by TMA) takes under bf16 on an sm_90 GPU, one dict per
    GEMM of each distinct convolution: forwards; backward-datas as the forward of dy by the mirrored weights (at
    stride 2, by phases of dx); backward-weights: its kernel, output box, tiles, grid (the forward's persistent, a
    block an SM: the ring's shared memory), waves (the forward's: tiles a block), and the FLOPs per L2 byte of its
    tile; with the kernels' ptxas Resources."""
    resources = {kernel: r for _, _, kernel, r in report(["conv_sm90"], ["sm_90"])}
    out = []
    for layer, count in layers.distinct(layers.resnet18_layers(batch)):
        if layer.op != "conv2d":
            continue
        g = geometry(layer)
        for gemm, supported, planned, pixels in (("forward", conv_sm90.supports, conv_sm90.plan, g[0] * g[11] * g[12]),
                                                 ("dgrad", conv_sm90.supports_dgrad, conv_sm90.dgrad_plan,
                                                  g[0] * g[2] * g[3])):
            if not supported(g):
                continue
            p = planned(g)   # backward-data of stride 2: a GEMM a phase of dx
            columns, stages = conv_sm90.TILES[p.tile]
            rows = conv_sm90.ROWS
            blocks = min(p.tiles, sms)   # persistent: a block an SM takes the tiles in turn
            out.append({"layer": layer.label, "count": count, "gemm": gemm,
                        "kernel": f"conv_sm90_forward<{p.tile}, ADD>",   # ADD: backward-data into a gradient
                        "box": p.box, "grid": (blocks,), "tiles": p.tiles, "blocks": blocks, "waves": p.tiles / sms,
                        "stages": stages, "parts": 1, "padded": p.boxes * p.phases * rows / pixels,
                        "flops_per_byte": 2 * rows * columns / ((rows + columns) * ELEMENT_BYTES["bf16"])})
        for gemm, dtype in (("wgrad", bfloat16), ("wgrad tf32", np.float32)):
            if not conv_sm90.supports(g):   # backward-weight takes what the forward does
                continue
            p = conv_sm90.wgrad_plan(g, dtype)
            rows, columns, stages, resident, _ = conv_sm90.WGRAD_TILES[p.tile]
            blocks = math.prod(p.grid)
            out.append({"layer": layer.label, "count": count, "gemm": gemm, "kernel": p.kernel,
                        "box": p.box, "grid": p.grid, "tiles": blocks, "blocks": blocks, "waves": blocks / (resident * sms),
                        "stages": stages, "parts": p.parts,
                        "padded": math.prod(-(-size // side) for size, side in zip((g[0], g[11], g[12]), p.box)) *
                        conv_sm90.wgrad_pixels(dtype) / (g[0] * g[11] * g[12]),
                        "flops_per_byte": 2 * rows * columns / ((rows + columns) * np.dtype(dtype).itemsize)})
    return out, resources


def hopper_table(batch, sms):
    table, resources = hopper_rows(batch, sms)
    print("\n## bf16 on Hopper (conv_sm90.cu: stride 1 and 2; its TF32 forward tiles the same bytes; TF32's "
          "backward-weight's rows below bf16's)\n")
    for kernel, r in resources.items():
        if kernel.startswith("conv_sm90_forward<") and kernel.endswith("false>"):
            tile = tile_of(kernel)
            (columns, stages), rows, consumers, resident = conv_sm90.TILES[tile], conv_sm90.ROWS, 2, 1
            shared, copies = conv_sm90.dynamic_shared(kernel), 0
        elif kernel.startswith("conv_sm90_wgrad"):
            tile = tile_of(kernel)
            rows, columns, stages, resident, copies = conv_sm90.WGRAD_TILES[tile]
            consumers, shared = rows // 64, conv_sm90.dynamic_shared(kernel)
        else:
            continue
        left = 65536 // resident - 128 * 40
        k, line, element = (8, 32, "float32 (TF32)") if conv_sm90.precision_of(kernel) == "TF32" else (16, 64, "bf16")
        print(f"- `{kernel}`: {128 * (1 + consumers)} threads (a producer warpgroup, {consumers} consumer "
              f"warpgroup{'s' if consumers > 1 else ''} of 64 rows: m64n{columns}k{k} wgmma), {r.registers} registers a "
              f"thread at launch (setmaxnreg: 40 the producer's, {left // (128 * consumers) // 8 * 8} the consumers'), "
              f"{stages} stages of {rows}x{line} + {columns}x{line} {element}, "
              f"{f'{copies} copies of a stage transposed, ' if copies else ''}"
              f"{(r.shared_bytes + shared) / 1024:.1f} KB of shared memory: {resident} block{'s' if resident > 1 else ''} "
              f"({resident * consumers} warpgroups of wgmma in flight) an SM; spills {r.spill_stores} bytes")
    print(f"\n| layer (batch {batch}) | n | GEMM | kernel | pixel box (images x rows x columns) | tiles | grid | "
          f"split-K parts | waves on {sms} SMs (tiles a block, persistent) | pixels computed / pixels | "
          f"FLOPs per L2 byte |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['layer']} | {row['count']} | {row['gemm']} | `{row['kernel']}` | {'x'.join(map(str, row['box']))} | "
              f"{row['tiles']} | {'x'.join(map(str, row['grid']))} | {row['parts']} | {row['waves']:.2f} | "
              f"{row['padded']:.2f} | {row['flops_per_byte']:.1f} |")


def describe_loops(found, lean_hmma):
    """'instructions / HMMA' of each main loop, and the instructions per HMMA of the product (the lean
    loop's HMMA count: a bias loop's extra HMMA sum the bias)."""
    return ", ".join(f"{size} / {hmma}" for size, hmma in found), \
        ", ".join(f"{size / lean_hmma:.2f}" for size, _ in found)


def kernel_table(precision, arch, launched, resources):
    """The kernels' table. A halo forward's or backward-data's main loop (one chunk of channels) runs its
    window's loops once per row of the window: its instructions per HMMA are given as they run at the layer
    the plan launches it for (the window's mean rows there; not launched: ResNet-18's first stage at the
    batch), the loop's count plus the window loops' for each further row; a halo backward-weight's loop
    (unrolled over the two stages of its ring) likewise, with the mean rows of its stages' windows. Shared
    memory: the static, and the dynamic a launch asks for."""
    kind = KINDS[precision]
    found = loops(arch, kind.family)
    window = window_loop_sizes(arch, kind.family)
    print(f"| kernel ({arch}) | threads | registers | shared memory, bytes | blocks per SM (limit) | warps per SM | "
          f"main loops: "
          f"instructions / HMMA | instructions per HMMA of the product | launched at batch "
          f"{args_batch} |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    first_stage = (args_batch, 64, 28, 28, 64, 3, 3, 1, 1, 1, 1, 28, 28)
    for kernel in (conv_tc.KERNELS if precision == "tf32" else conv_tc.BF16_KERNELS):
        if not found[kernel]:   # no GEMM (mirrored_weights)
            continue
        r = resources[kernel]
        dynamic = conv_tc.dynamic_shared(kernel)
        threads = conv_tc.threads(kernel)
        resident, limit = blocks_per_sm(r, threads, arch, dynamic=dynamic)
        lean = found[kernel][0][1]
        loops_ = found[kernel]
        windowed = "_halo<" in kernel
        if kernel == conv_tc.PHASE_KERNEL:   # a loop per count of taps (1, 2, 4), each GEMM its own HMMA
            compiled = compile_family(kind.family, arch)
            loops_ = phase_loops(compiled.sass()[compiled.lowered_names[kernel]])
            ratios[kernel] = [size / hmma for size, hmma in loops_]
            print(f"| `{kernel}` | {threads} | {r.registers} | {r.shared_bytes} + {dynamic} | {resident} ({limit}) | "
                  f"{resident * threads // 32} | {', '.join(f'{size} / {hmma}' for size, hmma in loops_)} (1, 2 and 4 taps) | "
                  f"{', '.join(f'{ratio:.2f}' for ratio in ratios[kernel])} | {'yes' if kernel in launched else 'no'} |")
            continue
        if windowed:
            rows_ = window_rows(launched[kernel]["geometry"] if kernel in launched else first_stage,
                                WGRAD_HALOS[kernel].pixels if kernel in WGRAD_HALOS else conv_tc.HALO_ROWS)
            loops_ = [(size + round((rows_ - 1) * window[kernel]), hmma) for size, hmma in loops_]
        sizes, per_hmma = describe_loops(loops_, lean)
        if windowed:
            sizes += f" (window loops of {window[kernel]} run for {rows_:.1f} rows)"
        ratios[kernel] = [size / lean for size, _ in loops_]
        shared = f"{r.shared_bytes} + {dynamic}" if dynamic else f"{r.shared_bytes}"
        print(f"| `{kernel}` | {threads} | {r.registers} | {shared} | {resident} ({limit}) | "
              f"{resident * threads // 32} | {sizes} | {per_hmma} | "
              f"{'yes' if kernel in launched else 'no'} |")
    step = [ratio for kernel in sorted(launched) for ratio in ratios[kernel]]
    # TF32's backward-weight's third loop sums a raw dy, which the step never hands it (its batch norms round dy)
    runs = [ratio for kernel in sorted(launched) for ratio in ratios[kernel][:2 if kernel.startswith(RAW_DY_LOOP) else None]]
    print(f"\n{precision}: instructions per HMMA of the product in the main loops of the kernels launched: median "
          f"{statistics.median(step):.2f}, most {max(step):.2f}; of the loops the step runs (not TF32 "
          f"backward-weight's raw-dy bias loop): median {statistics.median(runs):.2f}, most {max(runs):.2f}")


args_batch = layers.BATCH


def main(argv=None):
    global args_batch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--batch", type=int, default=layers.BATCH)
    p.add_argument("--arch", default="sm_90", choices=sorted(SM_LIMITS),
                   help="the architecture whose SASS and occupancy to report (default sm_90; sm_80: an A100, with "
                        "--sms 108)")
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default 132, an H200 SXM)")
    p.add_argument("--precision", nargs="+", choices=tuple(KINDS), default=tuple(KINDS),
                   help="the tensor-core precisions to show (default both)")
    args = p.parse_args(argv)
    args_batch = args.batch
    for precision in args.precision:
        table, resources, fp32 = rows(args.batch, args.arch, args.sms, precision)
        launched = {row["kernel"]: row for row in table}
        print(f"\n## {precision}\n")
        kernel_table(precision, args.arch, launched, resources)
        print(f"\n| layer (batch {args.batch}) | n | GEMM | kernel | grid | blocks | split-K parts (per group) | "
              f"waves on {args.sms} SMs | FLOPs per L2 byte |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in table:
            parts = f"{row['splits']} ({row['group']})" if row["splits"] > 1 else "1"
            print(f"| {row['layer']} | {row['count']} | {row['gemm']} | `{row['kernel']}` | "
                  f"{'x'.join(map(str, row['grid']))} | {row['blocks']} | {parts} | {row['waves']:.2f} | "
                  f"{row['flops_per_byte']:.1f} |")
        wgrad = [row["waves"] for row in table if row["gemm"] == "wgrad"]
        partials = sum(row["count"] * row["partial_bytes"] for row in table)
        weighted = [(row["flops_per_byte"], row["count"]) for row in table]
        goal = FLOPS_PER_BYTE_GOAL[precision]
        below = sorted({f"{row['layer']} {row['gemm']}" for row in table if row["flops_per_byte"] < goal})
        print(f"\nbackward-weight waves: fewest {min(wgrad):.2f}; split-K partial outputs written (and read once) "
              f"per step: {partials / 1e6:.0f} MB; FLOPs per L2 byte: {min(f for f, _ in weighted):.1f} to "
              f"{max(f for f, _ in weighted):.1f}" + (f"; below {goal} at {', '.join(below)}" if below else ""))
        print(f"\non the FP32 kernels (conv.cu, linear.cu), not the tensor cores: {'; '.join(fp32)}")
    if "bf16" in args.precision and args.arch == "sm_90":
        hopper_table(args.batch, args.sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
