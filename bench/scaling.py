#!/usr/bin/env python3
"""Expected data-parallel scaling of ResNet-18 training: a model, not a measurement.

For 2 to 8 GPUs joined by NVLink or by PCIe, the time a ring all-reduce of the gradients
takes, against the compute time of one step, and from them the scaling efficiency
(step time on one GPU / step time on N, at the same images per GPU) without overlap
(the whole all-reduce after backward) and with the bucket overlap of parallel/ddp.py (only
the last bucket to be ready, the one holding the first layers, is left after backward).

Ring all-reduce: each GPU sends and receives 2 (N - 1) / N of the buffer, in 2 (N - 1)
steps of a fixed latency each; time = 2 (N - 1) / N * bytes / bandwidth + 2 (N - 1) * latency.
The buckets are those of parallel/ddp.py's plan for the real model's parameters.

  python bench/scaling.py --step-ms 35 --per-gpu-batch 256
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nn.resnet import resnet18  # noqa: E402
from parallel.ddp import DEFAULT_BUCKET_MB, plan_buckets  # noqa: E402

# per direction, per GPU: NVLink 4 on H100/H200 SXM (18 links x 25 GB/s); PCIe Gen5 x16 and Gen4
# x16 at what NCCL typically reaches of their 64 and 32 GB/s
LINKS = {"NVLink (H100/H200 SXM)": 450e9, "PCIe Gen5 x16": 50e9, "PCIe Gen4 x16": 25e9}
LATENCY_S = 5e-6   # per ring step, NCCL's order of magnitude within a node


def ring_seconds(nbytes, ranks, bandwidth):
    steps = 2 * (ranks - 1)
    return steps / ranks * nbytes / bandwidth + steps * LATENCY_S


def gradient_buckets(bucket_mb):
    """(total bytes, bytes of the last bucket to be ready) of ResNet-18's float32 gradients."""
    sizes = [p.size for p in resnet18().parameters()]
    plan = plan_buckets(sizes, 4, bucket_mb * 2 ** 20)
    return 4 * sum(sizes), 4 * sum(sizes[i] for i in plan[-1])


def table(step_ms, bucket_mb):
    total, last = gradient_buckets(bucket_mb)
    rows = []
    for link, bandwidth in LINKS.items():
        for ranks in (2, 4, 8):
            whole = ring_seconds(total, ranks, bandwidth) * 1e3
            exposed = ring_seconds(last, ranks, bandwidth) * 1e3
            rows.append((link, ranks, whole, step_ms / (step_ms + whole), exposed, step_ms / (step_ms + exposed)))
    return total, last, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, required=True,
                   help="compute time of one training step on one GPU at --per-gpu-batch, in ms")
    p.add_argument("--per-gpu-batch", type=int, default=256, help="images per GPU (for the label only)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB, help="gradient bucket size")
    args = p.parse_args(argv)
    if args.step_ms <= 0:
        p.error(f"--step-ms must be positive, got {args.step_ms}")
    total, last, rows = table(args.step_ms, args.bucket_mb)
    print(f"gradients {total / 1e6:.1f} MB per step; last bucket {last / 1e6:.1f} MB "
          f"({args.bucket_mb:g} MB buckets); step {args.step_ms:g} ms at {args.per_gpu_batch} images per GPU")
    print("| link | GPUs | all-reduce ms | efficiency, no overlap | left after backward ms | efficiency, overlap |")
    print("|---|---|---|---|---|---|")
    for link, ranks, whole, plain, exposed, overlapped in rows:
        print(f"| {link} | {ranks} | {whole:.2f} | {plain:.1%} | {exposed:.2f} | {overlapped:.1%} |")


if __name__ == "__main__":
    main()
