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
import json
import math
import signal
import sys
import time
import traceback

import kernels
from kernels import emu
from parallel import comm as communicators
from parallel import launch
from . import checkpoint, config, fashion_mnist, loop, output

D = config.Config()
WATCHDOG_SECONDS = 600.0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for a command line it cannot read (the usage, then the error) rank 0 alone
    prints under mpiexec or srun, as one_line_error's (only_rank_0_says)."""

    def error(self, message):
        only_rank_0_says()
        super().error(message)


def parse_args(argv):
    p = _Parser(prog="train_resnet.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int,
                   help="GPUs to train on: 0 trains on the CPU, 1 on one GPU through CuPy, N on N GPUs "
                        "of this machine, one worker process each, gradients summed over NCCL; under "
                        "mpiexec, the GPUs of each node, one rank each (default 0; a resumed run: the "
                        "checkpoint's)")
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
    p.add_argument("--precision", choices=kernels.PRECISIONS,
                   help="of the step on GPUs: tf32 multiplies the convolutions on the tensor cores with the inputs "
                        "rounded to TF32 (10-bit mantissa) and sums in float32, as PyTorch does for convolutions by "
                        "default (the stem, of one input channel, and the linear layer multiply in float32); bf16 is "
                        "mixed precision as PyTorch's torch.autocast('cuda', torch.bfloat16) with channels_last: the "
                        "activations and their gradients are stored in bfloat16 and the convolutions multiply "
                        "bfloat16 on the tensor cores, summing in float32, while batch norm's statistics, the loss, "
                        "the linear layer, the gradients and the weights the optimizer updates stay float32 (float32 "
                        "master weights: checkpoints and --export hold them); fp32 multiplies in float32 throughout, "
                        "several times slower (default: tf32 with --gpus, fp32 on the CPU, which has no other; a "
                        "resumed run: the checkpoint's, and it says so when told another)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction,
                   help="on GPUs, capture the training step once as a CUDA graph and replay it every step, "
                        "which takes the Python side off the step's time; each step's batch and learning rate are "
                        "written into the graph's inputs first, an epoch's last, shorter batch runs eagerly, and "
                        "a step that cannot be captured runs eagerly after a one-line warning (default: --graph "
                        "with --gpus)")
    p.add_argument("--seed", type=int, help=f"seed of the weights and the batch order (default {D.seed})")
    p.add_argument("--limit", type=int, help="train on the first N images of the training split only")
    p.add_argument("--test-limit", type=int, help="evaluate on the first N images of the test split only")
    p.add_argument("--data-dir", help="folder of the four Fashion-MNIST .gz files (default: "
                                      "$FASHION_MNIST_DIR, else ./data/fashion-mnist; downloaded if missing; a resumed "
                                      "run: the folder its run read)")
    p.add_argument("--out", help="output folder (default runs/resnet18-<date>-<time>; "
                                 "when resuming, the checkpoint's folder)")
    p.add_argument("--resume", help="a checkpoint.npz, or an output folder holding one: the run continues with the "
                                    "checkpoint's flags but for those of one command (--out, --overwrite, "
                                    "--init-from, --export, --profile, --watchdog), which a checkpoint never keeps")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="let a new run replace the run whose files --out holds (without it, that is an error): "
                        "they are set aside once the new run has passed its checks, deleted when it writes its "
                        "first checkpoint, and put back if it ends without one")
    p.add_argument("--init-from", metavar="FILE",
                   help="start from the weights and batch-norm statistics in FILE, a safetensors file of this "
                        "model's state dict (from --export, or from d2l's PyTorch ResNet-18: "
                        "safetensors.torch.save_file(net.state_dict(), FILE)); the optimizer starts afresh")
    p.add_argument("--export", metavar="FILE",
                   help="after the last epoch, write the trained weights to FILE as safetensors under the keys of "
                        "d2l's PyTorch ResNet-18, in float32 whatever the precision (under bf16 the master weights, as "
                        "the state dict of a PyTorch model trained under autocast holds them), so that net.load_state_dict(safetensors.torch.load_file(FILE)) "
                        "loads them (with --resume of a finished run: export only); checked at the start: a regular "
                        "file (a symbolic link is followed), none of the run's own files")
    p.add_argument("--profile", action="store_true",
                   help="instead of training, time every layer's forward and backward, the loss, the "
                        "optimizer step, the batch gather and (with several ranks) each all-reduce bucket "
                        "over --profile-steps steps of this configuration; prints a table sorted by cost "
                        "and writes profile.json, profile.csv, profile.png and the timeline profile.trace.json (for "
                        "Perfetto) to --out (see the profiler package)")
    p.add_argument("--profile-steps", type=int, default=20, metavar="N",
                   help="steps to profile, after 3 warm-up steps (default 20)")
    ddp = p.add_argument_group("data parallelism (under mpiexec)")
    ddp.add_argument("--sync-bn", action=argparse.BooleanOptionalAction,
                     help="batch norm over the whole global batch (statistics summed over ranks) "
                          "instead of each rank's share (default: --no-sync-bn; a resumed run: the checkpoint's)")
    ddp.add_argument("--scale-lr", action=argparse.BooleanOptionalAction,
                     help="multiply --lr by the number of ranks (the linear scaling rule); by default "
                          "--lr is the learning rate of the global batch, whatever the ranks (a resumed run: the "
                          "checkpoint's)")
    ddp.add_argument("--check-sync", type=int, metavar="N",
                     help="compare a checksum of the parameters across ranks every N steps and stop if "
                          "they differ (default 0: only at the start)")
    ddp.add_argument("--bucket-mb", type=float,
                     help=f"gradient all-reduce bucket size in MB (default {D.bucket_mb:g})")
    ddp.add_argument("--watchdog", type=float, default=WATCHDOG_SECONDS, metavar="SECONDS",
                     help="with --gpus N: stop the job when a worker has not finished a step for this long "
                          f"(default {WATCHDOG_SECONDS:g}; the first step compiles the kernels)")
    return p, p.parse_args(argv)


