"""One small training step of ResNet-18 for compute-sanitizer (tier (a) of bench/gpu_check): width 8,
batch 4, SGD with momentum and weight decay, then an eval-mode forward with the count of correct
predictions, so that every kernel of training and evaluation runs at least once.

  compute-sanitizer --tool memcheck python -m bench.sanitizer_step
  python -m bench.sanitizer_step --device cpu     # the same step on the NumPy backend

On the GPU, CuPy's memory pool is switched off first: each array is then its own allocation, so
memcheck sees an access past an array's end instead of one landing inside a pooled block.
"""
import argparse
import sys

import numpy as np

import kernels

WIDTH, BATCH = 8, 4


def step(device):
    """(loss, correct) after one training step and one evaluation of the same batch."""
    import nn
    xp = kernels.array_module_for(device)
    if device.startswith("cuda"):
        xp.cuda.set_allocator(None)
    g = np.random.default_rng(0)
    images = xp.asarray(g.integers(0, 256, (BATCH, 28, 28)).astype(np.uint8))
    labels = xp.asarray(g.integers(0, 10, BATCH).astype(np.int32))
    K = kernels.backend_of(images)
    nn.manual_seed(0)
    model = nn.resnet18(width=WIDTH).to(device)
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    x = nn.Tensor(K.images_to_float(images))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    opt.step()
    model.eval()
    with nn.no_grad():
        correct = K.count_correct(model(x).data, labels)
    return float(loss.data), int(correct)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = p.parse_args(argv)
    loss, correct = step(args.device)
    if not np.isfinite(loss):
        print(f"loss is {loss}", file=sys.stderr)
        return 1
    print(f"one step of ResNet-18 (width {WIDTH}, batch {BATCH}) on {args.device}: loss {loss:.4f}, "
          f"{correct}/{BATCH} correct in eval mode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
