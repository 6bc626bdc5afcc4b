"""The README's learning check on the CPU, timed beside the same training in PyTorch.

Ours is the README's command, run as a user runs it (a fresh process of train_resnet.py):

    python train_resnet.py --limit 3000 --test-limit 1000 --epochs 3 --batch-size 64 --lr 0.1 --seed S

PyTorch, in a fresh process of its own, trains d2l's ResNet-18 (tests/test_torch_parity.py's builder)
from weights drawn as ours draws them (nn.resnet18 after nn.manual_seed(seed), copied over), on the same 3000 images
and 1000 test images, with the same schedule: SGD at lr 0.1 without momentum, batches of 64 in an order
shuffled each epoch, each epoch's test accuracy in eval mode. Each side's time is its process's wall
clock, start to end, imports and data loading included; the table gives both, their ratio, and each
epoch's test accuracy. Nothing else should run meanwhile.

    PYTHONPATH=. python -m bench.learning_check --data-dir data/fashion-mnist [--seed 0] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT, TEST_LIMIT, EPOCHS, BATCH, LR = 3000, 1000, 3, 64, 0.1


def ours(data_dir, seed):
    """(seconds, [test accuracy after each epoch]) of the README's command."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, os.path.join(ROOT, "train_resnet.py"), "--data-dir", data_dir,
                   "--limit", str(LIMIT), "--test-limit", str(TEST_LIMIT), "--epochs", str(EPOCHS),
                   "--batch-size", str(BATCH), "--lr", str(LR), "--seed", str(seed), "--out", out]
        began = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - began
        with open(os.path.join(out, "metrics.json")) as f:
            return seconds, [m["test_acc"] for m in json.load(f)]


def torch_side(data_dir, seed):
    """What `--torch` runs in its own process: PyTorch's training, (seconds since the process started,
    accuracies) on stdout as JSON."""
    import numpy as np
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import nn
    from test_torch_parity import copy_into_torch, torch_resnet18
    from training.fashion_mnist import load_split
    nn.manual_seed(seed)
    model = torch_resnet18(10, 1, 64)
    copy_into_torch(nn.resnet18(), model)
    (x, y), (xt, yt) = (load_split(data_dir, split) for split in ("train", "test"))
    as_input = lambda images: torch.from_numpy(images.astype(np.float32) / 255).unsqueeze(1)   # noqa: E731
    x, y, xt, yt = as_input(x[:LIMIT]), torch.from_numpy(y[:LIMIT].astype(np.int64)), \
        as_input(xt[:TEST_LIMIT]), torch.from_numpy(yt[:TEST_LIMIT].astype(np.int64))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(seed)
    accuracies = []
    for _ in range(EPOCHS):
        model.train()
        for batch in torch.randperm(LIMIT, generator=order).split(BATCH):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(xt[i:i + BATCH]).argmax(1) == yt[i:i + BATCH]).sum())
                          for i in range(0, TEST_LIMIT, BATCH))
        accuracies.append(correct / TEST_LIMIT)
    return accuracies


def theirs(data_dir, seed):
    """(seconds, accuracies) of PyTorch's training in a fresh process."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "bench.learning_check", "--torch", "--data-dir", data_dir,
                           "--seed", str(seed)], check=True, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    return time.perf_counter() - began, json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("FASHION_MNIST_DIR", "data/fashion-mnist"),
                        help="the four Fashion-MNIST .gz files (default: $FASHION_MNIST_DIR, else %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--torch", action="store_true", help=argparse.SUPPRESS)   # theirs' own process
    args = parser.parse_args(argv)
    if args.torch:
        print(json.dumps(torch_side(args.data_dir, args.seed)))
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        parser.error("PyTorch is not installed: the check's peer needs it (pip install torch)")
    print(f"learning check: {LIMIT} images, {EPOCHS} epochs, batch {BATCH}, lr {LR}, seed {args.seed}", flush=True)
    rows = {}
    for name, run in (("ours", ours), ("PyTorch", theirs)):
        seconds, accuracies = run(args.data_dir, args.seed)
        rows[name] = {"seconds": seconds, "test_acc": accuracies}
        print(f"  {name:8s} {seconds:7.1f} s   test accuracy by epoch {', '.join(f'{a:.3f}' for a in accuracies)}",
              flush=True)
    ratio = rows["ours"]["seconds"] / rows["PyTorch"]["seconds"]
    print(f"  ours / PyTorch: {ratio:.2f} of its time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**rows, "time_ratio": ratio, "seed": args.seed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
