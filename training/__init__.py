"""The training application: ResNet-18 on Fashion-MNIST, the program behind train_resnet.py.

- ``cli``: the command line (flags, --gpus N workers, errors and exit codes);
- ``config``: the run's configuration, its checks, and resuming;
- ``loop``: preparing a run, the epochs, evaluation, --profile, the GPU workers;
- ``output``: the output folder, fresh by default, checked and locked for the run's life;
- ``checkpoint``: checkpoint.npz, written atomically, only of a finite model, restored bit for bit;
- ``fashion_mnist``: the dataset's four IDX files, found, downloaded and checked;
- ``reports``: the progress of an epoch, metrics.json, metrics.csv, training.png.

It sits on top: it uses kernels, nn, parallel and the profiler, and none of them imports it.
"""
