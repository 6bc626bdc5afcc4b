"""Training ResNet-18 on Fashion-MNIST: the loop behind ``train_resnet.py``.

Each epoch ends with an evaluation on the test split, one summary line, and the
files of the output folder rewritten atomically: ``checkpoint.npz``,
``metrics.json``, ``metrics.csv`` and ``training.png``. A run resumed from a
checkpoint computes the same weights, bit for bit, as one that was never stopped:
batch order depends only on (seed, epoch) and everything else is in the checkpoint.
"""
import functools
import sys
import time
from pathlib import Path

import numpy as np

from kernels import (DeviceError, array_module_for, backend_of, cupy_module, get_array_module, local_gpu,
                     precision_for, use_precision)
from kernels.cuda.launch import ELEMENT_LIMIT
from nn import data, init
from nn.functional import cross_entropy
from nn.optim import SGD, CosineAnnealingLR
from nn.resnet import largest_activation, largest_gpu_batch, memory_shortfall, resnet18
from nn.serialization import SerializationError, load_safetensors, save_safetensors
from nn.tensor import Tensor, no_grad
from parallel.comm import NCCLCommunicator, SingleProcess
from parallel.ddp import DataParallel, shard_bounds
from . import checkpoint, fashion_mnist, output
from .config import Config, ConfigError, merge_resumed, resumed_changes
from .reports import Progress, finite_or_none, write_reports
from .step import GraphedStep, train_step


class NonFiniteLoss(RuntimeError):
    pass


class OutOfMemory(RuntimeError):
    pass


class OutputError(RuntimeError):
    """A file of the run could not be written (a full disk, say); the message says which."""


def _limited(split, limit, name):
    images, labels = split
    if limit is None:
        return images, labels
    if limit > len(images):
        raise ConfigError(f"--{name} {limit} is larger than the split, which has {len(images)} images")
    return images[:limit], labels[:limit]


class _Window:
    """Loss and correct counts of recent steps, kept as arrays and read on the host
    once per window, so that the steps between reads never wait for the device."""

    def __init__(self):
        self.losses, self.correct, self.shares = [], [], []
        self.loss_sum = self.correct_sum = 0.0
        self.local_loss_sum = 0.0  # this rank's own mean losses, for its progress bar
        self.steps = 0

    def add(self, loss, correct, share):
        """``share``: this rank's fraction of the batch, so that the losses of all ranks
        add up to the batch's mean loss."""
        self.losses.append(loss)
        self.correct.append(correct)
        self.shares.append(share)

    def flush(self, epoch, first_step):
        values = [float(v) for v in self.losses]
        for i, v in enumerate(values):
            if not np.isfinite(v):
                raise NonFiniteLoss(f"loss is {v} at epoch {epoch}, step {first_step + i + 1}")
        self.loss_sum += sum(v * share for v, share in zip(values, self.shares))
        self.local_loss_sum += sum(values)
        self.correct_sum += sum(float(c) for c in self.correct)
        self.steps += len(values)
        self.losses, self.correct, self.shares = [], [], []

    def totals(self, comm):
        """(mean loss per step, correct count) over every rank."""
        loss_sum, correct = comm.all_reduce_values([self.loss_sum, self.correct_sum])
        return loss_sum / max(self.steps, 1), correct


def _kept(out, epoch):
    if not epoch:
        return "no checkpoint was written"
    return f"the last good checkpoint, of epoch {epoch}, is intact: {out / checkpoint.FILENAME}"


def _write_epoch(out, model, opt, record):
    """The checkpoint of the epoch just finished, then the reports; the checkpoint before it stays
    when the model has diverged or the disk is full."""
    epoch = record["epoch"]
    try:
        checkpoint.save(out / checkpoint.FILENAME, model, opt, record)
    except checkpoint.NotFinite as e:
        raise NonFiniteLoss(f"the model after epoch {epoch} is {e} (its last steps diverged); its checkpoint was "
                            f"not written: {_kept(out, epoch - 1)}") from None
    except OSError as e:
        raise OutputError(f"could not write {e.filename} ({e.strerror}); {_kept(out, epoch - 1)}") from None
    output.settle(out)   # the run this one replaced (--overwrite) goes only now
    try:
        write_reports(out, record["metrics"])
    except OSError as e:
        raise OutputError(f"could not write {e.filename} ({e.strerror}); the checkpoint of epoch {epoch} was "
                          f"written") from None


