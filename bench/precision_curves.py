"""The loss of the same seed's training under each precision of the CUDA kernels, step by step, on the
CPU emulator (the kernels the simulated GPUs and a GPU run), side by side: does bf16 learn as tf32 does?

  PYTHONPATH=. python -m bench.precision_curves --data-dir DIR [--images 128] [--epochs 6] [--batch 16]
      [--width 4] [--init pytorch] [--precisions tf32 bf16 fp32] [--test-images 256] [--json out.json]

ResNet-18 at --width, the same initial weights (seed 0, --init, the trainer's hyperparameters), the
first --images training images of Fashion-MNIST in --epochs passes, each in the order the trainer
draws for it (seed 0), in batches of --batch; then the accuracy on the first --test-images test
images (the network in evaluation mode). Each step is the trainer's (training/step.py's train_step,
eager): the batch gathered and converted on the device, forward, cross-entropy, backward, SGD. Prints
the loss at every step under each precision, and each epoch's mean. The emulator is slow (some
twenty seconds a step at width 4 and batch 16, half that without its sanitizer,
CUDA_EMU_SANITIZE=off): the default takes the better part of an hour.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

import kernels
import nn
from nn import data
from parallel.comm import SingleProcess
from parallel.ddp import DataParallel
from training.config import Config
from training.fashion_mnist import load_fashion_mnist
from training.step import train_step


def curve(precision, images, labels, test_images, test_labels, width, batch, epochs, init):
    """(loss of each step, test accuracy) of `epochs` passes over the images under `precision`."""
    with kernels.emulate(), kernels.use_precision(precision):
        nn.manual_seed(0)
        d = Config()
        model = nn.resnet18(width=width, init=init)
        opt = nn.SGD(model.parameters(), lr=d.lr, momentum=d.momentum, weight_decay=d.weight_decay)
        ddp = DataParallel(model, SingleProcess())
        losses = []
        batches = [idx for epoch in range(epochs) for idx in data.batch_indices(data.epoch_order(len(images), 0, epoch),
                                                                                 batch)]
        for idx in batches:
            began = time.perf_counter()
            loss, _ = train_step(model, opt, ddp, images, labels, ddp.scatter(idx))
            losses.append(float(loss))
            print(f"{precision} step {len(losses)}: loss {losses[-1]:.4f} ({time.perf_counter() - began:.1f} s)",
                  file=sys.stderr, flush=True)
        model.eval()
        K = kernels.backend_of(test_images)
        correct = 0
        with nn.no_grad():
            for lo in range(0, len(test_images), batch):
                idx = np.arange(lo, min(lo + batch, len(test_images)))
                logits = model(nn.Tensor(K.images_to_float(test_images, idx)))
                correct += int(K.count_correct(logits.data, K.take(test_labels, idx)))
        return losses, correct / len(test_images)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--data-dir", required=True, help="the folder of Fashion-MNIST's four .gz files")
    p.add_argument("--images", type=int, default=128, help="training images (default 128)")
    p.add_argument("--epochs", type=int, default=6, help="passes over them (default 6)")
    p.add_argument("--init", choices=("normal", "pytorch"), default="pytorch",
                   help="the initialisation (default pytorch: it learns in fewer steps than d2l's normal)")
    p.add_argument("--test-images", type=int, default=256, help="test images for the accuracy (default 256)")
    p.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--width", type=int, default=4, help="ResNet-18's width (default 4)")
    p.add_argument("--precisions", nargs="+", choices=kernels.PRECISIONS, default=("tf32", "bf16", "fp32"))
    p.add_argument("--json", help="also write the curves to this JSON file")
    args = p.parse_args(argv)
    splits = load_fashion_mnist(args.data_dir, download=False)
    (x_train, y_train), (x_test, y_test) = splits["train"], splits["test"]
    images, labels = x_train[:args.images], y_train[:args.images].astype(np.int32)
    test_images, test_labels = x_test[:args.test_images], y_test[:args.test_images].astype(np.int32)
    results = {precision: curve(precision, images, labels, test_images, test_labels, args.width, args.batch,
                                args.epochs, args.init) for precision in args.precisions}
    print(f"ResNet-18 width {args.width} ({args.init} init), {args.images} Fashion-MNIST images, {args.epochs} epochs "
          f"in batches of {args.batch}, seed 0, on the emulator: the loss at each step")
    print("| step | " + " | ".join(args.precisions) + " |")
    print("|---:|" + "---:|" * len(args.precisions))
    for step, row in enumerate(zip(*(results[p][0] for p in args.precisions)), 1):
        print(f"| {step} | " + " | ".join(f"{loss:.4f}" for loss in row) + " |")
    steps = len(results[args.precisions[0]][0]) // args.epochs
    for epoch in range(args.epochs):
        print(f"| mean of epoch {epoch + 1} | " + " | ".join(
            f"{statistics.mean(results[p][0][epoch * steps:(epoch + 1) * steps]):.4f}" for p in args.precisions) + " |")
    print(f"| test accuracy ({args.test_images} images) | " + " | ".join(
        f"{results[p][1]:.3f}" for p in args.precisions) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({p: {"losses": losses, "accuracy": accuracy} for p, (losses, accuracy) in results.items()}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
