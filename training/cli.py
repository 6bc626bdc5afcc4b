"""Train ResNet-18 on Fashion-MNIST.

  python train_resnet.py --epochs 10 --batch-size 256 --lr 0.1
  python train_resnet.py --limit 3000 --test-limit 1000 --epochs 3 --batch-size 64
  python train_resnet.py --resume runs/resnet18-20261129-120000 --epochs 20
  python train_resnet.py --epochs 10 --export resnet18.safetensors   # weights for PyTorch
  mpiexec -n 2 python train_resnet.py --gpus 0 --batch-size 128   # two CPU ranks

Each epoch prints one line and rewrites, in the --out folder, checkpoint.npz,
metrics.json, metrics.csv and training.png. Ctrl-C stops after keeping the last
finished epoch's files; --resume continues from them. --export writes the trained
weights as safetensors that d2l's PyTorch ResNet-18 loads; --init-from starts from
such a file, whichever framework wrote it.

Data parallelism: under mpiexec every rank trains a replica on its share of each
global batch of --batch-size images and the gradients are summed over ranks; rank 0
prints and writes the files. --lr is the learning rate of the global batch (add
--scale-lr to multiply it by the number of ranks). An error on any rank ends the job.
"""
import argparse
import sys
import time
import traceback

import kernels
from parallel import comm as communicators
from parallel import launch
from . import checkpoint, config, fashion_mnist, loop