def evaluate(model, images, labels, batch_size, comm=SingleProcess()):
    """(mean loss, accuracy) of ``model`` in eval mode; each rank evaluates its shard of
    the images and the sums are added over ranks."""
    K, xp = backend_of(images), get_array_module(images)
    lo, hi = shard_bounds(len(images), comm.world_size, comm.rank)
    model.eval()
    loss_sum = correct = 0.0
    with no_grad():
        for idx in data.batch_indices(xp.arange(lo, hi), batch_size):
            logits, y = model(Tensor(K.images_to_float(images, idx))), K.take(labels, idx)
            loss_sum += float(cross_entropy(logits, y).data) * len(idx)
            correct += float(K.count_correct(logits.data, y))
    model.train()
    loss_sum, correct = comm.all_reduce_values([loss_sum, correct])
    return loss_sum / len(images), correct / len(images)


class Terminated(KeyboardInterrupt):
    """SIGTERM, what schedulers and kill send: treated as Ctrl-C is."""


# The SIGTERMs the command's handler received. Its Terminated is raised wherever the signal lands, and where that is
# a weakref callback or a __del__ (an import's module lock has one) Python prints it and goes on: the training loop
# raises it again before its next batch, so that no SIGTERM is lost.
TERMINATIONS = []


def terminate(signum, frame):
    """SIGTERM's handler (training/cli.py installs it)."""
    TERMINATIONS.append(signum)
    raise Terminated


def train_epoch(model, opt, schedule, images, labels, cfg, epoch, ddp, step, log_seconds=1.0, show=True):
    """One pass over the shuffled training split, each global batch shared by the ranks
    of ``ddp``, each shard trained by ``step(idx)`` (training/step.py: eager, or a GraphedStep);
    (mean loss, accuracy) over all ranks. ``show``: draw the progress bar (of this rank's losses)."""
    xp = get_array_module(images)
    order = xp.asarray(data.epoch_order(len(images), cfg.seed, epoch))
    batches = data.batch_indices(order, cfg.batch_size)
    progress = Progress(len(images), f"epoch {epoch + 1}/{cfg.epochs}") if show else None
    window, last_read, trained = _Window(), time.perf_counter(), 0
    for number, idx in enumerate(batches):
        if TERMINATIONS:   # a SIGTERM whose Terminated was swallowed where it landed
            raise Terminated
        local = ddp.scatter(idx)
        if local is None:  # a last batch with fewer images than ranks
            continue
        trained += len(idx)
        if schedule is not None:
            opt.lr = schedule.lr_at(epoch * len(batches) + number)
        loss, correct = step(local)
        if cfg.check_sync and (epoch * len(batches) + number + 1) % cfg.check_sync == 0:
            ddp.check_in_sync(f"after epoch {epoch + 1}, step {number + 1}")
        window.add(loss, correct, len(local) / len(idx))
        if time.perf_counter() - last_read >= log_seconds or number == len(batches) - 1:
            window.flush(epoch + 1, number + 1 - len(window.losses))
            if progress:
                progress.update(trained, window.local_loss_sum / window.steps)
            last_read = time.perf_counter()
    window.flush(epoch + 1, len(batches) - len(window.losses))
    if progress:
        progress.close()
    loss, correct = window.totals(ddp.comm)
    return loss, correct / trained


def prepare(given, log=print, world_size=1, lead=True, profiling=False, dry=False):
    """Everything that can fail before training, checked first: the configuration (merged
    with the checkpoint's when resuming) for ``world_size`` ranks, the output folder (made and
    claimed by the ``lead`` rank: see training/output.py; a profile writes its own files beside
    a run's), the --export target, the data, the memory for the model, and the model with its
    weights. (cfg, train, test, model, opt, record, claim). ``dry``: only the checks, on the host
    (data and model on the CPU), as the parent of --gpus N workers makes them before they start."""
    saved_arrays = record = None
    for other in ("init_from", "overwrite"):
        if given.get("resume") and given.get(other):
            raise ConfigError(f"--{other.replace('_', '-')} starts a new run and --resume continues one: give "
                              f"one of them")
    if given.get("resume"):
        saved_arrays, record = checkpoint.load(given["resume"])
        home = checkpoint.resolve(given["resume"]).parent
        cfg = merge_resumed(given, record["config"], home)
        for line in resumed_changes(record["config"], cfg):
            log(line)
    else:
        cfg = Config(**given)
    cfg.check()
    cfg.check_world(world_size)
    try:
        xp = array_module_for(cfg.device)
        if cfg.gpus:   # the GPUs this process trains on: the node's, for the parent of --gpus N workers
            devices = range(cfg.gpus) if dry else [xp.cuda.runtime.getDevice()]
            cfg.precision, why = precision_for(devices, cfg.precision)
            if why:
                log(why)
    except DeviceError as e:
        raise ConfigError(f"--gpus {cfg.gpus}: {e}") from None
    finished = record is not None and record["epoch"] >= cfg.epochs and not profiling   # a profile trains none
    if finished and not given.get("export"):
        raise ConfigError(f"the checkpoint has finished {record['epoch']} epochs already; "
                          f"ask for more with --epochs (or only --export its weights)")
    if lead and finished:   # --export of a finished run reads the run and writes nothing in its folder, which
        held = output.Claim(None)   # may be read-only
    elif lead:
        cfg.out = str(cfg.out or output.fresh_default())
        elsewhere = record is not None and Path(cfg.out).resolve() != home.resolve()
        if elsewhere and output.earlier_run(cfg.out):
            raise ConfigError(f"--out {cfg.out} holds another run ({', '.join(output.earlier_run(cfg.out))}): a "
                              f"resumed run continues in its own folder ({home}), or in an empty or new one")
        held = output.claim(cfg.out, continues=(record is not None and not elsewhere) or profiling,
                            overwrite=cfg.overwrite)
    elif cfg.out is None:
        raise ConfigError("every rank needs the output folder: rank 0 decides it before the others start")
    else:
        held = output.Claim(None)
    try:
        if cfg.export is not None:
            output.export_target(cfg.export, cfg.out, cfg.resume)
        prepared = _data_and_model(cfg, xp, world_size, saved_arrays, record, log, dry)
        return (cfg, *prepared, record, held)
    except BaseException:
        held.release()
        raise


