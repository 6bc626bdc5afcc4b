#!/usr/bin/env python3
"""Train ResNet-18 on Fashion-MNIST: ``python train_resnet.py --help`` (training/cli.py)."""
import sys

from parallel import launch

launch.limit_threads()  # before NumPy loads: ranks of one machine share its cores

from training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
