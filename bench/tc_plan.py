"""What the tensor-core kernels (kernels/cuda/conv_tc.cu) launch for every convolution of ResNet-18
and its linear layer at batch 256, and how that fills an H200; no GPU needed.

  PYTHONPATH=. python -m bench.tc_plan [--batch 256] [--arch sm_90] [--sms 132]

Each tensor-core kernel's registers, shared memory and resident blocks, and its main loop in the SASS
NVRTC makes (the loop with the most HMMA): its instructions, its HMMA and the instructions per
HMMA, the issue slots the loop spends for each tensor-core instruction. Then for each GEMM
(forward, backward-data, backward-weight) of each distinct convolution that the tensor cores
take: the kernel the launchers choose (kernels/cuda/conv_tc.py's plan), its grid in blocks, its
split-K parts (and their groups), and the waves of blocks over the SMs at the occupancy that the
kernel's registers and shared memory allow (from ptxas through NVRTC, as kernels.cuda.ptxas_report gives
them). The occupancy rules are Hopper's (sm_90): 65,536 registers per SM, allocated per warp
in units of 256; 228 KB of shared memory per SM, 1 KB of it reserved per block; at most 32
blocks and 64 warps per SM. A model of the launch, not a measurement: the speed is measured by
bench/gpu_check (tier c) when a GPU is lent.
"""
import argparse
import math
import re
import statistics
import sys

from bench import layers
from kernels.cuda import conv_tc
from kernels.cuda.ptxas_report import compile_family, report

REGISTERS, REGISTER_UNIT, SHARED, SHARED_RESERVED, MAX_BLOCKS, MAX_WARPS = 65536, 256, 233472, 1024, 32, 64


def blocks_per_sm(resources, threads=conv_tc.THREADS):
    """Resident blocks per SM of a kernel of `threads` threads with ptxas' `resources`, and what limits them."""
    warps = threads // 32
    per_warp = math.ceil(resources.registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    limits = {"registers": REGISTERS // (per_warp * warps), "shared memory": SHARED // (resources.shared_bytes +
                                                                                       SHARED_RESERVED),
              "blocks": MAX_BLOCKS, "warps": MAX_WARPS // warps}
    limit = min(limits, key=limits.get)
    return limits[limit], limit


_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+0x([0-9a-f]+)")


def main_loop(instructions):
    """(instructions, HMMA) of a kernel's main loop, from its SASS: of the loops (a backward branch
    and the instructions from its target to it; each SASS instruction is 16 bytes) that hold the
    most HMMA, the shortest; (0, 0) for a kernel without one."""
    hmma = [i.startswith("HMMA") for i in instructions]
    best = (0, 0)
    for end, instruction in enumerate(instructions):
        branch = _BRANCH.search(instruction)
        start = int(branch.group(1), 16) // 16 if branch else end + 1
        if start <= end:
            size, count = end - start + 1, sum(hmma[start:end + 1])
            if count > best[1] or (count and count == best[1] and size < best[0]):
                best = (size, count)
    return best


def loops(arch, family="conv_tc"):
    """{name expression: (loop instructions, HMMA per loop)} of a family's kernels for `arch`."""
    compiled = compile_family(family, arch)
    sass = compiled.sass()
    return {name: main_loop(sass[mangled]) for name, mangled in compiled.lowered_names.items()}


def geometry(layer):
    """conv.py's geometry tuple of a conv2d Layer."""
    n, c, h, w = layer.x
    o, _, kh, kw = layer.w
    return (n, c, h, w, o, kh, kw, layer.stride, layer.stride, layer.padding, layer.padding, *layer.y[2:])


def rows(batch, arch, sms):
    """(the launches of the tensor-core GEMMs at `batch`, one dict per GEMM of each distinct
    convolution that conv_tc takes; the ptxas Resources of each kernel; the labels of the
    products that run the FP32 kernels instead: the stem, the linear layer)."""
    resources = {kernel: r for _, _, kernel, r in report(["conv_tc"], [arch])}
    out, fp32 = [], []
    for layer, count in layers.distinct(layers.resnet18_layers(batch)):
        if layer.op not in ("conv2d", "linear"):
            continue
        if layer.op == "linear" or not conv_tc.supports(layer.x[1], layer.w[0]):
            fp32.append(layer.label)
            continue
        n, c, h, w = layer.x
        o, _, kh, kw = layer.w
        outputs = {"forward": math.prod(layer.y), "dgrad": n * c * h * w, "wgrad": o * c * kh * kw}
        for gemm in ("forward", "dgrad", "wgrad"):
            p = conv_tc.plan(gemm, geometry(layer))
            resident, limit = blocks_per_sm(resources[p.kernel])
            blocks = math.prod(p.grid)
            out.append({"layer": layer.label, "count": count, "gemm": gemm, "kernel": p.kernel, "grid": p.grid,
                        "blocks": blocks, "resident": resident, "limit": limit, "splits": p.splits,
                        "group": p.group, "waves": blocks / (resident * sms),
                        "partial_bytes": 4 * conv_tc.partial_slots(p) * outputs[gemm]})
    return out, resources, fp32


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--batch", type=int, default=layers.BATCH)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default 132, an H200 SXM)")
    args = p.parse_args(argv)
    table, resources, fp32 = rows(args.batch, args.arch, args.sms)
    main_loops = loops(args.arch)
    launched = {row["kernel"] for row in table}
    print(f"| kernel ({args.arch}) | registers | shared memory, bytes | blocks per SM (limit) | main loop: "
          f"instructions | HMMA | instructions per HMMA | launched at batch {args.batch} |")
    print("|---|---|---|---|---|---|---|---|")
    for kernel in conv_tc.KERNELS:
        r = resources[kernel]
        resident, limit = blocks_per_sm(r)
        size, hmma = main_loops[kernel]
        print(f"| `{kernel}` | {r.registers} | {r.shared_bytes} | {resident} ({limit}) | {size} | {hmma} | "
              f"{size / hmma:.1f} | {'yes' if kernel in launched else 'no'} |")
    ratios = [main_loops[k][0] / main_loops[k][1] for k in sorted(launched)]
    print(f"\ninstructions per HMMA of the kernels launched: median {statistics.median(ratios):.1f}, "
          f"most {max(ratios):.1f}")
    print(f"\n| layer (batch {args.batch}) | n | GEMM | kernel | grid | blocks | split-K parts (per group) | "
          f"waves on {args.sms} SMs |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table:
        parts = f"{row['splits']} ({row['group']})" if row["splits"] > 1 else "1"
        print(f"| {row['layer']} | {row['count']} | {row['gemm']} | `{row['kernel']}` | "
              f"{'x'.join(map(str, row['grid']))} | {row['blocks']} | {parts} | {row['waves']:.2f} |")
    wgrad = [row["waves"] for row in table if row["gemm"] == "wgrad"]
    partials = sum(row["count"] * row["partial_bytes"] for row in table)
    print(f"\nbackward-weight waves: fewest {min(wgrad):.2f}; split-K partial outputs written (and read once) "
          f"per step: {partials / 1e6:.0f} MB")
    print(f"\non the FP32 kernels (conv.cu, linear.cu), not the tensor cores: {'; '.join(fp32)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
