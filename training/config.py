"""The configuration of a training run: its flags with their defaults and checks, which of them a
checkpoint keeps, and how a resumed run merges the flags given with its checkpoint's."""
import dataclasses
import math

import kernels
from nn import init
from parallel.ddp import DEFAULT_BUCKET_MB
from . import fashion_mnist

SCHEDULES = ("constant", "cosine")
GPU_PRECISIONS = ("tf32", "bf16")   # the tensor cores' (kernels.precision()): a CPU run computes in float32

# Every flag of train_resnet.py (training/cli.py's parser) is of one of three classes, by what a resumed run
# does with it:
# what the run trains: kept in the checkpoint, and one given to a resume must give the checkpoint's value
RUN_DEFINING = ("width", "batch_size", "lr", "momentum", "weight_decay", "schedule", "seed",
                "limit", "test_limit", "init")
# kept in the checkpoint and taken from it unless given: how far the run goes (--epochs, raised to train
# further), how it computes (devices, precision, graph, data parallelism) and where its data is (stored
# resolved, so that a resume from another working folder reads the same files)
KEPT = ("epochs", "gpus", "precision", "graph", "data_dir", "sync_bn", "scale_lr", "check_sync", "bucket_mb")
# what this one command does, and where: never kept, so that a resume does what its own command line says
# and nothing that the run's first command asked for that once (--export again over that command's file)
ONCE = ("out", "resume", "overwrite", "init_from", "export", "profile", "profile_steps", "watchdog")


