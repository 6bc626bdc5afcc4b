#!/usr/bin/env python3
"""Train ResNet-18 on Fashion-MNIST.

  python train_resnet.py --epochs 10 --batch-size 256 --lr 0.1
  python train_resnet.py --limit 3000 --test-limit 1000 --epochs 3 --batch-size 64
  python train_resnet.py --resume runs/resnet18-20261129-120000 --epochs 20

Each epoch prints one line and rewrites, in the --out folder, checkpoint.npz,
metrics.json, metrics.csv and training.png. Ctrl-C stops after keeping the last
finished epoch's files; --resume continues from them.
"""
import argparse
import sys

from nn import checkpoint, data, train

D = train.Config()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=0,
                   help="GPUs to train on: 0 trains on the CPU, 1 on one GPU through CuPy (default 0)")
    p.add_argument("--epochs", type=int, help=f"total epochs, counting resumed ones (default {D.epochs})")
    p.add_argument("--batch-size", type=int, help=f"images per step (default {D.batch_size})")
    p.add_argument("--lr", type=float, help=f"learning rate (default {D.lr})")
    p.add_argument("--momentum", type=float, help=f"SGD momentum (default {D.momentum})")
    p.add_argument("--weight-decay", type=float, help=f"L2 weight decay (default {D.weight_decay})")
    p.add_argument("--schedule", choices=train.SCHEDULES,
                   help="learning-rate schedule: constant, or cosine decay to 0 over all steps "
                        f"(default {D.schedule})")
    p.add_argument("--init", choices=("normal", "pytorch"),
                   help="weights ~ N(0, 0.01) with zero biases as in d2l, or PyTorch's default "
                        f"(default {D.init})")
    p.add_argument("--width", type=int, help=f"channels of the first stage; 64 is ResNet-18 (default {D.width})")
    p.add_argument("--seed", type=int, help=f"seed of the weights and the batch order (default {D.seed})")
    p.add_argument("--limit", type=int, help="train on the first N images of the training split only")
    p.add_argument("--test-limit", type=int, help="evaluate on the first N images of the test split only")
    p.add_argument("--data-dir", help="folder of the four Fashion-MNIST .gz files (default: "
                                      "$FASHION_MNIST_DIR, else ./data/fashion-mnist; downloaded if missing)")
    p.add_argument("--out", help="output folder (default runs/resnet18-<date>-<time>; "
                                 "when resuming, the checkpoint's folder)")
    p.add_argument("--resume", help="a checkpoint.npz, or an output folder holding one")
    return p, p.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    try:
        train.run(given)
    except (train.ConfigError, checkpoint.CheckpointError, data.DataError) as e:
        parser.error(str(e))
    except (train.NonFiniteLoss, train.OutOfMemory) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: the files of the last finished epoch are kept; --resume continues "
              "from them", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