def _data_and_model(cfg, xp, world_size, saved_arrays, record, log, dry=False):
    """The second half of prepare(): (train, test, model, opt); with ``dry``, all on the host."""
    splits = fashion_mnist.load_fashion_mnist(cfg.data_dir, log=log)
    # the whole split goes to the device once, as uint8; batches are gathered there
    place = np if dry else xp
    train, test = (tuple(place.asarray(a) for a in (images, labels.astype(np.int32)))
                   for images, labels in (_limited(splits["train"], cfg.limit, "limit"),
                                          _limited(splits["test"], cfg.test_limit, "test-limit")))
    if len(train[0]) < world_size:
        raise ConfigError(f"{len(train[0])} training images cannot be shared by {world_size} ranks")
    _check_memory(cfg, place)   # dry: the host's only (asking a GPU would make a CUDA context in the parent)
    if cfg.gpus:
        _check_index_range(cfg, world_size, test[0].shape)
    init.manual_seed(cfg.seed)
    try:
        model = resnet18(num_classes=fashion_mnist.NUM_CLASSES, in_channels=1, width=cfg.width, init=cfg.init)
        if not dry:
            model.to(cfg.device)
        opt = SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    except MemoryError:   # CuPy's OutOfMemoryError is one too
        raise ConfigError(f"--width {cfg.width}: out of {cfg.device} memory while making the model") from None
    if saved_arrays is not None:
        checkpoint.restore(saved_arrays, model, opt)
        init.set_rng_state(record["rng_state"])
    elif cfg.init_from:
        try:
            load_safetensors(model, cfg.init_from)
        except SerializationError as e:
            raise ConfigError(f"--init-from: {e}") from None
        log(f"weights and batch-norm statistics from {cfg.init_from}")
    return train, test, model, opt


def _check_memory(cfg, xp):
    """ConfigError, before the model is made, when its parameters cannot fit (nn.resnet.memory_shortfall)."""
    shortfall = memory_shortfall(cfg.width, fashion_mnist.NUM_CLASSES, 1, xp)
    if shortfall:
        raise ConfigError(shortfall)