class ConfigError(ValueError):
    """A flag or flag combination that cannot work; raised before any training."""


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
    sync_bn: bool = False
    check_sync: int = 0
    bucket_mb: float = DEFAULT_BUCKET_MB
    scale_lr: bool = False
    overwrite: bool = False   # a new run may replace the run whose files --out holds
    init_from: str = None     # a safetensors file of the model's weights to start from
    export: str = None        # where to write the trained weights as safetensors
    precision: str = None     # of the products on GPUs (compute_precision)
    graph: bool = None        # the training step as a CUDA graph (replayed_step)

    @property
    def device(self):
        return "cuda" if self.gpus else "cpu"

    @property
    def compute_precision(self):
        """The precision of the step (kernels.precision(): tf32 and fp32 differ in the convolutions, bf16
        also stores the activations in bfloat16; the linear layer computes in float32 under all three):
        --precision, else tf32 on GPUs, PyTorch's default for convolutions; a CPU run computes in float32."""
        return self.precision or ("tf32" if self.gpus else "fp32")

    @property
    def replayed_step(self):
        """Whether the training step runs as a CUDA graph: --graph, else on GPUs."""
        return bool(self.gpus) if self.graph is None else self.graph

    def kept(self):
        """What a checkpoint keeps of this configuration: the run-defining and kept flags, the data folder
        resolved (the one read, whatever the working folder of a later resume)."""
        kept = {name: getattr(self, name) for name in (*RUN_DEFINING, *KEPT)}
        kept["data_dir"] = str(fashion_mnist.resolve_dir(self.data_dir).resolve())
        return kept

    def check(self):
        for name in ("data_dir", "out", "resume", "init_from"):
            if getattr(self, name) == "":   # an unset shell variable: not the default, unasked
                raise ConfigError(f"--{name.replace('_', '-')} needs a path, got an empty one")
        positive = {"epochs": self.epochs, "batch size": self.batch_size, "width": self.width}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"learning rate must be positive and finite, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be at least 0 and below 1, got {self.momentum}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"--weight-decay must be 0 or more and finite, got {self.weight_decay}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be 0 or more, got {self.seed}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}: choose one of {SCHEDULES}")
        if self.init not in init.SCHEMES:
            raise ConfigError(f"unknown init {self.init!r}: choose one of {init.SCHEMES}")
        if self.gpus < 0:
            raise ConfigError(f"--gpus must be 0 or more, got {self.gpus}")
        if self.precision not in (None, *kernels.PRECISIONS):
            raise ConfigError(f"unknown precision {self.precision!r}: choose one of {kernels.PRECISIONS}")
        if self.precision in GPU_PRECISIONS and not self.gpus:
            raise ConfigError(f"--precision {self.precision} runs on GPU tensor cores: add --gpus N (on the CPU, NumPy "
                              f"computes in float32)")
        if self.graph and not self.gpus:
            raise ConfigError("--graph captures the step as a CUDA graph, on GPUs: add --gpus N (or drop --graph)")
        for name in ("limit", "test_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.check_sync < 0:
            raise ConfigError(f"--check-sync must be 0 (only at the start) or more, got {self.check_sync}")
        if not 0 < self.bucket_mb < math.inf:
            raise ConfigError(f"--bucket-mb must be positive and finite, got {self.bucket_mb}")

    def check_world(self, world_size):
        """What only the launch decides: the number of ranks against the flags."""
        if self.batch_size < world_size:
            raise ConfigError(f"--batch-size {self.batch_size} is smaller than the {world_size} ranks: "
                              f"every rank needs at least one image per step")


def merge_resumed(given, saved, home):
    """The configuration of a resumed run: the checkpoint's kept flags (``saved``, the checkpoint's record of
    them), except where a flag was given; a given run-defining flag that disagrees with the checkpoint is an
    error. ``given`` holds only the flags on the command line; without --out the run writes in ``home``, the
    checkpoint's folder wherever it now is. A checkpoint of an earlier version, which kept every flag, is read
    alike: of its flags that acted once, none acts again.

    --gpus and --precision say how the run computes, not what it trains (the checkpoint's float32
    weights and momentum are the whole state under every precision: the bf16 precision's bfloat16
    weights are remade from them), so a resumed run may change them, as it may move to other
    devices; it then continues as a run started so would, and no longer bit for bit (see
    resumed_changes). A run moved to the CPU whose checkpoint names a tensor-core precision is told
    to say --precision fp32, rather than have it changed unasked; its --graph, which changes no result,
    stays with the GPUs."""
    for name in RUN_DEFINING:
        if name in given and given[name] != saved[name]:
            raise ConfigError(f"--{name.replace('_', '-')} {given[name]} does not match the "
                              f"checkpoint's {saved[name]}")
    kept = _kept(saved)
    if given.get("gpus") == 0:
        if "precision" not in given and kept.get("precision") in GPU_PRECISIONS:
            raise ConfigError(f"the checkpoint's run trained with --precision {kept['precision']}, which runs on "
                              f"GPUs: add --precision fp32 to continue it on the CPU")
        if kept.get("graph"):
            kept["graph"] = None
    return Config(**{**kept, "out": str(home), **given})


def _kept(saved):
    return {name: value for name, value in saved.items() if name in (*RUN_DEFINING, *KEPT)}


def resumed_changes(saved, cfg):
    """Lines saying how a resumed run computes otherwise than its checkpoint's run did (the GPUs, the
    precision), for the log, and that it exports only when told, where the checkpoint of an earlier version
    names the file its run's first command exported to; none when it continues as it was."""
    before = Config(**_kept(saved))
    lines = []
    if cfg.gpus != before.gpus:
        lines.append(f"the checkpoint's run trained with --gpus {before.gpus}; it continues with --gpus {cfg.gpus}"
                     + (" (on the CPU)" if not cfg.gpus else ""))
    if cfg.compute_precision != before.compute_precision:
        lines.append(f"the checkpoint's run trained in precision {before.compute_precision}; it continues in "
                     f"{cfg.compute_precision}")
    if saved.get("export") and not cfg.export:
        lines.append(f"the checkpoint keeps --export {saved['export']} of its run's first command (an earlier "
                     f"version kept it): this run writes no weights file unless given --export FILE")
    return lines