D = config.Config()
WATCHDOG_SECONDS = 600.0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=0,
                   help="GPUs to train on: 0 trains on the CPU, 1 on one GPU through CuPy, N on N GPUs "
                        "of this machine, one worker process each, gradients summed over NCCL; under "
                        "mpiexec, the GPUs of each node, one rank each (default 0)")
    p.add_argument("--epochs", type=int, help=f"total epochs, counting resumed ones (default {D.epochs})")
    p.add_argument("--batch-size", type=int, help=f"images per step (default {D.batch_size})")
    p.add_argument("--lr", type=float, help=f"learning rate (default {D.lr})")
    p.add_argument("--momentum", type=float, help=f"SGD momentum (default {D.momentum})")
    p.add_argument("--weight-decay", type=float, help=f"L2 weight decay (default {D.weight_decay})")
    p.add_argument("--schedule", choices=config.SCHEDULES,
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
    p.add_argument("--init-from", metavar="FILE",
                   help="start from the weights and batch-norm statistics in FILE, a safetensors file of this "
                        "model's state dict (from --export, or from d2l's PyTorch ResNet-18: "
                        "safetensors.torch.save_file(net.state_dict(), FILE)); the optimizer starts afresh")
    p.add_argument("--export", metavar="FILE",
                   help="after the last epoch, write the trained weights to FILE as safetensors under the keys of "
                        "d2l's PyTorch ResNet-18, so that net.load_state_dict(safetensors.torch.load_file(FILE)) "
                        "loads them (with --resume of a finished run: export only)")
    p.add_argument("--profile", action="store_true",
                   help="instead of training, time every layer's forward and backward, the loss, the "
                        "optimizer step, the batch gather and (with several ranks) each all-reduce bucket "
                        "over --profile-steps steps of this configuration; prints a table sorted by cost "
                        "and writes profile.json, profile.csv and profile.png to --out (see the profiler package)")
    p.add_argument("--profile-steps", type=int, default=20, metavar="N",
                   help="steps to profile, after 3 warm-up steps (default 20)")
    ddp = p.add_argument_group("data parallelism (under mpiexec)")
    ddp.add_argument("--sync-bn", action="store_true", default=None,
                     help="batch norm over the whole global batch (statistics summed over ranks) "
                          "instead of each rank's share")
    ddp.add_argument("--scale-lr", action="store_true", default=None,
                     help="multiply --lr by the number of ranks (the linear scaling rule); by default "
                          "--lr is the learning rate of the global batch, whatever the ranks")
    ddp.add_argument("--check-sync", type=int, metavar="N",
                     help="compare a checksum of the parameters across ranks every N steps and stop if "
                          "they differ (default 0: only at the start)")
    ddp.add_argument("--bucket-mb", type=float,
                     help=f"gradient all-reduce bucket size in MB (default {D.bucket_mb:g})")
    ddp.add_argument("--watchdog", type=float, default=WATCHDOG_SECONDS, metavar="SECONDS",
                     help="with --gpus N: stop the job when a worker has not finished a step for this long "
                          f"(default {WATCHDOG_SECONDS:g}; the first step compiles the kernels)")
    return p, p.parse_args(argv)


def usage_error(parser, message):
    """parser.error, printed once: under mpiexec every rank finds the same fault, and only
    rank 0 says so (the others give it time to, since mpiexec ends the job at the first
    rank that exits with an error)."""
    world = launch.mpi_world()
    if world is not None and world.rank != 0:
        time.sleep(10)
        sys.exit(2)
    parser.error(message)


def train_on_gpus(parser, given, watchdog, profile_steps):
    """--gpus N on one node: one worker process per GPU; this process waits for them."""
    if "resume" not in given:  # the flags' faults, said once, before any worker starts
        try:
            config.Config(**given).check()
        except config.ConfigError as e:
            parser.error(str(e))
    try:
        unique_id = communicators.NCCLCommunicator.unique_id()
    except Exception as e:
        parser.error(f"--gpus {given['gpus']}: NCCL is unavailable ({type(e).__name__}: {e})")
    print(f"starting {given['gpus']} worker processes, one per GPU; rank 0 reports", flush=True)
    try:
        launch.run_workers(given["gpus"], loop.gpu_worker, (given, unique_id, profile_steps), watchdog=watchdog)
    except launch.WorkerFailed as e:
        if e.trace:
            print(e.trace.rstrip(), file=sys.stderr)
        print(f"error: {e} (GPU {e.rank}); every worker was stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: every worker was stopped; the files of the last finished epoch are kept, "
              "and --resume continues from them", file=sys.stderr)
        return 130
    return 0


def main(argv=None):
    parser, args = parse_args(argv)
    modes = ("watchdog", "profile", "profile_steps")
    given = {k: v for k, v in vars(args).items() if v is not None and k not in modes}
    profile_steps = args.profile_steps if args.profile else None
    if profile_steps is not None and profile_steps < 1:
        usage_error(parser, f"--profile-steps must be at least 1, got {profile_steps}")
    if args.gpus > 0:
        try:
            kernels.cupy_module()
        except kernels.DeviceError as e:
            usage_error(parser, f"--gpus {args.gpus}: {e}")
        # under mpiexec, --gpus counts the node's GPUs, and a rank may see only its own (kernels.local_gpu)
        mpi = launch.mpi_world() is not None
        if kernels.gpu_count() < (1 if mpi else args.gpus):
            usage_error(parser, f"--gpus {args.gpus}: this machine has {kernels.gpu_count()} GPU(s) that CuPy can use")
        if args.gpus > 1 and not mpi:
            return train_on_gpus(parser, given, args.watchdog, profile_steps)
    comm = communicators.SingleProcess()
    try:
        comm = communicators.from_environment()
        comm = communicators.for_training(args.gpus, comm)
        loop.train_or_profile(given, comm, profile_steps)
        return 0
    except (config.ConfigError, checkpoint.CheckpointError, fashion_mnist.DataError) as e:
        code, message = 2, f"{parser.prog}: error: {e}"
        if comm.world_size == 1:
            parser.error(str(e))
    except (loop.NonFiniteLoss, loop.OutOfMemory) as e:
        code, message = 1, f"error: {e}"
    except (launch.LaunchError, kernels.DeviceError) as e:
        code, message = 2, f"{parser.prog}: error: {e}"
    except KeyboardInterrupt:
        code, message = 130, ("\ninterrupted: the files of the last finished epoch are kept; --resume "
                              "continues from them")
    except Exception as e:
        if comm.world_size == 1:
            raise
        traceback.print_exc()
        code, message = 1, f"error: {type(e).__name__}: {e}"
    return launch.fail(comm, code, message)