def _check_index_range(cfg, world_size, test_shape):
    """ConfigError, before the model is made, when a GPU's largest activation, the first stage's of its
    largest batch (a training step's share of --batch-size, or an evaluation batch of its shard of the
    test images), has more elements than the CUDA kernels index with int (kernels/cuda/launch.py checks every
    array of every launch too, as a last line)."""
    batch = max(-(-cfg.batch_size // world_size), min(cfg.batch_size, -(-test_shape[0] // world_size)))
    fits = largest_gpu_batch(cfg.width, test_shape[1])
    if batch > fits:
        raise ConfigError(f"--batch-size {cfg.batch_size}: a GPU's batch of {batch:,} images at --width {cfg.width} "
                          f"makes the first stage's activations "
                          f"{batch * largest_activation(cfg.width, test_shape[1]):,} elements, more than the CUDA "
                          f"kernels index ({ELEMENT_LIMIT:,}); at most {fits:,} images fit a GPU's batch")


def _step(cfg, model, opt, ddp, images, labels):
    """The training step of this run, on this rank's shard of a batch: a GraphedStep (--graph),
    replayed for whole global batches, else train_step."""
    if not cfg.replayed_step:
        return functools.partial(train_step, model, opt, ddp, images, labels)
    who = f" (rank {ddp.rank})" if ddp.world_size > 1 else ""   # each rank captures its own step
    return GraphedStep(model, opt, ddp, images, labels, cfg.batch_size,
                       warn=lambda line: print(f"warning{who}: {line}", file=sys.stderr, flush=True))


def _stretched(schedule, before, now, step):
    """What --epochs changed on resuming a cosine schedule, in words: the schedule is the one of a
    run started with the new --epochs, so the learning rate moves to it at once."""
    earlier = CosineAnnealingLR(schedule.optimizer, schedule.T_max * before // now)
    return (f"the cosine schedule now spans {now} epochs, not {before}: from here the learning rate is that of a "
            f"run started with --epochs {now}, {schedule.lr_at(step):g} at the next step (the {before}-epoch "
            f"schedule was at {earlier.lr_at(step):g})")


def _world_line(cfg, ddp, lr):
    world = ddp.world_size
    sizes = sorted({hi - lo for lo, hi in (shard_bounds(cfg.batch_size, world, r) for r in range(world))})
    per_rank = "-".join(map(str, sizes))
    rule = f"--lr {cfg.lr} x {world} ranks (--scale-lr)" if cfg.scale_lr else "--lr, for the global batch"
    norm = "synchronised over ranks (--sync-bn)" if cfg.sync_bn else "per rank"
    return (f"data parallel: {world} ranks, global batch {cfg.batch_size}, {per_rank} images per rank, "
            f"lr {lr:g} ({rule}); batch norm {norm}; {len(ddp.buckets)} gradient bucket(s) of "
            f"~{cfg.bucket_mb:g} MB")


def _replicated(given, comm, log, profiling=False):
    """prepare() as one rank of ``comm``, the learning rate scaled if asked, and the model
    replicated; (cfg, train, test, model, opt, record, ddp, claim of the output folder)."""
    cfg, train, test, model, opt, record, held = prepare(given, log, comm.world_size, comm.rank == 0, profiling)
    if cfg.scale_lr:
        opt.lr = cfg.lr * comm.world_size
    ddp = DataParallel(model, comm, cfg.bucket_mb, cfg.sync_bn, state=(opt.velocity,))
    return cfg, train, test, model, opt, record, ddp, held


def run_profile(given, comm=None, steps=20, warmup=3, log=lambda *a: print(*a, flush=True)):
    """``--profile``: instead of training, profile ``steps`` training steps of the configured
    model, data and ranks (the profiler package); rank 0 prints the table and writes profile.json,
    profile.csv, profile.png and profile.trace.json to the output folder. Returns rank 0's report."""
    import profiler
    comm = comm or SingleProcess()
    log = log if comm.rank == 0 else (lambda *a: None)
    cfg, (x_train, y_train), _, model, opt, _, ddp, held = _replicated(given, comm, log, profiling=True)
    if cfg.replayed_step:
        log("--profile times eager steps: a CUDA graph replays the whole step as one launch, with no layer "
            "boundary to mark (training replays it; --no-graph leaves this note out)")
    with held, use_precision(cfg.compute_precision):
        title = f"ResNet-18 width {cfg.width}, {comm.world_size} rank(s), batch {cfg.batch_size} global"
        report = profiler.profile(model, opt, x_train, y_train, cfg.batch_size, steps, warmup, log=log,
                                  title=title, ddp=ddp)
        if comm.rank == 0:
            log(report.table())
            paths = report.write(cfg.out)
            log("profile written: " + ", ".join(str(p) for p in paths.values()))
    return report


def run(given, comm=None, log=lambda *a: print(*a, flush=True)):
    """Train with the flags in ``given`` (a dict of Config fields) as one rank of ``comm``
    (default: a world of one); returns the metrics. Only rank 0 logs and writes files."""
    comm = comm or SingleProcess()
    log = log if comm.rank == 0 else (lambda *a: None)
    *prepared, held = _replicated(given, comm, log)
    cfg, lead = prepared[0], comm.rank == 0
    with held, use_precision(cfg.compute_precision):   # the folder is this run's until it ends
        if lead and cfg.overwrite:   # every check passed: the earlier run steps aside until a checkpoint replaces it
            output.set_aside(cfg.out)
        try:
            return _train(comm, log, *prepared)
        except KeyboardInterrupt as e:    # Ctrl-C, or SIGTERM: what is on disk, for the last message
            if lead:
                output.restore_set_aside(cfg.out)
            e.kept = output.kept(cfg.out)
            raise
        finally:
            if lead:   # a run that wrote no checkpoint gives back the run it would have replaced
                output.restore_set_aside(cfg.out)


def _train(comm, log, cfg, train, test, model, opt, record, ddp):
    (x_train, y_train), (x_test, y_test), lead = train, test, comm.rank == 0
    out = Path(cfg.out)
    steps_per_epoch = -(-len(x_train) // cfg.batch_size)
    schedule = CosineAnnealingLR(opt, cfg.epochs * steps_per_epoch) if cfg.schedule == "cosine" else None
    metrics = record["metrics"] if record else []
    start = record["epoch"] if record else 0
    log(f"ResNet-18 (width {cfg.width}, {opt.flat.parameter_count:,} parameters) on {len(x_train)} training and "
        f"{len(x_test)} test images, batch {cfg.batch_size}, lr {opt.lr:g}, {cfg.schedule} schedule, "
        f"precision {cfg.compute_precision}{', the step as a CUDA graph' if cfg.replayed_step else ''}; "
        f"output in {out}" + (f"; resuming after epoch {start}" if start else ""))
    if schedule is not None and record is not None and record["config"]["epochs"] != cfg.epochs:
        log(_stretched(schedule, record["config"]["epochs"], cfg.epochs, start * steps_per_epoch))
    if comm.world_size > 1:
        log(_world_line(cfg, ddp, opt.lr))
    step = _step(cfg, model, opt, ddp, x_train, y_train)
    for epoch in range(start, cfg.epochs):
        began = time.perf_counter()
        try:
            train_loss, train_acc = train_epoch(model, opt, schedule, x_train, y_train, cfg, epoch, ddp=ddp, step=step,
                                                show=lead)
        except NonFiniteLoss as e:
            raise NonFiniteLoss(f"{e}; stopping: {_kept(out, epoch)}") from None
        except MemoryError:  # CuPy's OutOfMemoryError is one too
            raise OutOfMemory(f"out of {cfg.device} memory at batch size {cfg.batch_size}: try a "
                              f"smaller --batch-size; {_kept(out, epoch)}") from None
        train_seconds = time.perf_counter() - began
        # evaluation and the checkpoint see the same running statistics on every rank
        ddp.average_buffers()
        test_loss, test_acc = evaluate(model, x_test, y_test, cfg.batch_size, comm)
        seconds = time.perf_counter() - began
        metrics.append(finite_or_none({
            "epoch": epoch + 1, "lr": opt.lr, "train_loss": train_loss, "train_acc": train_acc,
            "test_loss": test_loss, "test_acc": test_acc, "seconds": seconds,
            "images_per_sec": len(x_train) / train_seconds, "world_size": comm.world_size,
            "precision": cfg.compute_precision}))
        if lead:
            _write_epoch(out, model, opt, {"epoch": epoch + 1, "config": cfg.kept(), "metrics": metrics,
                                           "rng_state": init.get_rng_state()})
        log(f"epoch {epoch + 1}/{cfg.epochs}: loss {train_loss:.4f}, train acc {train_acc:.3f}, "
            f"test acc {test_acc:.3f}, {seconds:.1f} s, {metrics[-1]['images_per_sec']:.1f} images/s")
    if lead and cfg.export:
        try:
            save_safetensors(model, output.export_target(cfg.export, out, cfg.resume))
        except OSError as e:
            raise OutputError(f"could not write {e.filename} ({e.strerror}); {_kept(out, len(metrics))}") from None
        log(f"weights of epoch {len(metrics)} exported to {cfg.export} (safetensors, d2l's PyTorch keys)")
    mean_seconds = sum(m["seconds"] for m in metrics) / len(metrics)
    log(f"test acc: {metrics[-1]['test_acc']:.2f}, {mean_seconds:.1f} sec/epoch on {backend_of(x_train).name}"
        + (f", {comm.world_size} ranks" if comm.world_size > 1 else ""))
    return metrics


def train_or_profile(given, comm, profile_steps=None):
    """run(), or run_profile() of ``profile_steps`` steps when that is given."""
    if profile_steps is None:
        return run(given, comm)
    return run_profile(given, comm, steps=profile_steps)


def gpu_worker(rank, world_size, given, unique_id, profile_steps=None):
    """One worker process of ``--gpus N`` on one node: it trains (or profiles) on its GPU (see
    kernels.local_gpu) and sums gradients with the others over NCCL (``unique_id`` from the parent)."""
    cupy_module().cuda.Device(local_gpu(rank, world_size)).use()
    train_or_profile(given, NCCLCommunicator(rank, world_size, unique_id), profile_steps)