# a user's mistake, or a folder of the machine that will not do (the CUDA emulator's cache of compiled kernels,
# on simulated GPUs): one line naming it, exit code 2, on every path (a worker's included)
USER_ERRORS = (config.ConfigError, checkpoint.CheckpointError, fashion_mnist.DataError, emu.CacheError)


def one_line_error(parser, message):
    """A command line whose every value is well-formed but will not do (out of range, or wrong for this
    machine, this data, this checkpoint, these ranks): ``train_resnet.py: error: message``, exit code 2,
    without the usage, which argparse prints for what it cannot read (an unknown flag, a missing value, a
    malformed number). Printed once: under mpiexec (or srun) every rank finds the same fault, and only
    rank 0 says so (the others give it time to, since mpiexec, and srun --kill-on-bad-exit, end the
    job at the first rank that exits with an error: only_rank_0_says). A default output folder this start
    made goes again."""
    output.discard_unused()
    only_rank_0_says()
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def only_rank_0_says():
    """Before a usage error is printed: under mpiexec (or srun) every rank finds the same fault, and a rank other
    than 0 exits with code 2 here, silently, once rank 0 has had the time to say it."""
    try:
        world = launch.mpi_world() or launch.slurm_world()
    except launch.LaunchError:
        world = None
    if world is not None and world.rank != 0:   # rank 0 finds it within milliseconds: three seconds are plenty
        launch.exit_on_sigterm(2)
        time.sleep(3)
        sys.exit(2)


def train_on_gpus(parser, given, watchdog, profile_steps):
    """--gpus N on one node: one worker process per GPU; this process waits for them. Everything
    that can be checked is checked here, once, before any worker starts (loop.prepare without
    the GPUs: the flags, the checkpoint, the output folder, --export, the data, the memory for the
    model, --init-from); a user's mistake that a worker still finds is one line too."""
    try:
        if "resume" not in given:
            given = {**given, "out": given.get("out") or str(output.fresh_default())}
        loop.prepare(given, log=lambda *a: None, world_size=given["gpus"], profiling=profile_steps is not None,
                     dry=True)[-1].release()
    except USER_ERRORS as e:
        one_line_error(parser, str(e))
    try:
        unique_id = communicators.NCCLCommunicator.unique_id()
    except Exception as e:
        one_line_error(parser, f"--gpus {given['gpus']}: NCCL is unavailable ({type(e).__name__}: {e})")
    print(f"starting {given['gpus']} worker processes, one per GPU; rank 0 reports", flush=True)
    try:
        launch.run_workers(given["gpus"], loop.gpu_worker, (given, unique_id, profile_steps), watchdog=watchdog)
    except launch.WorkerFailed as e:
        output.discard_unused()
        if isinstance(e.error, USER_ERRORS):
            print(f"{parser.prog}: error: {e.error}", file=sys.stderr)
            return 2
        if e.trace:
            print(e.trace.rstrip(), file=sys.stderr)
        print(f"error: {e} (GPU {e.rank}); every worker was stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        out = given.get("out") or checkpoint.resolve(given["resume"]).parent
        print(f"\n{_stopped_by(e)}: every worker was stopped; {output.kept(out)}", file=sys.stderr)
        return _exit_code(e)
    return 0


# flags a rank may give otherwise than the others: where this node keeps the data
LOCAL_FLAGS = ("data_dir",)


def _check_ranks_agree(parser, comm, flags):
    """Every rank of an MPI job must be started with the flags that define the run (mpiexec -n 1 ...
    --lr 0.1 : -n 1 ... --lr 0.2 would train replicas that drift apart, or hang at the end): the
    first flag that differs, with its value on each rank, is a usage error before anything starts."""
    if comm.world_size == 1:
        return
    mine = {k: v for k, v in flags.items() if k not in LOCAL_FLAGS}
    ranks = [json.loads(part) for part in comm.all_gather_bytes(json.dumps(mine, sort_keys=True).encode())]
    for name in sorted(set().union(*ranks)):
        values = [rank.get(name) for rank in ranks]
        if any(v != values[0] for v in values):
            flag = "--" + name.replace("_", "-")
            said = ", ".join(f"{'not given' if v is None else v} on rank {r}" for r, v in enumerate(values))
            one_line_error(parser, f"the ranks were started with different flags: {flag} is {said}; start "
                                   f"every rank with the same flags")


Terminated, _terminate = loop.Terminated, loop.terminate   # SIGTERM's exception and handler (the loop's: see there)


def _stopped_by(interrupt):
    return "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"


def _exit_code(interrupt):
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)


