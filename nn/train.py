"""Training ResNet-18 on Fashion-MNIST: the loop behind ``train_resnet.py``.

Each epoch ends with an evaluation on the test split, one summary line, and the
files of the output folder rewritten atomically: ``checkpoint.npz``,
``metrics.json``, ``metrics.csv`` and ``training.png``. A run resumed from a
checkpoint computes the same weights, bit for bit, as one that was never stopped:
batch order depends only on (seed, epoch) and everything else is in the checkpoint.
"""
import csv
import dataclasses
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

from kernels import DeviceError, array_module_for, backend_of, get_array_module
from . import checkpoint, data, init
from .functional import cross_entropy
from .optim import SGD, CosineAnnealingLR
from .resnet import resnet18
from .tensor import Tensor, no_grad

SCHEDULES = ("constant", "cosine")
# flags that must agree between a checkpoint and the run that resumes it
RUN_DEFINING = ("width", "batch_size", "lr", "momentum", "weight_decay", "schedule", "seed",
                "limit", "test_limit", "init")


class ConfigError(ValueError):
    """A flag or flag combination that cannot work; raised before any training."""


class NonFiniteLoss(RuntimeError):
    pass


class OutOfMemory(RuntimeError):
    pass


@dataclasses.dataclass
class Config:
    epochs: int = 10
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    schedule: str = "constant"
    width: int = 64
    seed: int = 0
    init: str = "normal"
    limit: int = None
    test_limit: int = None
    data_dir: str = None
    out: str = None
    resume: str = None
    gpus: int = 0

    @property
    def device(self):
        return "cuda" if self.gpus else "cpu"

    def check(self):
        positive = {"epochs": self.epochs, "batch size": self.batch_size, "width": self.width}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if not self.lr > 0:
            raise ConfigError(f"learning rate must be positive, got {self.lr}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError(f"momentum and weight decay must be >= 0, got {self.momentum}, "
                              f"{self.weight_decay}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}: choose one of {SCHEDULES}")
        if self.init not in init.SCHEMES:
            raise ConfigError(f"unknown init {self.init!r}: choose one of {init.SCHEMES}")
        if self.gpus < 0:
            raise ConfigError(f"--gpus must be 0 or more, got {self.gpus}")
        if self.gpus > 1:
            raise ConfigError(f"--gpus {self.gpus}: training on several GPUs is not built yet; "
                              f"use --gpus 1, or 0 for the CPU")
        for name in ("limit", "test_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def merge_resumed(given, saved):
    """The configuration of a resumed run: the checkpoint's, except where a flag was
    given; a given run-defining flag that disagrees with the checkpoint is an error.
    ``given`` holds only the flags on the command line."""
    for name in RUN_DEFINING:
        if name in given and given[name] != saved[name]:
            raise ConfigError(f"--{name.replace('_', '-')} {given[name]} does not match the "
                              f"checkpoint's {saved[name]}")
    return Config(**{**saved, **given})


def _limited(split, limit, name):
    images, labels = split
    if limit is None:
        return images, labels
    if limit > len(images):
        raise ConfigError(f"--{name} {limit} is larger than the split, which has {len(images)} images")
    return images[:limit], labels[:limit]


class Progress:
    """A one-line progress bar on a terminal; on a pipe, a line every tenth of the epoch."""

    def __init__(self, total, label, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.tty = stream.isatty()
        self.next_line = 0.1

    def update(self, done, loss):
        fraction = done / self.total
        if self.tty:
            bar = "#" * int(30 * fraction)
            self.stream.write(f"\r{self.label} [{bar:<30}] {done}/{self.total} loss {loss:.4f}")
        elif fraction >= self.next_line:
            self.stream.write(f"{self.label} {done}/{self.total} loss {loss:.4f}\n")
            self.next_line = (int(fraction * 10) + 1) / 10
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\r" + " " * (len(self.label) + 60) + "\r")
            self.stream.flush()


class _Window:
    """Loss and correct counts of recent steps, kept as arrays and read on the host
    once per window, so that the steps between reads never wait for the device."""

    def __init__(self):
        self.losses, self.correct = [], []
        self.loss_sum = self.correct_sum = 0.0
        self.steps = 0

    def add(self, loss, correct):
        self.losses.append(loss)
        self.correct.append(correct)

    def flush(self, epoch, first_step):
        values = [float(v) for v in self.losses]
        for i, v in enumerate(values):
            if not np.isfinite(v):
                raise NonFiniteLoss(f"loss is {v} at epoch {epoch}, step {first_step + i + 1}")
        self.loss_sum += sum(values)
        self.correct_sum += sum(float(c) for c in self.correct)
        self.steps += len(values)
        self.losses, self.correct = [], []


def _kept(out, epoch):
    if not epoch:
        return "no checkpoint was written"
    return f"the last good checkpoint (epoch {epoch}) is {out / checkpoint.FILENAME}"


def evaluate(model, images, labels, batch_size):
    """(mean loss, accuracy) of ``model`` in eval mode."""
    K, xp = backend_of(images), get_array_module(images)
    model.eval()
    loss_sum = correct = 0.0
    with no_grad():
        for idx in data.batch_indices(xp.arange(len(images)), batch_size):
            logits = model(Tensor(K.images_to_float(images[idx])))
            loss_sum += float(cross_entropy(logits, labels[idx]).data) * len(idx)
            correct += float(K.count_correct(logits.data, labels[idx]))
    model.train()
    return loss_sum / len(images), correct / len(images)


def train_epoch(model, opt, schedule, images, labels, cfg, epoch, log_seconds=1.0):
    """One pass over the shuffled training split; (mean loss, accuracy)."""
    K, xp = backend_of(images), get_array_module(images)
    order = xp.asarray(data.epoch_order(len(images), cfg.seed, epoch))
    batches = data.batch_indices(order, cfg.batch_size)
    progress = Progress(len(batches), f"epoch {epoch + 1}/{cfg.epochs}")
    window, last_read = _Window(), time.perf_counter()
    for step, idx in enumerate(batches):
        if schedule is not None:
            opt.lr = schedule.lr_at(epoch * len(batches) + step)
        x, y = Tensor(K.images_to_float(images[idx])), labels[idx]
        opt.zero_grad()
        logits = model(x)
        loss = cross_entropy(logits, y)
        loss.backward()
        opt.step()
        window.add(loss.data, K.count_correct(logits.data, y))
        if time.perf_counter() - last_read >= log_seconds or step == len(batches) - 1:
            window.flush(epoch + 1, step + 1 - len(window.losses))
            progress.update(step + 1, window.loss_sum / window.steps)
            last_read = time.perf_counter()
    progress.close()
    return window.loss_sum / window.steps, window.correct_sum / len(images)


def write_reports(out, metrics):
    """metrics.json, metrics.csv and training.png, each replaced atomically."""
    with checkpoint.atomic_write(out / "metrics.json", "w") as f:
        json.dump(metrics, f, indent=1)
    with checkpoint.atomic_write(out / "metrics.csv", "w") as f:
        writer = csv.DictWriter(f, fieldnames=list(metrics[0]))
        writer.writeheader()
        writer.writerows(metrics)
    with checkpoint.atomic_write(out / "training.png") as f:
        f.write(plot(metrics))


def plot(metrics):
    """PNG bytes: train loss, train accuracy and test accuracy against epoch, as d2l draws them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [m["epoch"] for m in metrics]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(epochs, [m["train_loss"] for m in metrics], "o-", ms=3, label="train loss")
    ax.plot(epochs, [m["train_acc"] for m in metrics], "o--", ms=3, label="train acc")
    ax.plot(epochs, [m["test_acc"] for m in metrics], "o-.", ms=3, label="test acc")
    ax.set_xlabel("epoch")
    ax.set_xlim(1, max(epochs[-1], 2))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def default_out():
    return Path("runs") / time.strftime("resnet18-%Y%m%d-%H%M%S")


def prepare(given, log=print):
    """Everything that can fail before training, checked first: the configuration
    (merged with the checkpoint's when resuming), the data and the model."""
    saved_arrays = record = None
    if given.get("resume"):
        saved_arrays, record = checkpoint.load(given["resume"])
        # without --out, a resumed run writes beside its checkpoint, wherever that now is
        saved = {**record["config"], "out": str(checkpoint.resolve(given["resume"]).parent)}
        cfg = merge_resumed(given, saved)
    else:
        cfg = Config(**given)
    cfg.check()
    try:
        xp = array_module_for(cfg.device)
    except DeviceError as e:
        raise ConfigError(f"--gpus {cfg.gpus}: {e}") from None
    if record is not None and record["epoch"] >= cfg.epochs:
        raise ConfigError(f"the checkpoint has finished {record['epoch']} epochs already; "
                          f"ask for more with --epochs")
    splits = data.load_fashion_mnist(cfg.data_dir, log=log)
    # the whole split goes to the device once, as uint8; batches are gathered there
    train, test = (tuple(xp.asarray(a) for a in (images, labels.astype(np.int32)))
                   for images, labels in (_limited(splits["train"], cfg.limit, "limit"),
                                          _limited(splits["test"], cfg.test_limit, "test-limit")))
    init.manual_seed(cfg.seed)
    model = resnet18(num_classes=data.NUM_CLASSES, in_channels=1, width=cfg.width, init=cfg.init)
    model.to(cfg.device)
    opt = SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if saved_arrays is not None:
        checkpoint.restore(saved_arrays, model, opt)
        init.set_rng_state(record["rng_state"])
    return cfg, train, test, model, opt, record


def run(given, log=lambda *a: print(*a, flush=True)):
    """Train with the flags in ``given`` (a dict of Config fields); returns the metrics."""
    cfg, (x_train, y_train), (x_test, y_test), model, opt, record = prepare(given, log)
    out = Path(cfg.out or default_out())
    out.mkdir(parents=True, exist_ok=True)
    cfg.out = str(out)
    steps_per_epoch = -(-len(x_train) // cfg.batch_size)
    schedule = CosineAnnealingLR(opt, cfg.epochs * steps_per_epoch) if cfg.schedule == "cosine" else None
    metrics = record["metrics"] if record else []
    start = record["epoch"] if record else 0
    log(f"ResNet-18 (width {cfg.width}, {len(opt.flat):,} parameters) on {len(x_train)} training and "
        f"{len(x_test)} test images, batch {cfg.batch_size}, lr {cfg.lr}, {cfg.schedule} schedule; "
        f"output in {out}" + (f"; resuming after epoch {start}" if start else ""))
    for epoch in range(start, cfg.epochs):
        began = time.perf_counter()
        try:
            train_loss, train_acc = train_epoch(model, opt, schedule, x_train, y_train, cfg, epoch)
        except NonFiniteLoss as e:
            raise NonFiniteLoss(f"{e}; stopping: {_kept(out, epoch)}") from None
        except MemoryError:  # CuPy's OutOfMemoryError is one too
            raise OutOfMemory(f"out of {cfg.device} memory at batch size {cfg.batch_size}: try a "
                              f"smaller --batch-size; {_kept(out, epoch)}") from None
        train_seconds = time.perf_counter() - began
        test_loss, test_acc = evaluate(model, x_test, y_test, cfg.batch_size)
        seconds = time.perf_counter() - began
        metrics.append({"epoch": epoch + 1, "lr": opt.lr, "train_loss": train_loss, "train_acc": train_acc,
                        "test_loss": test_loss, "test_acc": test_acc, "seconds": seconds,
                        "images_per_sec": len(x_train) / train_seconds})
        checkpoint.save(out / checkpoint.FILENAME, model, opt, {
            "epoch": epoch + 1, "config": dataclasses.asdict(cfg), "metrics": metrics,
            "rng_state": init.get_rng_state()})
        write_reports(out, metrics)
        log(f"epoch {epoch + 1}/{cfg.epochs}: loss {train_loss:.4f}, train acc {train_acc:.3f}, "
            f"test acc {test_acc:.3f}, {seconds:.1f} s, {metrics[-1]['images_per_sec']:.1f} images/s")
    mean_seconds = sum(m["seconds"] for m in metrics) / len(metrics)
    log(f"test acc: {metrics[-1]['test_acc']:.2f}, {mean_seconds:.1f} sec/epoch on {backend_of(x_train).name}")
    return metrics