def main(argv=None):
    """The command; SIGTERM stops it as Ctrl-C does, keeping the last finished epoch. A SIGTERM that
    lands while an error is being dealt with (the MPI runtime's, sent to every rank once one has
    failed, reaching a rank that is failing too, before it has said so) ends the command quietly
    with SIGTERM's code: the failure is reported by the rank that ended the job."""
    launch.forgiving_streams()
    loop.TERMINATIONS.clear()
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv)
    except Terminated as e:
        launch.flush_quietly()
        return _exit_code(e)
    finally:
        signal.signal(signal.SIGTERM, previous)
        loop.TERMINATIONS.clear()


def given_flags(args):
    """The flags of the run that the command line gave (not None), without those of how this command runs
    (--watchdog, --profile, --profile-steps), which the run's configuration does not hold."""
    return {k: v for k, v in vars(args).items()
            if v is not None and k not in ("watchdog", "profile", "profile_steps")}


def _main(argv):
    parser, args = parse_args(argv)
    given = given_flags(args)
    profile_steps = args.profile_steps if args.profile else None
    if profile_steps is not None and profile_steps < 1:
        one_line_error(parser, f"--profile-steps must be at least 1, got {profile_steps}")
    if profile_steps is not None and args.export is not None:
        one_line_error(parser, "--export writes the weights a run trained, and --profile trains none: give one of them")
    if not 0 < args.watchdog < math.inf:
        one_line_error(parser, f"--watchdog must be a positive number of seconds, got {args.watchdog}")
    try:   # an environment that makes no sense, named before it is used
        mpi, tasks = launch.mpi_world() is not None, launch.slurm_world()
    except launch.LaunchError as e:
        one_line_error(parser, str(e))
    slurm = tasks is not None and tasks.size > 1
    gpus = args.gpus
    if args.resume:
        output.put_back_before_resuming(args.resume)
    if gpus is None:   # a resumed run keeps its checkpoint's device; a new one trains on the CPU
        try:
            gpus = checkpoint.record_of(args.resume)["config"].get("gpus", 0) if args.resume else 0
        except checkpoint.CheckpointError:   # loop.prepare says so, after the flags
            gpus = 0
    if gpus > 0:
        try:
            kernels.cupy_module()
        except kernels.DeviceError as e:
            one_line_error(parser, f"--gpus {gpus}: {e}")
        # under mpiexec or srun, --gpus counts the node's GPUs, and a rank may see only its own (kernels.local_gpu)
        if kernels.gpu_count() < (1 if mpi or slurm else gpus):
            one_line_error(parser, f"--gpus {gpus}: this machine has {kernels.gpu_count()} GPU(s) that CuPy can use")
        if gpus > 1 and not mpi and not slurm:
            return train_on_gpus(parser, {**given, "gpus": gpus}, args.watchdog, profile_steps)
    comm = communicators.SingleProcess()
    try:
        comm = communicators.from_environment()
        if comm.world_size == 1:   # srun's tasks, whose MPI sees each alone
            comm = communicators.from_slurm(gpus)
        _check_ranks_agree(parser, comm, {**given, "profile_steps": profile_steps})
        if comm.world_size > 1 and not given.get("out") and not given.get("resume"):
            config.Config(**given).check()   # before a folder is made for nothing
            given["out"] = comm.broadcast_object(str(output.fresh_default()) if comm.rank == 0 else None)
        comm = communicators.for_training(gpus, comm)
        loop.train_or_profile(given, comm, profile_steps)
        return 0
    except USER_ERRORS as e:
        code, message = 2, f"{parser.prog}: error: {e}"
        if comm.world_size == 1:
            one_line_error(parser, str(e))
    except (loop.NonFiniteLoss, loop.OutOfMemory, loop.OutputError) as e:
        code, message = 1, f"error: {e}"
    except (launch.LaunchError, kernels.DeviceError) as e:
        code, message = 2, f"{parser.prog}: error: {e}"
        if comm.world_size == 1:   # srun's tasks find it alike: rank 0 says it (one_line_error)
            one_line_error(parser, str(e))
    except KeyboardInterrupt as e:
        kept = getattr(e, "kept", "it stopped before training: nothing was written")
        code, message = _exit_code(e), f"\n{_stopped_by(e)}: {kept}"
    except Exception as e:
        if comm.world_size == 1:
            output.discard_unused()
            raise
        launch.exit_on_sigterm(1)
        traceback.print_exc()
        code, message = 1, f"error: {type(e).__name__}: {e}"
    output.discard_unused()
    return launch.fail(comm, code, message)

